"""`kvfs bench serve`: its workloads and ceiling (no engine), and its --quick form end to end:
three real vLLM servers (alone, kvfs, a 2nd host restoring from S3) under vLLM's own load
generator, every figure produced and the report rendering it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvfs.bench import serve_report
from kvfs.bench import serve_workloads as wl
from kvfs.models.trace import Request

from .conftest import kvfs
from .test_vllm import _require_vllm

TRACE = Path(__file__).parent / "data" / "mooncake_head.jsonl"


def test_ceiling_counts_leading_blocks_seen_before_and_never_the_last_token():
    reqs = [Request(0, 300, 1, [1, 2, 3]),  # 2 full blocks of 128 + 44 tokens
            Request(0, 300, 1, [1, 2, 4]),  # shares blocks 1, 2: 256 tokens
            Request(0, 256, 1, [1, 2]),  # all of it seen, but its last token is computed
            Request(0, 200, 1, [9, 2])]  # first block new: nothing, whatever follows
    c = wl.ceiling(reqs, 128)
    assert c["per_request"] == [0, 256, 128, 0]
    assert c["misses"] == [0, 3]
    assert c["share"] == pytest.approx(384 / 1056)
    # what a second host can take of everything the first saved: full blocks less the last token
    assert c["saved_share"] == pytest.approx((256 + 256 + 128 + 128) / 1056)
    # a partial last block is never a hit for a later request that extends it
    assert wl.ceiling([Request(0, 200, 1, [5, 6]), Request(0, 400, 1, [5, 7, 8, 9])],
                      128)["per_request"] == [0, 128]


def test_runs_never_share_prompts_and_mooncake_is_scaled_to_the_model():
    reqs = wl.agentic(4, sessions=6, turns=3, block=128, max_len=2048, output=8)
    assert reqs and all(r.input_length <= 2048 - 8 - 1 and r.output_length == 8 for r in reqs)
    assert wl.ceiling(reqs, 128)["share"] > 0.3  # shared prefixes and histories
    a, b = wl.offset(reqs, 1), wl.offset(reqs, 2)
    assert not {h for r in a for h in r.hash_ids} & {h for r in b for h in r.hash_ids}
    assert wl.ceiling(a, 128)["share"] == wl.ceiling(reqs, 128)["share"]
    m = wl.mooncake(str(TRACE), requests=50, block=128, max_len=4096, output=8)
    assert len(m) == 50
    for r in m:
        assert r.input_length <= 4096 - 9 and len(r.hash_ids) * 128 >= r.input_length
        assert len(r.hash_ids) == -(-r.input_length // 128)


def test_metrics_sum_labels_and_deltas_name_vllms_counters():
    text = ('# HELP vllm:prefix_cache_hits_total x\n'
            'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 10.0\n'
            'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 5.0\n'
            'vllm:prefix_cache_queries_total{engine="0"} 40\n'
            'process_start_time_seconds 1.7e9\n')
    m = wl.metrics(text)
    assert m["vllm:prefix_cache_hits_total"] == 15.0
    assert m["process_start_time_seconds"] == 1.7e9
    d = wl.counter_delta({"vllm:prefix_cache_hits_total": 5.0}, m)
    assert d["own_hit_tokens"] == 10 and d["queried_tokens"] == 40
    assert d["external_hit_tokens"] == 0


def test_bench_serve_refuses_bad_arguments(tmp_path):
    for args, word in ((["--concurrency", "0"], "at least 1"),
                       (["--conditions", "alone", "kvfs_s3"], "give both"),
                       (["--workload", "mooncake", "--trace", str(tmp_path / "no")], "trace"),
                       (["--kv-blocks", "2"], "must hold one request"),
                       (["--hot-only"], "nothing to restore")):
        res = kvfs("bench", "serve", *args, "--dir", str(tmp_path), check=False)
        assert res.returncode == 2 and word in res.stderr, (args, res.stderr)
    assert not list(tmp_path.iterdir())


@pytest.mark.mount
def test_bench_serve_quick_produces_every_figure(tmp_path):
    """Three real vLLM servers under vLLM's own load generator: vLLM alone, vLLM + kvfs,
    and a second host restoring from the shared S3 tier, with the store slowed and down."""
    _require_vllm()
    out = tmp_path / "serve.json"
    res = kvfs("bench", "serve", "--quick", "--dir", str(tmp_path), "--json", str(out),
               check=False, timeout=1500)
    assert res.returncode == 0, res.stderr[-4000:]
    record = json.loads(out.read_text())
    rows = record["rows"]
    conds = {(r["condition"], r["concurrency"]) for r in rows}
    for c in (1, 4):
        assert {("alone", c), ("kvfs", c), ("kvfs_s3", c)} <= conds
    assert {("kvfs_s3_slow", 4), ("kvfs_s3_down", 4)} <= conds
    for r in rows:
        assert r["failed"] == 0 and r["completed"] == r["requests"], r
        assert r["ttft_p50_ms"] > 0 and r["ttft_by_length"] and r["requests_per_s"] > 0
        assert r["prompt_tokens"] == r["counters"]["prompt_tokens"], r
    by = {(r["condition"], r["concurrency"]): r for r in rows}
    # vLLM alone never gets external hits; kvfs's servers do; the 2nd host's all come from S3
    assert by[("alone", 4)]["external_hit_rate"] == 0
    assert by[("kvfs", 4)]["external_hit_rate"] > 0
    s3 = by[("kvfs_s3", 4)]
    assert s3["external_hit_rate"] > 0.5 * s3["saved_ceiling"], s3
    assert sum(v for k, v in s3["kvfs"].items()
               if k.endswith((".hits", ".grants"))) > 0, s3["kvfs"]  # B read the bucket
    assert record["daemon_tracebacks"] == {"a": 0, "b": 0}
    v = {x["target"]: x for x in record["verdicts"]}
    assert v["every figure produced"]["ok"], v
    assert record["plot"] == "serve.png" and (tmp_path / "serve.png").exists()
    lines = serve_report.report_table(record)
    assert any("2nd host, store down" in line for line in lines)


def test_every_condition_replays_the_same_plans_and_only_the_top_is_degraded(tmp_path):
    from types import SimpleNamespace

    from kvfs.bench import serve

    args = SimpleNamespace(workloads=["agentic", "mooncake"], concurrency=[1, 4],
                           conditions=["alone", "kvfs", "kvfs_s3"], sessions=4, turns=3.0,
                           block_size=128, max_model_len=2048, output_tokens=8,
                           prefix_blocks=2, seed=0, requests=12, trace=str(TRACE))
    todo, loads = serve.plans(args, tmp_path)
    assert [(p.workload, p.concurrency, p.fault) for p in todo] == [
        ("agentic", 1, ""), ("agentic", 4, ""), ("agentic", 4, "kvfs_s3_slow"),
        ("agentic", 4, "kvfs_s3_down"), ("mooncake", 1, ""), ("mooncake", 4, "")]
    ids = [{h for r in p.reqs for h in r.hash_ids} for p in todo]
    assert all(not a & b for i, a in enumerate(ids) for b in ids[i + 1:])
    assert all(Path(p.trace).is_file() for p in todo) and set(loads) == {"agentic", "mooncake"}
    # the agents' shared prefixes take what the option says
    two = wl.agentic(1, sessions=3, turns=2, block=128, max_len=2048, output=8)
    eight = wl.agentic(1, sessions=3, turns=2, block=128, max_len=2048, output=8,
                       prefix_blocks=8)
    assert sum(r.input_length for r in eight) > sum(r.input_length for r in two)


def test_the_ttft_verdict_carries_the_bound_a_cache_at_the_ceiling_gives():
    def row(cond, c, hit, ttft, per_request_s=1.0):
        return {"workload": "agentic", "condition": cond, "concurrency": c, "hit_rate": hit,
                "own_hit_rate": hit, "external_hit_rate": 0.0, "ceiling": 0.6,
                "ttft_p50_ms": ttft, "ttft_p99_ms": 2 * ttft, "saved_ceiling": 0.9,
                "requests_per_s": 1 / per_request_s}
    record = {"params": {"concurrency": [1, 32], "workloads": {"agentic": {}}},
              "rows": [row("alone", 1, 0.6, 100.0), row("kvfs", 1, 0.6, 100.0),
                       row("alone", 32, 0.2, 1000.0, 0.9), row("kvfs", 32, 0.5, 800.0),
                       row("kvfs_s3", 32, 0.9, 300.0, 0.2)]}
    v = {x["target"]: x for x in serve_report.verdicts(record)}
    ttft = v["TTFT p50 with kvfs <= 0.5x vLLM alone's"]
    # alone computes 80 % of the prompt tokens, kvfs 50 %, a cache at the ceiling 40 %
    assert ttft["computed_ratio"] == pytest.approx(0.625)
    assert ttft["ceiling_bound"] == pytest.approx(0.5)
    assert "0.80x" in ttft["figures"] and "0.50x for a cache at the ceiling" in ttft["figures"]
    assert ttft["ok"] is False
    # time per request 0.1 s + 1.0 s x the share computed, through alone (0.8: 0.9 s) and
    # the 2nd host (0.1: 0.2 s): at the ceiling (0.4 computed) 0.5 / 0.9 of alone's
    assert ttft["fit_fixed_s"] == pytest.approx(0.1) and ttft["fit_per_share_s"] == 1.0
    assert ttft["fit_ceiling_ratio"] == pytest.approx(0.556, abs=1e-3)
    assert ttft["fit_kvfs_ratio"] == pytest.approx(0.667, abs=1e-3)
    assert "0.56x at the ceiling" in ttft["figures"]
    assert serve_report.request_time_fit(record["rows"][2], None) is None
    assert serve_report.compute_bound(1.0, 1.0) is None  # nothing computed alone: no bound
    # the verdicts are listed once, in the table, with their figures
    lines = serve_report.report_table(record)
    assert sum("0.50x for a cache at the ceiling" in line for line in lines) == 1
