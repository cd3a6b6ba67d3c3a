"""The tree the daemon serves, and the state every daemon module shares.

`Tree` holds the index and the backing store, the paths of directories, the kernel's lookup
counts, the open files, the orphans, the usage counters, the worker threads for blocking I/O,
and the residency (kvfs.daemon.residency). The FUSE handlers (kvfs.daemon.fs), indexing
(kvfs.daemon.adoption), eviction and retention (kvfs.daemon.reclaim), promotion
(kvfs.daemon.promotion), the attributes and the control commands (kvfs.daemon.xattrs,
kvfs.daemon.commands) and stats.json (kvfs.daemon.stats_json) all work on one Tree.

Concurrency: everything here runs on the trio event loop, in one thread; only `io` hands
blocking work to worker threads (and `close_later` closes to the closer's), and those never
touch this state. Statements between two
awaits are atomic for the other tasks: no lock guards any of it. Who changes what:
- `lookups`: the FUSE handlers that return entries (lookup, create, mkdir, symlink, readdir)
  and `forget`.
- `open_files`: open, create, write, setattr, flush, release (kvfs.daemon.fs); read by eviction
  (never evicts an open file) and by the accounting (`size_of`).
- `orphans`: `drop` (any task that removes a name) adds; `purge_orphan` (forget, release).
- `evicting`: kvfs.daemon.reclaim's `remove_files`, for the duration of one unlink batch; `open`
  refuses those inodes (a miss) and residency never chooses them again.
- `stats`: every task that changes a file's size or presence; counters also by the control
  commands.
- `_dir_paths`: filled by `dir_path`, emptied by a rename of a directory (`forget_dir_paths`).
- `serving`, `nursery`: set once by `Operations.run_background` (the daemon's nursery, in
  which handlers start work they do not wait for).
- `writeback_cache`, `keep_cache`: the mount's kernel-cache options (kvfs.daemon.settings), set once
  by `Operations` before the mount; read by `file_cache` and `refused_writeback`.
- `passthrough`: whether the kernel reads and writes open files itself, and their backing
  ids (kvfs.daemon.passthrough): set up by kvfs.daemon.mount, used by open, create, flush and
  release.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pyfuse3
import trio
from pyfuse3 import FUSEError

from ..format.layout import TENANT_NAME
from ..models.policy import DEFAULT_POLICY
from . import virtual
from .audit import Audit
from .capacity import Budget
from .closer import closer
from .index import ORPHAN_PARENT, ROOT_INODE, Index, Node
from .openfiles import OpenFile
from .passthrough import Passthrough
from .residency import Residency
from .settings import DEFAULTS
from .stats import Key, Stats
from .store import BackingStore
from .tiers.mover import Tiering

log = logging.getLogger(__name__)


def drop_pages(inode: int) -> None:
    """Thread: drop the kernel's cached pages of `inode`. The kernel may have forgotten the
    inode already (its last close came first: ENOENT), which leaves nothing to drop; no error
    of this notification may escape into the daemon's task group."""
    try:
        pyfuse3.invalidate_inode(inode, False)
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            log.warning("could not drop the kernel's pages of inode %d: %s", inode, exc)

async def _acquire(limiter: trio.CapacityLimiter) -> None:
    try:
        limiter.acquire_nowait()  # the common case: no extra trip through the scheduler
    except trio.WouldBlock:
        await limiter.acquire()


def _not_cancellable(_: Any) -> trio.lowlevel.Abort:
    return trio.lowlevel.Abort.FAILED


@trio.lowlevel.enable_ki_protection
async def in_thread(fn: Callable[[], T]) -> T:
    """`fn()` in one of trio's cached worker threads; the calling task waits for it, and a
    cancellation waits for it too (as `trio.to_thread.run_sync` does by default). The same
    hand-off as `to_thread.run_sync` without what the daemon never uses there (a thread
    name set and reset per call, a copied context, calls from the thread back into trio):
    ~70-85 us of CPU per call against ~100-135 on the 2-core VM."""
    await trio.lowlevel.checkpoint_if_cancelled()
    token = trio.lowlevel.current_trio_token()
    task = trio.lowlevel.current_task()

    def deliver(result: Any) -> None:  # (in the worker thread)
        with contextlib.suppress(trio.RunFinishedError):
            token.run_sync_soon(trio.lowlevel.reschedule, task, result)

    trio.lowlevel.start_thread_soon(fn, deliver)
    return await trio.lowlevel.wait_task_rescheduled(_not_cancellable)  # type: ignore[no-any-return]


#: How long the kernel may cache names and attributes. The daemon is the only writer of the
#: namespace; changes it makes on its own (eviction) invalidate the kernel's entries.
ENTRY_TIMEOUT = 10.0
BLKSIZE = 128 * 1024  # st_blksize: the size of one FUSE read request
NAME_MAX = 255
#: The mode bits a regular file in kvfs never has: set-user-ID and set-group-ID. The kernel
#: leaves clearing them on a write, truncate or chown to the daemon (the INIT reply's
#: FUSE_HANDLE_KILLPRIV_V2, kvfs.daemon._passthrough), and a passthrough write never reaches
#: the daemon; with none to clear, a write asks nothing (docs/architecture.md, "The mount
#: door"). Dropped where a file is created or changes mode, and never shown to the kernel (a
#: file found in the backing tree with them keeps them there, unused: the mount is nosuid).
FILE_SXID = stat.S_ISUID | stat.S_ISGID

T = TypeVar("T")


@dataclass
class MountInfo:
    """What the daemon knows about itself, for `.kvfs/stats.json`."""

    mountpoint: str
    backing: str
    capacity: int | None
    policy: str = DEFAULT_POLICY
    high_watermark: float = DEFAULTS["high_watermark"]
    low_watermark: float = DEFAULTS["low_watermark"]
    #: Seconds between retention scans.
    scan_interval: float = DEFAULTS["scan_interval"]
    #: Files whose eviction state the policies keep in memory, all tenants together; the
    #: rest wait in the index in access order and are evicted first (bounded memory).
    policy_entries: int = DEFAULTS["policy_entries"]
    #: How clients store the blocks they save in the hot tier (kvfs.format.codec.NAMES).
    hot_codec: str = DEFAULTS["hot_codec"]
    #: Clients seal the blocks they save in the hot tier (kvfs.format.seal).
    hot_encrypt: bool = DEFAULTS["hot_encrypt"]
    #: What the mount did with the host's fuse.wake_here (kvfs.daemon.wakeup.apply).
    wake: str = ""
    pid: int = field(default_factory=os.getpid)
    started: float = field(default_factory=time.time)


def join(dirpath: bytes, name: bytes) -> bytes:
    return dirpath + b"/" + name if dirpath else name


def check_name(name: bytes) -> None:
    """A name a new entry may have (ENAMETOOLONG, EINVAL otherwise)."""
    if len(name) > NAME_MAX:
        raise FUSEError(errno.ENAMETOOLONG)
    if name in (b"", b".", b"..") or b"/" in name or b"\0" in name:
        raise FUSEError(errno.EINVAL)


def check_move(node: Node, parent_old: int, new_parent: Node, name_new: bytes) -> None:
    """Where a rename may put a node: tenants stay at the top (under a tenant's name),
    everything else below a tenant, and in its own tenant (EINVAL, EPERM, EXDEV)."""
    at_top = (parent_old == ROOT_INODE, new_parent.inode == ROOT_INODE)
    if at_top == (True, True):
        if not TENANT_NAME.match(name_new):
            raise FUSEError(errno.EINVAL)
    elif any(at_top):
        raise FUSEError(errno.EPERM)  # files and namespaces live below a tenant
    elif node.tenant != new_parent.tenant:
        raise FUSEError(errno.EXDEV)  # tenants share nothing; mv copies instead


def attr_changes(node: Node, attr: pyfuse3.EntryAttributes, fields: pyfuse3.SetattrFields,
                 changes: dict[str, Any], kwargs: dict[str, Any]) -> None:
    """setattr's mode, owner and times: into `changes` (for the index) and `kwargs` (for
    BackingStore.setattr)."""
    if fields.update_mode:
        mode = stat.S_IMODE(attr.st_mode) & (~0 if node.is_dir else ~FILE_SXID)
        changes["mode"] = stat.S_IFMT(node.mode) | mode
        kwargs["mode"] = mode
    if fields.update_uid:
        changes["uid"] = kwargs["uid"] = attr.st_uid
    if fields.update_gid:
        changes["gid"] = kwargs["gid"] = attr.st_gid
    if fields.update_atime or fields.update_mtime:
        atime = attr.st_atime_ns if fields.update_atime else node.atime_ns
        mtime = attr.st_mtime_ns if fields.update_mtime else node.mtime_ns
        changes["atime_ns"], changes["mtime_ns"] = atime, mtime
        kwargs["times_ns"] = (atime, mtime)


def owner_gid(parent: Node, ctx: Any) -> int:
    """The group of a new entry: its directory's if that is set-group-ID, else the caller's."""
    return parent.gid if parent.mode & stat.S_ISGID else ctx.gid



class InUse:
    """The inodes open through the mount, never chosen for eviction or retention: those the
    daemon's handles hold and those the request thread opened (kvfs.daemon.passthrough)."""

    def __init__(self, open_files: dict[int, OpenFile], passthrough: Passthrough) -> None:
        self.open_files = open_files
        self.passthrough = passthrough

    def __contains__(self, inode: object) -> bool:
        return inode in self.open_files or (
            isinstance(inode, int) and self.passthrough.thread_opens(inode) > 0)

class Tree:
    """The shared state of one mount (see the module docstring for who changes what)."""

    def __init__(self, index: Index, store: BackingStore, info: MountInfo, *,
                 owner_uid: int = 0, io_threads: int = DEFAULTS["io_threads"],
                 tiering: Tiering | None = None, audit: Audit | None = None,
                 writeback_cache: bool = DEFAULTS["writeback_cache"],
                 keep_cache: bool = DEFAULTS["keep_cache"],
                 passthrough: bool = DEFAULTS["passthrough"]) -> None:
        self.index = index
        self.passthrough = Passthrough(wanted=passthrough)
        index.changed = self.passthrough.revoke  # nothing changes under the request thread
        index.gone = self.passthrough.take_dir
        self.writeback_cache = writeback_cache
        self.keep_cache = keep_cache
        self.store = store
        self.info = info
        self.owner_uid = owner_uid
        self.tiering = tiering
        self.audit = audit
        self.limiter = trio.CapacityLimiter(io_threads)
        # One tenant's backing I/O may take at most this many of the threads: a tenant whose
        # tree makes calls slow slows itself, never the others (see io).
        self._tenant_threads = max(1, io_threads - max(1, io_threads // 4))
        self._tenant_limiters: dict[int, trio.CapacityLimiter] = {}
        self.stats = Stats()
        self.stats.reset_usage(index.usage_by_namespace())
        self.lookups: dict[int, int] = {}
        self.passthrough.kernel_lookups = self.lookups  # its thread answers LOOKUPs too
        self.open_files: dict[int, OpenFile] = {}
        self.orphans: set[int] = set()  # unlinked inodes the kernel or an open file still holds
        self.evicting: set[int] = set()
        self._dir_paths: dict[int, bytes] = {ROOT_INODE: b""}
        self.serving = False  # the kernel connection is up (set once the session runs)
        self.nursery: trio.Nursery | None = None
        # Counts the opens the request thread answered (kvfs.daemon.door `Door.collect`, set
        # by the door): before usage, hits or access times are read.
        self.collect_opens: Callable[[], None] = lambda: None
        #: Placements, keys, forgetting (kvfs.daemon.governance; set by Operations).
        self.governance: Any = None
        self.in_use = InUse(self.open_files, self.passthrough)
        self.residency = Residency(
            index, self.stats, Budget(info.capacity, info.high_watermark, info.low_watermark),
            policy=info.policy, entries_limit=info.policy_entries,
            open_files=self.in_use, evicting=self.evicting)

    async def io(self, fn: Callable[..., T], *args: Any, tenant: int = 0) -> T:
        """Run blocking backing I/O in a worker thread. Work on a tenant's tree (`tenant`)
        first takes a place in that tenant's own limiter, so that it can never hold every
        thread of the global one."""
        limiter = None
        if tenant:
            limiter = self._tenant_limiters.get(tenant)
            if limiter is None:
                limiter = self._tenant_limiters[tenant] = trio.CapacityLimiter(
                    self._tenant_threads)
            await _acquire(limiter)
        try:
            await _acquire(self.limiter)
            try:
                return await in_thread(functools.partial(fn, *args) if args else fn)
            finally:
                self.limiter.release()
        finally:
            if limiter is not None:
                limiter.release()

    @staticmethod
    def close_later(fd: int) -> None:
        """Close a handle's backing fd off the event loop, without waiting for it
        (`kvfs.daemon.closer`)."""
        closer.close(fd)

    # -- paths ----------------------------------------------------------------------------

    def dir_path(self, inode: int) -> bytes:
        path = self._dir_paths.get(inode)
        if path is None:
            node = self.index.get(inode)
            if node.parent == ORPHAN_PARENT:
                raise FUSEError(errno.ENOENT)
            path = join(self.dir_path(node.parent), node.name)
            self._dir_paths[inode] = path
        return path

    def path(self, node: Node) -> bytes:
        """A node's path relative to the backing root (ENOENT for an orphan)."""
        if node.inode == ROOT_INODE:
            return b""
        if node.parent == ORPHAN_PARENT:
            raise FUSEError(errno.ENOENT)
        return join(self.dir_path(node.parent), node.name)

    def forget_dir_paths(self) -> None:
        self._dir_paths = {ROOT_INODE: b""}

    def check_parent(self, parent_inode: int, *, is_dir: bool, name: bytes, uid: int) -> Node:
        """The directory a new entry `name` goes into, checked: never `.kvfs/`; at the top,
        tenant directories only, made by root or the mount's owner, with a tenant's name."""
        if parent_inode in virtual.INODES:
            raise FUSEError(errno.EPERM)
        check_name(name)
        parent = self.index.get(parent_inode)
        if not parent.is_dir:
            raise FUSEError(errno.ENOTDIR)
        if parent.inode == ROOT_INODE:
            if not is_dir:
                raise FUSEError(errno.EPERM)
            if uid not in (0, self.owner_uid):
                raise FUSEError(errno.EACCES)
            if not TENANT_NAME.match(name):
                log.warning("refused tenant name %r: use letters, digits, _ . @ -", name)
                raise FUSEError(errno.EINVAL)
        return parent

    # -- what the kernel sees -------------------------------------------------------------

    def ref(self, inode: int) -> None:
        """The kernel now holds one more lookup of `inode` (released by forget)."""
        self.lookups[inode] = self.lookups.get(inode, 0) + 1

    def size_of(self, node: Node) -> int:
        """The size the usage counters hold for `node` (a passthrough writer's growth since
        its last flush is not in it yet: `attrs` shows the file as it is)."""
        of = self.open_files.get(node.inode)
        return of.size if of is not None and of.dirty else node.size

    @staticmethod
    def file_mode(mode: int, umask: int) -> int:
        """A new file's permission bits: the caller's umask applied, FILE_SXID dropped."""
        return stat.S_IMODE(mode) & ~umask & ~FILE_SXID

    def attrs(self, node: Node) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = node.inode
        a.generation = 0
        a.entry_timeout = ENTRY_TIMEOUT
        a.attr_timeout = ENTRY_TIMEOUT
        a.st_mode = node.mode if node.is_dir else node.mode & ~FILE_SXID
        if node.parent == ORPHAN_PARENT:
            a.st_nlink = 0  # unlinked, still open (or still known to the kernel)
        elif node.is_dir:
            # 2 + subdirectories, as POSIX tools (find) expect; the root also holds .kvfs/.
            a.st_nlink = 2 + self.index.subdirs(node.inode) + (node.inode == ROOT_INODE)
        else:
            a.st_nlink = 1
        a.st_uid = node.uid
        a.st_gid = node.gid
        a.st_rdev = 0
        size, mtime = node.size, node.mtime_ns
        of = self.open_files.get(node.inode)
        if of is not None and of.dirty:
            size, mtime = of.size, of.mtime_ns
            if of.pt_fds:  # written by the kernel: as the backing file is now (no disk I/O)
                st = os.fstat(of.pt_fds[0])
                size, mtime = st.st_size, st.st_mtime_ns
        a.st_size = size
        a.st_blksize = BLKSIZE
        # Blocks that live only in a lower tier take no local space: du shows the hot tier.
        a.st_blocks = 8 if node.is_dir else 0 if node.tier else -(-size // 4096) * 8
        a.st_atime_ns = self.residency.atime(node.inode, node.atime_ns)
        a.st_mtime_ns = mtime
        a.st_ctime_ns = node.ctime_ns
        return a

    def invalidate(self, node: Node) -> None:
        """Tell the kernel a name the daemon removed on its own is gone (once serving: before
        the connection is up there is nothing to tell, and the call would fail)."""
        if self.serving:
            pyfuse3.invalidate_entry_async(node.parent, node.name, ignore_enoent=True)

    def file_cache(self, node: Node, flags: int, writable: bool, *, busy: bool
                   ) -> tuple[bool, bool]:
        """An open's (direct_io, keep_cache). A writer in a tenant with a quota writes
        through, bypassing the write-back cache: the kernel reports a refused write-back as
        EIO at close, and EDQUOT must reach the writer. Readers keep the page cache of a file
        nobody writes (`busy`: someone does), unless the mount says otherwise."""
        limits = self.residency.limits.get(node.tenant)
        exact = (self.writeback_cache and writable and limits is not None
                 and limits.quota is not None)
        return bool(flags & os.O_DIRECT) or exact, self.keep_cache and not busy

    def refused_writeback(self, inode: int) -> None:
        """A write refused (no room) with the write-back cache on: the writer hears it at
        close (ENOSPC) or fsync. The kernel trusts its own size of a file it caches: dropping
        the name makes it forget the inode (size and pages) at the last close, so that the
        next open sees what was kept, never bytes that were not."""
        node = self.index.find(inode)
        if not (self.writeback_cache and self.serving and node is not None):
            return
        pyfuse3.invalidate_entry_async(node.parent, node.name, ignore_enoent=True)
        if self.nursery is not None:  # and its pages, once this reply is sent
            self.nursery.start_soon(functools.partial(
                trio.to_thread.run_sync, drop_pages, inode, abandon_on_cancel=True))

    # -- tenants and namespaces -----------------------------------------------------------

    @staticmethod
    def key(node: Node) -> Key:
        """The usage counters' key of a node: (tenant, namespace)."""
        return (node.tenant, node.ns)

    @staticmethod
    def child_place(parent: Node, mode: int) -> tuple[int, int]:
        """(tenant, ns) a new child of `parent` will have; 0s are filled in by the index."""
        if parent.inode == ROOT_INODE:
            return 0, 0
        if parent.inode == parent.tenant:  # a child of a tenant directory
            return parent.tenant, 0
        return parent.tenant, parent.ns

    def replace_place(self, node: Node, new_parent: Node) -> None:
        """After a move: give a subtree the tenant and namespace of its new place."""
        if new_parent.inode == ROOT_INODE:
            return  # a renamed tenant keeps its inode, hence its place
        tenant, ns = self.child_place(new_parent, node.mode)
        if node.is_dir and ns == 0:
            ns = node.inode  # a directory directly in a tenant is a namespace
        if (tenant, ns) == (node.tenant, node.ns):
            return
        self.index.reassign_subtree(node.inode, tenant, ns)
        self.stats.reset_usage(self.index.usage_by_namespace())
        self.residency.load(tenant)  # block keys carry their namespace

    def moved(self, inode: int, parent_old: int, name_old: bytes, parent_new: int,
              name_new: bytes, *, exchange: bool) -> tuple[Node, Node | None]:
        """After a rename in the backing tree: the same in the index (the moved node and its
        subtree's place; the replaced target dropped, or put at the old name on an exchange).
        Returns the node and the target, as they were before the move."""
        # Re-read everything: other requests may have run during the rename's await.
        node = self.index.get(inode)
        new_parent = self.index.get(parent_new)
        target = self.index.lookup(parent_new, name_new)
        with self.index.transaction():
            if exchange and target is not None:
                old_parent = self.index.get(parent_old)
                self.index.move(target.inode, ORPHAN_PARENT, b"#x%d" % target.inode)
                self.index.move(node.inode, parent_new, name_new)
                self.index.move(target.inode, parent_old, name_old)
                self.replace_place(target, old_parent)
            else:
                if target is not None and target.inode != node.inode:
                    self.drop(target)
                self.index.move(node.inode, parent_new, name_new)
            self.replace_place(node, new_parent)
            self.dir_changed(parent_old, parent_new)
            self.index.update(node.inode, ctime_ns=time.time_ns())
        if node.is_dir or (target is not None and target.is_dir):
            self.forget_dir_paths()
        return node, target

    def statvfs(self, st: os.statvfs_result) -> pyfuse3.StatvfsData:
        """statfs: the backing file system's figures, within the capacity when there is one."""
        out = pyfuse3.StatvfsData()
        bs = 4096
        out.f_bsize = out.f_frsize = bs
        avail = st.f_bavail * st.f_frsize
        cap = self.info.capacity
        if cap is not None:
            out.f_blocks = cap // bs
            avail = min(avail, max(cap - self.stats.used_bytes, 0))
        else:
            out.f_blocks = st.f_blocks * st.f_frsize // bs
        out.f_bfree = out.f_bavail = avail // bs
        out.f_files = st.f_files
        out.f_ffree = out.f_favail = st.f_favail
        out.f_namemax = NAME_MAX
        return out

    def names_of(self, inodes: set[int]) -> dict[int, str]:
        out = {}
        for inode in inodes:
            node = self.index.find(inode)
            if node is not None:
                out[inode] = node.name.decode(errors="replace")
        return out

    def audit_op(self, uid: int, pid: int, node: Node, op: str, *, blocks: int = 0,
                 nbytes: int = 0, path: bytes | None = None, **extra: Any) -> None:
        """One audit record, when the audit log is on."""
        if self.audit is None:
            return
        names = self.names_of({node.tenant, node.ns} - {0})
        try:
            shown = (path if path is not None else self.path(node)).decode(errors="replace")
        except FUSEError:
            shown = node.name.decode(errors="replace")
        self.audit.record(uid=uid, pid=pid, tenant=names.get(node.tenant, ""),
                          model=names.get(node.ns, ""), op=op, path=shown, blocks=blocks,
                          nbytes=nbytes, **extra)

    # -- removing names -------------------------------------------------------------------

    def unaccount(self, node: Node) -> None:
        """Take a file's hot copy out of the accounting and the eviction policy."""
        if node.is_reg and not node.tier:
            self.residency.forget_file(node)
            self.stats.account(self.key(node), -1, -self.size_of(node))

    def dir_changed(self, *inodes: int, now: int | None = None) -> int:
        """Entries were added to, removed from or renamed in these directories: their mtime
        and ctime are now (or `now`), as the backing directories' are. Returns that time."""
        now = time.time_ns() if now is None else now
        changed = {i for i in inodes if i != ORPHAN_PARENT}
        self.index.set_times(changed, now)
        if self.passthrough.routed:  # their new attributes, for the request thread to answer
            for i in changed:
                if (node := self.index.find(i)) is not None:
                    self.passthrough.put_attrs(i, self.attrs(node))
        return now

    def drop(self, node: Node) -> None:
        """Remove a node from the namespace (after its backing entry is gone)."""
        self.unaccount(node)
        if node.is_dir:
            self._dir_paths.pop(node.inode, None)
            if node.inode == node.tenant:
                self.stats.drop_tenant(node.inode)
            elif node.inode == node.ns:
                self.stats.fold_namespace(node.tenant, node.inode)
        if self.lookups.get(node.inode) or node.inode in self.open_files:
            self.index.orphan(node.inode, node.parent)
            self.orphans.add(node.inode)
        else:
            self.index.delete(node.inode)
        self.dir_changed(node.parent)  # last: its attributes as they now are

    def purge_orphan(self, inode: int) -> None:
        """Delete an orphan's row once neither the kernel nor an open file refers to it."""
        if inode in self.orphans and not self.lookups.get(inode) and inode not in self.open_files:
            self.orphans.discard(inode)
            self.index.delete(inode)

    # -- the lower tiers' view of a hot file ----------------------------------------------

    @staticmethod
    def tier_key(rel: bytes) -> str:
        """A block's key in the lower tiers: its path in the index (the tenant's name, the
        namespace's, the block's), never anything read from the backing tree."""
        return rel.decode(errors="surrogateescape")

    def block_source(self, rel: bytes) -> Callable[[], bytes | bytearray]:
        """What an upload or demotion reads: the block's bytes from a verified fd of the
        hot copy, bounded by its header (never another file through a tenant's link)."""
        return functools.partial(self.store.read_block, rel)

    def unlinked_block(self, node: Node, rel: bytes) -> None:
        """A block was unlinked: this host's lower-tier copy goes too; the shared tier's
        stays (other hosts may be using it): its bucket's lifecycle rules expire it."""
        if node.block_hash is not None and self.tiering is not None and self.nursery:
            self.nursery.start_soon(self.tiering.delete, self.tier_key(rel), False)

    def publish_shared(self, node: Node) -> None:
        """Write-through: queue a complete block for the shared tiers (never waits)."""
        if self.tiering is not None:
            rel = self.path(node)
            self.tiering.enqueue_upload(self.tier_key(rel), self.block_source(rel))
