"""PNG plots of benchmark records (matplotlib, optional: `pip install kvfs[bench]`).

Each benchmark module draws its own kind (its `KIND.plot`, from the record alone: `kvfs bench
report --redraw` redraws them all from committed records); this module holds what the
drawings share (ticks, a title with the conditions, time to first token against context
length, ratio bars), the table drawn for a kind without a drawing of its own, and
:func:`draw`, which writes a PNG. Every drawing is robust to rows that lack a field: a point
or a bar that cannot be drawn is left out, never invented. The title carries the conditions
that make a figure comparable (CPU, cores, memory, filesystem, load).
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable
from typing import Any

from .records import conditions_brief, number, rows_of

log = logging.getLogger(__name__)

#: A drawing: (record, matplotlib.pyplot) -> the figure.
Drawing = Callable[[dict[str, Any], Any], Any]


def data_ticks(ax: Any, xs: list[float | None]) -> None:
    """Ticks at the measured x values (16, 64, 256 rather than 2^4, 2^6, 2^8), when few."""
    ticks = sorted({x for x in xs if x is not None and x > 0})
    if 0 < len(ticks) <= 12:
        ax.set_xticks(ticks, [f"{x:g}" for x in ticks])
        ax.minorticks_off()


def title(record: dict[str, Any], what: str) -> str:
    brief = conditions_brief(record.get("conditions"))
    return f"{what}\n{brief}" if brief else what


# -- what several kinds draw -------------------------------------------------------------------


def ttft(record: dict[str, Any], plt: Any, lines: tuple[tuple[str, str, str], ...],
          winner: str, heading: str) -> Any:
    """Time to first token against context length: a line per (row key, label, style), the
    crossover marked."""
    rows = rows_of(record)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, label, style in lines:
        pts = sorted((number(r.get("tokens")), number(r.get(key))) for r in rows
                     if (number(r.get("tokens")) or 0) > 0 and (number(r.get(key)) or 0) > 0)
        if pts:
            ax.plot([x for x, _ in pts], [y for _, y in pts], style, label=label)
    cross = number(record.get("crossover_tokens"))
    if cross:
        ax.axvline(cross, color="tab:red", linestyle=":", label=f"{winner} wins from "
                   f"{cross:g} tokens")
    ax.set_xscale("log", base=2)
    data_ticks(ax, [number(r.get("tokens")) for r in rows])
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("time to first token (ms)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title(record, heading), fontsize=9)
    return fig


def ratio_bars(record: dict[str, Any], plt: Any, what: str) -> Any:
    """A bar per figure row with a numeric ratio, log scale, 1.0 marked; green/red by target."""
    rows = [r for r in rows_of(record) if (number(r.get("ratio")) or 0) > 0]
    fig, ax = plt.subplots(figsize=(10, 0.32 * len(rows) + 1.8))
    ys = list(range(len(rows)))[::-1]
    colors = ["tab:gray" if r.get("ok") is None else "tab:green" if r.get("ok") else "tab:red"
              for r in rows]
    ratios = [number(r["ratio"]) or 0.0 for r in rows]
    ax.barh(ys, ratios, color=colors)
    for y, x in zip(ys, ratios, strict=True):
        ax.annotate(f"{x:.2f}x" if x >= 0.1 else f"{x:.2g}x", (x, y), xytext=(3, 0),
                    textcoords="offset points", va="center", fontsize=7)
    ax.set_yticks(ys, [str(r.get("figure", "?"))[:90] for r in rows], fontsize=7)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("kvfs / baseline (same run, same machine); green: target met, red: missed")
    ax.set_title(title(record, what), fontsize=9)
    return fig


def generic(record: dict[str, Any], plt: Any) -> Any:
    """Any other kind: its rows as a table (first columns that fit), or its scalars."""
    rows = rows_of(record)
    if rows:
        cols = list(dict.fromkeys(k for r in rows for k, v in r.items()
                                  if isinstance(v, str | int | float) or v is None))[:8]
        cells = [[_cell(r.get(c)) for c in cols] for r in rows[:30]]
    else:
        cols = ["field", "value"]
        cells = [[k, _cell(v)] for k, v in record.items()
                 if isinstance(v, str | int | float) and k != "benchmark"][:30]
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(cols)), 0.3 * len(cells) + 1.5))
    ax.axis("off")
    if cells:
        table = ax.table(cellText=cells, colLabels=cols, loc="center")
        table.auto_set_font_size(False)
        table.set_fontsize(7)
    else:
        ax.text(0.5, 0.5, "no figures in this record", ha="center")
    ax.set_title(title(record, f"benchmark {record.get('benchmark', '?')}"), fontsize=9)
    return fig


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "-" if v is None else str(v)[:40]


def draw(record: dict[str, Any], png: str, drawing: Drawing | None = None) -> bool:
    """Draw `record` into `png`; False (and nothing written) when matplotlib is absent or
    the record cannot be drawn (logged: the record itself is still worth writing).

    `drawing` is the record's kind's (None: a table of its rows). The PNG is written under
    a temporary name and
    renamed, so a failed drawing leaves no partial file and an older plot stays whole.
    """
    try:
        import matplotlib  # noqa: PLC0415
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    try:
        fig = (drawing or generic)(record, plt)
    except Exception:  # a record the drawing cannot read must not cost the run its record
        log.warning("cannot draw the %s record into %s", record.get("benchmark"), png,
                    exc_info=True)
        plt.close("all")
        return False
    where = os.path.dirname(os.path.abspath(png))
    fd, tmp = tempfile.mkstemp(prefix=".plot-", suffix=".png", dir=where)
    try:
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, format="png", dpi=100, bbox_inches="tight")
        os.replace(tmp, png)
    except BaseException:
        os.unlink(tmp)
        raise
    finally:
        plt.close(fig)
    log.debug("drew %s", png)
    return True
