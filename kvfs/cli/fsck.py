"""`kvfs fsck`: reconcile an unmounted backing directory's index with its tree."""

from __future__ import annotations

import argparse
import os
import sys

from .common import CliError, setup_logging


def cmd_fsck(args: argparse.Namespace) -> int:
    from ..daemon import made, scanner  # noqa: PLC0415
    from ..daemon.mount import MountError, open_index, open_state_dir  # noqa: PLC0415

    setup_logging(None, args.debug)
    try:
        store, lock_fd = open_state_dir(os.path.abspath(args.backing))
    except MountError as exc:
        # In use: by its mounted daemon (unmount it first) or by another fsck.
        hint = "; unmount it first" if "in use" in str(exc) else ""
        raise CliError(f"{exc}{hint}") from None
    index = open_index(store)

    def progress(n: int) -> None:
        print(f"\rfsck: {n} entries", end="", file=sys.stderr, flush=True)

    made.replay(index, store)  # what a killed daemon's request thread created, first
    report = scanner.reconcile(index, store, verify=args.verify, progress=progress)
    print("", file=sys.stderr)
    index.set_meta("clean", "1")
    index.close()
    os.close(lock_fd)
    for label, items in (("added", report.added), ("dropped", report.dropped),
                         ("updated", report.updated), ("removed partial", report.removed_partial),
                         ("removed temporary", report.removed_temp),
                         ("quarantined", report.quarantined)):
        shown = items.examples[: args.show]
        for item in shown:
            print(f"{label}: {item}")
        if items.count > len(shown):
            print(f"{label}: ... and {items.count - len(shown)} more")
    print(f"fsck: {report.summary()}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add this module's subcommands to `kvfs`."""
    f = sub.add_parser("fsck", help="reconcile an unmounted backing directory's index")
    f.add_argument("backing")
    f.add_argument("--verify", action="store_true", help="verify every block's checksum")
    f.add_argument("--show", type=int, default=20, help="changes to list per kind")
    f.add_argument("--debug", action="store_true")
    f.set_defaults(func=cmd_fsck)
