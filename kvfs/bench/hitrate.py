"""`kvfs bench hitrate`: replay a request trace through a real mount and the kvfs client.

Each request of a Mooncake-format trace (or a generated one) becomes a chain of kvfs-native
blocks: block i of a request carries the token ids ``[hash_ids[i]] * block_tokens``, so two
requests that share a leading run of ids share those blocks' hashes, exactly as the trace
means. Per request the client does what an engine does: ``lookup`` (the leading run of cached
blocks: the hits), ``load`` of the hits, ``save`` of the rest (the recompute). The mount has a
hot-tier capacity of a fraction of the trace's distinct blocks, with no background watermark
(capacity is enforced by synchronous eviction, as the simulator does). Block bytes are scaled
down (``--block-kib``; printed) so the working set fits on one machine; capacity is counted in
blocks, all of one size. Beside each run: the offline optimum (Belady) and the same policy
simulated in memory (`kvfs.models.simulate`), so the daemon's own behaviour is checked against it.

With ``--codec`` (repeatable: ``none``, ``planes``, ``int8``) the payloads are KV-like
(bfloat16 normal values, one log-normal scale per head, head_dim 64: the codec benchmark's
synthetic source) and the capacity is the same number of *bytes* for every codec: the raw
blocks' files at the fraction. ``planes`` mounts with ``--hot-codec planes``, ``int8`` opens
an int8 namespace; each then holds more blocks in those bytes. The simulated and optimum
columns use the blocks that fit those bytes at the codec's measured file size.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from typing import Any

from ..format.hashing import ModelSpec
from ..models import simulate
from ..models.policy import DEFAULT_POLICY
from ..models.trace import GENERATORS, Request, describe
from .common import finish
from .harness import Mount, conditions, mounted
from .plot import data_ticks, title
from .records import (
    Kind,
    concurrency_key,
    md_table,
    num_text,
    number,
    ratio_text,
    rows_of,
    value_text,
)

#: The codecs a replay can store its blocks with (``--codec``).
CODECS = ("none", "planes", "int8")
KV_HEAD_DIM = 64


def _spec(block_tokens: int, block_kib: int, codec: str | None = None) -> ModelSpec:
    if codec is None:  # bytes of no meaning: zeros, one uint8 per element
        head_dim = max(1, block_kib * 1024 // (2 * block_tokens))
        return ModelSpec(model="bench/hitrate", revision="1", kv_dtype="uint8",
                         block_size=block_tokens, num_layers=1, num_kv_heads=1,
                         head_dim=head_dim)
    heads = max(1, block_kib * 1024 // (2 * block_tokens * KV_HEAD_DIM * 2))
    return ModelSpec(model="bench/hitrate-kv", revision="1", kv_dtype="bfloat16",
                     block_size=block_tokens, num_layers=1, num_kv_heads=heads,
                     head_dim=KV_HEAD_DIM,
                     extras={"kv_codec": "int8"} if codec == "int8" else {})


def _kv_payloads(spec: ModelSpec, n: int = 16) -> Any:
    """``n`` KV-like blocks (bfloat16 normal values, one log-normal scale per head)."""
    import torch  # noqa: PLC0415

    g = torch.Generator().manual_seed(0)
    shape = (n, *spec.block_shape)
    scale = torch.exp(torch.randn((n, spec.num_layers, 2, 1, spec.num_kv_heads, 1),
                                  generator=g) * 0.5)
    return (torch.randn(shape, generator=g) * scale).to(torch.bfloat16)


def replay(requests: list[Request], *, fraction: float, policy: str, workdir: str,
           block_tokens: int = 512, block_kib: int = 4, progress: bool = True,
           codec: str | None = None) -> dict[str, Any]:
    """One replay through a fresh mount; returns the figures. ``codec``: KV-like payloads
    stored so (one of CODECS), the capacity the raw blocks' bytes at ``fraction``."""
    import torch  # noqa: PLC0415 - the client side

    from ..client import KVCache  # noqa: PLC0415

    spec = _spec(block_tokens, block_kib, codec)
    file_bytes = 4096 + -(-spec.block_payload_bytes // 4096) * 4096
    distinct = len({k for r in requests for k in r.hash_ids})
    blocks = max(1, round(fraction * distinct))
    capacity = blocks * file_bytes + 4096  # + the namespace's manifest
    base = tempfile.mkdtemp(prefix="kvfs-hitrate-", dir=workdir)
    m = Mount.under(base, ["--capacity", str(capacity), "--policy", policy,
                           "--high-watermark", "1", "--low-watermark", "1",
                           *(["--hot-codec", "planes"] if codec == "planes" else [])])
    m.start()
    hits = refs = hit_tokens = tokens = 0
    start = time.monotonic()
    try:
        m.add_tenant("bench")
        pool = (torch.zeros(1, *spec.block_shape, dtype=torch.uint8) if codec is None
                else _kv_payloads(spec))

        def payloads(ids: list[int]) -> Any:
            if codec is None:
                return pool.expand(len(ids), *spec.block_shape).contiguous()
            return pool[torch.tensor([k % len(pool) for k in ids])]

        stored = stored_blocks = 0
        with KVCache.open(m.mnt, tenant="bench", spec=spec) as cache:
            for i, req in enumerate(requests):
                ids = req.hash_ids
                hashes = cache.block_hashes([t for t in ids for _ in range(block_tokens)])
                n = cache.lookup(hashes)
                if n:
                    cache.load(hashes[:n], torch.empty((n, *spec.block_shape),
                                                       dtype=pool.dtype))
                if n < len(hashes):
                    before = cache.stats["written_bytes"]
                    wrote = cache.save(hashes[n:], payloads(ids[n:]),
                                       parent=hashes[n - 1] if n else None)
                    stored += cache.stats["written_bytes"] - before
                    stored_blocks += wrote
                hits += n
                refs += len(ids)
                hit_tokens += min(n * block_tokens, req.input_length)
                tokens += req.input_length
                if progress and i % 200 == 0:
                    print(f"\r  {policy} at {fraction:.0%}: {i}/{len(requests)} requests",
                          end="", file=sys.stderr, flush=True)
        stats = m.stats()
    finally:
        m.stop(check=False)
        if not mounted(m.mnt):  # a mount left behind keeps its tree
            shutil.rmtree(base, ignore_errors=True)
    if progress:
        print("", file=sys.stderr)
    ns = stats["tenants"]["bench"][spec.namespace]
    mean = stored / stored_blocks if stored_blocks else file_bytes
    return {
        "policy": policy, "fraction": fraction, "capacity_blocks": blocks,
        **({} if codec is None else {
            "codec": codec, "raw_file_bytes": file_bytes, "mean_file_bytes": round(mean),
            "file_ratio": round(file_bytes / mean, 3),
            "blocks_in_capacity": int((capacity - 4096) // mean)}),
        "block_hit": round(100 * hits / refs, 2) if refs else 0.0,
        "token_hit": round(100 * hit_tokens / tokens, 2) if tokens else 0.0,
        "evictions": ns["evictions"], "refused_blocks": ns["refused_blocks"],
        "used_bytes": stats["used_bytes"], "capacity_bytes": capacity,
        "seconds": round(time.monotonic() - start, 1),
    }


def _traces(trace: str, *, limit: int | None, seed: int, options: dict[str, Any],
            concurrency: list[int] | None) -> list[tuple[int | None, list[Request]]]:
    """(concurrency, requests) for each point of the run: one trace, or on the concurrency
    axis the same generated sessions run N at a time (closed loop) for each N."""
    if not concurrency:
        if trace in GENERATORS:
            requests = GENERATORS[trace](**{"seed": seed, **options})
        else:
            requests = simulate.load(trace, seed)
        return [(None, requests[:limit] if limit else requests)]
    out = []
    for n in concurrency:
        requests = GENERATORS[trace](**{"seed": seed, **options, "concurrency": n})
        out.append((n, requests))
    return out


def run(trace: str, fractions: list[float], policies: list[str], *, workdir: str,
        block_kib: int, limit: int | None, seed: int, options: dict[str, Any] | None = None,
        concurrency: list[int] | None = None, codecs: list[str] | None = None
        ) -> dict[str, Any]:
    """Each policy at each capacity fraction; with `concurrency`, at each number of sessions
    interleaved too. The sessions (so the turns, the distinct blocks and the capacity in
    blocks) are the same at every concurrency; only their interleaving changes."""
    points = _traces(trace, limit=limit, seed=seed, options=options or {},
                     concurrency=concurrency)
    for _, requests in points:
        distinct = len({k for r in requests for k in r.hash_ids})
        longest = max((len(r.hash_ids) for r in requests), default=0)
        for fraction in fractions:
            if max(1, round(fraction * distinct)) < longest:
                raise ValueError(
                    f"a capacity of {fraction:g} x {distinct} distinct blocks cannot hold one "
                    f"request of {longest} blocks (the mount would refuse it): raise "
                    "--capacity-fraction")
    rows = []
    for n, requests in points:
        distinct = len({k for r in requests for k in r.hash_ids})
        shape = describe(requests)
        for fraction in fractions:
            cap = max(1, round(fraction * distinct))
            opt = simulate.belady(requests, cap)
            for policy in policies:
                for codec in codecs or [None]:
                    row = replay(requests, fraction=fraction, policy=policy, workdir=workdir,
                                 block_kib=block_kib, codec=codec)
                    held = row.get("blocks_in_capacity", cap)
                    sim = simulate.simulate(requests, policy, held)
                    best = opt if held == cap else simulate.belady(requests, held)
                    row.update(concurrency=n,
                               measured_concurrency=shape["concurrency"].get("p50"),
                               requests=len(requests), distinct_blocks=distinct,
                               simulated_block_hit=round(100 * sim.block_hit_rate, 2),
                               optimum_block_hit=round(100 * best.block_hit_rate, 2),
                               optimum_token_hit=round(100 * best.token_hit_rate, 2))
                    rows.append(row)
    requests = points[0][1]
    return {"benchmark": "hitrate", "trace": str(trace), "generator_options": options or {},
            "seed": seed, "requests": len(requests),
            "distinct_blocks": len({k for r in requests for k in r.hash_ids}),
            "concurrency_axis": concurrency or None, "block_kib": block_kib,
            "codecs": codecs or None,
            "scale": (f"each 512-token block stored as {block_kib} KiB of payload"
                      + (", KV-like bfloat16 values (head_dim 64); capacity in the raw "
                         "blocks' bytes for every codec" if codecs else "")),
            "rows": rows, "conditions": conditions([workdir])}


def _label(r: dict[str, Any], ratio: bool = True) -> str:
    """A row's policy, and its codec where the run compared codecs (with its file ratio)."""
    codec = r.get("codec")
    if not codec:
        return str(r.get("policy", "?"))
    return f"{r.get('policy', '?')}, {codec}" + (f" ({r.get('file_ratio')}x)" if ratio else "")


def table(record: dict[str, Any]) -> str:
    axis = bool(record.get("concurrency_axis"))
    lines = [f"{record['requests']} requests, {record['distinct_blocks']} distinct blocks; "
             f"{record['scale']}",
             ("sessions at once (set / measured median) " if axis else "")
             + f"{'capacity':>10} {'policy':<22} {'block hit %':>11} {'token hit %':>11} "
             f"{'simulated %':>11} {'optimum %':>10} {'evictions':>9}"]
    for r in record["rows"]:
        conc = (f"{r['concurrency']:>21} / {r['measured_concurrency']!s:<17}" if axis
                else "")
        lines.append(f"{conc}{r['fraction']:>9.0%} {_label(r):<22} {r['block_hit']:>11.2f} "
                     f"{r['token_hit']:>11.2f} {r['simulated_block_hit']:>11.2f} "
                     f"{r['optimum_block_hit']:>10.2f} {r['evictions']:>9}")
    return "\n".join(lines)


def main(args: Any) -> int:
    record = run(args.trace, args.capacity_fraction, args.policy or [DEFAULT_POLICY],
                 workdir=args.dir, block_kib=args.block_kib, limit=args.limit, seed=args.seed,
                 options=args.options, concurrency=args.concurrency,
                 codecs=getattr(args, "codec", None))
    return finish(record, args, table(record), draw)


# -- the record, as `kvfs bench report` shows it --------------------------------------------


def report_table(record: dict[str, Any]) -> list[str]:
    rows = rows_of(record)
    ckey = concurrency_key(rows)
    lru = {(number(r.get("fraction")), number(r.get(ckey)) if ckey else None): r for r in rows
           if r.get("policy") == "lru" and r.get("codec") in (None, "none")}
    head = ["capacity", *([ckey] if ckey else []), "policy", "block hit %", "token hit %",
            "same policy simulated", "optimum", "of the optimum",
            "gap to the optimum closed vs LRU"]
    out = []
    for r in rows:
        f = number(r.get("fraction"))
        cap = "-" if f is None else f"{f:.0%}".replace("%", " %")
        if number(r.get("capacity_blocks")) is not None:
            cap += f" ({r['capacity_blocks']:,} blocks)"
        hit, opt = number(r.get("block_hit")), number(r.get("optimum_block_hit"))
        base = lru.get((f, number(r.get(ckey)) if ckey else None))
        gap = "-"
        if r.get("policy") == "lru":
            gap = "baseline"
        elif base is not None and hit is not None and opt is not None:
            b = number(base.get("block_hit"))
            if b is not None and opt > b:
                gap = f"{100 * (hit - b) / (opt - b):.1f} %"
        conc = num_text(r.get(ckey), "g") if ckey else ""
        if ckey and r.get("measured_concurrency") is not None:
            conc += f" (measured {value_text(r['measured_concurrency'])})"
        out.append([cap, *([conc] if ckey else []), _label(r),
                    num_text(hit), num_text(r.get("token_hit")),
                    num_text(r.get("simulated_block_hit")),
                    num_text(opt), ratio_text(hit / opt if hit is not None and opt else None), gap])
    lines = []
    if record.get("requests") is not None:
        lines.append(f"Trace `{os.path.basename(str(record.get('trace', '?')))}`: "
                     f"{record.get('requests')} requests, {record.get('distinct_blocks', '?')} "
                     f"distinct blocks; {record.get('scale', '')}.".replace("; .", "."))
        lines.append("")
    return lines + md_table(head, out)


def draw(record: dict[str, Any], plt: Any) -> Any:
    rows = rows_of(record)
    ckey = concurrency_key(rows)
    levels = sorted({number(r.get(ckey)) for r in rows} - {None}) if ckey else []
    fig, axes = plt.subplots(1, 2 if len(levels) > 1 else 1, figsize=(
        12 if len(levels) > 1 else 7, 4.5), squeeze=False, layout="constrained")
    policies = list(dict.fromkeys(_label(r, False) for r in rows))
    base = [r for r in rows if not levels or number(r.get(ckey)) == levels[0]]
    ax = axes[0][0]
    for p in policies:
        pts = sorted((number(r.get("fraction")), number(r.get("block_hit")))
                     for r in base if _label(r, False) == p
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
                             if _label(r, False) == p and number(r.get("fraction")) == f
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


KIND = Kind("hitrate", "Hit rate", "kvfs bench hitrate --trace mooncake_synthetic_trace.jsonl "
            "--policy lru --policy kvfs --out docs/bench", """\
`kvfs bench hitrate` (`kvfs/bench/hitrate.py`) replays a request trace in the Mooncake format
(or a generated agentic one) through a real mount and the kvfs client: block i of a request
carries the token ids `[hash_ids[i]] * 512`, so requests that share a leading run of ids share
those blocks' hashes. Per request the client does what an engine does: `lookup` (the request's
leading run of cached blocks is its hits), `load` of the hits, `save` of the rest (the
recompute). The mount's capacity is a fraction of the trace's distinct blocks (block payloads
scaled down, as the record says), with synchronous eviction only (both watermarks at 1.0), so
capacity is counted in blocks as in the simulator. Beside each run: the same policy replayed
in memory by `kvfs.models.simulate` and the offline optimum (Belady, evicting the deeper of two
blocks next used by the same request first, which keeps the cache prefix-closed;
`kvfs/models/simulate.py` says why this is the optimum). Where rows carry a concurrency (sessions
interleaved), the plot also shows hit rate against it. LRU at the same capacity is the
baseline: "gap closed" is how much of LRU's distance to the optimum a policy recovers. The
synthetic trace published with the Mooncake paper (kvcache-ai/Mooncake; its first 200 requests
are in `tests/data/mooncake_head.jsonl`) is the reference; hit rates do not depend on the
machine's load, timings do.""", report_table,
            ("fraction", "block_hit", "token_hit", "simulated_block_hit", "optimum_block_hit",
             "concurrency", "sessions"), shown=("trace", "requests", "distinct_blocks", "scale"),
            plot=draw)
