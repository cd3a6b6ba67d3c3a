"""Unit tests of kvfs.daemon.residency: the per-tenant policies, the cold files beyond their bound,
and the choice of victims. No mount, no FUSE, no backing files: an index and the usage counters."""

from __future__ import annotations

import errno
import stat
import sys

import pytest

from kvfs.daemon.capacity import Budget, Limits
from kvfs.daemon.index import ROOT_INODE, Index, Node
from kvfs.daemon.residency import NoRoom, Plan, Residency, policy_key
from kvfs.daemon.stats import Stats
from kvfs.format import hashing
from kvfs.format.layout import MANIFEST

GB = 1 << 30


class World:
    """An index with tenants, one namespace each, and files with chosen access times."""

    def __init__(self, tmp_path, capacity: int | None = None, entries_limit: int = 1000,
                 policy: str = "lru") -> None:
        self.index = Index(str(tmp_path / "index.db"))
        self.stats = Stats()
        self.open_files: dict[int, object] = {}
        self.evicting: set[int] = set()
        self.capacity = capacity
        self.entries_limit = entries_limit
        self.policy = policy
        self.ns: dict[int, int] = {}
        self.clock = 1_000_000_000_000

    def tenant(self, name: bytes) -> int:
        t = self.index.insert(parent=ROOT_INODE, name=name, mode=stat.S_IFDIR | 0o755,
                              uid=0, gid=0)
        ns = self.index.insert(parent=t.inode, name=b"model", mode=stat.S_IFDIR | 0o755,
                               uid=0, gid=0, tenant=t.inode)
        self.ns[t.inode] = ns.inode
        return t.inode

    def file(self, tenant: int, name: bytes, size: int, *, block: bool = False,
             parent_hash: bytes = hashing.ROOT_PARENT) -> Node:
        """A complete file, accessed after every file made before it."""
        self.clock += 1_000_000
        node = self.index.insert(parent=self.ns[tenant], name=name, mode=stat.S_IFREG | 0o644,
                                 uid=0, gid=0, size=size, tenant=tenant, ns=self.ns[tenant],
                                 atime_ns=self.clock, mtime_ns=self.clock)
        if block:
            h = name.ljust(16, b"\0")[:16]
            self.index.update(node.inode, block_hash=h, parent_hash=parent_hash)
        return self.index.get(node.inode)

    def residency(self) -> Residency:
        self.stats.reset_usage(self.index.usage_by_namespace())
        r = Residency(self.index, self.stats, Budget(self.capacity), policy=self.policy,
                      entries_limit=self.entries_limit, open_files=self.open_files,
                      evicting=self.evicting)
        r.load()
        return r


@pytest.fixture
def world(tmp_path):
    w = World(tmp_path)
    yield w
    w.index.close()


def names(nodes: list[Node]) -> list[bytes]:
    return [n.name for n in nodes]


def test_no_fuse_and_no_trio():
    """Residency is plain code: importing it brings in neither pyfuse3 nor trio."""
    import subprocess  # noqa: PLC0415

    code = ("import sys, kvfs.daemon.residency; "
            "print(sorted(m for m in ('pyfuse3', 'trio') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


def test_victims_least_recently_used_first(world):
    t = world.tenant(b"acme")
    for i in range(5):
        world.file(t, b"f%d" % i, 100)
    r = world.residency()
    assert names(r.victims(250, t)) == [b"f0", b"f1", b"f2"]
    # Chosen files leave the policy at once (a plan that runs evicts them).
    assert len(r.policies[t]) == 2


def test_a_use_moves_a_file_to_the_back(world):
    t = world.tenant(b"acme")
    files = [world.file(t, b"f%d" % i, 100) for i in range(3)]
    r = world.residency()
    r.record_use(files[0], now=1e9)
    assert names(r.victims(200, t)) == [b"f1", b"f2"]


@pytest.mark.parametrize("entries_limit", [1000, 1], ids=["in-policy", "cold"])
def test_open_evicting_manifest_and_pinned_files_are_never_chosen(world, entries_limit):
    world.entries_limit = entries_limit
    t = world.tenant(b"acme")
    opened = world.file(t, b"open", 100)
    going = world.file(t, b"going", 100)
    world.file(t, MANIFEST, 100)
    pinned = world.file(t, b"pinned", 100)
    world.index.update(pinned.inode, pinned=1)
    world.file(t, b"plain", 100)
    world.open_files[opened.inode] = object()
    world.evicting.add(going.inode)
    r = world.residency()
    assert r.cold_count(t) == (0 if entries_limit > 5 else 4)  # all but the newest
    assert names(r.victims(10 * 100, t)) == [b"plain"]


def test_cold_files_beyond_the_bound_go_first_oldest_first(tmp_path):
    """Only `entries_limit` files have policy state; the rest are cold, in the index only,
    and evicted before any file the policy holds, in access order."""
    w = World(tmp_path, entries_limit=3)
    t = w.tenant(b"acme")
    for i in range(8):
        w.file(t, b"f%d" % i, 100)
    r = w.residency()
    assert r.entries() == 3 and r.cold_count(t) == 5
    hot = {n for n in (b"f5", b"f6", b"f7")}
    assert {r.inode_of(k) for k in r.policies[t].victims()} == {
        w.index.lookup(w.ns[t], n).inode for n in hot}
    assert names(r.victims(400, t)) == [b"f0", b"f1", b"f2", b"f3"]
    w.index.close()


def test_spill_keeps_the_policies_under_their_bound(tmp_path):
    w = World(tmp_path, entries_limit=64)
    t = w.tenant(b"acme")
    r = w.residency()
    for i in range(200):
        r.add_file(w.file(t, b"f%d" % i, 1))
        assert r.entries() <= 64
    w.index.close()


def test_a_used_cold_file_enters_its_policy(tmp_path):
    w = World(tmp_path, entries_limit=2)
    t = w.tenant(b"acme")
    files = [w.file(t, b"f%d" % i, 100) for i in range(4)]
    r = w.residency()
    assert policy_key(files[0]) not in r.policies[t]
    r.record_use(files[0], now=2e9)
    assert policy_key(files[0]) in r.policies[t]
    assert r.entries() <= 2
    w.index.close()


def test_a_scan_that_finds_nothing_evictable_is_not_repeated(world):
    t = world.tenant(b"acme")
    world.entries_limit = 1
    a = world.file(t, b"a", 100)
    world.file(t, b"b", 100)
    r = world.residency()
    world.open_files[a.inode] = object()  # the only cold file is open
    plan = Plan()
    plan.skip.add(world.index.lookup(world.ns[t], b"b").inode)
    assert r.tenant_victims(t, 100, plan) == 0
    assert r.cold_floor[t] == 1  # one cold file it could not take
    world.index.coldest = None  # a second scan would fail
    assert r.tenant_victims(t, 100, plan) == 0


def test_quota_refused_with_nothing_chosen(world):
    t = world.tenant(b"acme")
    world.file(t, b"a", 100)
    world.file(t, b"b", 100)
    r = world.residency()
    before = len(r.policies[t])
    r.limits[t] = Limits(quota=250)
    plan = r.plan_room(t, 50, None)  # fits under the quota: nothing goes
    assert plan.nodes == []
    plan = r.plan_room(t, 100, None)  # 300 > 250: the oldest file goes
    assert names(plan.nodes) == [b"a"]
    r.undo(plan)
    assert len(r.policies[t]) == before
    with pytest.raises(NoRoom) as exc:
        r.plan_room(t, 300, None)  # more than its own files can free
    assert exc.value.errno == errno.EDQUOT
    assert len(r.policies[t]) == before  # undone


def test_the_growing_file_never_makes_room_for_itself(world):
    t = world.tenant(b"acme")
    a = world.file(t, b"a", 100)
    r = world.residency()
    r.limits[t] = Limits(quota=150)
    with pytest.raises(NoRoom):
        r.plan_room(t, 100, exclude=a.inode)


def test_capacity_goes_by_fair_share(tmp_path):
    """A tenant that grows takes room from the tenant over its fair share, not from itself
    while under it; with no room anywhere, ENOSPC."""
    w = World(tmp_path, capacity=1000)
    big, small = w.tenant(b"big"), w.tenant(b"small")
    for i in range(8):
        w.file(big, b"b%d" % i, 100)
    w.file(small, b"s0", 100)
    r = w.residency()
    assert names(r.plan_room(small, 100, None).nodes) == []  # 1000 bytes fit
    plan = r.plan_room(small, 300, None)  # 200 bytes too many: the big tenant's oldest go
    assert names(plan.nodes) == [b"b0", b"b1"]
    assert all(n.tenant == big for n in plan.nodes)
    r.undo(plan)
    with pytest.raises(NoRoom) as exc:
        r.plan_room(small, 2000, None)
    assert exc.value.errno == errno.ENOSPC
    w.index.close()


def test_background_victims_come_from_the_tenant_over_its_share(tmp_path):
    w = World(tmp_path, capacity=1000)
    big, small = w.tenant(b"big"), w.tenant(b"small")
    w.file(small, b"s0", 100)
    for i in range(8):
        w.file(big, b"b%d" % i, 100)
    r = w.residency()
    chosen = r.victims(150, None)
    assert {n.tenant for n in chosen} == {big} and sum(n.size for n in chosen) >= 150
    w.index.close()


def test_a_block_is_keyed_by_its_hash_and_unblocked_by_inode(world):
    t = world.tenant(b"acme")
    blk = world.file(t, b"blk", 100, block=True)
    r = world.residency()
    key = (blk.ns, blk.block_hash)
    assert key in r.policies[t] and r.inode_of(key) == blk.inode
    r.unblock(blk)
    assert key not in r.policies[t] and blk.inode in r.policies[t]
    r.enter_block(blk)
    assert key in r.policies[t] and blk.inode not in r.policies[t]


def test_reported_accesses_enter_cold_blocks_and_reach_the_index_in_a_batch(tmp_path):
    w = World(tmp_path, entries_limit=2)
    t = w.tenant(b"acme")
    a = w.file(t, b"a", 100, block=True)
    w.file(t, b"b", 100, block=True)
    w.file(t, b"c", 100, block=True)
    r = w.residency()
    assert (a.ns, a.block_hash) not in r.policies[t]  # cold
    stamp = 5_000_000_000_000_000_000
    r.record_access(t, a.ns, [a.block_hash, b"x" * 16], stamp)  # the second is not cached
    assert (a.ns, a.block_hash) in r.policies[t]
    assert w.index.get(a.inode).atime_ns != stamp  # not written yet
    r.flush_atimes()
    assert w.index.get(a.inode).atime_ns == stamp and r.atimes == {}
    w.index.close()


def test_a_pin_reaches_the_policy(world):
    t = world.tenant(b"acme")
    a = world.file(t, b"a", 100)
    world.file(t, b"b", 100)
    r = world.residency()
    r.pin(a, True)
    assert names(r.victims(200, t)) == [b"b"]
    r = world.residency()
    r.pin(a, True)
    r.pin(a, False)  # a victim again (placed as if just used)
    assert names(r.victims(200, t)) == [b"b", b"a"]


def test_stale_keys_leave_the_policy(world):
    t = world.tenant(b"acme")
    a = world.file(t, b"a", 100)
    world.file(t, b"b", 100)
    r = world.residency()
    world.index.delete(a.inode)  # gone behind the policy's back
    assert names(r.victims(100, t)) == [b"b"]
    assert a.inode not in r.policies[t]


def test_forget_file_and_budget(world):
    t = world.tenant(b"acme")
    a = world.file(t, b"a", 100)
    r = world.residency()
    r.forget_file(a)
    assert len(r.policies[t]) == 0
    assert r.tenant_usage() == {t: 100}
    assert Budget(GB).overflow(GB - 10, 20) == 10
