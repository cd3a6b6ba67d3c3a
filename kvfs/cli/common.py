"""What every `kvfs` subcommand shares: exit codes, the error they raise, logging, the
mount's stats file, sizes and tables as people read them."""

from __future__ import annotations

import json
import logging
import os
import stat
import sys
import threading
from typing import Any

from ..daemon.watchdog import mount_fields
from ..format.layout import TENANT_NAME

log = logging.getLogger("kvfs")

EXIT_FAIL = 1
EXIT_USAGE = 2
EXIT_NOT_MOUNTED = 3


class CliError(Exception):
    def __init__(self, message: str, code: int = EXIT_FAIL) -> None:
        super().__init__(message)
        self.code = code


def private_log(path: str) -> None:
    """Create (or restrict) a daemon log as readable by its owner (root) alone: it names
    every tenant's files."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):  # (not a terminal or /dev/stderr)
            os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


def setup_logging(log_file: str | None, debug: bool) -> None:
    handler: logging.Handler
    if log_file:
        private_log(log_file)
        handler = logging.FileHandler(log_file)
    else:
        handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(
        "%(asctime)s.%(msecs)03d %(process)d %(levelname)s %(name)s: %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if debug else logging.INFO)


def _stats_path(mountpoint: str) -> str:
    return os.path.join(mountpoint, ".kvfs", "stats.json")


def mount_path(path: str) -> str:
    """`path` as the mount table names it: absolute, its parents' links resolved (not the
    path itself: resolving a mount point is a request to its daemon, which may not answer)."""
    path = os.path.abspath(path)
    return os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))


#: How long a command waits for the daemon to answer before it says that it does not.
ANSWER_TIMEOUT = 10.0


def read_stats(mountpoint: str, timeout: float = ANSWER_TIMEOUT) -> dict[str, Any]:
    """The mount's ``.kvfs/stats.json``. Whether something is mounted there is read from
    /proc/self/mountinfo (a stat of the mount point would wait on its daemon); a daemon that
    does not answer within `timeout` (stopped, or hung) is said, not waited for: the read is
    left in a thread the command's exit ends."""
    mountpoint = mount_path(mountpoint)
    fields = mount_fields(mountpoint)
    if fields is None:
        raise CliError(f"{mountpoint} is not mounted", EXIT_NOT_MOUNTED)
    fstype = fields[fields.index("-") + 1] if "-" in fields else ""
    if fstype != "fuse.kvfs":
        raise CliError(f"{mountpoint} is not a kvfs mount ({fstype or 'unknown'})",
                       EXIT_NOT_MOUNTED)
    box: dict[str, Any] = {}

    def read() -> None:
        try:
            with open(_stats_path(mountpoint), "rb") as f:
                box["stats"] = json.loads(f.read())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box["error"] = exc

    reader = threading.Thread(target=read, name="kvfs-stats", daemon=True)
    reader.start()
    reader.join(timeout)
    if reader.is_alive():
        raise CliError(f"the kvfs daemon of {mountpoint} does not answer after {timeout:g} s "
                       f"(stopped or hung; `kvfs umount --force {mountpoint}` aborts its "
                       "connection and unmounts it)")
    exc = box.get("error")
    if isinstance(exc, FileNotFoundError):
        raise CliError(f"{mountpoint} is not a kvfs mount", EXIT_NOT_MOUNTED) from None
    if isinstance(exc, OSError):
        raise CliError(f"cannot read {_stats_path(mountpoint)}: {exc.strerror}") from None
    if exc is not None:
        raise exc
    return box["stats"]


def tenant_dir(mountpoint: str, name: str, *, new: bool = False) -> str:
    """The directory of tenant `name` in the kvfs mount `mountpoint` (absolute): the name
    checked first (never a path out of the mount), and that it exists unless `new`."""
    if not TENANT_NAME.match(os.fsencode(name)):
        raise CliError(f"{name!r} is not a tenant name: 1 to 64 letters, digits and _ . @ -, "
                       "the first a letter, digit or _", EXIT_USAGE)
    mountpoint = os.path.abspath(mountpoint)
    read_stats(mountpoint)
    path = os.path.join(mountpoint, name)
    if not new and not os.path.isdir(path):
        raise CliError(f"no tenant {name} in {mountpoint}")
    return path


def human(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def table_lines(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def print_table(rows: list[tuple[str, ...]]) -> None:
    print("\n".join(table_lines(rows)))
