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
simulated in memory (`kvfs.simulate`), so the daemon's own behaviour is checked against it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from .. import simulate
from ..hashing import ModelSpec
from ..policy import DEFAULT_POLICY
from ..trace import GENERATORS, Request, describe
from .common import conditions, finish

KVFS = [sys.executable, "-m", "kvfs.cli"]


def _spec(block_tokens: int, block_kib: int) -> ModelSpec:
    head_dim = max(1, block_kib * 1024 // (2 * block_tokens))
    return ModelSpec(model="bench/hitrate", revision="1", kv_dtype="uint8",
                     block_size=block_tokens, num_layers=1, num_kv_heads=1, head_dim=head_dim)


def replay(requests: list[Request], *, fraction: float, policy: str, workdir: str,
           block_tokens: int = 512, block_kib: int = 4, progress: bool = True) -> dict[str, Any]:
    """One replay through a fresh mount; returns the figures."""
    import torch  # noqa: PLC0415 - the client side

    from ..client import KVCache  # noqa: PLC0415

    spec = _spec(block_tokens, block_kib)
    file_bytes = 4096 + -(-spec.block_payload_bytes // 4096) * 4096
    distinct = len({k for r in requests for k in r.hash_ids})
    blocks = max(1, round(fraction * distinct))
    capacity = blocks * file_bytes + 4096  # + the namespace's manifest
    base = tempfile.mkdtemp(prefix="kvfs-hitrate-", dir=workdir)
    backing, mnt = os.path.join(base, "backing"), os.path.join(base, "mnt")
    os.makedirs(backing)
    os.makedirs(mnt)
    subprocess.run([*KVFS, "mount", backing, mnt, "--capacity", str(capacity), "--policy",
                    policy, "--high-watermark", "1", "--low-watermark", "1",
                    "--log", os.path.join(base, "daemon.log")], check=True,
                   capture_output=True)
    hits = refs = hit_tokens = tokens = 0
    start = time.monotonic()
    try:
        subprocess.run([*KVFS, "tenant", "add", mnt, "bench", "--uid", str(os.getuid()),
                        "--gid", str(os.getgid())], check=True, capture_output=True)
        payload = torch.zeros(1, *spec.block_shape, dtype=torch.uint8)
        with KVCache.open(mnt, tenant="bench", spec=spec) as cache:
            for i, req in enumerate(requests):
                ids = req.hash_ids
                hashes = cache.block_hashes([t for t in ids for _ in range(block_tokens)])
                n = cache.lookup(hashes)
                if n:
                    cache.load(hashes[:n], payload.expand(n, *spec.block_shape).contiguous())
                if n < len(hashes):
                    rest = len(hashes) - n
                    cache.save(hashes[n:], payload.expand(rest, *spec.block_shape).contiguous(),
                               parent=hashes[n - 1] if n else None)
                hits += n
                refs += len(ids)
                hit_tokens += min(n * block_tokens, req.input_length)
                tokens += req.input_length
                if progress and i % 200 == 0:
                    print(f"\r  {policy} at {fraction:.0%}: {i}/{len(requests)} requests",
                          end="", file=sys.stderr, flush=True)
        with open(os.path.join(mnt, ".kvfs", "stats.json")) as f:
            stats = json.load(f)
    finally:
        if subprocess.run([*KVFS, "umount", mnt], capture_output=True).returncode == 0:
            shutil.rmtree(base, ignore_errors=True)  # a mount left behind keeps its tree
    if progress:
        print("", file=sys.stderr)
    ns = stats["tenants"]["bench"][spec.namespace]
    return {
        "policy": policy, "fraction": fraction, "capacity_blocks": blocks,
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
        concurrency: list[int] | None = None) -> dict[str, Any]:
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
                row = replay(requests, fraction=fraction, policy=policy, workdir=workdir,
                             block_kib=block_kib)
                sim = simulate.simulate(requests, policy, cap)
                row.update(concurrency=n,
                           measured_concurrency=shape["concurrency"].get("p50"),
                           requests=len(requests), distinct_blocks=distinct,
                           simulated_block_hit=round(100 * sim.block_hit_rate, 2),
                           optimum_block_hit=round(100 * opt.block_hit_rate, 2),
                           optimum_token_hit=round(100 * opt.token_hit_rate, 2))
                rows.append(row)
    requests = points[0][1]
    return {"benchmark": "hitrate", "trace": str(trace), "generator_options": options or {},
            "seed": seed, "requests": len(requests),
            "distinct_blocks": len({k for r in requests for k in r.hash_ids}),
            "concurrency_axis": concurrency or None, "block_kib": block_kib,
            "scale": f"each 512-token block stored as {block_kib} KiB of payload",
            "rows": rows, "conditions": conditions([workdir])}


def table(record: dict[str, Any]) -> str:
    axis = bool(record.get("concurrency_axis"))
    lines = [f"{record['requests']} requests, {record['distinct_blocks']} distinct blocks; "
             f"{record['scale']}",
             ("sessions at once (set / measured median) " if axis else "")
             + f"{'capacity':>10} {'policy':<10} {'block hit %':>11} {'token hit %':>11} "
             f"{'simulated %':>11} {'optimum %':>10} {'evictions':>9}"]
    for r in record["rows"]:
        conc = (f"{r['concurrency']:>21} / {r['measured_concurrency']!s:<17}" if axis
                else "")
        lines.append(f"{conc}{r['fraction']:>9.0%} {r['policy']:<10} {r['block_hit']:>11.2f} "
                     f"{r['token_hit']:>11.2f} {r['simulated_block_hit']:>11.2f} "
                     f"{r['optimum_block_hit']:>10.2f} {r['evictions']:>9}")
    return "\n".join(lines)


def main(args: Any) -> int:
    record = run(args.trace, args.capacity_fraction, args.policy or [DEFAULT_POLICY],
                 workdir=args.dir, block_kib=args.block_kib, limit=args.limit, seed=args.seed,
                 options=args.options, concurrency=args.concurrency)
    return finish(record, args, table(record))
