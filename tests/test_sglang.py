"""SGLang HiCache's storage backend on kvfs (kvfs.integrations.sglang), driven through SGLang
0.5.23's own classes: its storage backend factory loads the backend as ``dynamic`` from the
configuration the docs give, over a real host KV pool on CPU, on a real mount; each step is a
separate process of the engines' venv (tests/enginevenv.py)."""

from __future__ import annotations

import os
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
            "layers": 4, "page_size": 16, "heads": 2, "head_dim": 64, "dtype": "bfloat16",
            "layout": "page_first", "count": N, "seed": seed, "ops": ops} | kw


def add_tenant(m: Mount) -> None:
    kvfs("tenant", "add", str(m.mnt), TENANT, "--uid", "0", "--gid", "0")


def namespaces(m: Mount) -> dict[str, dict[str, int]]:
    return m.stats()["tenants"].get(TENANT, {})


LAYOUTS = [
    {"seed": "mha-lf", "layout": "layer_first"},
    {"seed": "mha-pf", "layout": "page_first"},
    {"seed": "mha-pfd", "layout": "page_first_direct"},
    {"seed": "mha-generic", "layout": "page_first", "zero_copy": False},
    {"seed": "mla-pf", "layout": "page_first", "mla": True, "kv_dim": 576},
    {"seed": "mla-lf", "layout": "layer_first", "mla": True, "kv_dim": 576},
]


def test_round_trips_second_process_corruption_and_bad_config(mount, tmp_path):
    add_tenant(mount)
    plans = [plan(mount, ops=["put", "exists", "get"], **p) for p in LAYOUTS]
    plans += [plan(mount, "x", ["exists"], tenant="nobody"),
              plan(mount, "x", ["exists"], mount=str(tmp_path))]
    first = drive("sglang", plans)
    for p, r in zip(LAYOUTS, first, strict=False):
        assert "error" not in r, (p, r)
        assert r["put_ok"] and r["exists"] == N and r["exists_each"] == [True] * N, (p, r)
        assert r["got"] == N and r["get_sha"] == r["put_sha"], p  # byte-identical
    assert "no tenant 'nobody'" in first[-2]["error"]
    assert "is not a kvfs mount" in first[-1]["error"]
    # One namespace per layout and attention kind (the generic path writes the same page
    # bytes as the zero-copy one, so the two page-first MHA plans share theirs).
    assert len(namespaces(mount)) == len(LAYOUTS) - 1

    # A second process reads what the first wrote: one page corrupted in the backing file,
    # one removed through the mount (a miss from there on), the rest intact.
    lf, pf, pfd = first[0], first[1], first[2]
    corrupt(block_file(mount.backing / TENANT, lf["blocks"][3]))
    os.unlink(block_file(mount.mnt / TENANT, pf["blocks"][4]))
    second = drive("sglang", [plan(mount, ops=["exists", "get"], **LAYOUTS[i])
                              for i in range(3)])
    assert second[0]["exists"] == N and second[0]["got"] == 3  # corrupt: a miss, not an error
    assert second[0]["get_sha"] == lf["put_sha"][:3]
    assert second[1]["exists"] == 4 and second[1]["got"] == 4
    assert second[1]["get_sha"] == pf["put_sha"][:4]
    assert second[2]["got"] == N and second[2]["get_sha"] == pfd["put_sha"]
    ns = namespaces(mount)
    assert sum(c.get("checksum_failures", 0) for c in ns.values()) >= 1
    assert sum(c.get("hit_blocks", 0) for c in ns.values()) > 0
    assert sum(c.get("miss_blocks", 0) for c in ns.values()) > 0  # the removed page


def test_pages_kvfs_evicted_are_misses(mount_factory):
    m = mount_factory(extra=["--capacity", "2M"])
    add_tenant(m)
    a = plan(m, "old", ["put"], count=20)
    # Newer pages in batches that each fit (a batch larger than the whole capacity is refused
    # whole, nothing evicted for it: tests/test_capacity.py).
    b = [plan(m, f"new{i}", ["put"], count=20) for i in range(5)]
    again = plan(m, "old", ["exists", "get"], count=20)
    r = drive("sglang", [a, *b, plan(m, "x", ["sleep"]), again])
    r = [r[0], r[1], r[-2], r[-1]]
    assert "error" not in r[3], r[3]
    assert r[3]["exists"] < 20  # kvfs evicted some of the old pages under SGLang
    assert r[3]["got"] == r[3]["exists"]  # what is left is a prefix, and loads
    assert r[3]["get_sha"] == r[0]["put_sha"][:r[3]["got"]]
    assert sum(c.get("evictions", 0) for c in namespaces(m).values()) > 0


def test_a_second_mount_reads_pages_through_the_shared_s3_tier(mount_factory, s3):  # noqa: F811
    extra = ["--shared", s3.url, "--fetch-timeout", "5", "--tier-cooldown", "1"]
    a, b = mount_factory("a", extra=extra), mount_factory("b", extra=extra)
    add_tenant(a)
    add_tenant(b)
    wrote = drive("sglang", [plan(a, "shared", ["put"])])[0]
    s3.wait_for_blocks(N)
    read = drive("sglang", [plan(b, "shared", ["exists", "get"])])[0]
    assert read["exists"] == N and read["got"] == N
    assert read["get_sha"] == wrote["put_sha"]


def test_a_batch_larger_than_the_cache_stores_a_prefix(mount_factory):
    m = mount_factory(extra=["--capacity", "2M"])
    add_tenant(m)
    # 128 pages of 32 KiB in one batch_set_v1 call: twice what the hot tier holds. kvfs
    # refuses such a batch whole; the backend stores a prefix of it that fits instead.
    r = drive("sglang", [plan(m, "big", ["put", "stats", "exists", "get"], count=128)])[0]
    assert "error" not in r, r
    stored = r["put_each"].index(False)
    assert 0 < stored < 128 and not any(r["put_each"][stored:])  # a prefix, answered per page
    # Cut to what the capacity can hold before writing: each stored page written once, none
    # written, refused and written again.
    assert r["stats"]["saved_blocks"] == stored == (2 << 20) // (4096 + (32 << 10))
    # The rest are misses; so may be the last few stored, once background eviction takes
    # the cache from its high watermark down to its low one (the chain's tail goes first,
    # possibly between the lookup and the load).
    assert 0 < r["got"] <= r["exists"] <= stored
    assert r["get_sha"] == r["put_sha"][:r["got"]]


def test_the_physical_floor_moves_the_pages_bytes(tmp_path):
    """The benchmark's physical floor: the pages' bytes where the host pool holds them."""
    check_raw_floor("sglang", tmp_path, 4 * 16 * 2 * 2 * 64 * 2,
                    {"model": "org/model", "layers": 4, "page_size": 16, "heads": 2,
                     "head_dim": 64, "dtype": "bfloat16", "layout": "page_first", "count": N})
