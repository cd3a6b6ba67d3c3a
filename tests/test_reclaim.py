"""Unit tests of kvfs.daemon.reclaim: eviction, refusals, retention and pruning, on a real backing
directory and index, with no mount (no kernel, no FUSE session: the daemon's objects only)."""

from __future__ import annotations

import errno
import os
import time

import pytest
import trio
from pyfuse3 import FUSEError

from kvfs.daemon import scanner
from kvfs.daemon.adoption import Adoption
from kvfs.daemon.capacity import Limits
from kvfs.daemon.index import ROOT_INODE, Index
from kvfs.daemon.reclaim import Reclaim
from kvfs.daemon.store import BackingStore
from kvfs.daemon.tree import MountInfo, Tree
from kvfs.format import codec

T0 = 1_700_000_000 * 10**9


class Daemon:
    """The daemon's shared state and its reclaim work over a backing tree made here."""

    def __init__(self, tmp_path, tenants: dict[str, list[tuple[str, int]]], *,
                 capacity: int | None = None, high: float = 0.95, low: float = 0.90) -> None:
        backing = tmp_path / "backing"
        (backing / ".kvfs").mkdir(parents=True)
        stamp = T0
        for tenant, files in tenants.items():
            (backing / tenant / "model").mkdir(parents=True)
            for name, size in files:  # accessed in the order given
                p = backing / tenant / "model" / name
                p.write_bytes(b"x" * size)
                stamp += 10**9
                os.utime(p, ns=(stamp, stamp))
        self.backing = backing
        self.index = Index(str(backing / ".kvfs" / "index.db"))
        self.store = BackingStore(str(backing))
        scanner.reconcile(self.index, self.store)
        info = MountInfo(str(tmp_path / "mnt"), str(backing), capacity, high_watermark=high,
                         low_watermark=low)
        self.tree = Tree(self.index, self.store, info)
        self.adoption = Adoption(self.tree)
        self.reclaim = Reclaim(self.tree, self.adoption)
        self.adoption.after_growth = self.reclaim.wake_if_over
        self.residency = self.tree.residency
        self.residency.load()

    def tenant(self, name: str) -> int:
        node = self.index.lookup(ROOT_INODE, name.encode())
        assert node is not None
        return node.inode

    def node(self, tenant: str, name: str):
        ns = self.index.lookup(self.tenant(tenant), b"model")
        return self.index.lookup(ns.inode, name.encode())

    def on_disk(self, tenant: str) -> set[str]:
        d = self.backing / tenant / "model"
        return set(os.listdir(d)) if d.exists() else set()

    def indexed(self, tenant: str) -> set[str]:
        ns = self.index.lookup(self.tenant(tenant), b"model")
        return {n.name.decode() for n in self.index.children(ns.inode)} if ns else set()


@pytest.fixture
def make(tmp_path):
    made = []

    def build(tenants, **kw) -> Daemon:
        d = Daemon(tmp_path, tenants, **kw)
        made.append(d)
        return d

    yield build
    for d in made:
        d.index.close()


def test_evict_removes_the_least_recently_used_files(make):
    d = make({"acme": [("a", 100), ("b", 100), ("c", 100), ("d", 100)]})
    t = d.tenant("acme")
    freed = trio.run(d.reclaim.evict, 150, t)
    assert freed == 200
    assert d.on_disk("acme") == d.indexed("acme") == {"c", "d"}
    assert d.tree.stats.tenant_bytes(t) == 200 and d.tree.stats.tenant_files(t) == 2
    assert sum(c.evictions for c in d.tree.stats.by_ns.values()) == 2
    assert not d.tree.evicting


def test_evict_leaves_open_files(make):
    d = make({"acme": [("a", 100), ("b", 100)]})
    d.tree.open_files[d.node("acme", "a").inode] = object()  # type: ignore[assignment]
    assert trio.run(d.reclaim.evict, 100, d.tenant("acme")) == 100
    assert d.on_disk("acme") == {"a"}


def test_a_growth_that_can_never_fit_is_refused_with_nothing_evicted(make):
    d = make({"acme": [("a", 100), ("b", 100)]}, capacity=1000)
    t = d.tenant("acme")
    node = d.index.get(t)

    def refused(growth: int, size: int | None = None) -> int:
        with pytest.raises(FUSEError) as exc:
            trio.run(d.reclaim.make_room, node, growth, size)
        assert d.on_disk("acme") == d.indexed("acme") == {"a", "b"}
        return exc.value.errno

    assert refused(2000) == errno.EFBIG  # more than the capacity
    d.residency.limits[t] = Limits(quota=150)
    assert refused(200, 200) == errno.EDQUOT  # more than the quota
    d.residency.limits[t] = Limits(quota=250)
    d.index.update(d.node("acme", "a").inode, pinned=1)
    d.residency.pin(d.node("acme", "a"), True)
    d.index.update(d.node("acme", "b").inode, pinned=1)
    d.residency.pin(d.node("acme", "b"), True)
    assert refused(100) == errno.EDQUOT  # its own files are pinned: nothing to free
    d.residency.limits[t] = Limits()
    assert refused(850) == errno.ENOSPC  # the capacity, all of it pinned


def test_make_room_evicts_what_the_quota_needs(make):
    d = make({"acme": [("a", 100), ("b", 100), ("c", 100)]})
    t = d.tenant("acme")
    d.residency.limits[t] = Limits(quota=300)
    trio.run(d.reclaim.make_room, d.index.get(t), 150, None)
    assert d.on_disk("acme") == {"c"}  # 150 more bytes: two of the oldest go
    assert d.tree.stats.tenant_bytes(t) == 100


def test_make_room_takes_from_the_tenant_over_its_share(make):
    d = make({"big": [(f"b{i}", 100) for i in range(8)], "small": [("s", 100)]},
             capacity=1000)
    trio.run(d.reclaim.make_room, d.index.get(d.tenant("small")), 200, None)
    assert d.on_disk("small") == {"s"}
    assert d.on_disk("big") == {f"b{i}" for i in range(1, 8)}


def test_settle_evicts_down_to_the_low_watermark(make):
    d = make({"acme": [(f"f{i}", 100) for i in range(10)]}, capacity=1000, high=0.8, low=0.5)
    trio.run(d.reclaim.settle)
    assert d.tree.stats.used_bytes <= 500
    assert d.on_disk("acme") == {f"f{i}" for i in range(5, 10)}


def test_settle_below_the_high_watermark_evicts_nothing(make):
    d = make({"acme": [(f"f{i}", 100) for i in range(9)]}, capacity=1000)
    trio.run(d.reclaim.settle)
    assert len(d.on_disk("acme")) == 9


def test_the_eviction_task_wakes_when_the_usage_passes_the_high_watermark(make):
    d = make({"acme": [(f"f{i}", 100) for i in range(5)]}, capacity=1000, high=0.9, low=0.3)

    async def go():
        async with trio.open_nursery() as nursery:
            d.reclaim.start(nursery)
            d.reclaim.wake_if_over()  # 500 of 1000: under the high watermark
            await trio.sleep(0.2)
            assert len(d.on_disk("acme")) == 5
            d.reclaim.wake_if_over(growth=450)  # a growth that would pass it
            await trio.sleep(0.2)
            # Not yet grown: the task finds nothing to do. Grown: it evicts.
            assert len(d.on_disk("acme")) == 5
            d.tree.stats.account(d.tree.key(d.index.get(d.tenant("acme"))), 0, 450)
            d.reclaim.wake()
            with trio.fail_after(10):
                while len(d.on_disk("acme")) == 5:
                    await trio.sleep(0.05)
            nursery.cancel_scope.cancel()

    trio.run(go)
    assert d.tree.stats.used_bytes <= 300 + 450


def test_expire_removes_idle_files_and_prunes_the_emptied_namespace(make):
    d = make({"old": [("a", 10), ("b", 10)], "new": [("c", 10)]})
    now = time.time_ns()
    d.index.update(d.node("new", "c").inode, atime_ns=now, mtime_ns=now)
    for tenant in ("old", "new"):
        d.residency.limits[d.tenant(tenant)] = Limits(max_idle=3600)
    assert trio.run(d.reclaim.expire) == 2
    assert not (d.backing / "old" / "model").exists()  # the namespace aged out with them
    assert (d.backing / "old").is_dir()  # the tenant stays
    assert d.index.lookup(d.tenant("old"), b"model") is None
    assert d.on_disk("new") == {"c"}
    assert sum(c.expirations for c in d.tree.stats.by_ns.values()) == 2


def test_expire_leaves_pinned_files(make):
    d = make({"acme": [("a", 10), ("b", 10)]})
    d.index.update(d.node("acme", "a").inode, pinned=1)
    d.residency.limits[d.tenant("acme")] = Limits(max_age=60)
    assert trio.run(d.reclaim.expire) == 1
    assert d.on_disk("acme") == {"a"}


def test_expire_without_limits_removes_nothing(make):
    d = make({"acme": [("a", 10)]})
    assert trio.run(d.reclaim.expire) == 0
    assert d.on_disk("acme") == {"a"}


def test_eviction_demotes_blocks_to_the_next_tier(tmp_path):
    """With a lower tier, an evicted block is demoted: its bytes go down, its name stays (in
    tier 1, out of the hot usage), and a later lookup can fetch it back. A plain file is
    deleted."""
    from kvfs.daemon.tiers import DirTier  # noqa: PLC0415
    from kvfs.daemon.tiers.mover import Tiering  # noqa: PLC0415
    from kvfs.format import blockfile, hashing  # noqa: PLC0415

    backing = tmp_path / "backing"
    (backing / ".kvfs").mkdir(parents=True)
    ns = backing / "acme" / "llama@0123456789abcdef"
    h = hashing.block_hashes([7] * 16, 16)[0]
    data = blockfile.encode(block_hash=h, parent_hash=hashing.ROOT_PARENT,
                            fingerprint=bytes(16), token_count=16, dtype="uint8",
                            shape=(100,), payload=bytes(100))
    block = ns / hashing.block_relpath(h)
    block.parent.mkdir(parents=True)
    block.write_bytes(data)
    (ns / "notes").write_bytes(b"n" * 10)
    index = Index(str(backing / ".kvfs" / "index.db"))
    store = BackingStore(str(backing))
    scanner.reconcile(index, store)
    cold = tmp_path / "cold"

    async def go():
        tiering = Tiering([DirTier(str(cold))], trio.CapacityLimiter(4))
        tree = Tree(index, store, MountInfo(str(tmp_path / "mnt"), str(backing), None),
                    tiering=tiering)
        tree.residency.load()
        reclaim = Reclaim(tree, Adoption(tree))
        t = index.lookup(ROOT_INODE, b"acme").inode
        freed = await reclaim.evict(len(data) + 10, t)
        tiering.close()
        return tree, freed

    tree, freed = trio.run(go)
    assert freed == len(data) + 10
    assert not block.exists() and not (ns / "notes").exists()
    demoted = (cold / "acme" / "llama@0123456789abcdef" / hashing.block_relpath(h)).read_bytes()
    # Stored encoded where that pays (the lossless codec, on by default below hot), and it
    # decodes to the very file that was evicted.
    assert codec.decode_file(demoted) == data
    if codec.available() and (small := codec.encode_file(data)) is not None:
        assert demoted == small
    node = index.find_block(index.lookup(index.lookup(ROOT_INODE, b"acme").inode,
                                         ns.name.encode()).inode, h)
    assert node is not None and node.tier == 1  # the name stays, in the lower tier
    assert index.lookup(node.ns, b"notes") is None  # a plain file is gone
    counters = [c for c in tree.stats.by_ns.values() if c.demotions or c.evictions]
    assert sum(c.demotions for c in counters) == 1 and sum(c.evictions for c in counters) == 1
    assert tree.stats.used_bytes == 0
    index.close()
