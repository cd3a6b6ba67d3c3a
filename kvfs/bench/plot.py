"""PNG plots of benchmark records (matplotlib, optional: `pip install kvfs[bench]`).

One drawing per record kind, made from the record alone (`kvfs bench report --redraw` redraws
them all from committed records). Every drawing is robust to rows that lack a field: a point
or a bar that cannot be drawn is left out, never invented. The title carries the conditions
that make a figure comparable (CPU, cores, memory, filesystem, load).
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

#: Which key of a hitrate row holds its concurrency (sessions interleaved), if any.
CONCURRENCY_KEYS = ("concurrency", "sessions")
PERCENTILES = ("p50", "p90", "p99", "max")


def number(x: Any) -> float | None:
    """`x` as a finite float, or None (missing, text, NaN)."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def rows_of(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The record's rows (dicts only); older restore records nest them under sizes[].results,
    older mount records call them `table`."""
    rows = record.get("rows")
    if not isinstance(rows, list) and isinstance(record.get("table"), list):
        rows = record["table"]
    if not isinstance(rows, list):
        rows = [r for s in record.get("sizes") or [] if isinstance(s, dict)
                for r in s.get("results") or []]
    return [r for r in rows if isinstance(r, dict)]


def concurrency_key(rows: list[dict[str, Any]]) -> str | None:
    for key in CONCURRENCY_KEYS:
        if any(number(r.get(key)) is not None for r in rows):
            return key
    return None


def latency(row: dict[str, Any], q: str) -> float | None:
    """A degraded row's percentile `q` in ms: `p99_ms`, or `latency_ms: {"p99": ...}`."""
    nested = row.get("latency_ms")
    if isinstance(nested, dict) and number(nested.get(q)) is not None:
        return number(nested.get(q))
    return number(row.get(f"{q}_ms"))


def data_ticks(ax: Any, xs: list[float | None]) -> None:
    """Ticks at the measured x values (16, 64, 256 rather than 2^4, 2^6, 2^8), when few."""
    ticks = sorted({x for x in xs if x is not None and x > 0})
    if 0 < len(ticks) <= 12:
        ax.set_xticks(ticks, [f"{x:g}" for x in ticks])
        ax.minorticks_off()


def title(record: dict[str, Any], what: str) -> str:
    from .report import conditions_brief  # noqa: PLC0415 - report owns the conditions' text

    brief = conditions_brief(record.get("conditions"))
    return f"{what}\n{brief}" if brief else what


# -- one drawing per kind --------------------------------------------------------------------


def _hitrate(record: dict[str, Any], plt: Any) -> Any:
    rows = rows_of(record)
    ckey = concurrency_key(rows)
    levels = sorted({number(r.get(ckey)) for r in rows} - {None}) if ckey else []
    fig, axes = plt.subplots(1, 2 if len(levels) > 1 else 1, figsize=(
        12 if len(levels) > 1 else 7, 4.5), squeeze=False, layout="constrained")
    policies = list(dict.fromkeys(str(r.get("policy", "?")) for r in rows))
    base = [r for r in rows if not levels or number(r.get(ckey)) == levels[0]]
    ax = axes[0][0]
    for p in policies:
        pts = sorted((number(r.get("fraction")), number(r.get("block_hit")))
                     for r in base if str(r.get("policy", "?")) == p
                     and None not in (number(r.get("fraction")), number(r.get("block_hit"))))
        if pts:
            ax.plot([100 * x for x, _ in pts], [y for _, y in pts], marker="o", label=p)
    opt = sorted({(number(r.get("fraction")), number(r.get("optimum_block_hit"))) for r in base
                  if None not in (number(r.get("fraction")), number(r.get("optimum_block_hit")))})
    if opt:
        ax.plot([100 * x for x, _ in opt], [y for _, y in opt], "k--", marker="x",
                label="optimum (Belady)")
    data_ticks(ax, [100 * x for x in (number(r.get("fraction")) for r in base) if x])
    ax.set_xlabel("hot-tier capacity (% of the trace's distinct blocks)")
    ax.set_ylabel("block hit %")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.05)
    ax.set_title("hit rate vs capacity" + (f" ({ckey} {levels[0]:g})" if levels else ""),
                 fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    if len(levels) > 1:
        ax = axes[0][1]
        fractions = sorted({number(r.get("fraction")) for r in rows} - {None})
        styles = ["-", "-.", ":", (0, (5, 1))]
        for i, f in enumerate(fractions):
            for p in policies:
                pts = sorted((number(r.get(ckey)), number(r.get("block_hit"))) for r in rows
                             if str(r.get("policy", "?")) == p and number(r.get("fraction")) == f
                             and None not in (number(r.get(ckey)), number(r.get("block_hit"))))
                if pts:
                    ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o",
                            linestyle=styles[i % len(styles)], label=f"{p}, {f:.0%}")
            opt = sorted({(number(r.get(ckey)), number(r.get("optimum_block_hit")))
                          for r in rows if number(r.get("fraction")) == f
                          and None not in (number(r.get(ckey)),
                                           number(r.get("optimum_block_hit")))})
            if opt:
                ax.plot([x for x, _ in opt], [y for _, y in opt], "k--", marker="x",
                        label=f"optimum, {f:.0%}")
        ax.set_xscale("log")
        data_ticks(ax, levels)
        ax.set_xlabel(f"{ckey} (interleaved)")
        ax.set_ylabel("block hit %")
        ax.set_ylim(0, ax.get_ylim()[1] * 1.05)
        ax.set_title(f"hit rate vs {ckey}", fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    trace = os.path.basename(str(record.get("trace", ""))) or "?"
    fig.suptitle(title(record, f"kvfs bench hitrate: trace {trace}, "
                               f"{record.get('requests', '?')} requests"), fontsize=9)
    return fig


def _ttft(record: dict[str, Any], plt: Any, lines: tuple[tuple[str, str, str], ...],
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


def _crossover(record: dict[str, Any], plt: Any) -> Any:
    return _ttft(record, plt, (
        ("recompute_ms", "recompute (prefill of every token)", "o-"),
        ("restore_ms", "restore from kvfs + prefill of the tail", "s-")), "restore",
        "kvfs bench crossover: time to first token, page cache "
        f"{record.get('page_cache', '?')}")


def _engine(record: dict[str, Any], plt: Any) -> Any:
    """TTFT against context length, a line per condition (recompute, kvfs warm and cold,
    ExampleConnector)."""
    return _ttft(record, plt, (
        ("recompute_ms", "recompute (no connector)", "o-"),
        ("kvfs_warm_ms", "kvfs, page cache warm", "s-"),
        ("kvfs_cold_ms", "kvfs, page cache cold", "s--"),
        ("example_ms", "vLLM ExampleConnector", "^-")), "kvfs",
        f"kvfs bench engine: vLLM + {record.get('model', '?')}")


def _restore(record: dict[str, Any], plt: Any) -> Any:
    """GB/s against block size, a line per path and page-cache state, a panel per thread count;
    below, the per-request latency (p50) where the rows carry it."""
    rows = [r for r in rows_of(record) if number(r.get("block_mib"))]
    threads = sorted({number(r.get("threads")) for r in rows} - {None}) or [None]
    panels = [("gbps", "GB/s of KV delivered", "linear")]
    if any(number(r.get("p50_ms")) for r in rows):
        panels.append(("p50_ms", "request latency p50 (ms)", "log"))
    fig, axes = plt.subplots(len(panels), len(threads), figsize=(
        4 * len(threads) + 1, 4 * len(panels) + 0.5), squeeze=False, sharey="row",
        sharex=True, layout="constrained")
    methods = list(dict.fromkeys(str(r.get("method", r.get("path", "?"))) for r in rows))
    colors = {m: f"C{i % 10}" for i, m in enumerate(methods)}
    caches = list(dict.fromkeys(str(r.get("cache", "")) for r in rows))
    for row_axes, (key, label, yscale) in zip(axes, panels, strict=True):
        for ax, t in zip(row_axes, threads, strict=True):
            for m in methods:
                for c in caches:
                    pts = sorted(p for p in ((number(r["block_mib"]), number(r.get(key)))
                                             for r in rows
                                             if str(r.get("method", r.get("path", "?"))) == m
                                             and str(r.get("cache", "")) == c
                                             and number(r.get("threads")) == t)
                                 if p[1] is not None and p[1] > 0)
                    if pts:
                        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o",
                                color=colors[m], linestyle="--" if c == "warm" else "-",
                                label=f"{m}{', ' + c if c else ''}")
            ax.set_xscale("log", base=2)
            ax.set_yscale(yscale)
            data_ticks(ax, [number(r.get("block_mib")) for r in rows])
            ax.grid(True, which="both", alpha=0.3)
            if key == panels[0][0]:
                ax.set_title(f"{t:g} thread{'s' if t != 1 else ''}" if t else "", fontsize=9)
            if key == panels[-1][0]:
                ax.set_xlabel("block size (MiB)")
        row_axes[0].set_ylabel(label)
    axes[0][-1].legend(fontsize=7, loc="best")
    fig.suptitle(title(record, "kvfs bench restore: each path against raw preadv (solid cold, "
                               "dashed warm page cache)"), fontsize=9)
    return fig


def _degraded(record: dict[str, Any], plt: Any) -> Any:
    rows = rows_of(record)
    names = [str(r.get("condition", r.get("name", r.get("tier", f"#{i}"))))
             for i, r in enumerate(rows)]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(rows) + 2), 4.5))
    width = 0.8 / len(PERCENTILES)
    for k, q in enumerate(PERCENTILES):
        xs, ys = [], []
        for i, r in enumerate(rows):
            v = latency(r, q)
            if v is not None and v > 0:
                xs.append(i + (k - (len(PERCENTILES) - 1) / 2) * width)
                ys.append(v)
        if xs:
            ax.bar(xs, ys, width, label=q)
    for key, scale, label, color in (("recompute_ms", 1, "recompute instead", "tab:gray"),
                                     ("fetch_timeout_s", 1e3, "fetch deadline", "tab:red")):
        v = number(record.get(key))
        if v:
            ax.axhline(v * scale, color=color, linestyle="--", linewidth=1,
                       label=f"{label}: {v * scale:.0f} ms")
    ax.set_xticks(range(len(rows)), names, fontsize=8, rotation=15)
    ax.set_yscale("log")
    ax.set_ylabel("load latency on a miss (ms)")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title(record, "kvfs bench degraded: tail latency of loads on misses"),
                 fontsize=9)
    return fig


def _ratio_bars(record: dict[str, Any], plt: Any, what: str) -> Any:
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


def _mount(record: dict[str, Any], plt: Any) -> Any:
    return _ratio_bars(record, plt, "tools/bench_mount.py: kvfs against its backing filesystem")


def _tiers(record: dict[str, Any], plt: Any) -> Any:
    restore = record.get("restore") if isinstance(record.get("restore"), dict) else {}
    delays = [d for d in record.get("delays") or [] if isinstance(d, dict)]
    if not restore and not delays:
        return _ratio_bars(record, plt, "tools/bench_tiers.py: lower tiers")
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), layout="constrained")
    ax = axes[0]
    tiers = [t for t in ("hot", "cold", "s3") if isinstance(restore.get(t), dict)]
    series = (("gbps", "kvfs restore"), ("baseline_gbps", "raw read of the source"),
              ("copy_gbps", "copy to a hot file + read back"))
    for k, (key, label) in enumerate(series):
        xs = [i + (k - 1) * 0.27 for i, t in enumerate(tiers) if number(restore[t].get(key))]
        ys = [number(restore[t].get(key)) for t in tiers if number(restore[t].get(key))]
        if xs:
            ax.bar(xs, ys, 0.27, label=label)
    ax.set_xticks(range(len(tiers)), tiers)
    ax.set_ylabel("GB/s of KV")
    ax.set_title(f"restore of {restore.get('blocks', '?')} x {restore.get('block_mib', '?')} MiB"
                 " per tier", fontsize=9)
    ax.legend(fontsize=8)
    ax = axes[1]
    for q, style in (("p50", "-"), ("p99", "--")):
        for key, label, color in (("latency_ms", "kvfs fresh miss", "C0"),
                                  ("baseline_ms", "boto3 GETs", "C1")):
            pts = sorted(p for p in ((number(d.get("delay_ms")), number(d[key].get(q)))
                                     for d in delays if isinstance(d.get(key), dict))
                         if None not in p)
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", linestyle=style,
                        color=color, label=f"{label} {q}")
    ax.set_xlabel("delay added per store request (ms)")
    ax.set_ylabel("request latency (ms)")
    ax.set_title("latency while the store is slow", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(title(record, "tools/bench_tiers.py: restores and latency from the lower "
                               "tiers"), fontsize=9)
    return fig


def _generic(record: dict[str, Any], plt: Any) -> Any:
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


DRAW: dict[str, Callable[[dict[str, Any], Any], Any]] = {
    "hitrate": _hitrate, "crossover": _crossover, "restore": _restore, "engine": _engine,
    "degraded": _degraded, "mount": _mount, "tiers": _tiers,
}


def draw(record: dict[str, Any], png: str) -> bool:
    """Draw `record` into `png`; False (and nothing written) when matplotlib is absent or
    the record cannot be drawn (logged: the record itself is still worth writing).

    Unknown kinds get a table of their rows. The PNG is written under a temporary name and
    renamed, so a failed drawing leaves no partial file and an older plot stays whole.
    """
    try:
        import matplotlib  # noqa: PLC0415
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    try:
        fig = DRAW.get(str(record.get("benchmark")), _generic)(record, plt)
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
