"""`kvfs`: one program, one small function per subcommand, in a module per command family.

Exit codes: 0 success; 1 the operation failed (the message says why); 2 bad usage or
configuration; 3 not a kvfs mount / not mounted.

Imports: any folder of kvfs (the command line is the top layer); nothing imports it but
its own entry points.
"""

from __future__ import annotations

import argparse
import sys

from .. import __version__
from ..format.config import ConfigError
from . import bench, daemon, demo, fsck, status, tenants
from .common import EXIT_FAIL, EXIT_NOT_MOUNTED, EXIT_USAGE, CliError

__all__ = ["EXIT_FAIL", "EXIT_NOT_MOUNTED", "EXIT_USAGE", "CliError", "build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvfs", description="kvfs: a KV-cache filesystem")
    p.add_argument("--version", action="version", version=f"kvfs {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    for family in (daemon, status, tenants, fsck, bench, demo):
        family.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["bench", "tiers"]:  # its own options (kvfs.bench.tiers), passed whole
        from ..bench import tiers  # noqa: PLC0415

        return tiers.main(argv[2:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"kvfs: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except CliError as exc:
        print(f"kvfs: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        return 130
