"""`kvfs bench restore`: restoring KV blocks with the kvfs client, against this machine's limit.

The same block files, written once through :class:`kvfs.KVCache` into a kvfs mount over a
directory of the filesystem measured (``--dir``), are read for each block size (``--sizes``,
MiB), thread count (``--threads``) and page-cache state (cold: ``sync; echo 3 >
/proc/sys/vm/drop_caches`` before every run, as root; warm: after one untimed run), by:

- ``raw``: threaded ``os.preadv`` of each whole block file into its own slice of one
  preallocated buffer (each thread, the caller included, takes the next file): the limit of
  this machine for this job, and the baseline of every ratio;
- ``raw+xxh3``: the same, and each thread hashes each file's bytes with one ``xxh3_64`` pass
  over the buffer right after reading them: the honest baseline of a verified read, which
  the direct paths are also compared with (``x_raw_xxh3``);
- ``fio``: buffered sequential reads of the same files (psync, 1 MiB requests, one job per
  thread, each its share of the files), where fio is installed; throughput only;
- ``direct``: ``KVCache.load`` on the direct path (POSIX transport), ``verify="full"`` (the
  default: every payload checksummed) and ``direct-sampled`` (``verify="sampled"``);
- ``mount``: the same load through the mount (``direct=False``);
- ``torch.load``: the naive alternative, one ``torch.save`` file per block (same KV),
  loaded and copied into the same preallocated tensor.

A run reads every block once, as requests of ``--request-mib`` of KV each (one engine
request restoring that much prefix), one after the other; latency is per request (p50, p99
over every request of every run). GB/s is KV payload (the 4 KiB header is read but not
counted) per second of wall time, the median run (``--repeats`` runs cold, each after a
cache drop; ``--warm-repeats`` warm, which are short); ``x_raw`` is the median over runs of
raw's time divided by the path's. A ``KVCache`` path's time is its loads' (reading its
counters after the last one waits for the access records to reach the daemon, which an engine
does not). Runs are interleaved (round r runs each path once, in an order rotated by r), so
the load of other processes weighs on all paths alike; warm, each run of a path is paired with
a raw run right beside it (so raw runs once per other path and round), and the ratio is that
pair's (``x_raw_runs``: every pair's).

The targets (the record's verdicts, every cell): ``verify="full"`` warm >= 0.9x
``raw+xxh3``, cold >= 0.95x raw; ``verify="sampled"`` warm >= 0.95x raw; the control overhead
below; fetch amplification 1.00x. Beside each wall-time ratio, the same pairs give one in CPU
time (``cpu_x_raw``, ``cpu_x_raw_xxh3``: this process's CPU seconds, all threads, kernel
time included; not for fio and the mount, whose work other processes do), which the load of
other processes on a shared machine moves far less than wall time.

Warm, checksumming is CPU that raw ``preadv`` does not spend: the record states what it
allows. After each round, xxh3_64 is timed over cached bytes (as many threads as the cell,
each hashing one :data:`kvfs.client.transport.HASH_PIECE` buffer over and over; the median over
rounds), and each direct row gets ``checksummed_fraction`` f (1 for ``verify="full"``; for
"sampled", the share of these very blocks that the sample picks), ``copy_gbps`` (raw's GB/s),
``hash_gbps`` and ``bound_x_raw`` = 1 / (1 + f * copy / hash): the ratio a load would reach if
hashing were the only thing it did beyond raw's copy, on cores the copy already keeps busy.
The verdicts give the median bound and the median fraction of it reached; the record's notes
(rendered by `kvfs bench report`) list them per cell.

Then the control plane: ``--control-requests`` requests (``lookup`` + ``load``) of 64 blocks
that carry 8 bytes of KV each, against raw ``preadv`` of the same 64 files: what a request
costs beyond moving its bytes; the control calls (setxattrs through the mount) per request;
one access setxattr alone. Fetch amplification (bytes read / bytes of the blocks loaded) is
the client's own count (``cache.stats``) over each path's loads.
"""
from __future__ import annotations

import functools
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .harness import Mount, can_drop_caches, conditions, conditions_after, median
from .harness import log as _progress
from .plot import data_ticks, title
from .records import Kind, md_table, num_text, number, ratio_text, rows_of
from .restore_paths import (  # noqa: F401 - the paths' API, as `restore.X` too
    CONTROL_BLOCKS,
    PATHS,
    TENANT,
    VERIFIED,
    Blocks,
    Run,
    bench_control,
    cache_read,
    fio_read,
    hash_rate,
    measure,
    ratio_key,
    raw_read,
    torch_read,
    verified_read,
    verify_bound,
)

#: Targets: full verification, warm, against VERIFIED; full, cold, and sampled, warm, against
#: raw preadv (cold, the disk is the limit; sampled hashes one block in 8).
TARGET_X_VERIFIED = 0.9
TARGET_X_RAW_COLD = 0.95
TARGET_X_RAW_SAMPLED = 0.95
TARGET_CONTROL_MS = 1.0  # per 64-block lookup + load

log = functools.partial(_progress, err=True)  # progress on stderr: stdout is the table


def bench_size(args: Any, mount: Mount, work: str, block_mib: int) -> list[dict[str, Any]]:
    from ..client import KVCache  # noqa: PLC0415

    t = time.perf_counter()
    blocks = Blocks(mount, work, block_mib, args.total_mib, args.request_mib)
    log(f"{block_mib} MiB blocks: {blocks.n} ({blocks.total_payload / 2**30:.2f} GiB of KV, "
         f"{blocks.spec.block_size} tokens each, {blocks.per_request} per request), and as "
         f"many torch.save files, written in {time.perf_counter() - t:.1f} s")
    rows: list[dict[str, Any]] = []
    chosen = {"raw", *(getattr(args, "paths", None) or PATHS)}
    if chosen & {"direct", "direct-sampled"}:
        chosen.add(VERIFIED)  # their baseline
    fio = shutil.which("fio") is not None and args.fio and "fio" in chosen
    try:
        for state in (["cold"] if args.cold else []) + ["warm"]:
            for threads in args.threads:
                pool = ThreadPoolExecutor(max(1, threads))
                opts = {"tenant": TENANT, "spec": blocks.spec, "io": "posix",
                        "threads": threads}
                caches = {
                    "direct": KVCache.open(mount.mnt, direct=True, **opts),
                    "direct-sampled": KVCache.open(mount.mnt, direct=True, verify="sampled",
                                                   **opts),
                    "mount": KVCache.open(mount.mnt, direct=False, **opts),
                }
                runs: dict[str, Run] = {
                    "raw": raw_read(blocks, pool, threads),
                    VERIFIED: verified_read(blocks, pool, threads),
                    **{k: cache_read(blocks, c) for k, c in caches.items()},
                    "torch.load": torch_read(blocks, pool),
                }
                if fio:
                    runs["fio"] = fio_read(blocks, threads, work)
                # Warm, xxh3's rate is measured after each round, as loaded as the runs.
                hash_rates: list[float] = []
                try:
                    got = measure({p: runs[p] for p in PATHS if p in runs and p in chosen},
                                  args.repeats if state == "cold" else args.warm_repeats,
                                  state == "cold", mount.pid(),
                                  None if state == "cold" else
                                  lambda rates=hash_rates, t=threads: rates.append(
                                      hash_rate(t, trials=3)),
                                  pairs={p: [VERIFIED] for p in ("direct", "direct-sampled")})
                finally:
                    pool.shutdown()
                    for c in caches.values():
                        c.close()
                    shutil.rmtree(os.path.join(work, f"fio-{block_mib}-{threads}"),
                                  ignore_errors=True)
                    with_ini = os.path.join(work, f"fio-{block_mib}-{threads}.ini")
                    if os.path.exists(with_ini):
                        os.unlink(with_ini)
                load = round(os.getloadavg()[0], 2)
                vkey = ratio_key(VERIFIED)
                for r in got.values():
                    r["gbps"] = blocks.total_payload / r.pop("seconds") / 1e9
                if state == "warm":
                    # What checksumming may cost at best, measured now on the same threads.
                    hashed = {p: sum(map(c._checksummed, blocks.hashes)) / blocks.n
                              for p, c in caches.items() if p.startswith("direct")}
                    xxh3 = median(hash_rates)
                    copy = got["raw"]["gbps"]
                    for p, f in hashed.items():
                        if p in got:
                            got[p].update(checksummed_fraction=f, copy_gbps=copy,
                                          hash_gbps=xxh3,
                                          bound_x_raw=verify_bound(copy, xxh3, f))
                for path, r in got.items():
                    rows.append({"path": path, "block_mib": block_mib, "threads": threads,
                                 "cache": state, "blocks": blocks.n,
                                 "request_blocks": blocks.per_request, "loadavg": load, **r})
                log(f"  {block_mib:>2} MiB {threads} thr {state}: " + "  ".join(
                    f"{p} {r['gbps']:.2f}" for p, r in got.items()) + f" GB/s (load {load})"
                    + "".join(f"; {p} {r['x_raw']:.2f}x raw, {r[vkey]:.2f}x {VERIFIED}"
                              for p, r in got.items() if vkey in r and p != VERIFIED))
    finally:
        blocks.remove()
    return rows


# -- record and table ----------------------------------------------------------------------------


#: The issue's targets: (path, cache state, baseline, least ratio in every cell).
TARGETS = (
    ("direct", "warm", VERIFIED, TARGET_X_VERIFIED),
    ("direct", "cold", "raw", TARGET_X_RAW_COLD),
    ("direct-sampled", "warm", "raw", TARGET_X_RAW_SAMPLED),
)


def verdicts(rows: list[dict[str, Any]], ctl: dict[str, Any] | None) -> list[dict[str, Any]]:
    out = []
    for path, cache, base, target in TARGETS:
        key = ratio_key(base)
        sel = [r for r in rows if r["path"] == path and r["cache"] == cache and key in r]
        if not sel:
            continue
        verify = "full" if path == "direct" else "sampled"
        what = "raw preadv + one xxh3_64 pass" if base == VERIFIED else "raw preadv"
        worst = min(sel, key=lambda r: r[key])
        v = {"target": f"direct load >= {target}x {what} (verify={verify}, {cache})",
             "met": worst[key] >= target, "worst": round(worst[key], 3),
             "worst_at": f"{worst['block_mib']} MiB, {worst['threads']} threads",
             "median": round(median([r[key] for r in sel]), 3)}
        cpus = [r[f"cpu_{key}"] for r in sel if f"cpu_{key}" in r]
        if cpus:  # the same ratio in CPU time, which other processes move less
            v["cpu_worst"], v["cpu_median"] = round(min(cpus), 3), round(median(cpus), 3)
        bounded = [r for r in sel if r.get("bound_x_raw")]
        if bounded and base == "raw":  # warm: the most that checksumming these bytes allows
            v["bound_median"] = round(median([r["bound_x_raw"] for r in bounded]), 3)
            v["of_bound_median"] = round(median(
                [r["x_raw"] / r["bound_x_raw"] for r in bounded]), 3)
        out.append(v)
    if ctl:
        out.append({"target": f"control overhead < {TARGET_CONTROL_MS} ms per "
                              f"{CONTROL_BLOCKS}-block lookup + load",
                    "met": ctl["overhead_ms"] < TARGET_CONTROL_MS,
                    "measured": round(ctl["overhead_ms"], 3)})
    amps = [r["amplification"] for r in rows if r.get("amplification") is not None]
    if ctl and ctl["amplification"] is not None:
        amps.append(ctl["amplification"])
    if amps:
        out.append({"target": "fetch amplification 1.00x", "met": max(amps) == 1.0,
                    "measured": round(max(amps), 4)})
    return out


def table(record: dict[str, Any]) -> str:
    rows = record["rows"]
    paths = [p for p in PATHS if any(r["path"] == p for r in rows)]
    lines = []
    if rows:
        head = f"{'block':>6} {'cache':<5} {'thr':>3} " + " ".join(f"{p:>16}" for p in paths)
        lines += ["GB/s of KV delivered (x raw preadv of the same files, same threads, "
                  "same run); then p50 / p99 ms per request:", head, "-" * len(head)]
        by = {(r["block_mib"], r["cache"], r["threads"], r["path"]): r for r in rows}
        keys = sorted({(r["block_mib"], r["cache"] != "cold", r["threads"]) for r in rows})
        for mib, warm, thr in keys:
            state = "warm" if warm else "cold"
            cells, lats = [], []
            for p in paths:
                r = by.get((mib, state, thr, p))
                cells.append(f"{r['gbps']:6.2f} ({r['x_raw']:4.2f}x)" if r else "-")
                lats.append(f"{r['p50_ms']:7.1f}/{r['p99_ms']:<7.1f}"
                            if r and r["p50_ms"] is not None else "-")
            lines.append(f"{mib:>4}Mi {state:<5} {thr:>3} " + " ".join(f"{c:>16}" for c in cells))
            lines.append(f"{'':>16}" + " ".join(f"{c:>16}" for c in lats))
    key = ratio_key(VERIFIED)
    against = sorted((r for r in rows if key in r and r["path"] != VERIFIED),
                     key=lambda r: (r["block_mib"], r["cache"] != "cold", r["threads"], r["path"]))
    if against:
        lines += ["", f"against the verified-read baseline ({VERIFIED}: raw preadv, then one "
                  "xxh3_64 pass over each file's bytes in the same thread), same run:"]
        for r in against:
            cpu = (f"; CPU time {r['cpu_' + key]:.2f}x {VERIFIED}, {r['cpu_x_raw']:.2f}x raw"
                   if "cpu_" + key in r else "")
            lines.append(f"  {r['block_mib']:>4}Mi {r['cache']:<5} {r['threads']:>3} thr "
                         f"{r['path']:<15} {r[key]:.2f}x {VERIFIED}, {r['x_raw']:.2f}x raw{cpu}")
    bounded = sorted((r for r in rows if r.get("bound_x_raw")),
                     key=lambda r: (r["block_mib"], r["threads"], r["path"]))
    if bounded:
        lines += ["", "what checksumming allows (warm): bound = 1 / (1 + f * copy / hash), f the "
                  "fraction of bytes checksummed, copy raw preadv's GB/s, hash xxh3_64's GB/s "
                  "over cached bytes on as many threads, both measured in this run:"]
        for r in bounded:
            lines.append(
                f"  {r['block_mib']:>4}Mi {r['threads']:>3} thr {r['path']:<15} f "
                f"{r['checksummed_fraction']:.3f}  copy {r['copy_gbps']:5.2f}  hash "
                f"{r['hash_gbps']:5.2f}  bound {r['bound_x_raw']:.2f}x  measured "
                f"{r['x_raw']:.2f}x ({r['x_raw'] / r['bound_x_raw']:.2f} of the bound)")
    ctl = record.get("control")
    if ctl:
        lines += ["", f"control plane, {ctl['blocks']}-block lookup + load of "
                  f"{ctl['payload_bytes']}-byte blocks (median of {ctl['requests']}): "
                  f"{ctl['request_ms']:.3f} ms (p99 {ctl['request_p99_ms']:.3f}) against "
                  f"{ctl['raw_preadv_ms']:.3f} ms of raw preadv of the same files: overhead "
                  f"{ctl['overhead_ms']:.3f} ms; CPU per request: client "
                  f"{ctl['client_cpu_ms']:.3f} ms + daemon {ctl['daemon_cpu_ms'] or 0:.3f} ms "
                  f"- raw preadv {ctl['raw_cpu_ms']:.3f} ms = {ctl['cpu_overhead_ms']:.3f} ms; "
                  f"{ctl['control_calls_per_request']:g} control calls per request; one access "
                  f"setxattr {ctl['setxattr_ms']:.3f} ms empty, "
                  f"{ctl['setxattr_64_ms']:.3f} ms with 64 hashes; load average "
                  f"{ctl['loadavg']}"]
    lines += ["", "targets:"]
    for v in record["verdicts"]:
        fig = v.get("measured", v.get("worst"))
        extra = f" (worst at {v['worst_at']}; median {v['median']}x" if "worst_at" in v else ""
        if "cpu_median" in v:
            extra += f"; in CPU time worst {v['cpu_worst']}x, median {v['cpu_median']}x"
        if "bound_median" in v:
            extra += (f"; bound for this verification {v['bound_median']}x, reached "
                      f"{v['of_bound_median']} of it")
        extra += ")" if extra else ""
        lines.append(f"  [{'met' if v['met'] else 'MISSED'}] {v['target']}: {fig}{extra}")
    c = record["conditions"]
    lines += ["", f"conditions: {c['cpu']}, {c['cores']} cores, {c['memory_gib']} GiB, load "
              f"average {c['load_average'][0]:.2f} before, {c['load_average_after'][0]:.2f} "
              f"after; other processes kept {c['other_busy_cpus_before']} CPUs busy before"]
    return "\n".join(lines)


def run(args: Any) -> dict[str, Any]:
    """The whole benchmark; returns the record."""
    if args.cold and not can_drop_caches():
        log("not root: no cold-cache figures (dropping the page cache needs root)")
        args.cold = False
    work = tempfile.mkdtemp(prefix=".kvfs-bench-restore-", dir=os.path.abspath(args.dir))
    os.chmod(work, 0o755)
    # The work directory is temporary: name its filesystem, not its path.
    cond = conditions({"work": work}, tools={"fio": ["fio", "--version"]}, load=True)
    cond["cold_cache"] = args.cold
    params = {k: getattr(args, k, None) for k in (
        "sizes", "threads", "total_mib", "request_mib", "repeats", "warm_repeats",
        "control_requests", "cold", "fio", "paths")}
    record: dict[str, Any] = {"benchmark": "restore", "params": params, "conditions": cond,
                              "rows": [], "control": None}
    mount = Mount.under(work)
    keep = args.keep
    try:
        mount.start()
        mount.add_tenant(TENANT)
        if not args.control_only:
            for size in args.sizes:
                record["rows"] += bench_size(args, mount, work, size)
        if args.control_requests:
            log("control plane")
            record["control"] = bench_control(args, mount)
    finally:
        mount.stop(check=False)
        if mount.tracebacks():
            log(f"WARNING: the daemon logged a traceback: see {mount.log}")
            keep = True
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    conditions_after(cond, load=True)
    record["verdicts"] = verdicts(record["rows"], record["control"])
    bound = bound_notes(record["rows"])
    if bound:
        record["notes"] = bound
    return record


def bound_notes(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown lines (the record's ``notes``, which `kvfs bench report` renders): each warm
    direct cell's ratio to raw beside the most that its checksumming allows."""
    bounded = sorted((r for r in rows if r.get("bound_x_raw")),
                     key=lambda r: (r["block_mib"], r["threads"], r["path"]))
    if not bounded:
        return []
    lines = ["What checksumming allows, warm: bound = 1 / (1 + f x copy / hash), where f is the "
             "fraction of the bytes checksummed, copy raw `preadv`'s GB/s and hash xxh3_64's "
             "GB/s over bytes in the CPU's cache on as many threads, both measured in this run; "
             "the ratio that a load would reach if hashing were all it did beyond raw's copy.",
             "", "| block | threads | verify | f | copy GB/s | hash GB/s | bound | measured "
             "| of the bound |", "|---|---|---|---|---|---|---|---|---|"]
    for r in bounded:
        verify = "full" if r["path"] == "direct" else "sampled"
        lines.append(f"| {r['block_mib']} MiB | {r['threads']} | {verify} | "
                     f"{r['checksummed_fraction']:.3f} | {r['copy_gbps']:.2f} | "
                     f"{r['hash_gbps']:.2f} | {r['bound_x_raw']:.2f}x | {r['x_raw']:.2f}x | "
                     f"{r['x_raw'] / r['bound_x_raw']:.2f} |")
    return lines


def command(argv: list[str]) -> list[str]:
    """How the record was made, as a reader would type it: the options after `restore`, with
    absolute paths (this machine's directories) replaced by their role."""
    rest = argv[argv.index("restore") + 1:] if "restore" in argv else argv[1:]
    out, role = ["kvfs", "bench", "restore"], {"--dir": "DIR", "--out": "OUT", "--json": "OUT"}
    for i, a in enumerate(rest):
        key, eq, value = a.partition("=")
        if key in role and eq and os.path.isabs(value):
            a = f"{key}={role[key]}"
        elif i and rest[i - 1] in role and os.path.isabs(a):
            a = role[rest[i - 1]]
        out.append(a)
    return out


def main(args: Any) -> int:
    import logging  # noqa: PLC0415

    from .common import finish  # noqa: PLC0415

    # The mount path is measured on purpose: its "through the mount (slower)" warning is known.
    logging.getLogger("kvfs.client").setLevel(logging.ERROR)
    if args.quick:
        args.sizes, args.threads = [1, 16], [1, 2]
        args.total_mib = min(args.total_mib, 64)
        args.repeats = args.warm_repeats = 1
        args.control_requests = min(args.control_requests, 50)
    record = run(args)
    record["command"] = command(list(sys.argv))
    return finish(record, args, table(record), draw)


# -- the record, as `kvfs bench report` shows it --------------------------------------------


def report_table(record: dict[str, Any]) -> list[str]:
    rows = [r for r in rows_of(record) if number(r.get("gbps")) is not None]
    methods = list(dict.fromkeys(str(r.get("path", "?")) for r in rows))
    keys = sorted({(number(r.get("block_mib")) or 0, str(r.get("cache", "")),
                    number(r.get("threads")) or 0) for r in rows},
                  key=lambda k: (k[0], k[1], k[2]))
    by = {(number(r.get("block_mib")) or 0, str(r.get("cache", "")), number(r.get("threads")) or 0,
           str(r.get("path", "?"))): r for r in rows}
    out = []
    for k in keys:
        cells = []
        for m in methods:
            r = by.get((*k, m))
            if r is None:
                cells.append("-")
            elif r.get("x_raw") is None:
                cells.append(num_text(r.get("gbps")))
            elif r.get("x_raw_xxh3") is not None:  # also against the verified-read baseline
                cells.append(f"{num_text(r.get('gbps'))} ({ratio_text(r.get('x_raw'))}; "
                             f"{ratio_text(r.get('x_raw_xxh3'))} raw+xxh3)")
            else:
                cells.append(f"{num_text(r.get('gbps'))} ({ratio_text(r.get('x_raw'))})")
        out.append([f"{k[0]:g} MiB" if k[0] else "-", k[1] or "-", f"{k[2]:g}" if k[2] else "-",
                    *cells])
    lines = []
    if out:
        lines += ["GB/s of KV delivered (x raw `preadv` of the same files, same threads, same "
                  "run):", ""]
        lines += md_table(["block", "page cache", "threads", *methods], out)
    if any(number(r.get("p50_ms")) is not None for r in rows):
        lat = []
        for k in keys:
            cells = []
            for m in methods:
                r = by.get((*k, m))
                cells.append("-" if r is None or number(r.get("p50_ms")) is None else
                             f"{num_text(r.get('p50_ms'), '.1f')} / "
                             f"{num_text(r.get('p99_ms'), '.1f')}")
            lat.append([f"{k[0]:g} MiB" if k[0] else "-", k[1] or "-",
                        f"{k[2]:g}" if k[2] else "-", *cells])
        per = (f" of {record['params']['request_mib']} MiB"
               if isinstance(record.get("params"), dict)
               and record["params"].get("request_mib") else "")
        lines += ["", f"Latency per request{per}, p50 / p99 (ms):", ""]
        lines += md_table(["block", "page cache", "threads", *methods], lat)
    amps: dict[str, float] = {}
    for r in rows:
        a = number(r.get("amplification"))
        if a is not None:
            m = str(r.get("path", "?"))
            amps[m] = max(amps.get(m, 0.0), a)
    if amps:
        lines += ["", "Fetch amplification (bytes read / bytes of the blocks loaded, worst row): "
                  + ", ".join(f"{m} {a:.2f}x" for m, a in amps.items()) + "."]
    ctl = record.get("control")
    if isinstance(ctl, dict) and ctl:
        lines += ["", f"Control plane: a {ctl.get('blocks', '?')}-block `lookup` + `load` of "
                  f"{ctl.get('payload_bytes', '?')}-byte blocks (median of "
                  f"{ctl.get('requests', '?')}): {num_text(ctl.get('request_ms'), '.3f', ' ms')} "
                  f"(p90 {num_text(ctl.get('request_p90_ms'), '.3f', ' ms')}"
                  + (f", p99 {num_text(ctl.get('request_p99_ms'), '.3f', ' ms')}"
                     if ctl.get("request_p99_ms") is not None else "")
                  + ") against "
                  f"{num_text(ctl.get('raw_preadv_ms'), '.3f', ' ms')} of raw `preadv` of the same "
                  f"files: **{num_text(ctl.get('overhead_ms'), '.3f', ' ms')} of overhead**; "
                  f"{num_text(ctl.get('control_calls_per_request'), 'g')} control calls per "
                  "request;"
                  f" `lookup` {num_text(ctl.get('lookup_ms'), '.3f', ' ms')}, `load` "
                  f"{num_text(ctl.get('load_ms'), '.3f', ' ms')}; one access setxattr "
                  f"{num_text(ctl.get('setxattr_ms'), '.3f', ' ms')} empty, "
                  f"{num_text(ctl.get('setxattr_64_ms'), '.3f', ' ms')} with the hashes"
                  + (f"; client CPU {num_text(ctl.get('client_cpu_ms'), '.3f', ' ms')} per request"
                     if ctl.get("client_cpu_ms") is not None else "")
                  + (f"; load average {ctl['loadavg']}" if ctl.get("loadavg") is not None
                     else "") + "."]
        r1 = ctl.get("real_1mib")
        if isinstance(r1, dict):
            lines += ["", f"Cross-check, 64 x 1 MiB blocks, warm, {r1.get('threads', '?')} "
                      f"threads: {num_text(r1.get('request_ms'))} ms per request, "
                      f"{num_text(r1.get('raw_preadv_ms'))} ms of raw `preadv`: "
                      f"{num_text(r1.get('overhead_ms'))} ms over raw."]
    return lines


def draw(record: dict[str, Any], plt: Any) -> Any:
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
    methods = list(dict.fromkeys(str(r.get("path", "?")) for r in rows))
    colors = {m: f"C{i % 10}" for i, m in enumerate(methods)}
    caches = list(dict.fromkeys(str(r.get("cache", "")) for r in rows))
    for row_axes, (key, label, yscale) in zip(axes, panels, strict=True):
        for ax, t in zip(row_axes, threads, strict=True):
            for m in methods:
                for c in caches:
                    pts = sorted(p for p in ((number(r["block_mib"]), number(r.get(key)))
                                             for r in rows
                                             if str(r.get("path", "?")) == m
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


KIND = Kind("restore", "Restore", "kvfs bench restore --out docs/bench", """\
`kvfs bench restore` measures the client's load path, the bytes on the way to the first token.
It mounts kvfs over a fresh directory of the filesystem being measured, adds a tenant, and
writes, for each block size (by default 1, 4, 16 and 64 MiB: 8 to 512 tokens of a
Llama-3-8B-shaped KV, 32 layers, 8 KV heads of 128, bfloat16, 128 KiB per token), the same
amount of blocks through `kvfs.KVCache` on the direct path, and the same KV once more as one
`torch.save` file per block beside it. Then the same blocks are read with each thread count,
with a cold page cache (dropped before every run, once the daemon has handled the FORGETs) and
a warm one (after one untimed pass), into preallocated host memory:

- **raw**: threaded `os.preadv` of each whole block file into its slice of one buffer (open,
  read, close): what this machine can do for this job, the baseline of every ratio;
- **raw+xxh3**: the same, each thread hashing each file's bytes with one xxh3_64 pass right
  after reading them: the honest baseline of a verified read. Each direct run is paired with
  a raw run and a raw+xxh3 run beside it ("raw+xxh3" in its cells: its ratio to that one);
- **fio**: buffered sequential reads of the same files (psync, 1 MiB requests, one job per
  thread), when fio is installed; it bounds the reading, not the restore (its processes hold no
  interpreter lock and reuse one buffer that stays in the CPU cache);
- **direct**: `KVCache.load` on the direct path, `verify="full"` (every payload checksummed),
  and **direct-sampled** (`verify="sampled"`, one block in 8);
- **mount**: the same `KVCache.load` through the mount;
- **torch.load**: the naive alternative, one file per block, copied into the same tensor.

The methods' runs are interleaved (run r of each, in an order rotated by r); GB/s is KV payload
per second of wall time (the median run), "x raw" the median of the per-run ratios. Then the
control plane: requests (`lookup` + `load`) of 64 blocks of 8 bytes of KV each, so that the
payload costs nothing, against raw `preadv` of the same 64 files, with the control calls per
request and one access setxattr alone. Fetch amplification is bytes read over bytes of the
blocks loaded. The targets, every cell: a fully verified load at least 0.9x raw+xxh3 warm and
0.95x raw cold; a sampled one at least 0.95x raw warm; control overhead under 1 ms per 64-block
request; fetch amplification 1.00x. Cold-cache figures need root.""",
            report_table, ("block_mib", "threads", "gbps", "x_raw", "amplification"), plot=draw)
