"""`kvfs bench engine`: time to first token of a real vLLM with a real model, restoring a
context through the KVFSConnector against recomputing it and against vLLM's ExampleConnector.

For each context length, a prompt of that many tokens (random token ids, a different chain per
length) is served once by a saving engine; then, in fresh engine processes, the same prompt
plus a 32-token tail is served with one output token, in each condition:

- **recompute**: no connector (vLLM's own prefix cache is off in every condition);
- **kvfs warm**: KVFSConnector, the block files in the page cache;
- **kvfs cold**: the same, the page cache dropped before each request (root only);
- **example**: vLLM's ExampleConnector (a copy that restores the longest stored prefix) on
  the same filesystem, page cache warm.

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
from typing import Any

from .common import finish
from .harness import Mount, can_drop_caches, conditions, mounted
from .plot import ttft
from .records import Kind, md_table, num_text, number, ratio_text, rows_of

TAIL = 32


def _engine(args: Any, work: str, extra: list[str], prompts: list[str]) -> dict[str, Any]:
    argv = [args.python, "-m", "kvfs.integrations.vllm", "--model", args.model,
            "--max-tokens", "1", "--max-model-len", str(args.max_model_len),
            "--no-prefix-cache", "--warmup", "64", *extra]
    for p in prompts:
        argv += ["--prompt-file", p]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
           "PYTHONPATH": os.getcwd()}
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
    m = Mount.under(os.path.join(work, "m"))
    m.start()
    results: dict[str, dict[str, Any]] = {}
    started = time.monotonic()
    try:
        m.add_tenant("bench")
        kv = ["--connector", "kvfs", "--mount", str(m.mnt), "--tenant", "bench"]
        _engine(args, work, kv, save_prompts)
        results["recompute"] = _engine(args, work, ["--connector", "none"], query_prompts)
        results["kvfs_warm"] = _engine(args, work, kv, query_prompts)
        if cold:
            results["kvfs_cold"] = _engine(args, work, [*kv, "--drop-caches"], query_prompts)
        storage = os.path.join(work, "example")
        os.makedirs(storage)
        ex = ["--connector", "example", "--storage", storage]
        _engine(args, work, ex, save_prompts)
        results["example"] = _engine(args, work, ex, query_prompts)
    finally:
        m.stop(check=False)
        if not args.keep and not mounted(m.mnt):
            shutil.rmtree(work, ignore_errors=True)
    rows = []
    crossover = None
    for i, n in enumerate(args.lengths):
        row: dict[str, Any] = {"tokens": n}
        for name, rec in results.items():
            req = rec["requests"][i]
            row[f"{name}_ms"] = round(req["seconds"] * 1000, 1)
            row[f"{name}_cached"] = req["cached_tokens"]
        rec_ms = row["recompute_ms"]
        for name in results:
            if name != "recompute":
                row[f"{name}_speedup"] = round(rec_ms / row[f"{name}_ms"], 2)
        c = results["kvfs_warm"]["requests"][i]["counters"]
        need = c.get("client.needed_bytes", 0)
        row["fetch_amplification"] = round(c.get("client.read_bytes", 0) / need, 4) if need \
            else None
        row["lookup_ms"] = round(c.get("scheduler.lookup_s", 0) * 1000, 3)
        row["load_ms"] = round(c.get("worker.load_s", 0) * 1000, 2)
        row["loaded_blocks"] = c.get("worker.loaded_blocks", 0)
        if "example_ms" in row:
            row["kvfs_vs_example"] = round(row["kvfs_warm_ms"] / row["example_ms"], 3)
        rows.append(row)
        if crossover is None and row["kvfs_warm_ms"] < rec_ms:
            crossover = n
    record: dict[str, Any] = {
        "benchmark": "engine", "rows": rows, "crossover_tokens": crossover,
        "model": os.path.basename(os.path.normpath(args.model)), "tail_tokens": TAIL,
        "block_tokens": results["kvfs_warm"].get("spec", {}).get("block_size"),
        "cold_measured": cold, "seconds": round(time.monotonic() - started, 1),
        "lmcache": "not measured: LMCache's vLLM connector needs CUDA (no CPU build)",
        "s3": "not measured in this run",
        "conditions": {**conditions([args.dir]), "note": args.note},
    }
    head = ["tokens", "recompute ms", "kvfs warm ms", "kvfs cold ms", "example ms",
            "speedup", "kvfs/example", "amplification"]
    lines = ["  ".join(f"{h:>13}" for h in head)]
    for r in rows:
        cells = [r["tokens"], r["recompute_ms"], r["kvfs_warm_ms"], r.get("kvfs_cold_ms", "-"),
                 r.get("example_ms", "-"), r.get("kvfs_warm_speedup"),
                 r.get("kvfs_vs_example", "-"), r["fetch_amplification"]]
        lines.append("  ".join(f"{c!s:>13}" for c in cells))
    lines.append(f"crossover: {crossover} tokens")
    return finish(record, args, "\n".join(lines), draw)


# -- the record, as `kvfs bench report` shows it --------------------------------------------


def report_table(record: dict[str, Any]) -> list[str]:
    head = ["context tokens", "recompute (ms)", "kvfs warm (ms)", "kvfs cold (ms)",
            "ExampleConnector (ms)", "speedup (recompute / kvfs warm)", "kvfs warm / Example",
            "fetch amplification", "lookup (ms)", "load (ms)"]
    out = []
    for r in rows_of(record):
        out.append([num_text(r.get("tokens"), "g"), num_text(r.get("recompute_ms"), ".0f"),
                    num_text(r.get("kvfs_warm_ms"), ".0f"), num_text(r.get("kvfs_cold_ms"), ".0f"),
                    num_text(r.get("example_ms"), ".0f"), ratio_text(r.get("kvfs_warm_speedup")),
                    ratio_text(r.get("kvfs_vs_example")),
                    num_text(r.get("fetch_amplification"), ".2f"),
                    num_text(r.get("lookup_ms"), ".3f"),
                    num_text(r.get("load_ms"), ".1f")])
    cross = number(record.get("crossover_tokens"))
    tail = [f"Restoring through kvfs beats recomputing from **{cross:g} tokens** on." if cross
            else "Restoring never beat recomputing at these lengths." if out else ""]
    return md_table(head, out) + ["", *tail]


def draw(record: dict[str, Any], plt: Any) -> Any:
    """TTFT against context length, a line per condition (recompute, kvfs warm and cold,
    ExampleConnector)."""
    return ttft(record, plt, (
        ("recompute_ms", "recompute (no connector)", "o-"),
        ("kvfs_warm_ms", "kvfs, page cache warm", "s-"),
        ("kvfs_cold_ms", "kvfs, page cache cold", "s--"),
        ("example_ms", "vLLM ExampleConnector", "^-")), "kvfs",
        f"kvfs bench engine: vLLM + {record.get('model', '?')}")


KIND = Kind("engine", "Engine (vLLM)", "kvfs bench engine --out docs/bench", """\
`kvfs bench engine` (`kvfs/bench/engine.py`): a real vLLM (`vllm-cpu` 0.32, from
`tools/setup_vllm.sh`) with a real model (SmolLM2-135M-Instruct, bfloat16, 30 layers, 3 KV
heads of 64: 23 KiB of KV per token, blocks of 128 tokens). For each context length a prompt
(random token ids, its own chain) is served once by a saving engine; then fresh engine
processes serve the same prompt plus a 32-token tail with one output token, each after an
untimed warm-up prompt, vLLM's own prefix cache off: with no connector (**recompute**), with
the KVFSConnector (page cache **warm**, and **cold**: dropped before each request), and with
vLLM's ExampleConnector on the same filesystem (a copy that restores the longest stored
prefix). Time to first token is the request's wall time in the engine process. Fetch
amplification is the client's bytes read over the bytes of the blocks loaded; lookup and load
are the connector's own times per request (scheduler lookup; worker read into the paged
cache). LMCache's vLLM connector needs CUDA and is not measured; the S3-promoted condition is
not measured by this subcommand yet (`tests/test_vllm.py` checks that path).""", report_table,
            ("tokens", "recompute_ms", "kvfs_warm_ms"), shown=("crossover_tokens",), plot=draw)
