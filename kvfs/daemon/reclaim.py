"""Reclaim: the work that frees hot-tier space. Eviction (room for a growing file, and the
background task above the high watermark), demotion to a lower tier instead of deletion,
retention (files past their tenant's idle or age limit) and pruning the directories that
retention emptied. Which files go is kvfs.daemon.residency's choice; this module removes them.

Shared state (event loop only): `_wanted`, the event that wakes the eviction task, set by any
task that grew the usage past the high watermark and replaced by the eviction task each time
it wakes. The inodes being removed are `Tree.evicting` (this module adds and removes them).
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable

import trio
from pyfuse3 import FUSEError

from .adoption import Adoption
from .handlers import is_full, say_full
from .index import ORPHAN_PARENT, Node
from .residency import NoRoom
from .tree import Tree

log = logging.getLogger(__name__)

#: Seconds between writes of the access times the kvfs client reports.
ATIME_FLUSH_INTERVAL = 1.0


class Reclaim:
    def __init__(self, tree: Tree, adoption: Adoption) -> None:
        self.tree = tree
        self.index = tree.index
        self.residency = tree.residency
        self.adoption = adoption
        self._wanted: trio.Event | None = None
        #: Before room is planned: the request thread's unspent grants taken back
        #: (kvfs.daemon.made `take_back`, set by the door).
        self.before_room: Callable[[], None] = lambda: None

    # -- background tasks -----------------------------------------------------------------

    def start(self, nursery: trio.Nursery) -> None:
        """Start the background tasks: eviction, retention, writing access times (and
        checkpointing the index)."""
        self._wanted = trio.Event()
        nursery.start_soon(self._evict_loop)
        nursery.start_soon(self._retention_loop)
        nursery.start_soon(self._index_loop)

    def wake(self) -> None:
        if self._wanted is not None:
            self._wanted.set()

    def wake_if_over(self, growth: int = 0) -> None:
        """Wake the eviction task if the usage (plus `growth`) is above the high watermark."""
        if self.residency.budget.excess(self.tree.stats.used_bytes + growth):
            self.wake()

    async def settle(self) -> None:
        """Before serving: a hot tier found above its high watermark (blocks placed just
        before a crash, a capacity lowered between mounts) is evicted down to the low one."""
        need = self.residency.budget.excess(self.tree.stats.used_bytes)
        if need:
            freed = await self.evict(need)
            log.info("over capacity at mount: evicted %d bytes", freed)

    async def _evict_loop(self) -> None:
        while True:
            assert self._wanted is not None
            await self._wanted.wait()
            self._wanted = trio.Event()
            need = self.residency.budget.excess(self.tree.stats.used_bytes)
            if need:
                try:
                    freed = await self.evict(need)
                except Exception:
                    log.exception("background eviction failed")
                    await trio.sleep(1)
                    continue
                log.debug("background eviction freed %d of %d bytes", freed, need)

    async def _index_loop(self) -> None:
        """Once a second: the batched access times, then the index's checkpoint (off the
        event loop, see Index.checkpoint)."""
        while True:
            await trio.sleep(ATIME_FLUSH_INTERVAL)
            try:
                self.tree.collect_opens()
                self.residency.flush_atimes()
            except Exception:
                log.exception("writing access times failed")
            try:
                await self.tree.io(self.index.checkpoint)
            except Exception as exc:
                if is_full(exc):  # (again a second later: a full disk is said once a minute)
                    say_full("checkpointing the index")
                else:
                    log.exception("checkpointing the index failed")

    async def _retention_loop(self) -> None:
        while True:
            await trio.sleep(self.tree.info.scan_interval)
            try:
                await self.expire()
            except Exception:
                log.exception("retention scan failed")

    # -- eviction -------------------------------------------------------------------------

    async def evict(self, need: int, tenant: int | None = None, reason: str = "evicted") -> int:
        """Evict files worth at least `need` bytes; returns the bytes freed."""
        self.tree.collect_opens()  # the uses the request thread saw count too
        return await self.remove_files(self.residency.victims(need, tenant), reason)

    async def remove_files(self, nodes: list[Node], reason: str) -> int:
        """Unlink files chosen by the daemon itself (eviction, retention).

        While their backing files are being unlinked they are marked `evicting`, so that no
        open can start on them; then they leave the index and the kernel's caches."""
        if not nodes:
            return 0
        tree = self.tree
        for n in nodes:  # chosen as not open: the request thread opens none of them now
            tree.passthrough.revoke(n.inode)
        for parent in {n.parent for n in nodes} & self.adoption.unlisted:
            await self.adoption.ensure_listed(parent)  # removing files is a change
        tree.evicting.update(n.inode for n in nodes)
        demoted: dict[int, int] = {}  # inode -> the tier it went to
        try:
            paths = [tree.path(n) for n in nodes]
            tiering = tree.tiering
            if reason == "evicted" and tiering is not None and tiering.tiers:
                # Eviction demotes blocks to the next tier down instead of deleting them.
                async def demote(node: Node, rel: bytes) -> None:
                    tier = await tiering.demote(tree.tier_key(rel), tree.block_source(rel),
                                                node.size)
                    if tier:
                        demoted[node.inode] = tier

                async with trio.open_nursery() as nursery:
                    for node, rel in zip(nodes, paths, strict=True):
                        if node.block_hash is not None:
                            nursery.start_soon(demote, node, rel)
            await tree.io(tree.store.unlink_many, paths)
        finally:
            tree.evicting.difference_update(n.inode for n in nodes)
        freed = 0
        for node in nodes:
            current = self.index.find(node.inode)
            if current is None or current.parent == ORPHAN_PARENT or current.tier:
                continue
            freed += tree.size_of(current)
            c = tree.stats.by_ns[tree.key(current)]
            if reason == "expired":
                c.expirations += 1
            elif node.inode in demoted:
                c.demotions += 1
                tree.unaccount(current)  # out of the hot tier; the name stays
                self.index.update(current.inode, tier=demoted[node.inode])
                continue
            else:
                c.evictions += 1
            tree.drop(current)
            tree.invalidate(current)
        return freed

    async def make_room(self, node: Node, growth: int, size: int | None = None,
                        exclude: int | None = None) -> None:
        """Before a file of `node`'s tenant grows by `growth` bytes (to `size` bytes, when
        one file grows): decide whether it can fit at all, then evict what that takes.

        Refused at once, with nothing evicted and nothing changed: EFBIG when the size itself
        can never fit (more than the capacity), EDQUOT when it passes the tenant's quota and
        its own evictable files cannot make up the difference, ENOSPC when the capacity
        cannot be freed under the fair-share rule. `exclude` (the file that grows) is never
        chosen to make room for itself."""
        await self.make_room_for(node.tenant, growth, size, exclude)

    async def make_room_for(self, tenant: int, growth: int, size: int | None = None,
                            exclude: int | None = None) -> None:
        """`make_room` by the tenant's inode (a write knows it without reading the index)."""
        if growth <= 0:
            return
        self.before_room()  # the request thread's grants, unspent, come back first
        cap, limits = self.tree.info.capacity, self.residency.limits.get(tenant)
        whole = growth if size is None else size
        if cap is not None and whole > cap:
            raise FUSEError(errno.EFBIG)
        if limits is not None and limits.quota is not None and whole > limits.quota:
            raise FUSEError(errno.EDQUOT)
        for _ in range(4):  # again when other requests took the room freed meanwhile
            try:
                plan = self.residency.plan_room(tenant, growth, exclude)
            except NoRoom as exc:
                raise FUSEError(exc.errno) from None
            if not plan.nodes:
                break
            await self.remove_files(plan.nodes, "evicted")
        else:
            raise FUSEError(errno.ENOSPC)
        self.wake_if_over(growth)

    # -- retention ------------------------------------------------------------------------

    async def expire(self) -> int:
        """Remove the files that have outlived their tenant's retention limits."""
        self.tree.collect_opens()
        self.residency.flush_atimes()  # retention reads access times from the index
        now = time.time_ns()
        removed = 0
        busy = self.tree.in_use
        for tenant, limits in list(self.residency.limits.items()):
            if limits.max_idle is None and limits.max_age is None:
                continue
            idle = now - int(limits.max_idle * 1e9) if limits.max_idle is not None else 0
            age = now - int(limits.max_age * 1e9) if limits.max_age is not None else 0
            while True:
                batch = [n for n in self.index.expired(tenant, idle, age)
                         if n.inode not in busy and n.inode not in self.tree.evicting]
                if not batch:
                    break
                removed += len(batch)
                await self.remove_files(batch, "expired")
                await self.prune({n.parent for n in batch})
        return removed

    async def prune(self, dirs: set[int]) -> None:
        """Remove directories that retention emptied, up to and including the model
        namespace: a namespace nobody uses ages out with its files."""
        tree = self.tree
        while dirs:
            parents = set()
            for inode in dirs:
                node = self.index.find(inode)
                if (node is None or not node.is_dir or node.ns == 0 or node.parent == ORPHAN_PARENT
                        or self.index.has_children(inode)):
                    continue
                await self.adoption.ensure_listed(node.parent)  # removing an entry: a change
                try:
                    await tree.io(tree.store.rmdir, tree.path(node))
                except OSError as exc:
                    log.debug("not pruning %s: %s", node.name, exc)
                    continue
                node = self.index.find(inode)
                if node is not None and not self.index.has_children(inode):
                    tree.drop(node)
                    tree.invalidate(node)
                    parents.add(node.parent)
            dirs = parents
