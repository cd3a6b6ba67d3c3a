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
