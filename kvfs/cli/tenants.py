"""`kvfs tenant add/set/list`, `kvfs warm`, `kvfs pin` / `unpin`: what an operator does to
tenants and their files through the mount."""

from __future__ import annotations

import argparse
import os
import sys
import time

from ..format import control
from . import keys
from .common import EXIT_FAIL, EXIT_USAGE, CliError, human, print_table, read_stats


def cmd_tenant_add(args: argparse.Namespace) -> int:
    mountpoint = os.path.abspath(args.mountpoint)
    read_stats(mountpoint)
    path = os.path.join(mountpoint, args.name)
    mode = int(args.mode, 8)
    try:
        os.mkdir(path, mode)
        os.chown(path, args.uid, args.gid)
        os.chmod(path, mode)
    except FileExistsError:
        raise CliError(f"tenant {args.name} already exists") from None
    except OSError as exc:
        raise CliError(f"cannot add tenant {args.name}: {exc.strerror}") from None
    print(f"kvfs: tenant {args.name} (uid {args.uid}, gid {args.gid}, mode {args.mode}) "
          f"at {path}")
    _set_limits(path, args)
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


def _set_limits(path: str, args: argparse.Namespace) -> None:
    for attr, name in LIMIT_OPTIONS:
        value = getattr(args, attr, None)
        if value is None:
            continue
        try:
            os.setxattr(path, control.limit_name(name), value.encode())
        except OSError as exc:
            hint = " (only root sets limits)" if exc.errno == 1 else ""
            raise CliError(f"cannot set {name}={value} on {path}: {exc.strerror}{hint}") from None
        shown = os.getxattr(path, control.limit_name(name)).decode()
        print(f"kvfs: {os.path.basename(path)}: {name} = {shown}")


def cmd_tenant_set(args: argparse.Namespace) -> int:
    mountpoint = os.path.abspath(args.mountpoint)
    read_stats(mountpoint)
    path = os.path.join(mountpoint, args.name)
    if not os.path.isdir(path):
        raise CliError(f"no tenant {args.name} in {mountpoint}")
    _set_limits(path, args)
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
