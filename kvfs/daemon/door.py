"""The mount door's passthrough part (kvfs.daemon.passthrough): which opens the kernel serves
itself, the reply that hands it the backing file, and what the daemon settles for a passthrough
writer whose writes it never sees (growth against the quota and the capacity at flush, fsync and
release; the backing id released with the inode's last passthrough handle). Which complete
files the request thread may open for reading without asking (`delegate`), and the count of
the opens it answered (`collect`).

No state of its own: the open files (kvfs.daemon.openfiles), the tree's counters and the
passthrough registry, on the event loop, between awaits.
"""

from __future__ import annotations

import errno
import logging
import os
import stat

import pyfuse3
from pyfuse3 import FUSEError

from .index import ORPHAN_PARENT, Node
from .made import Made
from .openfiles import Handle, OpenFile, OpenFiles
from .passthrough import PASS_HEADROOM
from .reclaim import Reclaim
from .tree import Tree

log = logging.getLogger(__name__)


class Door:
    def __init__(self, tree: Tree, files: OpenFiles, reclaim: Reclaim, *,
                 creates: bool = True) -> None:
        self.tree = tree
        self.files = files
        self.reclaim = reclaim
        tree.collect_opens = self.collect
        # The creates, flushes and releases the request thread answers (kvfs.daemon.made).
        self.made = Made(tree, files, wanted=creates)
        self.made.passed = lambda node, h: self.passed(node, h, tree.open_files[node.inode])
        self.made.grew = reclaim.wake_if_over
        self.made.room = self.room_to_pass
        self.made.delegate = self.delegate
        reclaim.before_room = self.made.take_back

    def may_pass(self, inode: int) -> bool:
        """Whether an open of `inode` may be a passthrough open: the mount has it, and no
        handle of the inode reads through the page cache the daemon fills (the kernel
        allows one or the other on an inode)."""
        of = self.tree.open_files.get(inode)
        return self.tree.passthrough.on and (of is None or not of.cached)

    def room_to_pass(self, tenant: int) -> bool:
        """Whether a writer of `tenant` may write through passthrough, where the daemon sees
        none of its writes and settles its growth only at flush: only while the tenant's
        quota and the mount's capacity have PASS_HEADROOM free for it and for every other
        passthrough writer. Nearer a limit writers take the daemon's path, which refuses
        the write that would cross it."""
        pt = self.tree.passthrough
        limits = self.tree.residency.limits.get(tenant)
        if limits is not None and limits.quota is not None and (
                limits.quota - self.tree.stats.tenant_bytes(tenant)
                < PASS_HEADROOM * (pt.writers[tenant] + 1)):
            return False
        cap = self.tree.info.capacity
        return cap is None or (cap - self.tree.stats.used_bytes
                               >= PASS_HEADROOM * (pt.writers.total() + 1))

    def reply(self, node: Node, fh: int, flags: int, *, busy: bool
              ) -> tuple[pyfuse3.FileInfo, int]:
        """The reply to an open or create of a hot file registered as handle `fh`, and the
        backing id it names (0: served by the daemon). Bytes a passthrough reader reads are
        counted at its open (the file's size); what a passthrough writer adds, at its
        flushes (`settle`)."""
        h = self.files.handles[fh]
        of = self.tree.open_files[node.inode]
        pt = self.tree.passthrough
        backing_id = 0
        if h.writable:
            pt.revoke(node.inode)  # the file may change from now on
        if self.may_pass(node.inode) and (not h.writable or self.room_to_pass(node.tenant)):
            backing_id = pt.register(node.inode, h.fd) or 0
        if backing_id:
            self.passed(node, h, of)
            return pyfuse3.FileInfo(fh=fh, direct_io=False, keep_cache=False), backing_id
        pt.revoke(node.inode)
        direct, keep = self.tree.file_cache(node, flags, h.writable, busy=busy)
        if of.passthrough or pt.thread_opens(node.inode):
            direct, keep = True, False  # beside passthrough opens the kernel allows only these
        if not direct:
            h.cached = True
            of.cached += 1
        return pyfuse3.FileInfo(fh=fh, direct_io=direct, keep_cache=keep), 0

    def passed(self, node: Node, h: Handle, of: OpenFile) -> None:
        """Handle `h` of `node` is a passthrough open (its backing id registered)."""
        pt = self.tree.passthrough
        h.passthrough = True
        of.passthrough += 1
        if h.writable:
            of.pt_fds.append(h.fd)
            pt.writers[node.tenant] += 1
            self.files.watch(of, node.inode, h)  # the daemon will not see its writes
        else:
            h.nread = node.size
            self.tree.stats.read(h.key, node.size)
            pt.read_bytes += node.size

    async def settle(self, h: Handle) -> None:
        """A passthrough writer's change in size since it was last settled: room made for
        its growth (evicting as a write would), accounted, and counted as written; or, where
        the tenant's quota or the capacity refuse it, the file cut back to what was
        accounted, and EDQUOT/ENOSPC/EFBIG raised, as NFS reports at close."""
        of = self.tree.open_files[h.inode]
        st = os.fstat(h.fd)
        size = st.st_size
        growth = size - of.size
        if growth > 0:
            try:
                await self.reclaim.make_room_for(h.key[0], growth, size, exclude=h.inode)
            except FUSEError as exc:
                keep = self.tree.open_files[h.inode].size
                await self.tree.io(os.ftruncate, h.fd, keep)
                self.tree.passthrough.cut += 1
                log.warning("inode %d: %d bytes written through passthrough refused at close "
                            "(%s): cut back to %d", h.inode, growth,
                            errno.errorcode.get(exc.errno, exc.errno), keep)
                raise
            growth = size - of.size  # another flush of it may have counted some meanwhile
        if growth:
            self.tree.stats.account(h.key, 0, growth)
            of.size = size
            if growth > 0:
                self.tree.stats.write(h.key, growth)
                self.tree.passthrough.write_bytes += growth
                h.nwritten += growth
        of.mtime_ns = st.st_mtime_ns

    async def release(self, h: Handle) -> None:
        """The last of a passthrough handle: what it wrote after its last flush (a dup'd
        descriptor, a shared mapping) settled. Its backing id is let go by `let_go`, once
        the close is done."""
        if h.writable:
            self.tree.passthrough.writers[h.key[0]] -= 1
            try:
                self.files.observe(h.inode, h)
                await self.settle(h)
            except FUSEError:
                pass  # cut back and logged; nobody is left to tell
            except OSError as exc:
                log.warning("inode %d: settling a passthrough writer failed: %s", h.inode, exc)

    def let_go(self, h: Handle) -> None:
        """A passthrough handle is closed and its file settled (checked, if it was a block
        just written): the file is delegated to the request thread if it may be, then the
        handle's reference to the backing id is released (with the inode's last one, the
        id)."""
        node = self.tree.index.find(h.inode)
        if node is not None:
            self.delegate(node)
        self.tree.passthrough.release(h.inode)

    def delegate(self, node: Node) -> None:
        """Let the request thread answer the read-only opens of `node` while nothing about
        it changes: a complete hot file that a passthrough handle holds open now (its
        backing id), no writer open, no audit of reads asked for."""
        tree = self.tree
        pt = tree.passthrough
        if (not pt.routed or tree.audit is not None or not node.is_reg or node.tier
                or node.writing or node.parent == ORPHAN_PARENT
                or node.inode in tree.evicting or node.inode not in pt.ids):
            return
        of = tree.open_files.get(node.inode)
        if of is not None and (of.writers or of.cached):
            return
        pt.delegate(node.inode, tree.key(node), node.size, tree.attrs(node), node.parent,
                    node.name)

    def collect(self) -> None:
        """The opens the request thread answered since the last call, counted as the daemon
        counts its own: reads, bytes and mount hits per tenant and namespace, access times,
        uses for eviction; and the files it created and flushed (kvfs.daemon.made)."""
        tree = self.tree
        self.made.harvest()
        self.made.refresh()
        for inode, key, size, opens, last_ns in tree.passthrough.harvest():
            tree.stats.read(key, opens * size, opens)
            tree.passthrough.read_bytes += opens * size
            if key[1]:
                tree.stats.by_ns[key].mount_hits += opens
            tree.residency.opened(inode, last_ns)
            node = tree.index.find(inode)
            if node is not None:
                tree.residency.record_use(node, last_ns / 1e9)
        for key, misses in tree.passthrough.harvest_misses():
            tree.stats.by_ns[key].mount_misses += misses

    async def hand_dir(self, parent: Node) -> bool:
        """A name was missing from model directory `parent`, listed (no backing entry waits
        to be indexed): the request thread answers its next missing names itself, from an
        fd of its backing directory (strict resolution: a swap of the path later changes
        nothing). Every name its index holds has its backing entry, but blocks demoted to a
        lower tier; so with lower tiers, the names of blocks and fan-out directories (which
        a lookup may fetch) stay the daemon's. Whether it was handed over now."""
        tree = self.tree
        pt = tree.passthrough
        if not pt.routed or not parent.is_dir or not parent.ns or parent.inode in pt.dirs:
            return False
        try:
            fd = await tree.io(tree.store.opendir, tree.path(parent), tenant=parent.tenant)
        except (OSError, FUSEError):
            return False
        now = tree.index.find(parent.inode)
        # Its creates too, with the tenant's grant (kvfs.daemon.made), unless it is
        # set-group-ID (the thread gives a new file its creator's group).
        tenant = 0 if parent.mode & stat.S_ISGID else self.made.tenant(parent.tenant)
        if (now is None or now.parent != parent.parent or now.name != parent.name
                or not pt.hand_dir(parent.inode, tree.key(parent), fd,
                                   below=tree.tiering is not None, tenant=tenant)):
            os.close(fd)  # gone or moved meanwhile, or handed over by another lookup
            return False
        return True
