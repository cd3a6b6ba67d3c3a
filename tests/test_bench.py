"""`kvfs bench` runs at a tiny scale and writes a well-formed record."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .conftest import fuse_available, kvfs

TRACE = Path(__file__).parent / "data" / "mooncake_head.jsonl"


def test_bench_hitrate_matches_the_simulator(tmp_path):
    why = fuse_available()
    if why:
        pytest.skip(why)
    pytest.importorskip("torch")
    out = tmp_path / "hitrate.json"
    res = kvfs("bench", "hitrate", "--trace", str(TRACE), "--limit", "80",
               "--capacity-fraction", "0.25", "--policy", "lru", "--policy", "kvfs",
               "--dir", str(tmp_path), "--json", str(out))
    assert "block hit %" in res.stdout
    record = json.loads(out.read_text())
    assert record["benchmark"] == "hitrate" and record["requests"] == 80
    assert record["conditions"]["cores"] and record["conditions"]["versions"]["kvfs"]
    for row in record["rows"]:
        # The daemon's eviction through a real mount is the policy the simulator models.
        assert row["block_hit"] == row["simulated_block_hit"]
        assert row["block_hit"] <= row["optimum_block_hit"]
        assert row["used_bytes"] <= row["capacity_bytes"]
    assert {r["policy"] for r in record["rows"]} == {"lru", "kvfs"}


def test_bench_crossover_restores_identical_tokens(tmp_path):
    why = fuse_available()
    if why:
        pytest.skip(why)
    pytest.importorskip("torch")
    out = tmp_path / "crossover.json"
    res = kvfs("bench", "crossover", "--lengths", "40", "200", "--repeats", "1",
               "--dir", str(tmp_path), "--json", str(out))
    assert "identical" in res.stdout
    record = json.loads(out.read_text())
    assert record["benchmark"] == "crossover" and record["conditions"]["cores"]
    assert [r["tokens"] for r in record["rows"]] == [40, 200]
    for r in record["rows"]:
        assert r["identical"] and r["restored_tokens"] == (r["tokens"] - 1) // 16 * 16
        assert r["recompute_ms"] > 0 and r["restore_ms"] > 0


def test_bench_restore_measures_every_path(tmp_path):
    why = fuse_available()
    if why:
        pytest.skip(why)
    pytest.importorskip("torch")
    out = tmp_path / "out" / "restore.json"
    res = kvfs("bench", "restore", "--sizes", "1", "--threads", "1,2", "--total-mib", "3",
               "--request-mib", "2", "--repeats", "1", "--no-cold", "--no-fio",
               "--control-requests", "5", "--dir", str(tmp_path), "--json", str(out))
    assert "GB/s of KV delivered" in res.stdout and "control plane" in res.stdout
    text = out.read_text()
    assert str(tmp_path) not in text  # no path of this machine in a record meant to be shared
    record = json.loads(text)
    assert record["benchmark"] == "restore" and record["conditions"]["cores"]
    assert record["command"][:3] == ["kvfs", "bench", "restore"] and "DIR" in record["command"]
    rows = record["rows"]
    paths = {"raw", "direct", "direct-sampled", "mount", "torch.load"}
    assert {(r["path"], r["threads"]) for r in rows} == {(p, t) for p in paths for t in (1, 2)}
    for r in rows:
        assert (r["block_mib"], r["cache"], r["blocks"], r["request_blocks"]) == (1, "warm", 3, 2)
        assert r["gbps"] > 0 and r["x_raw"] > 0 and 0 < r["p50_ms"] <= r["p99_ms"]
        assert r["requests"] == 2  # 3 blocks, 2 per request, one run
        if r["path"] == "raw":
            assert r["x_raw"] == 1.0
        if r["path"] in ("direct", "direct-sampled", "mount"):
            assert r["amplification"] == 1.0  # every block read exactly once
    ctl = record["control"]
    assert ctl["blocks"] == 64 and ctl["requests"] == 5
    assert ctl["control_calls_per_request"] == 1  # the lookup's record rides with the load's
    assert ctl["amplification"] == 1.0 and ctl["request_ms"] > 0
    assert {v["target"].split(" (")[0] for v in record["verdicts"]} >= {
        "direct load >= 0.9x raw preadv", "fetch amplification 1.00x"}
    bad = kvfs("bench", "restore", "--sizes", "0", "--dir", str(tmp_path), check=False)
    assert bad.returncode == 2 and "positive" in bad.stderr and "Traceback" not in bad.stderr
