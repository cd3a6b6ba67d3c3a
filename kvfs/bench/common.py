"""The tail of every benchmark: its options for the record, and writing the record and plot."""

from __future__ import annotations

import os
import sys
from typing import Any

from .harness import conditions  # noqa: F401 - `kvfs bench trace` (kvfs/cli.py) takes it here
from .plot import Drawing


def add_output_args(parser: Any) -> None:
    """The options every `kvfs bench` subcommand shares: where its record and plot go."""
    parser.add_argument("--out", default=".",
                        help="directory for BENCHMARK.json and BENCHMARK.png (default: here)")
    parser.add_argument("--json", help="write the JSON record here instead (plot beside it)")


def portable(value: Any) -> Any:
    """A record as it may be published: the paths of the machine that ran it (work
    directories, the trace's location, the checkout) reduced to their last component; the
    kvfs entry point named `kvfs`. Devices and mount points stay as they are."""
    if isinstance(value, dict):
        return {portable(k): portable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [portable(v) for v in value]
    if isinstance(value, str) and value.startswith("/") and value != "/" and not (
            value.startswith(("/dev/", "/proc/", "/sys/"))):
        if value.endswith(("/kvfs/cli.py", "/kvfs/cli/__main__.py", "/bin/kvfs")):
            return "kvfs"
        return os.path.basename(value.rstrip("/")) or value
    return value


def finish(record: dict[str, Any], args: Any, table: str, drawing: Drawing | None = None
           ) -> int:
    """Print the table, write the JSON record and its PNG plot; the tail of every subcommand.

    The record is the source of truth: `kvfs bench report` renders docs from records alone,
    and the plot is drawn from the record (never from state the record lacks) by `drawing`,
    the kind's (None: a table of the rows).
    """
    import json  # noqa: PLC0415

    from . import plot  # noqa: PLC0415 - matplotlib is imported only when drawing

    print(table)
    record.setdefault("command", list(sys.argv))  # how to reproduce it: `kvfs bench report`
    record = portable(record)
    name = record["benchmark"]
    path = args.json or os.path.join(args.out, f"{name}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    png = os.path.splitext(path)[0] + ".png"
    drawn = plot.draw(record, png, drawing)  # None when matplotlib is absent: said, not fatal
    record["plot"] = os.path.basename(png) if drawn else None
    with open(path, "w") as f:
        f.write(json.dumps(record, indent=2) + "\n")
    print(f"record: {path}" + (f"; plot: {png}" if drawn else
                               "; no plot (matplotlib is not installed, or the log says why)"))
    return 0
