"""The daemon side of the direct path's control commands (the protocol is kvfs.format.control):
publish (index blocks a client wrote into the backing tree), access (the client's hits and
misses, and the blocks it read), corrupt (check and quarantine blocks a client found bad),
fetch and prefetch (promote blocks from the lower tiers), grant (where the client may read
the blocks the hot tier lacks itself: kvfs.daemon.grants). Each is one setxattr on a model
namespace's directory; kvfs.daemon.xattrs routes them here.

No state of its own: it changes the index, the usage counters (Tree.stats) and the policies
(kvfs.daemon.residency), on the event loop, between awaits.
"""

from __future__ import annotations

import errno
import logging
import time
from typing import Any

from pyfuse3 import FUSEError

from ..format import blockfile, control, hashing
from .adoption import Adoption
from .grants import Grants
from .index import ORPHAN_PARENT, Node
from .promotion import Promotion
from .reclaim import Reclaim
from .tree import Tree, join

log = logging.getLogger(__name__)


class Commands:
    def __init__(self, tree: Tree, adoption: Adoption, reclaim: Reclaim,
                 promotion: Promotion) -> None:
        self.tree = tree
        self.index = tree.index
        self.residency = tree.residency
        self.adoption = adoption
        self.reclaim = reclaim
        self.promotion = promotion
        self.grants = Grants(tree, adoption, promotion)

    async def run(self, dnode: Node, name: bytes, value: bytes, ctx: Any) -> None:
        """Run command `name` (one of control.COMMANDS) on directory `dnode`."""
        # The kernel has checked write permission on the directory (default_permissions).
        if not dnode.is_dir or dnode.ns == 0:
            raise FUSEError(errno.EINVAL)  # commands address a model-namespace directory
        op = name.decode().rpartition(".")[2]
        blocks = len(value) // control.HASH_LEN if name != control.ACCESS else 0
        self.tree.audit_op(ctx.uid, ctx.pid, dnode, op, blocks=blocks)
        await self.adoption.ensure_listed(dnode.inode)
        try:
            if name == control.PUBLISH:
                hashes, fetched = control.unpack_publish(value)
                await self.publish(dnode, hashes, fetched=fetched)
            elif name == control.ACCESS:
                access = control.Access.unpack(value)
                await self.adoption.listed_fans(dnode, access.hashes)
                self.access(dnode, access)
            elif name == control.CORRUPT:
                await self.corrupt(dnode, control.unpack_hashes(value))
            elif name == control.GRANT:
                await self.grants.grant(dnode, value, ctx.uid)
            elif name == control.FETCH:
                await self.promotion.fetch_many(dnode, *control.unpack_fetch(value))
            elif self.tree.nursery is not None:
                self.tree.nursery.start_soon(self.promotion.fetch_many, dnode,
                                             control.unpack_hashes(value))
        except control.ControlError as exc:
            log.warning("refused %s from uid %d: %s", name.decode(), ctx.uid, exc)
            raise FUSEError(errno.EINVAL) from None

    async def publish(self, dnode: Node, hashes: list[bytes], *, fetched: bool = False
                      ) -> None:
        """Index blocks that a client wrote and renamed into place below `dnode`
        (`fetched`: hot copies of blocks it read from a shared tier: promotions, not
        uploaded again)."""
        tree, adoption = self.tree, self.adoption
        await adoption.listed_fans(dnode, hashes)
        dpath = tree.path(dnode)
        rels = [join(dpath, hashing.block_relpath(h).encode()) for h in hashes]
        # Only fan-out directories the index does not hold yet are looked at on the disk.
        wanted = {h[:1].hex().encode() for h in hashes}
        fans = sorted(wanted - self.index.present(dnode.inode, wanted))
        fan_stats = (await tree.io(adoption.fan_stats, dpath, fans, tenant=dnode.tenant)
                     if fans else {})
        inspected = await tree.io(adoption.inspect_blocks, dpath, rels, hashes,
                                  tenant=dnode.tenant)
        fresh, dropped = [], []
        policy, now = self.residency.policy(dnode.tenant), time.time()
        placed: set[bytes] = set()
        refused: set[bytes] = set()  # refused in this batch: their files are about to go
        for h, rel, (hdr, st, parent_there) in zip(hashes, rels, inspected, strict=True):
            if st is None or hdr.block_hash != h:
                log.warning("publish of %s refused: %s", rel.decode(errors="replace"),
                            hdr if st is None else "header names another block")
                if st is not None or not isinstance(hdr, FileNotFoundError):
                    dropped.append(rel)
                refused.add(h)
                continue
            known = self.index.lookup_in(dnode.inode, h[:1].hex().encode(),
                                         hashing.block_filename(h).encode())
            if known is not None and not known.tier:
                placed.add(h)
                continue  # content-addressed: publishing twice changes nothing
            p = hdr.parent_hash
            orphan = p in refused or (not parent_there and p not in placed
                                      and self.index.find_block(dnode.ns, p) is None)
            pkey = (dnode.ns, p) if p != hashing.ROOT_PARENT else None
            if orphan or not policy.admit((dnode.ns, h), st.st_size, parent=pkey, now=now):
                # A block whose prefix is not cached can never be a prefix hit; a block the
                # policy would not keep is not worth the space. Neither is placed.
                dropped.append(rel)
                refused.add(h)
                tree.stats.by_ns[tree.key(dnode)].refused_blocks += 1
                continue
            placed.add(h)
            fresh.append((h, rel, hdr, st))
        if dropped:
            await tree.io(tree.store.unlink_many, dropped)
        try:
            sizes = [st.st_size for _, _, _, st in fresh]
            await self.reclaim.make_room(dnode, sum(sizes), max(sizes, default=0))
        except FUSEError:
            # Nothing is left behind by a write that cannot be placed.
            await tree.io(tree.store.unlink_many, [rel for _, rel, _, _ in fresh])
            raise
        dnode = self.index.get(dnode.inode)
        key = tree.key(dnode)
        c = tree.stats.by_ns[key]
        changed: set[int] = set()  # directories with new entries
        back: list[Node] = []  # names known below, hot again: the kernel's attributes go
        with self.index.transaction():
            for h, _rel, hdr, st in fresh:
                fan = h[:1].hex().encode()
                fnode = self.index.lookup(dnode.inode, fan)
                if fnode is None:
                    fst = fan_stats.get(fan)
                    if fst is None:
                        continue  # no directory when listed (a link then): not indexed
                    changed.add(dnode.inode)
                    fnode = self.index.insert(parent=dnode.inode, name=fan, mode=fst.st_mode,
                                              uid=fst.st_uid, gid=fst.st_gid,
                                              tenant=dnode.tenant, ns=dnode.ns)
                fname = hashing.block_filename(h).encode()
                node = self.index.lookup(fnode.inode, fname)
                if node is not None and not node.tier:
                    continue  # content-addressed: publishing twice changes nothing
                promoted = fetched or node is not None
                if node is not None:
                    # Known in a lower tier only: its hot copy is here again (a promotion,
                    # written by the client that read it from below).
                    self.index.update(node.inode, tier=0, size=st.st_size,
                                      block_hash=hdr.block_hash, parent_hash=hdr.parent_hash)
                    node = self.index.get(node.inode)
                    back.append(node)
                else:
                    node = self.index.insert(parent=fnode.inode, name=fname, mode=st.st_mode,
                                             uid=st.st_uid, gid=st.st_gid, size=st.st_size,
                                             tenant=dnode.tenant, ns=dnode.ns,
                                             block_hash=hdr.block_hash,
                                             parent_hash=hdr.parent_hash)
                    changed.add(fnode.inode)
                self.residency.enter_block(node, current=True)
                tree.stats.account(key, 1, st.st_size)
                if promoted:
                    c.promotions += 1
                    continue
                tree.publish_shared(node)
                c.published_blocks += 1
                c.published_bytes += st.st_size
            tree.dir_changed(*changed)
        for node in back:
            tree.invalidate(node)

    def access(self, dnode: Node, a: control.Access) -> None:
        """The client's lookup results and reads of namespace `dnode`."""
        c = self.tree.stats.by_ns[self.tree.key(dnode)]
        c.lookups += a.lookups
        c.hit_blocks += a.hit_blocks
        c.miss_blocks += a.miss_blocks
        c.hit_tokens += a.hit_tokens
        c.miss_tokens += a.miss_tokens
        c.direct_read_bytes += a.read_bytes
        c.direct_needed_bytes += a.needed_bytes
        if a.hashes:
            self.residency.record_access(dnode.tenant, dnode.ns, a.hashes, time.time_ns())

    def _verify_block(self, rel: bytes) -> str | None:
        """Thread: None if the block file is sound, else what is wrong with it (read on a
        verified fd of a regular file, bounded by its header)."""
        try:
            blockfile.verify_file(self.tree.store.read_block(rel))
        except blockfile.BlockFormatError as exc:
            return str(exc)
        return None

    async def corrupt(self, dnode: Node, hashes: list[bytes]) -> None:
        """A client found these blocks bad: check, and quarantine the ones that are."""
        tree = self.tree
        await self.adoption.listed_fans(dnode, hashes)
        for h in hashes:
            node = self.index.find_block(dnode.ns, h)
            if node is None:
                continue
            rel = tree.path(node)
            try:
                problem = await tree.io(self._verify_block, rel, tenant=dnode.tenant)
            except OSError as exc:
                log.warning("not checking %s: %s", rel.decode(errors="replace"), exc)
                continue
            if problem is None:
                continue  # the client's read was bad, not the file
            await tree.io(tree.store.quarantine, rel, tenant=dnode.tenant)
            node = self.index.find(node.inode)
            if node is not None and node.parent != ORPHAN_PARENT:
                tree.drop(node)
            tree.stats.by_ns[tree.key(dnode)].checksum_failures += 1
            log.warning("quarantined %s: %s", rel.decode(errors="replace"), problem)
