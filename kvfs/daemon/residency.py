"""Residency: which hot files stay and which go. Per-tenant eviction policies, the bound on
their entries (the cold files beyond it), the tenants' limits and the hot tier's budget, and
the choice of victims that make room.

No FUSE and no trio here: every method is synchronous and runs on the event-loop thread, so a
run of them between two awaits of a caller is atomic for the other tasks. It reads the index
and the usage counters; it changes only the policies and `limits`, never a file (eviction
itself is `kvfs.daemon.reclaim`'s). Unit-tested without a mount (tests/test_residency.py).

Shared state, all touched from the event loop only:
- `policies`, `cold_floor`: changed by every request that opens, writes, publishes, pins or
  closes a file, and by eviction choosing its victims.
- `limits`: read at mount (`load_limits`); changed by the limit xattrs (kvfs.daemon.xattrs).
- `atimes`: access times the client reports (the access command), and `file_atimes`, those of
  opens through the mount, written to the index by the atime task of kvfs.daemon.reclaim
  (`flush_atimes`) and before each retention scan; a setattr of the times drops the file's.
- `open_files`, `evicting` are the caller's (kvfs.daemon.tree): read here, never changed.
"""

from __future__ import annotations

import errno
import os
import time
from collections import Counter
from collections.abc import Container, Hashable
from dataclasses import dataclass, field

from ..format import hashing
from ..format.layout import MANIFEST
from ..models.policy import Policy, policy_by_name
from .capacity import UNLIMITED, Budget, Limits, fair_shares, quota_overflow, room_order
from .index import ORPHAN_PARENT, Index, Node
from .stats import Stats


class NoRoom(OSError):
    """A growth that cannot fit: errno EDQUOT (past the tenant's quota) or ENOSPC."""

    def __init__(self, code: int) -> None:
        super().__init__(code, os.strerror(code))


@dataclass(slots=True)
class Plan:
    """Files chosen to make room, not evicted yet."""

    nodes: list[Node] = field(default_factory=list)
    from_policy: list[tuple[Node, Hashable]] = field(default_factory=list)  # taken out of it
    skip: set[int] = field(default_factory=set)  # inodes not to choose (chosen, or growing)

    def take(self, node: Node, key: Hashable | None = None) -> None:
        self.nodes.append(node)
        self.skip.add(node.inode)
        if key is not None:
            self.from_policy.append((node, key))


def policy_key(node: Node) -> Hashable:
    """A file's key in its tenant's policy: (namespace, hash) for a complete block, so that a
    block cached again is known again (ghosts, admission); else its inode."""
    return (node.ns, node.block_hash) if node.block_hash is not None else node.inode


def parent_key(node: Node) -> Hashable | None:
    """The policy key of a block's parent block (None for the first block of a chain)."""
    p = node.parent_hash
    return (node.ns, p) if p is not None and p != hashing.ROOT_PARENT else None


def is_manifest(node: Node) -> bool:
    """A namespace's manifest (the spec its blocks were written for): a few hundred bytes that
    capacity eviction leaves alone (retention still ages it out with its blocks)."""
    return node.parent == node.ns and node.name == MANIFEST


class Residency:
    """The per-tenant policies and the victim choice over one index."""

    def __init__(self, index: Index, stats: Stats, budget: Budget, *, policy: str,
                 entries_limit: int, open_files: Container[int],
                 evicting: Container[int]) -> None:
        self.index = index
        self.stats = stats
        self.budget = budget
        self.policy_name = policy
        #: Files whose eviction state the policies keep in memory, all tenants together; the
        #: rest are cold: cached, known to the index only, evicted first (bounded memory).
        self.entries_limit = entries_limit
        self.open_files = open_files  # inodes being read or written: never chosen
        self.evicting = evicting  # inodes being evicted now: never chosen twice
        self.policies: dict[int, Policy] = {}
        self.limits: dict[int, Limits] = {}
        self.cold_floor: dict[int, int] = {}  # tenant -> cold files a scan could not evict
        self.atimes: dict[tuple[int, bytes], int] = {}  # (ns, hash) -> atime, not yet written
        self.file_atimes: dict[int, int] = {}  # inode -> atime of an open, not yet written
        # Bytes the request thread may still add at flushes, or added and the daemon has not
        # counted yet (kvfs.daemon.made): by tenant (counted where it has a quota), and of
        # the capacity. Room is planned with them counted as used.
        self.granted: Counter[int] = Counter()
        self.cap_granted = 0

    # -- the policies' entries ------------------------------------------------------------

    def policy(self, tenant: int) -> Policy:
        p = self.policies.get(tenant)
        if p is None:
            p = self.policies[tenant] = policy_by_name(self.policy_name)
        return p

    def entries(self) -> int:
        """Files with eviction state in memory, all tenants together."""
        return sum(len(p) for p in self.policies.values())

    def inode_of(self, key: Hashable) -> int | None:
        if isinstance(key, int):
            return key
        found = self.index.find_block(*key)  # type: ignore[misc]
        return found.inode if found is not None else None

    def load(self, tenant: int | None = None) -> None:
        """Rebuild the policies' state from the index, oldest access first (of one tenant,
        after a move that changed its files' keys; of all, at mount). Only the most recently
        used `entries_limit` files enter memory: the others are cold (see `cold_victims`)."""
        if tenant is not None:
            self.policies.pop(tenant, None)
        for node in self.index.cached_files(self.entries_limit, tenant):
            self.make_hot(node)
        self.spill_to_cold()

    def make_hot(self, node: Node, now: float = 0.0) -> None:
        """Give a cold file an entry in its tenant's policy (at mount, or when it is used
        again)."""
        p = self.policy(node.tenant)
        key = policy_key(node)
        p.insert(key, node.size, parent=parent_key(node), now=now)
        if node.pinned:
            p.pin(key, True)

    def spill_to_cold(self) -> None:
        """Keep the policies' entries, all tenants together, under `entries_limit`: past it,
        the largest policy gives up its best victims (plus a sixty-fourth of the limit, so
        that this runs rarely). Their files stay cached, cold: known to the index only, and
        evicted first, oldest access first."""
        limit = self.entries_limit
        total = self.entries()
        if total <= limit or not self.policies:
            return
        policy = max(self.policies.values(), key=len)
        want = total - limit + max(1, limit // 64)
        spilled = []
        offered = policy.victims()
        for key in offered:
            spilled.append(key)
            if len(spilled) >= want:
                break
        offered.close()
        for key in spilled:
            policy.forget(key)  # still cached: not an eviction the policy should learn from

    def add_file(self, node: Node) -> None:
        """A new file, not a block yet: an entry keyed by its inode."""
        self.policy(node.tenant).insert(node.inode, 0, now=time.time())
        self.spill_to_cold()

    def record_use(self, node: Node, now: float) -> None:
        """A hot file was used: tell its policy, entering it first if it was cold."""
        if not node.is_reg or node.tier or node.parent == ORPHAN_PARENT:
            return
        policy = self.policy(node.tenant)
        key = policy_key(node)
        if key not in policy:
            self.make_hot(node, now)
            self.spill_to_cold()
        policy.access(key, now)

    def record_access(self, tenant: int, ns: int, hashes: list[bytes], now_ns: int) -> None:
        """The client read these blocks of namespace `ns` straight from their backing files:
        each counts as a use. Access times reach the index in batches (`flush_atimes`): the
        control call costs what the policy costs, not one UPDATE per block."""
        policy = self.policy(tenant)
        now, entered = now_ns / 1e9, False
        for h in hashes:
            if (ns, h) not in policy:  # cold (or not cached here: then skipped)
                node = self.index.find_block(ns, h)
                if node is None or node.tier or node.parent == ORPHAN_PARENT:
                    continue
                self.make_hot(node, now)
                entered = True
            policy.access((ns, h), now)
            self.atimes[(ns, h)] = now_ns
        if entered:
            self.spill_to_cold()

    def opened(self, inode: int, now_ns: int) -> None:
        """A file was opened through the mount at `now_ns`: its access time reaches the index
        with the next batch (`flush_atimes`), not as one commit per open; until then
        `atime` answers for it."""
        self.file_atimes[inode] = now_ns

    def atime(self, inode: int, indexed: int) -> int:
        """A file's access time: one not written yet, else the index's (`indexed`)."""
        return self.file_atimes.get(inode, indexed) if self.file_atimes else indexed

    def flush_atimes(self) -> None:
        """Write the access times the kvfs client reported and the mount's opens made since
        the last flush (one transaction)."""
        if self.atimes or self.file_atimes:
            blocks, self.atimes = self.atimes, {}
            files, self.file_atimes = self.file_atimes, {}
            self.index.touch([(t, ns, h) for (ns, h), t in blocks.items()],
                             [(t, inode) for inode, t in files.items()])

    def unblock(self, node: Node) -> None:
        """A block stops being one (truncated, renamed away): key its policy entry by inode."""
        if node.block_hash is not None and not node.tier:
            policy = self.policy(node.tenant)
            policy.remove(policy_key(node))
            policy.insert(node.inode, node.size, now=time.time())
            self.spill_to_cold()

    def enter_block(self, node: Node, *, current: bool = False) -> None:
        """(Re)enter a complete block into its tenant's policy, linked to its parent
        (``current``: ``node`` is the index's row as it is now, just inserted, not read
        again)."""
        if not current:
            node = self.index.get(node.inode)
        policy = self.policy(node.tenant)
        policy.remove(node.inode)
        key = policy_key(node)
        policy.remove(key)
        policy.insert(key, node.size, parent=parent_key(node), now=time.time())
        if node.pinned:
            policy.pin(key, True)
        self.spill_to_cold()

    def pin(self, node: Node, pinned: bool) -> None:
        self.policy(node.tenant).pin(policy_key(node), pinned)

    def forget_file(self, node: Node) -> None:
        """A hot file leaves the tier (removed, demoted): its entry goes."""
        policy = self.policies.get(node.tenant)
        if policy is not None:
            policy.remove(policy_key(node))

    # -- choosing victims -----------------------------------------------------------------

    def cold_count(self, tenant: int) -> int:
        """How many of a tenant's hot files have no entry in its policy."""
        p = self.policies.get(tenant)
        return self.stats.tenant_files(tenant) - (len(p) if p is not None else 0)

    def _busy(self, inode: int | None, plan: Plan) -> bool:
        return inode in self.open_files or inode in self.evicting or inode in plan.skip

    def cold_victims(self, tenant: int, need: int, plan: Plan, cold: int,
                     limit: int = UNLIMITED) -> int:
        """Choose cold files of a tenant, least recently accessed first, until `need` bytes
        (and no more than `limit`); returns the bytes chosen. Files the policy holds are
        skipped: it orders those. A scan that runs out remembers how many cold files it could
        not take (`cold_floor`), so that the next eviction does not scan the tenant's files
        again for nothing."""
        policy = self.policies.get(tenant)
        freed, after, taken = 0, (-1, 0), 0
        while freed < need:
            rows = self.index.coldest(tenant, after, 256)
            if not rows:
                self.cold_floor[tenant] = cold - taken
                break
            for node in rows:
                after = (node.atime_ns, node.inode)
                if (self._busy(node.inode, plan) or is_manifest(node)
                        or (policy is not None and policy_key(node) in policy)):
                    continue
                if freed + node.size > limit:
                    return freed
                plan.take(node)
                taken += 1
                freed += node.size
                if freed >= need:
                    break
        return freed

    def tenant_victims(self, t: int, need: int, plan: Plan, limit: int = UNLIMITED) -> int:
        """Choose files of tenant `t` worth at least `need` bytes into `plan` (fewer if it has
        not enough evictable, and never more than `limit`); returns the bytes chosen. Cold
        files go first, then the policy's victims in its order; each leaves the policy at
        once, so that its parent may become the next victim (`undo` puts them back)."""
        freed = 0
        cold = self.cold_count(t)
        # Files without policy state go first, unless a scan has just found that the
        # cold files left cannot be evicted (pinned, open, a manifest).
        floor = self.cold_floor[t] = min(self.cold_floor.get(t, 0), cold)
        if cold > floor:
            freed += self.cold_victims(t, need, plan, cold, limit)
            if freed >= need or freed >= limit:
                return freed
        policy = self.policies.get(t)
        if policy is None:
            return freed
        stale = []
        offered = policy.victims()
        for key in offered:
            inode = self.inode_of(key)
            if self._busy(inode, plan):
                continue  # being read or written (or the file that grows): never evicted
            node = self.index.find(inode) if inode is not None else None
            if node is None or node.parent == ORPHAN_PARENT or not node.is_reg or node.tier:
                stale.append(key)
                continue
            if is_manifest(node):
                continue  # kept, and kept in the policy (not made cold)
            if freed + node.size > limit:
                break
            policy.remove(key)
            plan.take(node, key)
            freed += node.size
            if freed >= need:
                break
        offered.close()
        for key in stale:
            policy.remove(key)
        return freed

    def tenant_usage(self) -> dict[int, int]:
        usage: dict[int, int] = {}
        for (t, _), c in self.stats.by_ns.items():
            if t:
                usage[t] = usage.get(t, 0) + c.bytes
        return usage

    def room_victims(self, plan: Plan, need: int, grower: int | None,
                     usage: dict[int, int]) -> int:
        """Choose files worth `need` bytes of capacity under the fair-share rule
        (`capacity.room_order`); returns the bytes chosen."""
        quotas = {t: lim.quota for t, lim in self.limits.items()}
        shares = fair_shares(usage, self.budget.capacity or 0, quotas, grower)
        freed = 0
        for t, want, limit in room_order(usage, shares, grower, need):
            freed += self.tenant_victims(t, min(need - freed, want), plan, limit)
            if freed >= need:
                break
        return freed

    def victims(self, need: int, tenant: int | None) -> list[Node]:
        """Choose files to evict that free at least `need` bytes (fewer if there are not
        enough): a tenant's own, or (background eviction) under the fair-share rule."""
        plan = Plan()
        if tenant is not None:
            self.tenant_victims(tenant, need, plan)
        else:
            self.room_victims(plan, need, None, self.tenant_usage())
        return plan.nodes

    def plan_room(self, tenant: int, growth: int, exclude: int | None) -> Plan:
        """What must go before `tenant` grows by `growth` bytes, chosen but not yet evicted:
        its own files past its quota, then files under the fair-share rule past the
        capacity. A growth that cannot fit is refused here (NoRoom: EDQUOT, ENOSPC), with the
        choice undone: nothing is evicted for a request that fails anyway."""
        plan = Plan()
        if exclude is not None:
            plan.skip.add(exclude)
        usage = self.tenant_usage()
        used = sum(usage.values()) + self.cap_granted
        limits = self.limits.get(tenant)
        granted = self.granted[tenant] if limits is not None and limits.quota is not None else 0
        over = quota_overflow(limits, usage.get(tenant, 0) + granted, growth)
        if over:
            got = self.tenant_victims(tenant, over, plan)
            if got < over:
                self.undo(plan)
                raise NoRoom(errno.EDQUOT)
            usage[tenant] = usage.get(tenant, 0) - got
            used -= got
        over = self.budget.overflow(used, growth)
        if over and self.room_victims(plan, over, tenant, usage) < over:
            self.undo(plan)
            raise NoRoom(errno.ENOSPC)
        return plan

    def undo(self, plan: Plan) -> None:
        """Put files chosen for a plan that will not run back into their policies."""
        for node, key in plan.from_policy:
            p = self.policy(node.tenant)
            p.insert(key, node.size, parent=parent_key(node), now=time.time())
            if node.pinned:
                p.pin(key, True)
