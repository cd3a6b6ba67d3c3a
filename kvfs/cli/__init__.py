"""`kvfs`: one program, one small function per subcommand, in a module per command family.

Exit codes: 0 success; 1 the operation failed (the message says why); 2 bad usage or
configuration; 3 not a kvfs mount / not mounted; 141 the output's reader went away (`kvfs
status --json | head`: what other tools' SIGPIPE gives, without a traceback).

Imports: any folder of kvfs (the command line is the top layer); nothing imports it but
its own entry points.
"""

from __future__ import annotations

import argparse
import os
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


#: The exit status of a command whose output's reader went away (128 + SIGPIPE).
EXIT_PIPE = 141


def main(argv: list[str] | None = None) -> int:
    try:
        return _run(sys.argv[1:] if argv is None else argv)
    except BrokenPipeError:
        # Python's own flush at exit would fail again and say so: stdout goes nowhere now.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_PIPE


def _run(argv: list[str]) -> int:
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
    except (BrokenPipeError, ConnectionResetError):
        raise
    except OSError as exc:
        # What the system refused (a path that is not there, a permission, a full disk):
        # one line naming it, not a traceback; but the daemon's own failures keep theirs
        # (its log is where they are read).
        if args.command == "mount":
            raise
        where = f": {exc.filename}" if exc.filename is not None else ""
        print(f"kvfs: {exc.strerror or exc}{where}", file=sys.stderr)
        return EXIT_FAIL
