"""`kvfs mount` and `kvfs umount`: the daemon, in the foreground or started in the background
with every setting on its command line (kvfs.daemon.settings)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from typing import Any

from ..daemon import settings
from ..daemon.capacity import Budget
from ..daemon.watchdog import abort_connection
from .common import (
    ANSWER_TIMEOUT,
    EXIT_FAIL,
    EXIT_NOT_MOUNTED,
    EXIT_USAGE,
    CliError,
    log,
    mount_path,
    private_log,
    read_stats,
    setup_logging,
)


def cmd_mount(args: argparse.Namespace) -> int:
    from ..daemon.mount import MountOptions  # noqa: PLC0415 - pyfuse3 only where needed

    values = settings.resolve(args, settings.load(args.config) if args.config else {})
    if not values["backing"] or not values["mountpoint"]:
        raise CliError("mount needs BACKING_DIR and MOUNTPOINT (or both in --config)", EXIT_USAGE)
    values["backing"] = os.path.abspath(values["backing"])
    values["mountpoint"] = os.path.abspath(values["mountpoint"])
    opts = MountOptions(**{s.name: values[s.name] for s in settings.SETTINGS if s.daemon})
    Budget(opts.capacity, opts.high_watermark, opts.low_watermark)  # the watermarks together
    if args.foreground:
        return _mount_foreground(opts, values["log"], args.ready_fd)
    # Background: run the daemon as a child in its own session, and return once it is ready.
    log_file = values["log"] = values["log"] or settings.default_log(opts.backing)
    if not os.path.isdir(opts.backing):
        raise CliError(f"backing directory {opts.backing} does not exist")
    if not os.path.isdir(opts.mountpoint):
        raise CliError(f"mount point {opts.mountpoint} is not a directory")
    try:
        os.makedirs(os.path.dirname(os.path.abspath(log_file)), mode=0o700, exist_ok=True)
        private_log(log_file)
    except OSError as exc:
        raise CliError(f"cannot write the log {log_file}: {exc.strerror}") from None
    rfd, wfd = os.pipe()
    cmd = [sys.executable, "-m", "kvfs.cli", "mount", *settings.daemon_argv(values),
           "--foreground", "--ready-fd", str(wfd)]
    with open(os.devnull, "rb") as devnull, open(log_file, "ab") as logf:
        proc = subprocess.Popen(cmd, stdin=devnull, stdout=logf, stderr=logf,
                                pass_fds=(wfd,), start_new_session=True)
    os.close(wfd)
    with os.fdopen(rfd, "rb") as r:
        msg = r.read()
    if msg.startswith(b"ok"):
        print(f"kvfs: mounted {opts.mountpoint} (backing {opts.backing}, pid {proc.pid}, "
              f"log {log_file})")
        return 0
    code = proc.wait()
    raise CliError(msg.decode(errors="replace").strip() or
                   f"the daemon exited with status {code} before mounting; see {log_file}")


def _mount_foreground(opts: Any, log_file: str | None, ready_fd: int | None) -> int:
    from ..daemon.mount import MountError, run  # noqa: PLC0415

    try:
        setup_logging(log_file, opts.debug)
    except OSError as exc:
        raise CliError(f"cannot write the log {log_file}: {exc.strerror}") from None

    def ready() -> None:
        if ready_fd is not None:
            os.write(ready_fd, b"ok\n")
            os.close(ready_fd)

    try:
        return run(opts, ready)
    except MountError as exc:
        log.error("%s", exc)
        if ready_fd is not None:
            os.write(ready_fd, f"{exc}\n".encode())
            os.close(ready_fd)
            return EXIT_FAIL
        raise CliError(str(exc)) from None


def cmd_umount(args: argparse.Namespace) -> int:
    mountpoint = mount_path(args.mountpoint)
    try:
        pid = read_stats(mountpoint, timeout=2.0 if args.force else ANSWER_TIMEOUT).get("pid")
    except CliError as exc:
        if exc.code == EXIT_NOT_MOUNTED or not args.force:
            raise
        pid = None  # it does not answer: its exit is not waited for
    if args.force:
        # Every request waiting on the daemon fails (what it wrote stays; a file being
        # written is removed at the next mount, as after a crash), then the mount goes.
        if not abort_connection(mountpoint):
            raise CliError(f"cannot abort the FUSE connection of {mountpoint} (root only)")
        for flags in ("-u", "-uz"):
            res = subprocess.run(["fusermount3", flags, mountpoint], capture_output=True,
                                 text=True, timeout=args.timeout)
            if res.returncode == 0:
                break
    else:
        res = subprocess.run(["fusermount3", "-u", mountpoint], capture_output=True,
                             text=True, timeout=args.timeout)
    if res.returncode != 0:
        busy = ("; a process has a file or its working directory in it (fuser -vm "
                f"{mountpoint} names it)" if "busy" in res.stderr else "")
        raise CliError(f"cannot unmount {mountpoint}: {res.stderr.strip()}{busy}")
    deadline = time.monotonic() + args.timeout
    while pid and _alive(pid):
        if time.monotonic() > deadline:
            raise CliError(f"unmounted, but the daemon (pid {pid}) has not exited after "
                           f"{args.timeout} s")
        time.sleep(0.05)
    print(f"kvfs: unmounted {mountpoint}")
    return 0


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][:1] != "Z"
    except FileNotFoundError:
        return False


def register(sub: argparse._SubParsersAction) -> None:
    """Add this module's subcommands to `kvfs`."""
    m = sub.add_parser("mount", help="mount kvfs over a backing directory")
    settings.add_arguments(m)
    m.add_argument("--foreground", "-f", action="store_true", help="stay attached")
    m.add_argument("--config", help="TOML config file; the command line overrides it")
    m.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    m.set_defaults(func=cmd_mount)

    u = sub.add_parser("umount", help="unmount and wait for the daemon to exit")
    u.add_argument("mountpoint")
    u.add_argument("--timeout", type=float, default=60.0)
    u.add_argument("--force", action="store_true",
                   help="abort the daemon's connection first (requests in flight fail): for a "
                        "daemon that does not answer")
    u.set_defaults(func=cmd_umount)
