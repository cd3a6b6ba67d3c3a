"""`kvfs tenant add/set/list`, `kvfs warm`, `kvfs pin` / `unpin`: what an operator does to
tenants and their files through the mount."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

from ..format import control
from . import keys
from .common import (
    EXIT_FAIL,
    EXIT_USAGE,
    CliError,
    human,
    print_table,
    read_stats,
    tenant_dir,
)


def cmd_tenant_add(args: argparse.Namespace) -> int:
    for what in ("uid", "gid"):
        if not 0 <= getattr(args, what) < 2**32 - 1:
            raise CliError(f"--{what} {getattr(args, what)} is not a {what}", EXIT_USAGE)
    try:
        mode = int(args.mode, 8)
    except ValueError:
        mode = -1
    if not 0 <= mode <= 0o7777:
        raise CliError(f"--mode {args.mode} is not an octal mode", EXIT_USAGE)
    path = tenant_dir(args.mountpoint, args.name, new=True)
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        raise CliError(f"tenant {args.name} already exists") from None
    except OSError as exc:
        raise CliError(f"cannot add tenant {args.name}: {exc.strerror}") from None
    try:  # a tenant whose owner, mode or limits cannot be set is not left behind
        try:
            os.chown(path, args.uid, args.gid)
            os.chmod(path, mode)
        except OSError as exc:
            raise CliError(f"cannot add tenant {args.name}: {exc.strerror}") from None
        limits = _set_limits(path, args)
    except BaseException:
        try:
            os.rmdir(path)
        except OSError as exc:
            print(f"kvfs: tenant {args.name} was made but could not be removed again: "
                  f"{exc.strerror}", file=sys.stderr)
        raise
    print(f"kvfs: tenant {args.name} (uid {args.uid}, gid {args.gid}, mode {args.mode}) "
          f"at {path}")
    for line in limits:
        print(line)
    deadline = time.monotonic() + 5  # the daemon makes its key in the background
    while time.monotonic() < deadline:
        st = keys.key_state(path)
        if not st.get("encrypt", True):
            break  # no keys on this mount (no lower tier, or --no-encrypt)
        live = st.get("live")
        if live:
            print(f"kvfs: {args.name}: key {live[0]} (blocks below the hot tier are sealed "
                  "with it)")
            break
        time.sleep(0.05)
    return 0


LIMIT_OPTIONS = (("quota", "quota"), ("max_idle", "max_idle"), ("max_age", "max_age"),
                 ("placement", "placement"))


def _set_limits(path: str, args: argparse.Namespace) -> list[str]:
    """Set the limits `args` gives on tenant directory `path`, all or none (one the daemon
    refuses puts back those set before it): the lines that say them."""
    said: list[str] = []
    before: list[tuple[bytes, bytes]] = []
    for attr, name in LIMIT_OPTIONS:
        value = getattr(args, attr, None)
        if value is None:
            continue
        xattr = control.limit_name(name)
        try:
            old = os.getxattr(path, xattr)
            os.setxattr(path, xattr, value.encode())
        except OSError as exc:
            for earlier, was in reversed(before):
                with contextlib.suppress(OSError):
                    os.setxattr(path, earlier, was)
            hint = " (only root sets limits)" if exc.errno == 1 else ""
            raise CliError(f"cannot set {name}={value} on {path}: {exc.strerror}{hint}") from None
        before.append((xattr, old))
        said.append(f"kvfs: {os.path.basename(path)}: {name} = "
                    f"{os.getxattr(path, xattr).decode()}")
    return said


def cmd_tenant_set(args: argparse.Namespace) -> int:
    for line in _set_limits(tenant_dir(args.mountpoint, args.name), args):
        print(line)
    return 0


def cmd_tenant_list(args: argparse.Namespace) -> int:
    mountpoint = os.path.abspath(args.mountpoint)
    read_stats(mountpoint)
    rows = [("TENANT", "UID", "GID", "MODE", "USED", "QUOTA", "MAX_IDLE", "MAX_AGE",
             "PLACEMENT")]
    for name in sorted(os.listdir(mountpoint)):
        if name == ".kvfs":
            continue
        path = os.path.join(mountpoint, name)
        st = os.stat(path)

        def x(attr: bytes, p: str = path) -> str:
            try:
                return os.getxattr(p, attr).decode()
            except OSError:
                return "?"

        quota, used = x(control.limit_name("quota")), x(control.USED)
        rows.append((name, str(st.st_uid), str(st.st_gid), f"{st.st_mode & 0o7777:o}",
                     human(int(used)) if used.isdigit() else "?",
                     human(int(quota)) if quota.isdigit() else quota,
                     x(control.limit_name("max_idle")), x(control.limit_name("max_age")),
                     x(control.limit_name("placement"))))
    print_table(rows)
    return 0


def cmd_warm(args: argparse.Namespace) -> int:
    """Promote every block below PATH that lives in a lower tier (reading it through the
    mount fetches, verifies and places it hot), with progress."""
    if not os.path.isdir(args.path):
        raise CliError(f"{args.path} is not a directory (warm takes a tenant's or a "
                       "namespace's directory in a kvfs mount)")
    todo = []
    for d, _, files in os.walk(args.path):
        for f in files:
            p = os.path.join(d, f)
            try:
                if os.getxattr(p, control.TIER) != b"hot":
                    todo.append(p)
            except OSError as exc:
                raise CliError(f"{p}: {exc.strerror} (is {args.path} in a kvfs mount?)") from None
    done = failed = 0
    start = time.monotonic()
    for p in todo:
        try:
            with open(p, "rb") as f:
                while f.read(1 << 20):
                    pass
            done += 1
        except OSError:
            failed += 1
        print(f"\rkvfs warm: {done + failed}/{len(todo)} blocks", end="", file=sys.stderr,
              flush=True)
    print("", file=sys.stderr)
    print(f"kvfs: warmed {done} blocks in {time.monotonic() - start:.1f} s"
          + (f", {failed} could not be fetched (misses)" if failed else ""))
    return EXIT_FAIL if failed else 0


def cmd_pin(args: argparse.Namespace) -> int:
    value = b"0" if args.unpin else b"1"
    count = 0
    for top in args.paths:
        paths = [top]
        if os.path.isdir(top):
            if not args.recursive:
                raise CliError(f"{top} is a directory (use -r)", EXIT_USAGE)
            paths = [os.path.join(d, f) for d, _, files in os.walk(top) for f in files]
        for path in paths:
            try:
                os.setxattr(path, control.PIN, value)
            except OSError as exc:
                raise CliError(f"cannot {'un' if args.unpin else ''}pin {path}: "
                               f"{exc.strerror}") from None
            count += 1
    print(f"kvfs: {'un' if args.unpin else ''}pinned {count} files")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add this module's subcommands to `kvfs`."""
    t = sub.add_parser("tenant", help="manage tenants")
    tsub = t.add_subparsers(dest="tenant_command", required=True)
    ta = tsub.add_parser("add", help="create a tenant directory owned by UID:GID")
    ta.add_argument("mountpoint")
    ta.add_argument("name")
    ta.add_argument("--uid", type=int, required=True)
    ta.add_argument("--gid", type=int, required=True)
    ta.add_argument("--mode", default="0700", help="octal mode (default 0700)")
    ta.set_defaults(func=cmd_tenant_add)
    ts = tsub.add_parser("set", help="set a tenant's quota and retention")
    ts.add_argument("mountpoint")
    ts.add_argument("name")
    ts.set_defaults(func=cmd_tenant_set)
    for parser in (ta, ts):
        parser.add_argument("--quota", help="bytes, e.g. 100G ('none' clears)")
        parser.add_argument("--max-idle", dest="max_idle",
                            help="remove files idle this long, e.g. 12h ('none' clears)")
        parser.add_argument("--max-age", dest="max_age",
                            help="remove files older than this, e.g. 7d ('none' clears)")
        parser.add_argument("--placement", help="the tiers its blocks may reach, e.g. "
                            "hot,cold,eu ('all' clears)")
    keys.register(tsub)
    tl = tsub.add_parser("list", help="list tenants")
    tl.add_argument("mountpoint")
    tl.set_defaults(func=cmd_tenant_list)

    w = sub.add_parser("warm", help="promote a namespace's blocks from the lower tiers")
    w.add_argument("path", help="a directory in the mount (a tenant or model namespace)")
    w.set_defaults(func=cmd_warm)

    for cmd, unpin in (("pin", False), ("unpin", True)):
        pp = sub.add_parser(cmd, help=f"{cmd} files: pinned files are never evicted or expired")
        pp.add_argument("paths", nargs="+")
        pp.add_argument("-r", "--recursive", action="store_true")
        pp.set_defaults(func=cmd_pin, unpin=unpin)
