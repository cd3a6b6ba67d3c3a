"""LMCache's storage plugin on kvfs (kvfs.integrations.lmcache), driven through LMCache 0.5.6's
own StorageManager on CPU: its plugin launcher loads the backend from the configuration the
docs give (``storage_plugins: ["kvfs"]``), beside its CPU backend, on a real mount; each step
is a separate process of the engines' venv (tests/enginevenv.py)."""

from __future__ import annotations

from typing import Any

import pytest

from .conftest import Mount, kvfs
from .enginevenv import block_file, check_raw_floor, corrupt, drive, engines_python
from .s3server import s3  # noqa: F401 - the fixture

TENANT = "t"
N = 6


@pytest.fixture(autouse=True)
def _venv() -> None:
    engines_python()


def plan(m: Mount, seed: str, ops: list[str], **kw: Any) -> dict[str, Any]:
    return {"backend": "kvfs", "mount": str(m.mnt), "tenant": TENANT, "model": "org/model",
            "layers": 4, "chunk_size": 16, "heads": 2, "head_dim": 64, "dtype": "bfloat16",
            "count": N, "seed": seed, "ops": ops} | kw


def add_tenant(m: Mount) -> None:
    kvfs("tenant", "add", str(m.mnt), TENANT, "--uid", "0", "--gid", "0")


def namespaces(m: Mount) -> dict[str, dict[str, int]]:
    return m.stats()["tenants"].get(TENANT, {})


def test_round_trip_second_process_corruption_and_bad_config(mount, tmp_path):
    add_tenant(mount)
    first = drive("lmcache", [plan(mount, "a", ["put", "exists", "bget"]),
                              plan(mount, "b", ["put"]),
                              plan(mount, "x", ["exists"], tenant="nobody")])
    a, b, bad = first
    assert "error" not in a, a
    assert a["backends"] == ["LocalCPUBackend", "kvfs"]
    assert a["exists"] == N and a["exists_each"] == [True] * N
    assert a["got"] == N and a["get_sha"] == a["put_sha"]  # from the kvfs backend alone
    # LMCache's launcher logs a plugin that fails to start and goes on without it.
    assert bad["backends"] == ["LocalCPUBackend"] and "error" in bad

    # A fresh process (its CPU cache empty) reads through LMCache's own search order.
    corrupt(block_file(mount.backing / TENANT, a["blocks"][2]))
    second = drive("lmcache", [plan(mount, "a", ["exists", "get"]),
                               plan(mount, "b", ["exists", "get"])])
    assert second[0]["exists"] == N  # the file is there...
    assert second[0]["got"] == 2 and second[0]["got_none"][2:] == [True] * (N - 2)
    assert second[0]["get_sha"] == a["put_sha"][:2]  # ...but a corrupt chunk is a miss
    assert second[1]["got"] == N and second[1]["get_sha"] == b["put_sha"]
    ns = namespaces(mount)
    assert len(ns) == 1
    (c,) = ns.values()
    assert c["checksum_failures"] >= 1 and c["hit_blocks"] > 0


def test_chunks_kvfs_evicted_are_misses(mount_factory):
    m = mount_factory(extra=["--capacity", "2M"])
    add_tenant(m)
    # Newer chunks in batches that each fit (a batch larger than the whole capacity is refused
    # whole, nothing evicted for it: tests/test_capacity.py).
    r = drive("lmcache", [plan(m, "old", ["put"], count=20),
                          *[plan(m, f"new{i}", ["put"], count=20) for i in range(5)],
                          plan(m, "x", ["sleep"]),
                          plan(m, "old", ["exists", "bget"], count=20)])
    r = [r[0], r[1], r[-2], r[-1]]
    again = r[3]
    assert "error" not in again, again
    assert again["exists"] < 20  # kvfs evicted chunks LMCache stored: no KeyError, misses
    assert again["got"] == again["exists"]
    assert again["get_sha"] == r[0]["put_sha"][:again["got"]]
    assert sum(c.get("evictions", 0) for c in namespaces(m).values()) > 0


def test_a_second_mount_reads_chunks_through_the_shared_s3_tier(mount_factory, s3):  # noqa: F811
    extra = ["--shared", s3.url, "--fetch-timeout", "5", "--tier-cooldown", "1"]
    a, b = mount_factory("a", extra=extra), mount_factory("b", extra=extra)
    add_tenant(a)
    add_tenant(b)
    wrote = drive("lmcache", [plan(a, "shared", ["put"])])[0]
    s3.wait_for_blocks(N)
    read = drive("lmcache", [plan(b, "shared", ["exists", "get"])])[0]
    assert read["exists"] == N and read["got"] == N
    assert read["get_sha"] == wrote["put_sha"]


def test_a_put_larger_than_the_cache_stores_a_prefix(mount_factory):
    m = mount_factory(extra=["--capacity", "2M"])
    add_tenant(m)
    # 100 chunks of 32 KiB in one batched put: more than the hot tier holds. kvfs refuses such
    # a batch whole; the backend stores a prefix of it that fits instead.
    r = drive("lmcache", [plan(m, "big", ["put", "stats"], count=100),
                          plan(m, "big", ["exists", "bget"], count=100)])
    again = r[1]
    assert "error" not in r[0] and "error" not in again, r
    assert 0 < again["exists"] < 100  # a prefix is stored, the rest are misses
    # (Background eviction, from the high watermark to the low one, may take the chain's
    # last chunks between one question and the next.)
    each = again["exists_each"].count(True)
    assert again["exists_each"] == [True] * each + [False] * (100 - each)
    assert 0 < again["got"] <= again["exists"]
    assert again["get_sha"] == r[0]["put_sha"][:again["got"]]
    # Cut to what the capacity can hold before writing: each stored chunk written once, none
    # written, refused and written again (background eviction may then take the last few).
    assert again["exists"] <= r[0]["stats"]["saved_blocks"] == (2 << 20) // (4096 + (32 << 10))


@pytest.mark.mount
def test_bench_backends_writes_a_record(tmp_path):
    """`kvfs bench backends` at a tiny scale, LMCache's backends only: every backend's sets
    (repeated under new keys, each waited for through LMCache's completion callback) and warm
    gets, a ratio per figure against LocalDiskBackend, its verified floor (hashed in its own
    I/O threads)."""
    import json

    out = tmp_path / "backends.json"
    kvfs("bench", "backends", "--engines", "lmcache", "--total-mib", "16", "--repeats", "2",
         "--passes", "2", "--no-cold", "--work", str(tmp_path), "--json", str(out))
    record = json.loads(out.read_text())
    rows = {r["figure"]: r for r in record["rows"]}
    assert set(rows) == {"lmcache set", "lmcache get warm"}
    for r in rows.values():
        assert r["kvfs"] > 0 and r["baseline"] > 0 and r["verified_baseline"] > 0
        assert r["ratio"] == pytest.approx(r["kvfs"] / r["baseline"], rel=0.01)
        # Both against the physical floor measured in the same run.
        assert r["floor_name"] == "raw preadv/pwritev on ext4" and r["floor"] > 0
        assert r["ratio_floor"] == pytest.approx(r["kvfs"] / r["floor"], rel=0.01)
        assert r["baseline_ratio_floor"] == pytest.approx(r["baseline"] / r["floor"],
                                                          rel=0.01)
    res = record["results"]["lmcache"]
    assert set(res) >= {"kvfs backend", "LocalDiskBackend on ext4",
                        "LocalDiskBackend + xxh3 on ext4", "raw preadv/pwritev on ext4",
                        "first_pass"}
    assert all(r["bytes"] == 16 << 20 and r["set_s"] > 0 and r["get_warm_s"] > 0
               for n, r in res.items() if n not in ("first_pass", "passes"))
    kvfs_sets = [p["kvfs backend"]["set_s"] for p in res["passes"]]
    assert len(kvfs_sets) == 2 and res["kvfs backend"]["set_s"] == pytest.approx(
        sum(kvfs_sets) / 2)  # the median of two passes
    assert record["params"]["passes"] == 2


def test_the_physical_floor_moves_the_chunks_bytes(tmp_path):
    """The benchmark's physical floor: LMCache's chunks, from and into memory objects of its
    allocator."""
    check_raw_floor("lmcache", tmp_path, 2 * 4 * 16 * 2 * 64 * 2,
                    {"model": "org/model", "layers": 4, "chunk_size": 16, "heads": 2,
                     "head_dim": 64, "dtype": "bfloat16", "count": N})


def test_a_bench_plan_removes_what_it_wrote(mount, tmp_path):
    """The benchmark's ``clean`` step (so that its passes do not fill the disk): the kvfs
    backend's chunks go through the mount, LocalDiskBackend's files from its directory."""
    add_tenant(mount)
    disk = tmp_path / "disk"
    disk.mkdir()
    r = drive("lmcache", [plan(mount, "c", ["put", "clean", "exists"]),
                          plan(mount, "d", ["put", "clean"], backend="file", dir=str(disk))])
    assert "error" not in r[0] and "error" not in r[1], r
    assert r[0]["exists_each"] == [False] * N and namespaces(mount)  # (LMCache's CPU
    # backend still holds them: "exists" asks every backend)
    # Only the namespace's manifest is left.
    assert [(ns["files"], ns["bytes"] < 4096) for ns in namespaces(mount).values()] == [
        (1, True)], namespaces(mount)
    assert not list(disk.iterdir())
    assert not list(tmp_path.glob(".kvfs-bench-engines-*"))  # the mount and its data gone


def test_a_get_larger_than_lmcaches_memory_is_a_prefix_not_a_hang(mount):
    """A get of more chunks than LMCache's CPU memory can hold (here 6 chunks, room for 3):
    LMCache's own allocator would wait for room without end; the kvfs backend returns the
    chunks it has room for, byte-identical, and the rest are misses, within seconds."""
    import time

    add_tenant(mount)
    put = drive("lmcache", [plan(mount, "m", ["put"])])[0]
    assert "error" not in put, put
    chunk = 2 * 4 * 16 * 2 * 64 * 2
    t = time.monotonic()
    got = drive("lmcache", [plan(mount, "m", ["bget"], cpu_gb=3.5 * chunk / 2**30)],
                timeout=120)[0]
    assert "error" not in got, got
    assert got["got"] == 3 and got["get_sha"] == put["put_sha"][:3]
    assert time.monotonic() - t < 60
