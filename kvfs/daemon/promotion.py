"""Promotion: a name the hot tier lacks. In a model namespace that is a cache miss, counted
once per name; with lower tiers, a block found there is fetched, verified and placed hot
(the fan-out directories it needs appear on demand), on a lookup, an open, or the fetch and
prefetch commands.

Shared state (event loop only): `_recent_misses`, the names recently missed (lookups count
them, a create that follows takes its kernel lookup's miss back).
"""

from __future__ import annotations

import errno
import logging
import stat
import time
from collections import OrderedDict

import trio
from pyfuse3 import FUSEError

from ..format import hashing
from .adoption import Adoption
from .index import Node
from .reclaim import Reclaim
from .tree import Tree, join

log = logging.getLogger(__name__)

#: Seconds within which repeated lookups of one missing name count as one miss.
MISS_WINDOW = 60.0
#: A create this soon after the one failed lookup of its name is a creation, not a miss.
CREATE_WINDOW = 2.0


class Promotion:
    def __init__(self, tree: Tree, adoption: Adoption, reclaim: Reclaim) -> None:
        self.tree = tree
        self.index = tree.index
        self.adoption = adoption
        self.reclaim = reclaim
        # (parent, name) of recent failed lookups -> [first seen, lookups since]
        self._recent_misses: OrderedDict[tuple[int, bytes], list[float]] = OrderedDict()

    async def lookup_below(self, parent_inode: int, name: bytes) -> Node | None:
        """A name the hot tier lacks: fetched from a lower tier, or a miss (None)."""
        parent = self.index.find(parent_inode)
        if parent is None or not parent.is_dir or parent.ns == 0:
            return None
        if self.tree.tiering is not None:
            # A fetch places a file (or a fan-out directory) here: a change, which lists an
            # unlisted directory first (see Adoption.ensure_named).
            await self.adoption.ensure_listed(parent.inode)
            listed = self.index.lookup(parent_inode, name)
            if listed is not None:
                return listed
            text = name.decode(errors="replace")
            if parent.inode == parent.ns and len(name) == 2 and all(
                    c in "0123456789abcdef" for c in text):
                return await self.fan_dir(parent, name)
            block_hash = hashing.parse_block_filename(text)
            if block_hash is not None and parent.name == block_hash[:1].hex().encode():
                node = await self.fetch_block(parent, name, None)
                if node is not None:
                    return node
        self.count_miss(parent, name)
        return None

    def count_miss(self, parent: Node, name: bytes) -> None:
        """A miss through the mount, counted once per name: an engine's exists() and the
        kernel's lookup before the create that follows it are one miss, not two."""
        key, now = (parent.inode, name), time.monotonic()
        seen = self._recent_misses.pop(key, None)
        if seen is None or now - seen[0] > MISS_WINDOW:
            seen = [now, 0]
            self.tree.stats.by_ns[self.tree.key(parent)].mount_misses += 1
        seen[1] += 1
        self._recent_misses[key] = seen
        if len(self._recent_misses) > 4096:
            self._recent_misses.popitem(last=False)

    def hand_over_miss(self, parent_inode: int, name: bytes) -> None:
        """The directory of a name just missed is now the request thread's to answer: the
        name's recent misses go with it (counted here once; the thread counts no more)."""
        seen = self._recent_misses.pop((parent_inode, name), None)
        if seen is not None:
            self.tree.passthrough.put_miss(parent_inode, name, time.monotonic() - seen[0],
                                           seen[1])

    def creating(self, parent: Node, name: bytes) -> None:
        """A name is being created. If its only failed lookup was the kernel's, just before
        the create (a temporary, a new directory), that was no cache miss: take it back."""
        seen = self._recent_misses.pop((parent.inode, name), None)
        if seen is not None:
            age, lookups = time.monotonic() - seen[0], seen[1]
        else:  # or one the request thread answered (kvfs.daemon.passthrough `hand_dir`)
            age, lookups = self.tree.passthrough.take_miss(parent.inode, name) or (0.0, 0)
        if lookups == 1 and age < CREATE_WINDOW:
            self.tree.stats.by_ns[self.tree.key(parent)].mount_misses -= 1

    async def fan_dir(self, ns_node: Node, name: bytes) -> Node:
        """The fan-out directory `name` of a namespace, made if the backing tree lacks it."""
        found = self.index.lookup(ns_node.inode, name)
        if found is not None and found.is_dir:
            return found  # indexed: its backing directory exists
        tree = self.tree
        path = join(tree.path(ns_node), name)
        mode = stat.S_IMODE(ns_node.mode)
        try:
            await tree.io(tree.store.mkdir, path, mode, ns_node.uid, ns_node.gid)
        except FileExistsError:
            pass
        found = self.index.lookup(ns_node.inode, name)
        if found is not None:
            return found
        tree.dir_changed(ns_node.inode)
        return self.index.insert(parent=ns_node.inode, name=name, mode=stat.S_IFDIR | mode,
                                 uid=ns_node.uid, gid=ns_node.gid, tenant=ns_node.tenant,
                                 ns=ns_node.ns)

    async def fetch_block(self, dnode: Node, name: bytes, node: Node | None) -> Node | None:
        """Fetch block `name` below `dnode` from the lower tiers and place it hot. `node` is
        its index entry when it is known (in a lower tier), None when it is not."""
        tree = self.tree
        assert tree.tiering is not None
        rel = join(tree.path(dnode), name)
        owner = (dnode.uid, dnode.gid, 0o644)
        got = await tree.tiering.fetch(tree.tier_key(rel), tree.store.placement(rel),
                                       owner, node.size if node is not None else None)
        if got is None:
            return None
        current = self.index.lookup(dnode.inode, name)
        if current is not None and not current.tier:
            return current  # another request placed it meanwhile
        try:
            await self.reclaim.make_room(dnode, got.size, got.size)
        except FUSEError:
            await tree.io(tree.store.unlink_many, [rel])
            return None
        current = self.index.lookup(dnode.inode, name)
        if current is None:
            current = self.index.insert(parent=dnode.inode, name=name,
                                        mode=stat.S_IFREG | 0o644, uid=dnode.uid,
                                        gid=dnode.gid, size=got.size, tenant=dnode.tenant,
                                        ns=dnode.ns)
        self.index.update(current.inode, tier=0, size=got.size,
                          block_hash=got.header.block_hash, parent_hash=got.header.parent_hash)
        current = self.index.get(current.inode)
        tree.stats.account(tree.key(current), 1, got.size)
        tree.stats.by_ns[tree.key(current)].promotions += 1
        tree.residency.enter_block(current)
        return current

    async def fetch_to_open(self, node: Node) -> Node:
        """A file known only in a lower tier is being opened: fetch it, or count a miss
        (ENOENT)."""
        await self.adoption.ensure_listed(node.parent)  # a fetch is a change to the directory
        if self.tree.tiering is None or await self.fetch_block(
                self.index.get(node.parent), node.name, node) is None:
            self.tree.stats.by_ns[self.tree.key(node)].mount_misses += 1
            raise FUSEError(errno.ENOENT)  # the lower tier could not deliver: a miss
        return self.index.get(node.inode)

    async def fetch_many(self, dnode: Node, hashes: list[bytes],
                         budget: float | None = None) -> None:
        """Promote the blocks of `dnode` that the hot tier lacks, concurrently. With a
        `budget` (seconds), return once it is spent: the fetches still running are not
        cancelled (a block is placed and indexed whole, or not at all) but finish in the
        background, and serve the next request."""
        tiering = self.tree.tiering
        if tiering is None or not tiering.reachable():
            return  # no tiers, or every tier's circuit is open: misses, at once
        await self.adoption.listed_fans(dnode, hashes)
        nursery = self.tree.nursery
        if budget is not None and nursery is not None:
            done = trio.Event()

            async def all_then_done() -> None:
                try:
                    await self.fetch_many(dnode, hashes)
                finally:
                    done.set()

            nursery.start_soon(all_then_done)
            with trio.move_on_after(budget):
                await done.wait()
            return

        async def one(h: bytes) -> None:
            try:
                fan = await self.fan_dir(self.index.get(dnode.inode), h[:1].hex().encode())
            except OSError as exc:  # the tenant's tree is not as indexed: a miss
                log.warning("not fetching %s: %s", h.hex(), exc)
                return
            name = hashing.block_filename(h).encode()
            node = self.index.lookup(fan.inode, name)
            if node is None or node.tier:
                await self.fetch_block(fan, name, node)

        try:
            async with trio.open_nursery() as nursery:
                for h in hashes:
                    nursery.start_soon(one, h)
        except Exception:
            log.exception("fetching %d blocks failed", len(hashes))
