"""`kvfs demo`: mount a demo kvfs with real KV blocks in it (kvfs.models.demo)."""

from __future__ import annotations

import argparse


def cmd_demo(args: argparse.Namespace) -> int:
    from ..models.demo import run_demo  # noqa: PLC0415

    return run_demo(args.dir)


def register(sub: argparse._SubParsersAction) -> None:
    """Add this module's subcommands to `kvfs`."""
    d = sub.add_parser("demo", help="mount a demo kvfs with real KV blocks in it")
    d.add_argument("dir", nargs="?", default="demo", help="where to put it (default ./demo)")
    d.set_defaults(func=cmd_demo)
