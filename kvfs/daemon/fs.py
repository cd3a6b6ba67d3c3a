"""The pyfuse3 Operations: FUSE requests translated to the daemon's modules, nothing else.

Handlers are thin: check arguments, update the index (on the event-loop thread), do blocking
backing-store I/O through `Tree.io` (worker threads), map failures to errno. No exception
escapes a handler (pyfuse3 would end the session for every client): `kvfs.daemon.handlers.handler`,
the one wrapper every handler has, turns anything but a `FUSEError(errno)` into one (EIO,
logged), and counts the requests (stats.json `requests`).
The rest lives in kvfs.daemon.tree (shared state), kvfs.daemon.openfiles, kvfs.daemon.residency,
kvfs.daemon.adoption, kvfs.daemon.reclaim, kvfs.daemon.promotion, kvfs.daemon.xattrs,
kvfs.daemon.commands, kvfs.daemon.stats_json, kvfs.daemon.virtual. Only the mount entry point
(`kvfs.daemon.mount`) imports this module.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import stat
import time
from typing import Any

import pyfuse3
import trio
from pyfuse3 import FUSEError

from .. import __version__
from ..format import hashing
from . import stats_json, virtual
from .adoption import Adoption
from .audit import Audit
from .commands import Commands
from .door import Door
from .governance import Governance
from .handlers import REQUESTS, handler
from .handout import Handout
from .index import FIRST_REAL_INODE, ORPHAN_PARENT, ROOT_INODE, Index, Node
from .keys import Keyring
from .openfiles import READ_AHEAD, Handle, OpenFiles, advise, backing_flags, open_ahead, read_disk
from .promotion import Promotion
from .reclaim import Reclaim
from .settings import DEFAULTS
from .store import BackingStore
from .tiers.mover import Tiering
from .tree import NAME_MAX, MountInfo, Tree, attr_changes, check_move, check_name, join, owner_gid
from .virtual import VDIR, VDIR_NAME, VFILES, VSTATS, VVERSION
from .xattrs import Xattrs

__all__ = ["MountInfo", "Operations"]

log = logging.getLogger(__name__)


class Operations(pyfuse3.Operations):
    supports_dot_lookup = True
    enable_writeback_cache = False
    enable_acl = False

    def __init__(
        self,
        index: Index,
        store: BackingStore,
        info: MountInfo,
        *,
        owner_uid: int = 0,
        io_threads: int = DEFAULTS["io_threads"],
        tiering: Tiering | None = None,
        keyring: Keyring | None = None,
        audit: Audit | None = None,
        writeback_cache: bool = DEFAULTS["writeback_cache"],
        keep_cache: bool = DEFAULTS["keep_cache"],
        passthrough: bool = DEFAULTS["passthrough"],
        thread_creates: bool = DEFAULTS["thread_creates"],
    ) -> None:
        super().__init__()
        self.enable_writeback_cache = writeback_cache  # read by pyfuse3 when it mounts
        # The shared state and the modules that work on it (see each module for who changes
        # what: all on the event loop, between awaits, no locks).
        self.tree = tree = Tree(index, store, info, owner_uid=owner_uid,
                                io_threads=io_threads, tiering=tiering, audit=audit,
                                writeback_cache=writeback_cache, keep_cache=keep_cache,
                                passthrough=passthrough)
        self.residency = tree.residency
        self.files = OpenFiles(index, tree.residency, tree.open_files)
        self.adoption = Adoption(tree)
        self.reclaim = Reclaim(tree, self.adoption)
        self.adoption.after_growth = self.reclaim.wake_if_over
        self.promotion = Promotion(tree, self.adoption, self.reclaim)
        self.governance = tree.governance = Governance(tree, self.reclaim, keyring)
        self.door = Door(tree, self.files, self.reclaim, creates=thread_creates)
        self.made = self.door.made
        self.made.creating = self.promotion.creating
        self.made.release = self.release_settled
        self.made.complete = self.complete_later
        commands = Commands(tree, self.adoption, self.reclaim, self.promotion)
        self.xattrs = Xattrs(tree, self.reclaim, commands, self.governance)
        self.handout = Handout(store.root, commands.grants.take_fds, commands.grants.close)
        commands.grants.handout_on = lambda: self.handout.on
        # The same objects, by the names the handlers use.
        self.index, self.store, self.stats = index, store, tree.stats
        self.lookups, self.open_files, self.handles = (tree.lookups, tree.open_files,
                                                       self.files.handles)
        self.residency.load()

    # -- the mount's life (kvfs.daemon.mount) ----------------------------------------------------

    def load_limits(self) -> None:
        """Read every tenant's limits from its backing directory (blocking: before serving;
        a tenant whose directory went away while unmounted was reconciled out before)."""
        for t in self.index.tenants():
            limits = self.residency.limits[t.inode] = self.store.read_limits(t.name)
            self.governance.set_placement(t.name.decode(errors="surrogateescape"),
                                          limits.placement)

    async def settle(self) -> None:
        await self.reclaim.settle()

    async def run_background(self) -> None:
        """The daemon's own tasks: eviction, retention, access times, indexing, the tiers."""
        self.tree.serving = True
        async with trio.open_nursery() as nursery:
            self.tree.nursery = nursery
            self.reclaim.start(nursery)
            nursery.start_soon(self.adoption.run)
            nursery.start_soon(self.governance.run)
            if self.tree.tiering is not None:
                nursery.start_soon(self.tree.tiering.run)
                if any(t.hands_files for t in self.tree.tiering.tiers):
                    nursery.start_soon(self.handout.run)

    def snapshot(self, tenants: set[int] | None = None) -> dict[str, Any]:
        """Everything `.kvfs/stats.json` shows (the metrics endpoint's source too)."""
        return stats_json.snapshot(self.tree, self.adoption, tenants)

    def flush_atimes(self) -> None:
        self.residency.flush_atimes()

    def _persist(self, inode: int) -> None:
        self.files.persist(inode)

    def _virtual_attrs(self, inode: int) -> pyfuse3.EntryAttributes:
        return virtual.attrs(inode, self.tree.info.started)

    def _new_entry(self, parent_inode: int, name: bytes, *, is_dir: bool, ctx: Any) -> Node:
        """The parent of a name about to be created (mkdir, create, symlink), checked."""
        parent = self.tree.check_parent(parent_inode, is_dir=is_dir, name=name, uid=ctx.uid)
        if self.index.lookup(parent.inode, name) is not None:
            raise FUSEError(errno.EEXIST)
        self.promotion.creating(parent, name)
        return parent

    # -- lookups and attributes -----------------------------------------------------------

    @handler
    async def lookup(self, parent_inode: int, name: bytes, ctx: Any) -> pyfuse3.EntryAttributes:
        if parent_inode == ROOT_INODE and name == VDIR_NAME:
            return self._virtual_attrs(VDIR)
        if parent_inode == VDIR:
            if name in VFILES:
                return self._virtual_attrs(VFILES[name])
            if name == b"..":
                return await self.getattr(ROOT_INODE, ctx)
            raise FUSEError(errno.ENOENT)
        if len(name) > NAME_MAX:
            raise FUSEError(errno.ENAMETOOLONG)
        if name == b".":
            node = self.index.get(parent_inode)
        elif name == b"..":
            node = self.index.get(self.index.get(parent_inode).parent)
        else:
            await self.adoption.ensure_named(parent_inode, name)
            found = self.index.lookup(parent_inode, name)
            if found is None:
                found = await self.promotion.lookup_below(parent_inode, name)
            if found is None:
                if parent_inode not in self.adoption.unlisted and await self.door.hand_dir(
                        self.index.get(parent_inode)):
                    self.promotion.hand_over_miss(parent_inode, name)
                raise FUSEError(errno.ENOENT)
            node = found
        self.tree.ref(node.inode)
        return self.tree.attrs(node)

    @handler
    async def forget(self, inode_list: list[tuple[int, int]]) -> None:
        for inode, nlookup in inode_list:
            self.tree.passthrough.take_lookups(inode)  # those its request thread answered
            left = self.lookups.get(inode, 0) - nlookup
            if left > 0:
                self.lookups[inode] = left
                continue
            self.lookups.pop(inode, None)
            self.tree.purge_orphan(inode)  # (a set lookup: forget costs no query)

    @handler
    async def getattr(self, inode: int, ctx: Any) -> pyfuse3.EntryAttributes:
        if inode in (VDIR, VSTATS, VVERSION):
            return self._virtual_attrs(inode)
        return self.tree.attrs(self.index.get(inode))

    @handler
    async def setattr(
        self, inode: int, attr: pyfuse3.EntryAttributes, fields: pyfuse3.SetattrFields,
        fh: int | None, ctx: Any,
    ) -> pyfuse3.EntryAttributes:
        if inode < FIRST_REAL_INODE and inode != ROOT_INODE:
            raise FUSEError(errno.EPERM)
        self.made.own(inode)  # its size and times are the daemon's to change now
        node = self.index.get(inode)
        if node.is_dir and (fields.update_mode or fields.update_gid):
            self.tree.passthrough.take_dir(inode)  # the request thread's creates in it
        path = self.tree.path(node)
        changes: dict[str, Any] = {}
        kwargs: dict[str, Any] = {}
        now = time.time_ns()
        if fields.update_size:
            if not node.is_reg:
                raise FUSEError(errno.EISDIR if node.is_dir else errno.EINVAL)
            if attr.st_size < 0:
                raise FUSEError(errno.EINVAL)
            await self.reclaim.make_room(node, attr.st_size - self.tree.size_of(node),
                                         attr.st_size, exclude=inode)
            kwargs["size"] = attr.st_size
            h = self.handles.get(fh) if fh is not None else None
            if h is not None and h.fd >= 0 and h.writable:
                kwargs["fd"] = h.fd
            else:
                h = None
            of = self.open_files.get(inode)
            if of is not None and of.writers:
                self.files.writing(of, inode, h)
        attr_changes(node, attr, fields, changes, kwargs)
        await self.tree.io(functools.partial(
            self.store.setattr, path, is_link=stat.S_ISLNK(node.mode), is_dir=node.is_dir,
            **kwargs), tenant=node.tenant)
        if "size" in kwargs:
            new_size = kwargs["size"]
            node = self.index.get(inode)  # re-read: the world may have moved during the await
            old_size = self.tree.size_of(node)
            self.stats.account(self.tree.key(node), 0, new_size - old_size)
            of = self.open_files.get(inode)
            if of is not None and of.dirty:
                of.size, of.mtime_ns = new_size, now
            changes.update(size=new_size, block_hash=None, parent_hash=None)
            changes.setdefault("mtime_ns", now)
            self.residency.unblock(node)
        changes["ctime_ns"] = now
        if "atime_ns" in changes:
            self.residency.file_atimes.pop(inode, None)  # set now: an open's must not follow
        self.index.update(inode, **changes)
        return self.tree.attrs(self.index.get(inode))

    @handler
    async def readlink(self, inode: int, ctx: Any) -> bytes:
        node = self.index.get(inode)
        if node.target is None:
            raise FUSEError(errno.EINVAL)
        return node.target

    # -- directories ----------------------------------------------------------------------

    @handler
    async def opendir(self, inode: int, ctx: Any) -> int:
        if inode != VDIR and not self.index.get(inode).is_dir:
            raise FUSEError(errno.ENOTDIR)
        await self.adoption.ensure_listed(inode)
        return inode

    @handler
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        if fh == VDIR:
            return virtual.readdir(token, start_id, self.tree.info.started)
        if fh == ROOT_INODE and start_id < VDIR:
            if not pyfuse3.readdir_reply(token, VDIR_NAME, self._virtual_attrs(VDIR), VDIR):
                return
            start_id = VDIR
        while True:
            batch = self.index.children(fh, after=start_id, limit=512)
            if not batch:
                return
            for node in batch:
                if not pyfuse3.readdir_reply(token, node.name, self.tree.attrs(node), node.inode):
                    return
                self.tree.ref(node.inode)
            start_id = batch[-1].inode

    @handler
    async def releasedir(self, fh: int) -> None:
        pass

    @handler
    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        pass

    @handler
    async def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: Any
                    ) -> pyfuse3.EntryAttributes:
        await self.adoption.ensure_listed(parent_inode)
        parent = self._new_entry(parent_inode, name, is_dir=True, ctx=ctx)
        mode = stat.S_IMODE(mode) & ~ctx.umask
        if parent.mode & stat.S_ISGID:
            mode |= stat.S_ISGID
        gid = owner_gid(parent, ctx)
        path = join(self.tree.path(parent), name)
        await self.tree.io(self.store.mkdir, path, mode, ctx.uid, gid)
        tenant, ns = self.tree.child_place(parent, stat.S_IFDIR)
        node = self.index.insert(parent=parent.inode, name=name, mode=stat.S_IFDIR | mode,
                                 uid=ctx.uid, gid=gid, tenant=tenant, ns=ns)
        self.tree.dir_changed(parent.inode)
        self.tree.audit_op(ctx.uid, ctx.pid, node, "mkdir", path=path)
        if parent.inode == ROOT_INODE and self.tree.nursery is not None:  # a new tenant
            self.tree.nursery.start_soon(self.governance.ensure,
                                         name.decode(errors="surrogateescape"))
        self.tree.ref(node.inode)
        return self.tree.attrs(node)

    @handler
    async def rmdir(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        if parent_inode == ROOT_INODE and name == VDIR_NAME or parent_inode == VDIR:
            raise FUSEError(errno.EPERM)
        await self.adoption.ensure_listed(parent_inode)
        node = self.index.lookup(parent_inode, name)
        if node is None:
            raise FUSEError(errno.ENOENT)
        if not node.is_dir:
            raise FUSEError(errno.ENOTDIR)
        await self.adoption.ensure_listed(node.inode)
        if self.index.has_children(node.inode):
            raise FUSEError(errno.ENOTEMPTY)
        try:
            await self.tree.io(self.store.rmdir, self.tree.path(node))
        except FileNotFoundError:
            log.warning("%s was already gone from the backing directory", self.tree.path(node))
        self.tree.audit_op(ctx.uid, ctx.pid, node, "rmdir")
        self.tree.drop(node)

    # -- files ----------------------------------------------------------------------------

    @handler
    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: Any
                     ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        fi, attrs, backing_id = await self._create(parent_inode, name, mode, flags, ctx)
        if backing_id:
            self.tree.passthrough.arm(fi.fh, backing_id)  # last: the reply goes out next
        return fi, attrs

    async def _create(self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: Any
                      ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes, int]:
        """create, and the backing id its reply names (0: served by the daemon)."""
        if self.tree.passthrough.state == "starting":
            await self.tree.passthrough.ready.wait()  # the first creates after the mount
        await self.adoption.ensure_listed(parent_inode)
        parent = self._new_entry(parent_inode, name, is_dir=False, ctx=ctx)
        mode = self.tree.file_mode(mode, ctx.umask)
        gid = owner_gid(parent, ctx)
        path = join(self.tree.path(parent), name)
        bflags = backing_flags(flags)
        tenant, ns = self.tree.child_place(parent, stat.S_IFREG)
        writable = flags & os.O_ACCMODE != os.O_RDONLY
        # Indexed (as being written) before the backing file exists: a daemon that dies in
        # between leaves a row that the next mount removes, never a stray empty file. The
        # directory's new times go in the same commit (one index transaction per create);
        # a create that fails puts them back.
        with self.index.transaction():
            node = self.index.insert(parent=parent.inode, name=name, mode=stat.S_IFREG | mode,
                                     uid=ctx.uid, gid=gid, tenant=tenant, ns=ns, writing=1)
            stamp = self.tree.dir_changed(parent.inode)
        try:
            fd = await self.tree.io(self.store.create, path, bflags, mode, ctx.uid, gid,
                                    tenant=parent.tenant)
        except BaseException:
            with self.index.transaction():
                current = self.index.find(node.inode)
                if current is not None and current.parent != ORPHAN_PARENT:
                    self.index.delete(node.inode)
                now = self.index.find(parent.inode)
                if now is not None and now.mtime_ns == stamp:  # no other change since
                    self.index.update(parent.inode, mtime_ns=parent.mtime_ns,
                                      ctime_ns=parent.ctime_ns)
            raise
        if not writable:
            self.index.update(node.inode, writing=0)
        self.stats.account(self.tree.key(node), 1, 0)
        self.residency.add_file(node)  # no block yet
        fh = self.files.register(node, fd, writable, ctx, created=True)
        self.tree.ref(node.inode)
        fi, backing_id = self.door.reply(node, fh, flags, busy=True)
        return fi, self.tree.attrs(node), backing_id

    @handler
    async def mknod(self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx: Any
                    ) -> pyfuse3.EntryAttributes:
        if not stat.S_ISREG(mode):
            # Device nodes, FIFOs and sockets have no place in a cache.
            raise FUSEError(errno.EPERM)
        fi, attrs, _ = await self._create(parent_inode, name, mode, os.O_RDONLY, ctx)
        await self.release(fi.fh)
        return attrs

    @handler
    async def open(self, inode: int, flags: int, ctx: Any) -> pyfuse3.FileInfo:
        if inode in (VSTATS, VVERSION):
            if flags & os.O_ACCMODE != os.O_RDONLY:
                raise FUSEError(errno.EACCES)
            content = (f"{__version__}\n".encode() if inode == VVERSION else stats_json.render(
                self.tree, self.adoption, await stats_json.visible_tenants(self.tree, ctx)))
            fh = self.files.new_fh(Handle(inode, content=content))
            self.tree.passthrough.arm(fh, 0, noflush=True)  # read-only: nothing to flush
            return pyfuse3.FileInfo(fh=fh, direct_io=True, keep_cache=False)
        self.made.own(inode)  # another open: its creator's flushes are the daemon's
        node = self.index.get(inode)
        if not node.is_reg:
            raise FUSEError(errno.EISDIR if node.is_dir else errno.EINVAL)
        if inode in self.tree.evicting:
            raise FUSEError(errno.ENOENT)  # being evicted: a miss
        if node.tier:
            node = await self.promotion.fetch_to_open(node)
        writable = flags & os.O_ACCMODE != os.O_RDONLY
        truncate = writable and bool(flags & os.O_TRUNC)
        rel, bflags = self.tree.path(node), backing_flags(flags)
        if self.tree.passthrough.state == "starting":
            await self.tree.passthrough.ready.wait()  # the first opens after the mount
        # A read whose path the kernel has cached opens here, without a thread (no I/O).
        fd, ahead = (None if writable else self.store.open_cached(rel, bflags)), 0
        if fd is None:  # in a thread; a cold read asks for its data too (openfiles.open_ahead),
            # unless the kernel will read it (passthrough: its own read-ahead, or O_DIRECT)
            daemon_reads = not self.door.may_pass(inode)
            fd, ahead = await self.tree.io(open_ahead, functools.partial(
                self.store.open, rel, bflags), node.size if daemon_reads and not writable
                else 0, tenant=node.tenant)
            node = self.index.get(inode)  # re-read: the world may have moved during the await
        fh = self.files.register(node, fd, writable, ctx, ahead=ahead)
        if truncate:
            of = self.open_files[inode]
            self.files.writing(of, inode, self.handles[fh])  # marked before the file changes
            try:
                await self.tree.io(os.ftruncate, fd, 0)
            except BaseException:
                await self.release(fh)
                raise
            self.stats.account(self.tree.key(node), 0, -of.size)
            of.size, of.mtime_ns = 0, time.time_ns()
        now = time.time_ns()
        self.residency.opened(inode, now)  # the index has it with the next batch
        self.residency.record_use(node, now / 1e9)
        if not writable and node.ns:
            self.stats.by_ns[self.tree.key(node)].mount_hits += 1
        fi, backing_id = self.door.reply(node, fh, flags,
                                    busy=writable or self.open_files[inode].writers > 0)
        if backing_id and not writable:
            self.door.delegate(node)  # its next opens need not come here
        # Last: the reply goes out next. A read-only open's closes have nothing to flush.
        self.tree.passthrough.arm(fh, backing_id, noflush=not writable)
        return fi

    @handler
    async def read(self, fh: int, off: int, size: int) -> bytes:
        h = self.handles[fh]
        if h.content is not None:
            # Counted apart: "read" is what files cost (no file of .kvfs/ is passed through).
            REQUESTS["read"] -= 1
            REQUESTS["read_virtual"] += 1
            return h.content[off:off + size]
        data = self.files.read_cached(h, off, size)
        if data is None:
            data = await self.tree.io(read_disk, h, off, size)
        elif h.ahead and off == h.next_off and off + size + READ_AHEAD // 2 > h.ahead:
            # A cold sequential reader served from what was read ahead: ask for more before
            # it runs out (in a thread, not waited for), so that it never meets the disk.
            start, h.ahead = h.ahead, off + size + READ_AHEAD
            if self.tree.nursery is not None:
                self.tree.nursery.start_soon(self.tree.io, advise, h.fd, start, h.ahead - start)
        h.next_off = off + len(data)
        self.stats.read(h.key, len(data))
        h.nread += len(data)
        return data

    @handler
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        h = self.handles[fh]
        if not h.writable:
            raise FUSEError(errno.EBADF)
        of = self.open_files[h.inode]
        growth = off + len(buf) - of.size
        if growth > 0:
            try:
                await self.reclaim.make_room_for(h.key[0], growth, off + len(buf),
                                                 exclude=h.inode)
            except FUSEError:
                self.tree.refused_writeback(h.inode)  # with the write-back cache on
                raise
            # Account before the await, so that concurrent writes see each other's growth.
            self.stats.account(h.key, 0, growth)
            of.size += growth
        self.files.writing(of, h.inode, h)
        n = 0
        try:
            n = await self.tree.io(os.pwrite, h.fd, buf, off)
        finally:
            if growth > 0 and n < len(buf) and of.size == off + len(buf):
                short = min(growth, len(buf) - n)  # give back what was not written
                self.stats.account(h.key, 0, -short)
                of.size -= short
        of.mtime_ns = time.time_ns()
        self.stats.write(h.key, n)
        h.nwritten += n
        return n

    @handler
    async def flush(self, fh: int) -> None:
        h = self.handles[fh]
        self.made.own(h.inode)  # (the request thread left this flush to the daemon)
        if h.writable:
            if h.passthrough:
                self.files.observe(h.inode, h)
                await self.door.settle(h)
            self.files.flushed(h)

    @handler
    async def fsync(self, fh: int, datasync: bool) -> None:
        h = self.handles[fh]
        self.made.own(h.inode)
        if h.passthrough and h.writable:
            self.files.observe(h.inode, h)
            await self.door.settle(h)
        if h.fd >= 0:
            await self.tree.io(os.fdatasync if datasync else os.fsync, h.fd)
        if h.writable:
            self.files.persist(h.inode)

    @handler
    async def release(self, fh: int) -> None:
        h = self.handles.pop(fh)
        if h.content is not None:
            return
        self.made.released(fh, h.inode)  # (a handle the request thread gave: its fd is ours)
        if h.passthrough:
            await self.door.release(h)
        if self._closed(h):
            await self.adoption.complete(h.inode)
        if h.passthrough:
            self.door.let_go(h)
        self.tree.purge_orphan(h.inode)

    def release_settled(self, fh: int) -> None:
        """A release the request thread answered (kvfs.daemon.made): a passthrough writer it
        created, whose file it settled at the last flush, unchanged since. The file is
        checked as a block in the background (the release is answered already)."""
        h = self.handles.pop(fh, None)
        if h is None:
            return
        self.tree.passthrough.writers[h.key[0]] -= 1
        if self._closed(h):
            self.complete_later(h.inode)
        self.door.let_go(h)
        self.tree.purge_orphan(h.inode)

    def complete_later(self, inode: int) -> None:
        """Check a file as a block in the background (`adoption.complete`), unless it is
        neither named as a block nor indexed as one (an engine's temporary, any other file):
        the check would have nothing to do, and a task spawned for nothing costs more than
        this test. A later rename into a block's name is the daemon's, which checks it then."""
        node = self.index.find(inode)
        if (node is None or self.tree.nursery is None
                or (node.block_hash is None and hashing.parse_block_filename(
                    node.name.decode(errors="replace")) is None)):
            return
        self.tree.nursery.start_soon(self._complete, inode)

    async def _complete(self, inode: int) -> None:
        try:
            await self.adoption.complete(inode)
        except Exception:  # a background task: never the mount's end
            log.exception("checking inode %d as a block failed", inode)

    def _closed(self, h: Handle) -> bool:
        """A handle is released and settled: audited, its fd closed, its open file's state
        updated; whether the file is now to be checked as a block (`adoption.complete`)."""
        if self.tree.audit is not None:
            node = self.index.find(h.inode)
            if node is not None and (h.nread or h.nwritten or h.writable):
                self.tree.audit_op(h.uid, h.pid, node, "write" if h.writable else "read",
                                   nbytes=h.nwritten if h.writable else h.nread)
        if h.passthrough:
            # Never the file's last reference: its backing id holds the file until `let_go`
            # below, so the close itself is cheap, and a thread hand-off would cost more.
            os.close(h.fd)
        else:
            # Off the event loop (the last close of an unlinked file frees its blocks, and
            # ext4 starts write-back at the close of a file truncated and rewritten), not
            # waited for.
            self.tree.close_later(h.fd)
        of, changed = self.files.closed(h)
        return h.writable and of.writers == 0 and changed

    # -- names ----------------------------------------------------------------------------

    @handler
    async def unlink(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        if parent_inode in (VDIR, VSTATS, VVERSION):
            raise FUSEError(errno.EPERM)
        await self.adoption.ensure_listed(parent_inode)
        node = self.index.lookup(parent_inode, name)
        if node is None:
            raise FUSEError(errno.ENOENT)
        if node.is_dir:
            raise FUSEError(errno.EISDIR)
        rel = self.tree.path(node)
        if not node.tier:
            try:
                await self.tree.io(self.store.unlink, rel, tenant=node.tenant)
            except FileNotFoundError:
                log.warning("%s was already gone from the backing directory", rel)
        self.tree.audit_op(ctx.uid, ctx.pid, node, "unlink", nbytes=node.size, path=rel)
        self.tree.unlinked_block(node, rel)
        node = self.index.find(node.inode)
        if node is not None and node.parent != ORPHAN_PARENT:
            self.tree.drop(node)

    @handler
    async def symlink(self, parent_inode: int, name: bytes, target: bytes, ctx: Any
                      ) -> pyfuse3.EntryAttributes:
        await self.adoption.ensure_listed(parent_inode)
        parent = self._new_entry(parent_inode, name, is_dir=False, ctx=ctx)
        gid = owner_gid(parent, ctx)
        path = join(self.tree.path(parent), name)
        await self.tree.io(self.store.symlink, target, path, ctx.uid, gid)
        tenant, ns = self.tree.child_place(parent, stat.S_IFLNK)
        node = self.index.insert(parent=parent.inode, name=name, mode=stat.S_IFLNK | 0o777,
                                 uid=ctx.uid, gid=gid, size=len(target), target=target,
                                 tenant=tenant, ns=ns)
        self.tree.dir_changed(parent.inode)
        self.tree.ref(node.inode)
        return self.tree.attrs(node)

    @handler
    async def link(self, inode: int, new_parent_inode: int, new_name: bytes, ctx: Any
                   ) -> pyfuse3.EntryAttributes:
        # Hard links would give one file two tenants or two namespaces' accounting.
        raise FUSEError(errno.EPERM)

    @handler
    async def rename(self, parent_old: int, name_old: bytes, parent_new: int, name_new: bytes,
                     flags: int, ctx: Any) -> None:
        if VDIR in (parent_old, parent_new) or (
                ROOT_INODE in (parent_old, parent_new) and VDIR_NAME in (name_old, name_new)):
            raise FUSEError(errno.EPERM)
        check_name(name_new)
        await self.adoption.ensure_listed(parent_old)
        await self.adoption.ensure_listed(parent_new)
        node = self.index.lookup(parent_old, name_old)
        if node is None:
            raise FUSEError(errno.ENOENT)
        new_parent = self.index.get(parent_new)
        if not new_parent.is_dir:
            raise FUSEError(errno.ENOTDIR)
        target = self.index.lookup(parent_new, name_new)
        if target is not None and target.is_dir:
            await self.adoption.ensure_listed(target.inode)  # replaced only if empty
            target = self.index.lookup(parent_new, name_new)
        check_move(node, parent_old, new_parent, name_new)
        if flags & pyfuse3.RENAME_EXCHANGE and target is None:
            raise FUSEError(errno.ENOENT)
        if flags & pyfuse3.RENAME_NOREPLACE and target is not None:
            raise FUSEError(errno.EEXIST)
        old_path = self.tree.path(node)
        new_path = join(self.tree.path(new_parent), name_new)
        # A pinned file's new directory is marked as holding pins first (store.mark_pins).
        marks = [self.tree.path(new_parent)] if node.is_reg and node.pinned else []
        if flags & pyfuse3.RENAME_EXCHANGE and target is not None and target.is_reg and (
                target.pinned):
            marks.append(self.tree.path(self.index.get(parent_old)))

        def move() -> None:
            for rel in marks:
                self.store.mark_pins(rel)
            self.store.rename(old_path, new_path, flags)

        await self.tree.io(move)
        self.tree.audit_op(ctx.uid, ctx.pid, node, "rename", path=old_path,
                           to=new_path.decode(errors="replace"))
        # A file the request thread opens (the engines' temporary renamed into place) stays
        # its to open under the new name: its backing id is kept across the move.
        held = self.tree.passthrough.hold(node.inode)
        try:
            node, target = self.tree.moved(node.inode, parent_old, name_old, parent_new,
                                           name_new, exchange=bool(flags & pyfuse3.RENAME_EXCHANGE))
            if node.is_reg and node.inode not in self.open_files and (
                    node.block_hash is not None or hashing.parse_block_filename(
                        name_new.decode(errors="replace")) is not None):
                await self.adoption.complete(node.inode)  # renamed into (or out of) a block's name
        finally:
            if held:
                if (moved := self.index.find(node.inode)) is not None:
                    self.door.delegate(moved)
                self.tree.passthrough.release(node.inode)

    @handler
    async def getxattr(self, inode: int, name: bytes, ctx: Any) -> bytes:
        self.files.observe(inode)  # a block changed by a passthrough writer is not one
        return await self.xattrs.get(inode, name, ctx)

    @handler
    async def listxattr(self, inode: int, ctx: Any) -> list[bytes]:
        self.files.observe(inode)
        return await self.xattrs.names(inode)

    @handler
    async def setxattr(self, inode: int, name: bytes, value: bytes, ctx: Any) -> None:
        await self.xattrs.set(inode, name, value, ctx)

    @handler
    async def removexattr(self, inode: int, name: bytes, ctx: Any) -> None:
        await self.xattrs.remove(inode, name, ctx)

    # -- the filesystem as a whole --------------------------------------------------------

    @handler
    async def statfs(self, ctx: Any) -> pyfuse3.StatvfsData:
        return self.tree.statvfs(await self.tree.io(self.store.statvfs))

    @handler
    async def access(self, inode: int, mode: int, ctx: Any) -> bool:
        return True  # default_permissions: the kernel checks modes itself
