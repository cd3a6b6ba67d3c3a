"""`kvfs tenant forget / rotate-key / retire-key / keys`: a tenant's keys through the mount
(kvfs.daemon.governance), and crypto-shredding it."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

from ..format import control
from .common import EXIT_FAIL, EXIT_USAGE, CliError, tenant_dir


def _tenant_dir(args: argparse.Namespace) -> str:
    return tenant_dir(args.mountpoint, args.name)


def _command(path: str, name: bytes, value: bytes, what: str) -> None:
    try:
        os.setxattr(path, name, value)
    except OSError as exc:
        hint = {1: " (only root)", 95: " (this mount has no keys: --no-encrypt or no lower "
                "tier)", 22: " (see the daemon's log)"}.get(exc.errno or 0, "")
        raise CliError(f"cannot {what} for tenant {os.path.basename(path)}: "
                       f"{exc.strerror}{hint}") from None


def key_state(path: str) -> dict:
    try:
        return json.loads(os.getxattr(path, control.KEY_STATE))
    except (OSError, ValueError):
        return {}


def cmd_keys(args: argparse.Namespace) -> int:
    path = _tenant_dir(args)
    st = key_state(path)
    print(f"tenant {args.name}: live keys {', '.join(st.get('live', [])) or 'none'} "
          f"(newest first; new blocks are sealed with the first), retired "
          f"{', '.join(st.get('retired', [])) or 'none'}"
          + (", forgotten before" if st.get("forgotten") else ""))
    return 0


def cmd_rotate(args: argparse.Namespace) -> int:
    path = _tenant_dir(args)
    _command(path, control.ROTATE_KEY, b"1", "rotate the key")
    live = key_state(path).get("live", [])
    print(f"kvfs: tenant {args.name}: new key {live[0] if live else '?'}; older keys still "
          f"open their blocks until retired ({', '.join(live[1:]) or 'none'})")
    return 0


def cmd_retire(args: argparse.Namespace) -> int:
    path = _tenant_dir(args)
    _command(path, control.RETIRE_KEY, args.key_id.encode(), f"retire key {args.key_id}")
    print(f"kvfs: tenant {args.name}: key {args.key_id} retired: the blocks sealed with it "
          "are misses from now on (on other hosts within their key_ttl)")
    return 0


def cmd_forget(args: argparse.Namespace) -> int:
    path = _tenant_dir(args)
    if not args.yes:
        if not sys.stdin.isatty():
            raise CliError("forgetting a tenant cannot be undone: confirm on a terminal or "
                           "pass --yes", EXIT_USAGE)
        print(f"Forget tenant {args.name}? Its keys are destroyed in every tier (no host can "
              "read its KV again, anywhere), then its blocks are deleted.", file=sys.stderr)
        if input(f"Type the tenant's name ({args.name}) to confirm: ").strip() != args.name:
            raise CliError("not confirmed: nothing done", EXIT_USAGE)
    _command(path, control.FORGET, b"1", "forget")
    start = time.monotonic()
    while True:
        try:
            report = json.loads(os.getxattr(path, control.FORGET))
        except (OSError, ValueError) as exc:
            raise CliError(f"forgetting {args.name}: no report from the daemon: {exc}") from None
        print(f"\rkvfs forget: {report['hot_removed']} files removed here, "
              f"{report['deleted']} objects deleted below", end="", file=sys.stderr,
              flush=True)
        if report["done"]:
            break
        time.sleep(0.2)
    print("", file=sys.stderr)
    leftover = 0
    try:  # what is not a block (or was open): through the mount, then the tenant itself
        for entry in os.listdir(path):
            p = os.path.join(path, entry)
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p)
            else:
                os.unlink(p)
        os.rmdir(path)
    except OSError as exc:
        leftover = 1
        print(f"kvfs: {path} not removed: {exc.strerror}", file=sys.stderr)
    print(f"kvfs: tenant {args.name} forgotten in {time.monotonic() - start:.1f} s: keys "
          f"{', '.join(report['keys']) or '(none)'} destroyed in "
          f"{', '.join(report['destroyed_in']) or 'nothing'}; {report['hot_removed']} files "
          f"removed here, {report['deleted']} objects deleted from the lower tiers")
    failed = report["not_reached"] + report["errors"]
    for line in failed:
        print(f"kvfs: not reached: {line}", file=sys.stderr)
    if report["not_deleted"]:
        print(f"kvfs: {report['not_deleted']} objects could not be deleted (unreadable without "
              "the destroyed keys)", file=sys.stderr)
    return EXIT_FAIL if failed or report["not_deleted"] or leftover else 0


def register(tsub: argparse._SubParsersAction) -> None:
    """Add the key subcommands to `kvfs tenant`."""
    for name, func, text in (
            ("keys", cmd_keys, "show a tenant's keys"),
            ("rotate-key", cmd_rotate, "a new key for a tenant's new blocks"),
            ("retire-key", cmd_retire, "a key opens nothing any more"),
            ("forget", cmd_forget, "crypto-shred a tenant: destroy its keys everywhere, "
                                   "then delete its blocks")):
        p = tsub.add_parser(name, help=text)
        p.add_argument("mountpoint")
        p.add_argument("name")
        if name == "retire-key":
            p.add_argument("key_id", help="the key's id (hex, as `kvfs tenant keys` shows)")
        if name == "forget":
            p.add_argument("--yes", action="store_true", help="do not ask (for scripts)")
        p.set_defaults(func=func)
