"""The pyfuse3 Operations: translation between FUSE requests, the index and the backing store.

Handlers are thin: check arguments, update the index (synchronously, on the event-loop
thread), do blocking backing-store I/O through `trio.to_thread.run_sync` under a capacity
limiter, map failures to errno. No exception escapes a handler: pyfuse3 would end the session
for every client. Expected failures are `FUSEError(errno)`; anything else is logged with its
traceback and becomes EIO.

Only the mount entry point (`kvfs.mount`) imports this module.
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
import re
import sqlite3
import stat
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pyfuse3
import trio
from pyfuse3 import FUSEError

from . import __version__, blockfile, control, fsck, hashing
from .audit import Audit
from .capacity import UNLIMITED, Budget, Limits, fair_shares, quota_overflow, room_order
from .index import ORPHAN_PARENT, ROOT_INODE, Index, Node, NoSuchNode
from .layout import MANIFEST, STATE_DIR
from .policy import DEFAULT_POLICY, Policy, policy_by_name
from .stats import Key, Stats
from .store import BackingStore
from .tiers.mover import Tiering

log = logging.getLogger(__name__)

NAME_MAX = 255
#: Tenant names: what a user name or a DNS label may be; never starts with a dot.
TENANT_RE = re.compile(rb"^[A-Za-z0-9_][A-Za-z0-9_.@-]{0,63}$")
#: How long the kernel may cache names and attributes. The daemon is the only writer of the
#: namespace; changes it makes on its own (eviction) invalidate the kernel's entries.
ENTRY_TIMEOUT = 10.0
BLKSIZE = 128 * 1024  # st_blksize: the size of one FUSE read request
#: Seconds between writes of the access times the kvfs client reports.
ATIME_FLUSH_INTERVAL = 1.0
#: Seconds within which repeated lookups of one missing name count as one miss.
MISS_WINDOW = 60.0
#: A create this soon after the one failed lookup of its name is a creation, not a miss.
CREATE_WINDOW = 2.0

# Virtual nodes, in the reserved inode range below index.FIRST_REAL_INODE.
VDIR = 2
VSTATS = 3
VVERSION = 4
VDIR_NAME = STATE_DIR
VFILES = {b"stats.json": VSTATS, b"version": VVERSION}


T = TypeVar("T")


def handler(fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """Map every failure of a handler to a FUSEError; never let one escape."""

    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> T:
        try:
            return await fn(*args, **kwargs)
        except FUSEError:
            raise
        except NoSuchNode:
            raise FUSEError(errno.ENOENT) from None
        except OSError as exc:
            if exc.errno is None:
                log.exception("%s failed", fn.__name__)
                raise FUSEError(errno.EIO) from None
            raise FUSEError(exc.errno) from None
        except Exception:
            log.exception("unexpected error in %s", fn.__name__)
            raise FUSEError(errno.EIO) from None

    return wrapper


def _check_name(name: bytes) -> None:
    if len(name) > NAME_MAX:
        raise FUSEError(errno.ENAMETOOLONG)
    if name in (b"", b".", b"..") or b"/" in name or b"\0" in name:
        raise FUSEError(errno.EINVAL)




@dataclass(slots=True)
class OpenFile:
    """State of an inode that has open handles."""

    handles: int = 0
    writers: int = 0
    written: bool = False  # marked `writing`: changed through a descriptor not closed yet
    pending: int = 0  # handles that changed it since their last flush
    unowned: bool = False  # changed by a request of no handle (truncate by path): until the end
    changed: bool = False  # changed since its first writer opened it: checked at the last close
    size: int = 0
    mtime_ns: int = 0
    dirty: bool = False


@dataclass(slots=True)
class Handle:
    inode: int
    fd: int = -1
    writable: bool = False
    key: Key = (0, 0)
    content: bytes | None = None  # virtual files: a snapshot taken at open
    uid: int = 0  # who opened it (for the audit log)
    pid: int = 0
    nread: int = 0
    nwritten: int = 0
    next_off: int = 0  # where a sequential reader reads next
    written: bool = False  # changed the file since its last flush
    ahead: int = 0  # how far the kernel has been asked to read ahead in the backing file


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


@dataclass
class MountInfo:
    """What the daemon knows about itself, for `.kvfs/stats.json`."""

    mountpoint: str
    backing: str
    capacity: int | None
    policy: str = DEFAULT_POLICY
    high_watermark: float = 0.95
    low_watermark: float = 0.90
    #: Seconds between retention scans.
    scan_interval: float = 60.0
    #: Files whose eviction state the policies keep in memory, all tenants together; the
    #: rest wait in the index in access order and are evicted first (bounded memory).
    policy_entries: int = 131072
    pid: int = field(default_factory=os.getpid)
    started: float = field(default_factory=time.time)


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
        io_threads: int = 32,
        tiering: Tiering | None = None,
        audit: Audit | None = None,
    ) -> None:
        super().__init__()
        self.index = index
        self.store = store
        self.info = info
        self.owner_uid = owner_uid
        self.limiter = trio.CapacityLimiter(io_threads)
        # One tenant's backing I/O may take at most this many of the threads: a tenant whose
        # tree makes calls slow slows itself, never the others (see _io).
        self._tenant_threads = max(1, io_threads - max(1, io_threads // 4))
        self._tenant_limiters: dict[int, trio.CapacityLimiter] = {}
        self.stats = Stats()
        self.stats.reset_usage(index.usage_by_namespace())
        self.lookups: dict[int, int] = {}
        self.open_files: dict[int, OpenFile] = {}
        self.handles: dict[int, Handle] = {}
        self._next_fh = 1
        self._dir_paths: dict[int, bytes] = {ROOT_INODE: b""}
        self.budget = Budget(info.capacity, info.high_watermark, info.low_watermark)
        self.limits: dict[int, Limits] = {}
        self.policies: dict[int, Policy] = {}
        self.evicting: set[int] = set()
        self._cold_floor: dict[int, int] = {}  # tenant -> cold files a scan could not evict
        self.orphans: set[int] = set()  # unlinked inodes the kernel or an open file still holds
        self._atimes: dict[tuple[int, bytes], int] = {}  # (ns, hash) -> atime, not yet written
        self.serving = False  # the kernel connection is up (set once the session runs)
        self._evict_wanted: trio.Event | None = None
        self.tiering = tiering
        self.audit = audit
        # (parent, name) of recent failed lookups -> [first seen, lookups since]
        self._recent_misses: OrderedDict[tuple[int, bytes], list[float]] = OrderedDict()
        self._nursery: trio.Nursery | None = None
        # Directories of an adopted tree whose entries are not indexed yet (see _listed).
        self.unlisted: set[int] = set(index.unlisted())
        self._to_list: deque[int] = deque(sorted(self.unlisted))
        self._listing: dict[int, trio.Event] = {}
        self._inserting: set[int] = set()  # listings past their read, writing the index
        self.reconciler = fsck.Reconciler(index, store, verify=False, progress=None)
        # Temporaries older than this were left before this mount: a listing removes them.
        self._started_ns = time.time_ns()
        self._load_policies()

    # -- background work ------------------------------------------------------------------

    def _policy(self, tenant: int) -> Policy:
        p = self.policies.get(tenant)
        if p is None:
            p = self.policies[tenant] = policy_by_name(self.info.policy)
        return p

    @staticmethod
    def _pkey(node: Node) -> Hashable:
        """A file's key in its tenant's policy: (namespace, hash) for a complete block, so
        that a block cached again is known again (ghosts, admission); else its inode."""
        return (node.ns, node.block_hash) if node.block_hash is not None else node.inode

    @staticmethod
    def _parent_key(node: Node) -> Hashable | None:
        p = node.parent_hash
        return (node.ns, p) if p is not None and p != hashing.ROOT_PARENT else None

    def _inode_of(self, key: Hashable) -> int | None:
        if isinstance(key, int):
            return key
        found = self.index.find_block(*key)  # type: ignore[misc]
        return found.inode if found is not None else None

    def _load_policies(self, tenant: int | None = None) -> None:
        """Rebuild the eviction policies' state from the index, oldest access first (of one
        tenant, after a move that changed its files' keys; of all, at mount). Only the most
        recently used `policy_entries` files enter memory: the others are cold (see
        `_cold_victims`)."""
        if tenant is not None:
            self.policies.pop(tenant, None)
        for node in self.index.cached_files(self.info.policy_entries, tenant):
            self._enter(node)
        self._bound()

    def _enter(self, node: Node, now: float = 0.0) -> None:
        """Give a hot file an entry in its tenant's policy (at mount, or when a cold one is
        used again)."""
        p = self._policy(node.tenant)
        key = self._pkey(node)
        p.insert(key, node.size, parent=self._parent_key(node), now=now)
        if node.pinned:
            p.pin(key, True)

    def _bound(self) -> None:
        """Keep the policies' entries, all tenants together, under `policy_entries`: past it,
        the largest policy gives up its best victims (plus a sixty-fourth of the limit, so
        that this runs rarely). Their files stay cached, cold: known to the index only, and
        evicted first, oldest access first."""
        limit = self.info.policy_entries
        total = sum(len(p) for p in self.policies.values())
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

    @staticmethod
    def _is_manifest(node: Node) -> bool:
        """A namespace's manifest (the spec its blocks were written for): a few hundred bytes
        that capacity eviction leaves alone (retention still ages it out with its blocks)."""
        return node.parent == node.ns and node.name == MANIFEST

    def _cold(self, tenant: int) -> int:
        """How many of a tenant's hot files have no entry in its policy."""
        p = self.policies.get(tenant)
        return self.stats.tenant_files(tenant) - (len(p) if p is not None else 0)

    def _cold_victims(self, tenant: int, need: int, plan: Plan, cold: int,
                      limit: int = UNLIMITED) -> int:
        """Choose cold files of a tenant, least recently accessed first, until `need` bytes
        (and no more than `limit`); returns the bytes chosen. Files the policy holds are
        skipped: it orders those. A scan that runs out remembers how many cold files it could
        not take (`_cold_floor`), so that the next eviction does not scan the tenant's files
        again for nothing."""
        policy = self.policies.get(tenant)
        freed, after, taken = 0, (-1, 0), 0
        while freed < need:
            rows = self.index.coldest(tenant, after, 256)
            if not rows:
                self._cold_floor[tenant] = cold - taken
                break
            for node in rows:
                after = (node.atime_ns, node.inode)
                if (node.inode in self.open_files or node.inode in self.evicting
                        or node.inode in plan.skip or self._is_manifest(node)
                        or (policy is not None and self._pkey(node) in policy)):
                    continue
                if freed + node.size > limit:
                    return freed
                plan.take(node)
                taken += 1
                freed += node.size
                if freed >= need:
                    break
        return freed

    def load_limits(self) -> None:
        """Read every tenant's limits from its backing directory (blocking: before serving)."""
        for t in self.index.tenants():
            self.limits[t.inode] = self.store.read_limits(t.name)

    async def settle(self) -> None:
        """Before serving: a hot tier found above its high watermark (blocks placed just
        before a crash, a capacity lowered between mounts) is evicted down to the low one."""
        need = self.budget.excess(self.stats.used_bytes)
        if need:
            freed = await self.evict(need)
            log.info("over capacity at mount: evicted %d bytes", freed)

    async def run_background(self) -> None:
        """The daemon's own tasks: eviction above the high watermark, retention."""
        self._evict_wanted = trio.Event()
        self.serving = True
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._evict_loop)
            nursery.start_soon(self._retention_loop)
            nursery.start_soon(self._atime_loop)
            nursery.start_soon(self._index_loop)
            if self.tiering is not None:
                nursery.start_soon(self.tiering.run)

    # -- indexing an adopted tree ------------------------------------------------------------

    async def _listed(self, inode: int) -> None:
        """Make sure the index holds a directory's entries. A tree adopted at its first mount
        is indexed a directory at a time: here, when a request first needs one whole
        (readdir, every change to it, a control command), and in the background. A request
        that needs a directory being listed waits for that listing (a lookup only for its
        last part, when it writes the index: see `_named`)."""
        while inode in self.unlisted:
            busy = self._listing.get(inode)
            if busy is not None:
                await busy.wait()
                continue
            done = self._listing[inode] = trio.Event()
            try:
                await self._list_dir(inode)
            finally:
                del self._listing[inode]
                done.set()

    #: Entries indexed per transaction; requests are served between two.
    LIST_CHUNK = 1024

    async def _list_dir(self, inode: int) -> None:
        node = self.index.find(inode)
        if node is None or node.parent == ORPHAN_PARENT or not node.is_dir:
            self.index.mark_listed(inode)  # gone, or moved over meanwhile
            self.unlisted.discard(inode)
            return
        drel = self._path(node)
        try:
            listing = await self._io(self.reconciler.prepare, drel, None, self._started_ns,
                                     tenant=node.tenant)
        except FileNotFoundError:
            listing = fsck.Listing([], False, {})  # gone behind our back: nothing to index
        except OSError as exc:
            log.error("cannot list %s in the backing directory: %s",
                      drel.decode(errors="replace"), exc)
            raise FUSEError(errno.EIO) from None
        # Meanwhile lookups may have indexed single names (they are known below); the
        # directory itself may have moved: then read it again at its new place.
        node = self.index.find(inode)
        if node is None or node.parent == ORPHAN_PARENT or self._path(node) != drel:
            return
        self._inserting.add(inode)
        try:
            known = self.reconciler.known(node)
            before = set(known)
            for start in range(0, len(listing.entries), self.LIST_CHUNK):
                self._index_entries(node, drel, listing, known, before,
                                    listing.entries[start:start + self.LIST_CHUNK])
                await trio.sleep(0)  # serve what waits between two chunks
            with self.index.transaction():
                # Indexed before (named by a lookup, or a listing cut short by a crash) and
                # gone from the tree since: dropped, and the usage counted again.
                gone = [n for n in known.values() if not n.tier]
                self.reconciler.drop_missing(drel, known)
                self.index.mark_listed(inode)
            if listing.bad:  # bad blocks the daemon did not know (one it knows it may write)
                await self._io(self.reconciler.quarantine_bad, drel, listing, before)
        except (sqlite3.Error, OSError, blockfile.BlockFormatError, ValueError):
            log.exception("indexing %s failed", drel.decode(errors="replace"))
            raise FUSEError(errno.EIO) from None
        finally:
            self._inserting.discard(inode)
        for n in gone:
            if n.is_reg:
                self._unaccount(n)
        if any(n.is_dir for n in gone):  # its indexed files went with it: count again
            self.stats.reset_usage(self.index.usage_by_namespace())
        self.unlisted.discard(inode)
        if self.budget.excess(self.stats.used_bytes):
            self._wake_evictor()

    def _index_entries(self, node: Node, drel: bytes, listing: fsck.Listing,
                       known: dict[bytes, Node], before: set[bytes],
                       entries: list[tuple[bytes, os.stat_result]]) -> None:
        """Index some entries of a listing in one transaction; account the files; mark the
        new subdirectories unlisted."""
        subdirs: list[tuple[Node, bytes]] = []
        with self.index.transaction():
            rows = self.reconciler.walk_entries(node, drel, listing, subdirs, known, entries,
                                                refresh=False)
            new = [d.inode for d, _ in subdirs if d.name not in before]
            self.index.mark_unlisted(new)
        self.unlisted.update(new)
        self._to_list.extend(new)
        for row in rows:  # (parent, name, mode, uid, gid, size, ..., tenant, ns, ...)
            if stat.S_ISREG(row[2]):
                self.stats.account((row[9], row[10]), 1, row[5])

    async def _named(self, parent_inode: int, name: bytes) -> None:
        """For a lookup: make sure the index holds `name` in a directory if the backing tree
        has it. In a directory not listed yet that costs one lstat (in a thread), not a
        listing: the entry is indexed alone and the directory stays unlisted (its listing,
        later, finds the entry known). Requests that change a directory list it whole
        (`_listed`) instead: a listing never runs beside a change to the same directory."""
        if parent_inode not in self.unlisted:
            return
        # A listing that is reading the directory does not stop this (it takes what the
        # index has once its read is done); one that is writing the index does.
        writing = parent_inode in self._inserting
        if not writing and self.index.lookup(parent_inode, name) is None:
            node = self.index.find(parent_inode)
            if node is None or node.parent == ORPHAN_PARENT or not node.is_dir:
                return
            drel = self._path(node)
            listing = await self._io(self.reconciler.prepare, drel, [name], self._started_ns,
                                     tenant=node.tenant)
            writing = parent_inode in self._inserting
            if (not writing and parent_inode in self.unlisted
                    and self.index.lookup(parent_inode, name) is None):
                self._index_entries(node, drel, listing, {}, set(), listing.entries)
                if listing.bad:
                    await self._io(self.reconciler.quarantine_bad, drel, listing, set())
        if writing:
            await self._listing[parent_inode].wait()  # it has the name, when it is done
            if parent_inode in self.unlisted:  # ... unless it failed
                await self._named(parent_inode, name)

    async def _index_loop(self) -> None:
        """Index the directories of an adopted tree that no request has named yet: two
        listings at a time (one reads the backing tree while the other writes the index)."""
        if not self.unlisted:
            return
        start, report = time.monotonic(), self.reconciler.report
        log.info("indexing the backing tree: %d directories to list", len(self.unlisted))

        async def worker() -> None:
            last = 0
            while self._to_list:
                inode = self._to_list.popleft()
                try:
                    await self._listed(inode)
                except FUSEError:
                    pass  # logged; a request that names it tries again
                except Exception:  # never end the background tasks (and the mount) over one
                    log.exception("indexing directory inode %d failed", inode)
                if report.entries - last >= 100000:
                    last = report.entries
                    log.info("indexing the backing tree: %d entries, %d directories left",
                             report.entries, len(self.unlisted))

        async with trio.open_nursery() as nursery:
            for _ in range(2):
                nursery.start_soon(worker)
        log.info("indexed the backing tree: %s (%d directories could not be listed)",
                 report.summary().replace(f"{report.seconds:.1f} s",
                                          f"{time.monotonic() - start:.1f} s"),
                 len(self.unlisted))

    def _wake_evictor(self) -> None:
        if self._evict_wanted is not None:
            self._evict_wanted.set()

    async def _evict_loop(self) -> None:
        while True:
            assert self._evict_wanted is not None
            await self._evict_wanted.wait()
            self._evict_wanted = trio.Event()
            need = self.budget.excess(self.stats.used_bytes)
            if need:
                try:
                    freed = await self.evict(need)
                except Exception:
                    log.exception("background eviction failed")
                    await trio.sleep(1)
                    continue
                log.debug("background eviction freed %d of %d bytes", freed, need)

    def flush_atimes(self) -> None:
        """Write the access times the kvfs client reported since the last flush."""
        if self._atimes:
            pending, self._atimes = self._atimes, {}
            self.index.touch_blocks([(t, ns, h) for (ns, h), t in pending.items()])

    async def _atime_loop(self) -> None:
        while True:
            await trio.sleep(ATIME_FLUSH_INTERVAL)
            try:
                self.flush_atimes()
            except Exception:
                log.exception("writing access times failed")

    async def _retention_loop(self) -> None:
        while True:
            await trio.sleep(self.info.scan_interval)
            try:
                await self.expire()
            except Exception:
                log.exception("retention scan failed")

    def _tenant_victims(self, t: int, need: int, plan: Plan, limit: int = UNLIMITED) -> int:
        """Choose files of tenant `t` worth at least `need` bytes into `plan` (fewer if it has
        not enough evictable, and never more than `limit`); returns the bytes chosen. Cold
        files go first, then the policy's victims in its order; each leaves the policy at
        once, so that its parent may become the next victim (`_undo` puts them back)."""
        freed = 0
        cold = self._cold(t)
        # Files without policy state go first, unless a scan has just found that the
        # cold files left cannot be evicted (pinned, open, a manifest).
        floor = self._cold_floor[t] = min(self._cold_floor.get(t, 0), cold)
        if cold > floor:
            freed += self._cold_victims(t, need, plan, cold, limit)
            if freed >= need or freed >= limit:
                return freed
        policy = self.policies.get(t)
        if policy is None:
            return freed
        stale = []
        offered = policy.victims()
        for key in offered:
            inode = self._inode_of(key)
            if inode in self.open_files or inode in self.evicting or inode in plan.skip:
                continue  # being read or written (or the file that grows): never evicted
            node = self.index.find(inode) if inode is not None else None
            if node is None or node.parent == ORPHAN_PARENT or not node.is_reg or node.tier:
                stale.append(key)
                continue
            if self._is_manifest(node):
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

    def _tenant_usage(self) -> dict[int, int]:
        usage: dict[int, int] = {}
        for (t, _), c in self.stats.by_ns.items():
            if t:
                usage[t] = usage.get(t, 0) + c.bytes
        return usage

    def _room_victims(self, plan: Plan, need: int, grower: int | None,
                      usage: dict[int, int]) -> int:
        """Choose files worth `need` bytes of capacity under the fair-share rule
        (`capacity.room_order`); returns the bytes chosen."""
        quotas = {t: lim.quota for t, lim in self.limits.items()}
        shares = fair_shares(usage, self.info.capacity or 0, quotas, grower)
        freed = 0
        for t, want, limit in room_order(usage, shares, grower, need):
            freed += self._tenant_victims(t, min(need - freed, want), plan, limit)
            if freed >= need:
                break
        return freed

    def _victims(self, need: int, tenant: int | None) -> list[Node]:
        """Choose files to evict that free at least `need` bytes (fewer if there are not
        enough): a tenant's own, or (background eviction) under the fair-share rule."""
        plan = Plan()
        if tenant is not None:
            self._tenant_victims(tenant, need, plan)
        else:
            self._room_victims(plan, need, None, self._tenant_usage())
        return plan.nodes

    def _plan_room(self, tenant: int, growth: int, exclude: int | None) -> Plan:
        """What must go before `tenant` grows by `growth` bytes, chosen but not yet evicted:
        its own files past its quota, then files under the fair-share rule past the
        capacity. A growth that cannot fit is refused here (EDQUOT, ENOSPC), with the choice
        undone: nothing is evicted for a request that fails anyway."""
        plan = Plan()
        if exclude is not None:
            plan.skip.add(exclude)
        usage = self._tenant_usage()
        used = sum(usage.values())
        over = quota_overflow(self.limits.get(tenant), usage.get(tenant, 0), growth)
        if over:
            got = self._tenant_victims(tenant, over, plan)
            if got < over:
                self._undo(plan)
                raise FUSEError(errno.EDQUOT)
            usage[tenant] = usage.get(tenant, 0) - got
            used -= got
        over = self.budget.overflow(used, growth)
        if over and self._room_victims(plan, over, tenant, usage) < over:
            self._undo(plan)
            raise FUSEError(errno.ENOSPC)
        return plan

    def _undo(self, plan: Plan) -> None:
        """Put files chosen for a plan that will not run back into their policies."""
        for node, key in plan.from_policy:
            p = self._policy(node.tenant)
            p.insert(key, node.size, parent=self._parent_key(node), now=time.time())
            if node.pinned:
                p.pin(key, True)

    async def evict(self, need: int, tenant: int | None = None, reason: str = "evicted") -> int:
        """Evict files worth at least `need` bytes; returns the bytes freed."""
        return await self._remove_files(self._victims(need, tenant), reason)

    async def _remove_files(self, nodes: list[Node], reason: str) -> int:
        """Unlink files chosen by the daemon itself (eviction, retention).

        While their backing files are being unlinked they are marked `evicting`, so that no
        open can start on them; then they leave the index and the kernel's caches."""
        if not nodes:
            return 0
        for parent in {n.parent for n in nodes} & self.unlisted:
            await self._listed(parent)  # removing files is a change (see _named)
        self.evicting.update(n.inode for n in nodes)
        demoted: set[int] = set()
        try:
            paths = [self._path(n) for n in nodes]
            tiering = self.tiering
            if reason == "evicted" and tiering is not None and tiering.tiers:
                # Eviction demotes blocks to the next tier down instead of deleting them.
                async def demote(node: Node, rel: bytes) -> None:
                    if await tiering.demote(self._tier_key(rel),
                                            self._block_source(rel), node.size):
                        demoted.add(node.inode)

                async with trio.open_nursery() as nursery:
                    for node, rel in zip(nodes, paths, strict=True):
                        if node.block_hash is not None:
                            nursery.start_soon(demote, node, rel)
            await self._io(self.store.unlink_many, paths)
        finally:
            self.evicting.difference_update(n.inode for n in nodes)
        freed = 0
        for node in nodes:
            current = self.index.find(node.inode)
            if current is None or current.parent == ORPHAN_PARENT or current.tier:
                continue
            freed += self._size_of(current)
            c = self.stats.by_ns[self._key(current)]
            if reason == "expired":
                c.expirations += 1
            elif node.inode in demoted:
                c.demotions += 1
                self._unaccount(current)  # out of the hot tier; the name stays
                self.index.update(current.inode, tier=1)
                continue
            else:
                c.evictions += 1
            self._drop(current)
            self._invalidate(current)
        return freed

    def _invalidate(self, node: Node) -> None:
        """Tell the kernel a name the daemon removed on its own is gone (once serving: before
        the connection is up there is nothing to tell, and the call would fail)."""
        if self.serving:
            pyfuse3.invalidate_entry_async(node.parent, node.name, ignore_enoent=True)

    async def expire(self) -> int:
        """Remove the files that have outlived their tenant's retention limits."""
        self.flush_atimes()  # retention reads access times from the index
        now = time.time_ns()
        removed = 0
        for tenant, limits in list(self.limits.items()):
            if limits.max_idle is None and limits.max_age is None:
                continue
            idle = now - int(limits.max_idle * 1e9) if limits.max_idle is not None else 0
            age = now - int(limits.max_age * 1e9) if limits.max_age is not None else 0
            while True:
                batch = [n for n in self.index.expired(tenant, idle, age)
                         if n.inode not in self.open_files and n.inode not in self.evicting]
                if not batch:
                    break
                removed += len(batch)
                await self._remove_files(batch, "expired")
                await self._prune({n.parent for n in batch})
        return removed

    async def _prune(self, dirs: set[int]) -> None:
        """Remove directories that retention emptied, up to and including the model
        namespace: a namespace nobody uses ages out with its files."""
        while dirs:
            parents = set()
            for inode in dirs:
                node = self.index.find(inode)
                if (node is None or not node.is_dir or node.ns == 0 or node.parent == ORPHAN_PARENT
                        or self.index.has_children(inode)):
                    continue
                await self._listed(node.parent)  # removing an entry is a change (_named)
                try:
                    await self._io(self.store.rmdir, self._path(node))
                except OSError as exc:
                    log.debug("not pruning %s: %s", node.name, exc)
                    continue
                node = self.index.find(inode)
                if node is not None and not self.index.has_children(inode):
                    self._drop(node)
                    self._invalidate(node)
                    parents.add(node.parent)
            dirs = parents

    async def _make_room(self, node: Node, growth: int, size: int | None = None,
                         exclude: int | None = None) -> None:
        """Before a file of `node`'s tenant grows by `growth` bytes (to `size` bytes, when
        one file grows): decide whether it can fit at all, then evict what that takes.

        Refused at once, with nothing evicted and nothing changed: EFBIG when the size itself
        can never fit (more than the capacity), EDQUOT when it passes the tenant's quota and
        its own evictable files cannot make up the difference, ENOSPC when the capacity
        cannot be freed under the fair-share rule. `exclude` (the file that grows) is never
        chosen to make room for itself."""
        if growth <= 0:
            return
        tenant = node.tenant
        cap, limits = self.info.capacity, self.limits.get(tenant)
        whole = growth if size is None else size
        if cap is not None and whole > cap:
            raise FUSEError(errno.EFBIG)
        if limits is not None and limits.quota is not None and whole > limits.quota:
            raise FUSEError(errno.EDQUOT)
        for _ in range(4):  # again when other requests took the room freed meanwhile
            plan = self._plan_room(tenant, growth, exclude)
            if not plan.nodes:
                break
            await self._remove_files(plan.nodes, "evicted")
        else:
            raise FUSEError(errno.ENOSPC)
        if self.budget.excess(self.stats.used_bytes + growth):
            self._wake_evictor()

    # -- helpers --------------------------------------------------------------------------

    async def _io(self, fn: Callable[..., T], *args: Any, tenant: int = 0) -> T:
        """Run blocking backing I/O in a worker thread. Work on a tenant's tree (`tenant`)
        first takes a place in that tenant's own limiter, so that it can never hold every
        thread of the global one."""
        if not tenant:
            return await trio.to_thread.run_sync(fn, *args, limiter=self.limiter)
        limiter = self._tenant_limiters.get(tenant)
        if limiter is None:
            limiter = self._tenant_limiters[tenant] = trio.CapacityLimiter(self._tenant_threads)
        try:
            limiter.acquire_nowait()  # the common case: no extra trip through the scheduler
        except trio.WouldBlock:
            await limiter.acquire()
        try:
            return await trio.to_thread.run_sync(fn, *args, limiter=self.limiter)
        finally:
            limiter.release()

    def _dir_path(self, inode: int) -> bytes:
        path = self._dir_paths.get(inode)
        if path is None:
            node = self.index.get(inode)
            if node.parent == ORPHAN_PARENT:
                raise FUSEError(errno.ENOENT)
            path = self._join(self._dir_path(node.parent), node.name)
            self._dir_paths[inode] = path
        return path

    @staticmethod
    def _join(dirpath: bytes, name: bytes) -> bytes:
        return dirpath + b"/" + name if dirpath else name

    def _path(self, node: Node) -> bytes:
        if node.inode == ROOT_INODE:
            return b""
        if node.parent == ORPHAN_PARENT:
            raise FUSEError(errno.ENOENT)
        return self._join(self._dir_path(node.parent), node.name)

    def _forget_dir_paths(self) -> None:
        self._dir_paths = {ROOT_INODE: b""}

    def _new_fh(self, h: Handle) -> int:
        fh = self._next_fh
        self._next_fh += 1
        self.handles[fh] = h
        return fh

    def _ref(self, inode: int) -> None:
        self.lookups[inode] = self.lookups.get(inode, 0) + 1

    def _attrs(self, node: Node) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = node.inode
        a.generation = 0
        a.entry_timeout = ENTRY_TIMEOUT
        a.attr_timeout = ENTRY_TIMEOUT
        a.st_mode = node.mode
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
        a.st_size = size
        a.st_blksize = BLKSIZE
        # Blocks that live only in a lower tier take no local space: du shows the hot tier.
        a.st_blocks = 8 if node.is_dir else 0 if node.tier else -(-size // 4096) * 8
        a.st_atime_ns = node.atime_ns
        a.st_mtime_ns = mtime
        a.st_ctime_ns = node.ctime_ns
        return a

    def _virtual_attrs(self, inode: int) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = inode
        a.entry_timeout = a.attr_timeout = 0
        a.st_mode = (stat.S_IFDIR | 0o555) if inode == VDIR else (stat.S_IFREG | 0o444)
        a.st_nlink = 2 if inode == VDIR else 1
        a.st_blksize = 4096
        t = int(self.info.started * 1e9)
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = t
        return a

    def _child_place(self, parent: Node, mode: int) -> tuple[int, int]:
        """(tenant, ns) a new child of `parent` will have; 0s are filled in by the index."""
        if parent.inode == ROOT_INODE:
            return 0, 0
        if parent.inode == parent.tenant:  # a child of a tenant directory
            return parent.tenant, 0
        return parent.tenant, parent.ns

    def _check_parent(self, parent_inode: int, *, is_dir: bool, name: bytes, ctx: Any) -> Node:
        if parent_inode in (VDIR, VSTATS, VVERSION):
            raise FUSEError(errno.EPERM)
        _check_name(name)
        parent = self.index.get(parent_inode)
        if not parent.is_dir:
            raise FUSEError(errno.ENOTDIR)
        if parent.inode == ROOT_INODE:
            # The top level holds tenant directories only, made by root or the mount's owner.
            if not is_dir:
                raise FUSEError(errno.EPERM)
            if ctx.uid not in (0, self.owner_uid):
                raise FUSEError(errno.EACCES)
            if not TENANT_RE.match(name):
                log.warning("refused tenant name %r: use letters, digits, _ . @ -", name)
                raise FUSEError(errno.EINVAL)
        return parent

    def _new_entry(self, parent_inode: int, name: bytes, *, is_dir: bool, ctx: Any) -> Node:
        """The parent of a name about to be created (mkdir, create, symlink), checked."""
        parent = self._check_parent(parent_inode, is_dir=is_dir, name=name, ctx=ctx)
        if self.index.lookup(parent.inode, name) is not None:
            raise FUSEError(errno.EEXIST)
        self._creating(parent, name)
        return parent

    def _owner_gid(self, parent: Node, ctx: Any) -> int:
        return parent.gid if parent.mode & stat.S_ISGID else ctx.gid

    def _key(self, node: Node) -> Key:
        return (node.tenant, node.ns)

    def _audit(self, uid: int, pid: int, node: Node, op: str, *, blocks: int = 0,
               nbytes: int = 0, path: bytes | None = None, **extra: Any) -> None:
        """One audit record, when the audit log is on."""
        if self.audit is None:
            return
        names = self.names_of({node.tenant, node.ns} - {0})
        try:
            shown = (path if path is not None else self._path(node)).decode(errors="replace")
        except FUSEError:
            shown = node.name.decode(errors="replace")
        self.audit.record(uid=uid, pid=pid, tenant=names.get(node.tenant, ""),
                          model=names.get(node.ns, ""), op=op, path=shown, blocks=blocks,
                          nbytes=nbytes, **extra)

    def _unaccount(self, node: Node) -> None:
        """Take a file's hot copy out of the accounting and the eviction policy."""
        if node.is_reg and not node.tier:
            policy = self.policies.get(node.tenant)
            if policy is not None:
                policy.remove(self._pkey(node))
            self.stats.account(self._key(node), -1, -self._size_of(node))

    def _dir_changed(self, *inodes: int) -> None:
        """Entries were added to, removed from or renamed in these directories: their mtime
        and ctime are now, as the backing directories' are."""
        now = time.time_ns()
        for inode in set(inodes):
            if inode != ORPHAN_PARENT:
                self.index.update(inode, mtime_ns=now, ctime_ns=now)

    def _drop(self, node: Node) -> None:
        """Remove a node from the namespace (after its backing entry is gone)."""
        self._dir_changed(node.parent)
        self._unaccount(node)
        if node.is_dir:
            self._dir_paths.pop(node.inode, None)
            if node.inode == node.tenant:
                self.stats.drop_tenant(node.inode)
            elif node.inode == node.ns:
                self.stats.fold_namespace(node.tenant, node.inode)
        if self.lookups.get(node.inode) or node.inode in self.open_files:
            self.index.orphan(node.inode)
            self.orphans.add(node.inode)
        else:
            self.index.delete(node.inode)

    def _purge_orphan(self, inode: int) -> None:
        """Delete an orphan's row once neither the kernel nor an open file refers to it."""
        if inode in self.orphans and not self.lookups.get(inode) and inode not in self.open_files:
            self.orphans.discard(inode)
            self.index.delete(inode)

    def _size_of(self, node: Node) -> int:
        of = self.open_files.get(node.inode)
        return of.size if of is not None and of.dirty else node.size

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
            await self._named(parent_inode, name)
            found = self.index.lookup(parent_inode, name)
            if found is None:
                found = await self._lookup_below(parent_inode, name)
            if found is None:
                raise FUSEError(errno.ENOENT)
            node = found
        self._ref(node.inode)
        return self._attrs(node)

    async def _lookup_below(self, parent_inode: int, name: bytes) -> Node | None:
        """A name the hot tier lacks. In a model namespace that is a cache miss (counted);
        with lower tiers, a block found there is fetched, verified and placed hot, and the
        fan-out directories it needs appear on demand."""
        parent = self.index.find(parent_inode)
        if parent is None or not parent.is_dir or parent.ns == 0:
            return None
        if self.tiering is not None:
            # A fetch places a file (or a fan-out directory) here: a change, which lists an
            # unlisted directory first (see _named).
            await self._listed(parent.inode)
            listed = self.index.lookup(parent_inode, name)
            if listed is not None:
                return listed
            text = name.decode(errors="replace")
            if parent.inode == parent.ns and len(name) == 2 and all(
                    c in "0123456789abcdef" for c in text):
                return await self._fan_dir(parent, name)
            block_hash = hashing.parse_block_filename(text)
            if block_hash is not None and parent.name == block_hash[:1].hex().encode():
                node = await self._fetch_block(parent, name, None)
                if node is not None:
                    return node
        self._count_miss(parent, name)
        return None

    def _count_miss(self, parent: Node, name: bytes) -> None:
        """A miss through the mount, counted once per name: an engine's exists() and the
        kernel's lookup before the create that follows it are one miss, not two."""
        key, now = (parent.inode, name), time.monotonic()
        seen = self._recent_misses.pop(key, None)
        if seen is None or now - seen[0] > MISS_WINDOW:
            seen = [now, 0]
            self.stats.by_ns[self._key(parent)].mount_misses += 1
        seen[1] += 1
        self._recent_misses[key] = seen
        if len(self._recent_misses) > 4096:
            self._recent_misses.popitem(last=False)

    def _creating(self, parent: Node, name: bytes) -> None:
        """A name is being created. If its only failed lookup was the kernel's, just before
        the create (a temporary, a new directory), that was no cache miss: take it back."""
        seen = self._recent_misses.pop((parent.inode, name), None)
        if seen is not None and seen[1] == 1 and time.monotonic() - seen[0] < CREATE_WINDOW:
            self.stats.by_ns[self._key(parent)].mount_misses -= 1

    async def _fan_dir(self, ns_node: Node, name: bytes) -> Node:
        found = self.index.lookup(ns_node.inode, name)
        if found is not None and found.is_dir:
            return found  # indexed: its backing directory exists
        path = self._join(self._path(ns_node), name)
        mode = stat.S_IMODE(ns_node.mode)
        try:
            await self._io(self.store.mkdir, path, mode, ns_node.uid, ns_node.gid)
        except FileExistsError:
            pass
        found = self.index.lookup(ns_node.inode, name)
        if found is not None:
            return found
        self._dir_changed(ns_node.inode)
        return self.index.insert(parent=ns_node.inode, name=name, mode=stat.S_IFDIR | mode,
                                 uid=ns_node.uid, gid=ns_node.gid, tenant=ns_node.tenant,
                                 ns=ns_node.ns)

    def _tier_key(self, rel: bytes) -> str:
        """A block's key in the lower tiers: its path in the index (the tenant's name, the
        namespace's, the block's), never anything read from the backing tree."""
        return rel.decode(errors="surrogateescape")

    def _block_source(self, rel: bytes) -> Callable[[], bytes]:
        """What an upload or demotion reads: the block's bytes from a verified fd of the
        hot copy, bounded by its header (never another file through a tenant's link)."""
        return functools.partial(self.store.read_block, rel)

    async def _fetch_block(self, dnode: Node, name: bytes, node: Node | None) -> Node | None:
        """Fetch block `name` below `dnode` from the lower tiers and place it hot. `node` is
        its index entry when it is known (in a lower tier), None when it is not."""
        assert self.tiering is not None
        rel = self._join(self._path(dnode), name)
        owner = (dnode.uid, dnode.gid, 0o644)
        got = await self.tiering.fetch(self._tier_key(rel), self.store.placement(rel),
                                       owner, node.size if node is not None else None)
        if got is None:
            return None
        current = self.index.lookup(dnode.inode, name)
        if current is not None and not current.tier:
            return current  # another request placed it meanwhile
        try:
            await self._make_room(dnode, got.size, got.size)
        except FUSEError:
            await self._io(self.store.unlink_many, [rel])
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
        self.stats.account(self._key(current), 1, got.size)
        self.stats.by_ns[self._key(current)].promotions += 1
        self._cache_block(current)
        return current

    @handler
    async def forget(self, inode_list: list[tuple[int, int]]) -> None:
        for inode, nlookup in inode_list:
            left = self.lookups.get(inode, 0) - nlookup
            if left > 0:
                self.lookups[inode] = left
                continue
            self.lookups.pop(inode, None)
            self._purge_orphan(inode)  # (a set lookup: forget costs no query)

    @handler
    async def getattr(self, inode: int, ctx: Any) -> pyfuse3.EntryAttributes:
        if inode in (VDIR, VSTATS, VVERSION):
            return self._virtual_attrs(inode)
        return self._attrs(self.index.get(inode))

    @handler
    async def setattr(
        self, inode: int, attr: pyfuse3.EntryAttributes, fields: pyfuse3.SetattrFields,
        fh: int | None, ctx: Any,
    ) -> pyfuse3.EntryAttributes:
        if inode < 1000 and inode != ROOT_INODE:
            raise FUSEError(errno.EPERM)
        node = self.index.get(inode)
        path = self._path(node)
        changes: dict[str, Any] = {}
        kwargs: dict[str, Any] = {}
        now = time.time_ns()
        if fields.update_size:
            if not node.is_reg:
                raise FUSEError(errno.EISDIR if node.is_dir else errno.EINVAL)
            if attr.st_size < 0:
                raise FUSEError(errno.EINVAL)
            await self._make_room(node, attr.st_size - self._size_of(node), attr.st_size,
                                  exclude=inode)
            kwargs["size"] = attr.st_size
            h = self.handles.get(fh) if fh is not None else None
            if h is not None and h.fd >= 0 and h.writable:
                kwargs["fd"] = h.fd
            else:
                h = None
            of = self.open_files.get(inode)
            if of is not None and of.writers:
                self._writing(of, inode, h)
        if fields.update_mode:
            changes["mode"] = stat.S_IFMT(node.mode) | stat.S_IMODE(attr.st_mode)
            kwargs["mode"] = stat.S_IMODE(attr.st_mode)
        if fields.update_uid:
            changes["uid"] = kwargs["uid"] = attr.st_uid
        if fields.update_gid:
            changes["gid"] = kwargs["gid"] = attr.st_gid
        if fields.update_atime or fields.update_mtime:
            atime = attr.st_atime_ns if fields.update_atime else node.atime_ns
            mtime = attr.st_mtime_ns if fields.update_mtime else node.mtime_ns
            changes["atime_ns"], changes["mtime_ns"] = atime, mtime
            kwargs["times_ns"] = (atime, mtime)
        await self._io(functools.partial(
            self.store.setattr, path, is_link=stat.S_ISLNK(node.mode), is_dir=node.is_dir,
            **kwargs), tenant=node.tenant)
        if "size" in kwargs:
            new_size = kwargs["size"]
            node = self.index.get(inode)  # re-read: the world may have moved during the await
            old_size = self._size_of(node)
            self.stats.account(self._key(node), 0, new_size - old_size)
            of = self.open_files.get(inode)
            if of is not None and of.dirty:
                of.size, of.mtime_ns = new_size, now
            changes.update(size=new_size, block_hash=None, parent_hash=None)
            changes.setdefault("mtime_ns", now)
            self._unblock(node)
        changes["ctime_ns"] = now
        self.index.update(inode, **changes)
        return self._attrs(self.index.get(inode))

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
        await self._listed(inode)
        return inode

    @handler
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        if fh == VDIR:
            for i, (name, inode) in enumerate(VFILES.items(), start=1):
                if i > start_id and not pyfuse3.readdir_reply(
                        token, name, self._virtual_attrs(inode), i):
                    return
            return
        if fh == ROOT_INODE and start_id < VDIR:
            if not pyfuse3.readdir_reply(token, VDIR_NAME, self._virtual_attrs(VDIR), VDIR):
                return
            start_id = VDIR
        while True:
            batch = self.index.children(fh, after=start_id, limit=512)
            if not batch:
                return
            for node in batch:
                if not pyfuse3.readdir_reply(token, node.name, self._attrs(node), node.inode):
                    return
                self._ref(node.inode)
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
        await self._listed(parent_inode)
        parent = self._new_entry(parent_inode, name, is_dir=True, ctx=ctx)
        mode = stat.S_IMODE(mode) & ~ctx.umask
        if parent.mode & stat.S_ISGID:
            mode |= stat.S_ISGID
        gid = self._owner_gid(parent, ctx)
        path = self._join(self._path(parent), name)
        await self._io(self.store.mkdir, path, mode, ctx.uid, gid)
        tenant, ns = self._child_place(parent, stat.S_IFDIR)
        node = self.index.insert(parent=parent.inode, name=name, mode=stat.S_IFDIR | mode,
                                 uid=ctx.uid, gid=gid, tenant=tenant, ns=ns)
        self._dir_changed(parent.inode)
        self._audit(ctx.uid, ctx.pid, node, "mkdir", path=path)
        self._ref(node.inode)
        return self._attrs(node)

    @handler
    async def rmdir(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        if parent_inode == ROOT_INODE and name == VDIR_NAME or parent_inode == VDIR:
            raise FUSEError(errno.EPERM)
        await self._listed(parent_inode)
        node = self.index.lookup(parent_inode, name)
        if node is None:
            raise FUSEError(errno.ENOENT)
        if not node.is_dir:
            raise FUSEError(errno.ENOTDIR)
        await self._listed(node.inode)
        if self.index.has_children(node.inode):
            raise FUSEError(errno.ENOTEMPTY)
        try:
            await self._io(self.store.rmdir, self._path(node))
        except FileNotFoundError:
            log.warning("%s was already gone from the backing directory", self._path(node))
        self._audit(ctx.uid, ctx.pid, node, "rmdir")
        self._drop(node)

    # -- files ----------------------------------------------------------------------------

    def _open_state(self, node: Node) -> OpenFile:
        of = self.open_files.get(node.inode)
        if of is None:
            of = self.open_files[node.inode] = OpenFile(size=node.size, mtime_ns=node.mtime_ns)
        return of

    def _register(self, node: Node, fd: int, writable: bool, ctx: Any = None) -> int:
        of = self._open_state(node)
        of.handles += 1
        if writable:
            of.writers += 1
            if of.writers == 1:
                of.dirty = True
                of.size = node.size
        h = Handle(node.inode, fd, writable, self._key(node))
        if ctx is not None:
            h.uid, h.pid = ctx.uid, ctx.pid
        return self._new_fh(h)

    def _writing(self, of: OpenFile, inode: int, h: Handle | None) -> None:
        """A change (write, truncate) to a file open for writing, through handle `h` (None:
        by path). From the first one on the file is being written, until every descriptor
        that changed it is closed (removed if the daemon dies before: it may be half
        written), and not a block until its last writer closes it. A file opened for writing
        but not changed stays what it was (a block stays a block)."""
        if h is None:
            of.unowned = True
        elif not h.written:
            h.written = True
            of.pending += 1
        if not of.written:
            of.written = of.changed = True
            self._unblock(self.index.get(inode))
            self.index.update(inode, writing=1, block_hash=None, parent_hash=None)

    @staticmethod
    def _backing_flags(flags: int) -> int:
        """Open flags for the backing file. O_DIRECT is not passed on: the daemon's buffers
        are not aligned, and the mount honours it with direct_io instead."""
        keep = os.O_ACCMODE | os.O_SYNC | os.O_DSYNC | os.O_NOFOLLOW
        return flags & keep

    @handler
    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: Any
                     ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        await self._listed(parent_inode)
        parent = self._new_entry(parent_inode, name, is_dir=False, ctx=ctx)
        mode = stat.S_IMODE(mode) & ~ctx.umask
        gid = self._owner_gid(parent, ctx)
        path = self._join(self._path(parent), name)
        accmode = flags & os.O_ACCMODE
        bflags = self._backing_flags(flags)
        # Always open the backing file read-write: the kernel may read a write-only file to
        # fill pages.
        if accmode != os.O_RDONLY:
            bflags = (bflags & ~os.O_ACCMODE) | os.O_RDWR
        tenant, ns = self._child_place(parent, stat.S_IFREG)
        writable = accmode != os.O_RDONLY
        # Indexed (as being written) before the backing file exists: a daemon that dies in
        # between leaves a row that the next mount removes, never a stray empty file.
        node = self.index.insert(parent=parent.inode, name=name, mode=stat.S_IFREG | mode,
                                 uid=ctx.uid, gid=gid, tenant=tenant, ns=ns, writing=1)
        try:
            fd = await self._io(self.store.create, path, bflags, mode, ctx.uid, gid,
                                tenant=parent.tenant)
        except BaseException:
            current = self.index.find(node.inode)
            if current is not None and current.parent != ORPHAN_PARENT:
                self.index.delete(node.inode)
            raise
        if not writable:
            self.index.update(node.inode, writing=0)
        self._dir_changed(parent.inode)
        self.stats.account(self._key(node), 1, 0)
        self._policy(node.tenant).insert(node.inode, 0, now=time.time())  # no block yet
        self._bound()
        fh = self._register(node, fd, writable, ctx)
        if writable:  # new: indexed as being written from the start, by this handle
            of = self.open_files[node.inode]
            of.written = of.changed = True
            self.handles[fh].written = True
            of.pending += 1
        self._ref(node.inode)
        fi = pyfuse3.FileInfo(fh=fh, direct_io=bool(flags & os.O_DIRECT), keep_cache=False)
        return fi, self._attrs(node)

    @handler
    async def mknod(self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx: Any
                    ) -> pyfuse3.EntryAttributes:
        if not stat.S_ISREG(mode):
            # Device nodes, FIFOs and sockets have no place in a cache.
            raise FUSEError(errno.EPERM)
        fi, attrs = await self.create(parent_inode, name, mode, os.O_RDONLY, ctx)
        await self.release(fi.fh)
        return attrs

    @handler
    async def open(self, inode: int, flags: int, ctx: Any) -> pyfuse3.FileInfo:
        if inode in (VSTATS, VVERSION):
            if flags & os.O_ACCMODE != os.O_RDONLY:
                raise FUSEError(errno.EACCES)
            if inode == VSTATS:
                content = self._stats_json(await self._visible_tenants(ctx))
            else:
                content = f"{__version__}\n".encode()
            return pyfuse3.FileInfo(fh=self._new_fh(Handle(inode, content=content)),
                                    direct_io=True, keep_cache=False)
        node = self.index.get(inode)
        if not node.is_reg:
            raise FUSEError(errno.EISDIR if node.is_dir else errno.EINVAL)
        if inode in self.evicting:
            raise FUSEError(errno.ENOENT)  # being evicted: a miss
        if node.tier:
            await self._listed(node.parent)  # a fetch is a change to the directory
            if self.tiering is None or await self._fetch_block(
                    self.index.get(node.parent), node.name, node) is None:
                self.stats.by_ns[self._key(node)].mount_misses += 1
                raise FUSEError(errno.ENOENT)  # the lower tier could not deliver: a miss
            node = self.index.get(inode)
        accmode = flags & os.O_ACCMODE
        writable = accmode != os.O_RDONLY
        bflags = self._backing_flags(flags)
        if writable:
            bflags = (bflags & ~os.O_ACCMODE) | os.O_RDWR
        truncate = writable and bool(flags & os.O_TRUNC)
        fd = await self._io(self.store.open, self._path(node), bflags, tenant=node.tenant)
        node = self.index.get(inode)
        fh = self._register(node, fd, writable, ctx)
        if truncate:
            of = self.open_files[inode]
            self._writing(of, inode, self.handles[fh])  # marked before the file changes
            try:
                await self._io(os.ftruncate, fd, 0)
            except BaseException:
                await self.release(fh)
                raise
            self.stats.account(self._key(node), 0, -of.size)
            of.size, of.mtime_ns = 0, time.time_ns()
        now = time.time_ns()
        self.index.update(inode, atime_ns=now)
        self._used(node, now / 1e9)
        if not writable and node.ns:
            self.stats.by_ns[self._key(node)].mount_hits += 1
        busy = writable or self.open_files[inode].writers > 0
        return pyfuse3.FileInfo(fh=fh, direct_io=bool(flags & os.O_DIRECT), keep_cache=not busy)

    @handler
    async def read(self, fh: int, off: int, size: int) -> bytes:
        h = self.handles[fh]
        if h.content is not None:
            return h.content[off:off + size]
        data = self._read_cached(h, off, size)
        if data is None:
            data = await self._io(self._read_disk, h, off, size)
        elif h.ahead and off == h.next_off and off + size + self.READ_AHEAD // 2 > h.ahead:
            # A cold sequential reader served from what was read ahead: ask for more before
            # it runs out (in a thread, not waited for), so that it never meets the disk.
            start, h.ahead = h.ahead, off + size + self.READ_AHEAD
            if self._nursery is not None:
                self._nursery.start_soon(self._io, self._advise, h.fd, start, h.ahead - start)
        h.next_off = off + len(data)
        self.stats.read(h.key, len(data))
        h.nread += len(data)
        return data

    #: Bytes a sequential reader's backing file is read ahead of it.
    READ_AHEAD = 16 << 20

    def _read_disk(self, h: Handle, off: int, size: int) -> bytes:
        """Thread: read from the disk. A sequential reader's next READ_AHEAD bytes are asked
        for at once (WILLNEED starts the reads and returns), so that its next requests find
        them in the page cache and are served on the event loop, without a thread."""
        data = os.pread(h.fd, size, off)
        end = off + len(data)
        if off == h.next_off and len(data) == size and end + self.READ_AHEAD // 2 > h.ahead:
            start, h.ahead = max(end, h.ahead), end + self.READ_AHEAD
            self._advise(h.fd, start, h.ahead - start)
        return data

    @staticmethod
    def _advise(fd: int, off: int, length: int) -> None:
        """Thread: start reading a range of a backing file into the page cache."""
        try:
            os.posix_fadvise(fd, off, length, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass  # closed meanwhile, or not supported: only a lost hint

    def _read_cached(self, h: Handle, off: int, size: int) -> memoryview | None:
        """Bytes already in the page cache, read on the event loop without blocking
        (RWF_NOWAIT) and without a thread hand-off; None when the disk would be needed."""
        buf = bytearray(size)
        try:
            n = os.preadv(h.fd, [buf], off, os.RWF_NOWAIT)
        except (BlockingIOError, OSError):
            return None
        of = self.open_files.get(h.inode)
        end = of.size if of is not None and of.dirty else self.index.get(h.inode).size
        if n < size and off + n < end:
            return None  # partly cached: a short read here would look like the end of file
        return memoryview(buf)[:n]

    @handler
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        h = self.handles[fh]
        if not h.writable:
            raise FUSEError(errno.EBADF)
        of = self.open_files[h.inode]
        growth = off + len(buf) - of.size
        if growth > 0:
            await self._make_room(self.index.get(h.inode), growth, off + len(buf),
                                  exclude=h.inode)
            # Account before the await, so that concurrent writes see each other's growth.
            self.stats.account(h.key, 0, growth)
            of.size += growth
        self._writing(of, h.inode, h)
        n = 0
        try:
            n = await self._io(os.pwrite, h.fd, buf, off)
        finally:
            if growth > 0 and n < len(buf) and of.size == off + len(buf):
                short = min(growth, len(buf) - n)  # give back what was not written
                self.stats.account(h.key, 0, -short)
                of.size -= short
        of.mtime_ns = time.time_ns()
        self.stats.write(h.key, n)
        h.nwritten += n
        return n

    def _persist(self, inode: int) -> None:
        of = self.open_files.get(inode)
        if of is not None and of.dirty and of.changed:
            self.index.update(inode, size=of.size, mtime_ns=of.mtime_ns, ctime_ns=of.mtime_ns)

    @handler
    async def flush(self, fh: int) -> None:
        h = self.handles[fh]
        if h.writable:
            self._persist(h.inode)
            of = self.open_files.get(h.inode)
            if of is not None and h.written:
                # close(2) returned to a writer: what it wrote is complete as far as it knows,
                # so a daemon that dies before the (asynchronous) release must not remove it,
                # unless another descriptor has changed it too. A later change marks it again.
                h.written = False
                of.pending -= 1
                if of.written and not of.pending and not of.unowned:
                    of.written = False
                    self.index.update(h.inode, writing=0)

    @handler
    async def fsync(self, fh: int, datasync: bool) -> None:
        h = self.handles[fh]
        if h.fd >= 0:
            await self._io(os.fdatasync if datasync else os.fsync, h.fd)
        if h.writable:
            self._persist(h.inode)

    @handler
    async def release(self, fh: int) -> None:
        h = self.handles.pop(fh)
        if h.content is not None:
            return
        if self.audit is not None:
            node = self.index.find(h.inode)
            if node is not None and (h.nread or h.nwritten or h.writable):
                self._audit(h.uid, h.pid, node, "write" if h.writable else "read",
                            nbytes=h.nwritten if h.writable else h.nread)
        try:
            await self._io(os.close, h.fd)
        finally:
            of = self.open_files[h.inode]
            of.handles -= 1
            changed = of.changed
            if h.written:  # closed without a flush: what it changed is no longer pending
                of.pending -= 1
                if of.written and not of.pending and not of.unowned:
                    of.written = False
                    self.index.update(h.inode, writing=0)
            if h.writable:
                of.writers -= 1
                if of.writers == 0:
                    if changed:
                        self._persist(h.inode)
                        self.index.update(h.inode, writing=0)
                    of.dirty = of.written = of.changed = of.unowned = False
                    of.pending = 0
            if of.handles == 0:
                del self.open_files[h.inode]
        if h.writable and of.writers == 0 and changed:
            await self._complete(h.inode)
        self._purge_orphan(h.inode)

    async def _complete(self, inode: int) -> None:
        """The last writer closed a file: if it is a kvfs-native block, verify its header and
        publish it as a block. Anything else stays an ordinary file."""
        node = self.index.find(inode)
        if node is None or node.parent == ORPHAN_PARENT:
            return
        block_hash = hashing.parse_block_filename(node.name.decode(errors="replace"))
        if block_hash is None:
            if node.block_hash is not None:
                self._unblock(node)
                self.index.update(inode, block_hash=None, parent_hash=None)
            return
        try:
            head, size = await self._io(self.store.read_head, self._path(node),
                                        blockfile.HEADER_SIZE, tenant=node.tenant)
        except OSError as exc:
            log.warning("%s is named as a block but cannot be read as one (%s)",
                        self._path(node).decode(errors="replace"), exc)
            return
        try:
            hdr = blockfile.check_head(head, size, block_hash)
        except blockfile.BlockFormatError as exc:
            log.warning("%s is named as a block but is not one (%s): kept as a plain file",
                        self._path(node).decode(errors="replace"), exc)
            return
        node = self.index.find(inode)
        if node is not None and inode not in self.open_files:
            self.index.update(inode, block_hash=hdr.block_hash, parent_hash=hdr.parent_hash)
            self._cache_block(node)
            self._publish_shared(node)

    def _publish_shared(self, node: Node) -> None:
        """Write-through: queue a complete block for the shared tiers (never waits)."""
        if self.tiering is not None:
            rel = self._path(node)
            self.tiering.enqueue_upload(self._tier_key(rel), self._block_source(rel))

    def _used(self, node: Node, now: float) -> None:
        """A hot file was used: tell its policy, entering it first if it was cold."""
        if not node.is_reg or node.tier or node.parent == ORPHAN_PARENT:
            return
        policy = self._policy(node.tenant)
        key = self._pkey(node)
        if key not in policy:
            self._enter(node, now)
            self._bound()
        policy.access(key, now)

    def _unblock(self, node: Node) -> None:
        """A block stops being one (truncated, renamed away): key its policy entry by inode."""
        if node.block_hash is not None and not node.tier:
            policy = self._policy(node.tenant)
            policy.remove(self._pkey(node))
            policy.insert(node.inode, node.size, now=time.time())
            self._bound()

    def _cache_block(self, node: Node) -> None:
        """(Re)enter a complete block into its tenant's policy, linked to its parent."""
        node = self.index.get(node.inode)
        policy = self._policy(node.tenant)
        policy.remove(node.inode)
        key = self._pkey(node)
        policy.remove(key)
        policy.insert(key, node.size, parent=self._parent_key(node), now=time.time())
        if node.pinned:
            policy.pin(key, True)
        self._bound()

    # -- names ----------------------------------------------------------------------------

    @handler
    async def unlink(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        if parent_inode in (VDIR, VSTATS, VVERSION):
            raise FUSEError(errno.EPERM)
        await self._listed(parent_inode)
        node = self.index.lookup(parent_inode, name)
        if node is None:
            raise FUSEError(errno.ENOENT)
        if node.is_dir:
            raise FUSEError(errno.EISDIR)
        rel = self._path(node)
        if not node.tier:
            try:
                await self._io(self.store.unlink, rel, tenant=node.tenant)
            except FileNotFoundError:
                log.warning("%s was already gone from the backing directory", rel)
        self._audit(ctx.uid, ctx.pid, node, "unlink", nbytes=node.size, path=rel)
        if node.block_hash is not None and self.tiering is not None and self._nursery:
            # This host's lower-tier copy goes too; the shared tier's stays (other hosts may
            # be using it): its bucket's lifecycle rules expire it.
            self._nursery.start_soon(self.tiering.delete, self._tier_key(rel), False)
        node = self.index.find(node.inode)
        if node is not None and node.parent != ORPHAN_PARENT:
            self._drop(node)

    @handler
    async def symlink(self, parent_inode: int, name: bytes, target: bytes, ctx: Any
                      ) -> pyfuse3.EntryAttributes:
        await self._listed(parent_inode)
        parent = self._new_entry(parent_inode, name, is_dir=False, ctx=ctx)
        gid = self._owner_gid(parent, ctx)
        path = self._join(self._path(parent), name)
        await self._io(self.store.symlink, target, path, ctx.uid, gid)
        tenant, ns = self._child_place(parent, stat.S_IFLNK)
        node = self.index.insert(parent=parent.inode, name=name, mode=stat.S_IFLNK | 0o777,
                                 uid=ctx.uid, gid=gid, size=len(target), target=target,
                                 tenant=tenant, ns=ns)
        self._dir_changed(parent.inode)
        self._ref(node.inode)
        return self._attrs(node)

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
        _check_name(name_new)
        await self._listed(parent_old)
        await self._listed(parent_new)
        node = self.index.lookup(parent_old, name_old)
        if node is None:
            raise FUSEError(errno.ENOENT)
        new_parent = self.index.get(parent_new)
        if not new_parent.is_dir:
            raise FUSEError(errno.ENOTDIR)
        target = self.index.lookup(parent_new, name_new)
        if target is not None and target.is_dir:
            await self._listed(target.inode)  # replaced only if empty
            target = self.index.lookup(parent_new, name_new)
        at_top = (parent_old == ROOT_INODE, parent_new == ROOT_INODE)
        if at_top == (True, True):
            if not TENANT_RE.match(name_new):
                raise FUSEError(errno.EINVAL)
        elif any(at_top):
            raise FUSEError(errno.EPERM)  # files and namespaces live below a tenant
        elif node.tenant != new_parent.tenant:
            raise FUSEError(errno.EXDEV)  # tenants share nothing; mv copies instead
        if flags & pyfuse3.RENAME_EXCHANGE and target is None:
            raise FUSEError(errno.ENOENT)
        if flags & pyfuse3.RENAME_NOREPLACE and target is not None:
            raise FUSEError(errno.EEXIST)
        old_path = self._path(node)
        new_path = self._join(self._path(new_parent), name_new)
        # A pinned file's new directory is marked as holding pins first (store.mark_pins).
        marks = [self._path(new_parent)] if node.is_reg and node.pinned else []
        if flags & pyfuse3.RENAME_EXCHANGE and target is not None and target.is_reg and (
                target.pinned):
            marks.append(self._path(self.index.get(parent_old)))

        def move() -> None:
            for rel in marks:
                self.store.mark_pins(rel)
            self.store.rename(old_path, new_path, flags)

        await self._io(move)
        self._audit(ctx.uid, ctx.pid, node, "rename", path=old_path,
                    to=new_path.decode(errors="replace"))
        # Re-read everything: other requests may have run during the await.
        node = self.index.get(node.inode)
        new_parent = self.index.get(parent_new)
        target = self.index.lookup(parent_new, name_new)
        with self.index.transaction():
            if flags & pyfuse3.RENAME_EXCHANGE and target is not None:
                old_parent = self.index.get(parent_old)
                self.index.move(target.inode, ORPHAN_PARENT, b"#x%d" % target.inode)
                self.index.move(node.inode, parent_new, name_new)
                self.index.move(target.inode, parent_old, name_old)
                self._replace_place(target, old_parent)
            else:
                if target is not None and target.inode != node.inode:
                    self._drop(target)
                self.index.move(node.inode, parent_new, name_new)
            self._replace_place(node, new_parent)
            self._dir_changed(parent_old, parent_new)
            self.index.update(node.inode, ctime_ns=time.time_ns())
        if node.is_dir or (target is not None and target.is_dir):
            self._forget_dir_paths()
        if node.is_reg and node.inode not in self.open_files and (
                node.block_hash is not None or hashing.parse_block_filename(
                    name_new.decode(errors="replace")) is not None):
            await self._complete(node.inode)  # renamed into (or out of) a block's name

    def _replace_place(self, node: Node, new_parent: Node) -> None:
        """After a move: give a subtree the tenant and namespace of its new place."""
        if new_parent.inode == ROOT_INODE:
            return  # a renamed tenant keeps its inode, hence its place
        tenant, ns = self._child_place(new_parent, node.mode)
        if node.is_dir and ns == 0:
            ns = node.inode  # a directory directly in a tenant is a namespace
        if (tenant, ns) == (node.tenant, node.ns):
            return
        self.index.reassign_subtree(node.inode, tenant, ns)
        self.stats.reset_usage(self.index.usage_by_namespace())
        self._load_policies(tenant)  # block keys carry their namespace

    # -- extended attributes --------------------------------------------------------------

    def _tier_name(self, tier: int) -> str:
        if tier == 0 or self.tiering is None or tier > len(self.tiering.tiers):
            return "hot"
        return self.tiering.tiers[tier - 1].name

    LIMIT_XATTRS = {control.limit_name(n): n for n in Limits.names()}
    PIN = control.PIN

    def _kvfs_xattrs(self, node: Node) -> dict[bytes, bytes]:
        out = {control.TIER: self._tier_name(node.tier).encode()}
        if node.inode != ROOT_INODE:
            out[control.BACKING] = self.store.path(self._path(node))
        if node.is_dir and self.tiering is not None:
            out[control.TIERS] = ",".join(t.name for t in self.tiering.tiers).encode()
        if node.block_hash is not None:
            out[control.BLOCK_HASH] = node.block_hash.hex().encode()
            out[control.PARENT_HASH] = (node.parent_hash or b"").hex().encode()
        if node.pinned:
            out[self.PIN] = b"1"
        if node.inode == node.tenant:
            limits = self.limits.get(node.inode, Limits())
            for xname, name in self.LIMIT_XATTRS.items():
                out[xname] = limits.render(name).encode()
            out[control.USED] = str(self.stats.tenant_bytes(node.inode)).encode()
        return out

    @handler
    async def getxattr(self, inode: int, name: bytes, ctx: Any) -> bytes:
        if not name.startswith(b"user."):
            # Only the user namespace exists here (as setxattr says): ENOTSUP, not ENODATA,
            # tells tools such as `ls -l` that asking this file system again is pointless.
            raise FUSEError(errno.ENOTSUP)
        if inode < 1000 and inode != ROOT_INODE:
            raise FUSEError(pyfuse3.ENOATTR)
        node = self.index.get(inode)
        if name.startswith(control.XATTR_PREFIX):
            value = self._kvfs_xattrs(node).get(name)
            if value is None:
                raise FUSEError(pyfuse3.ENOATTR)
            return value
        return await self._io(self.store.getxattr, self._path(node), name, tenant=node.tenant)

    @handler
    async def listxattr(self, inode: int, ctx: Any) -> list[bytes]:
        if inode < 1000 and inode != ROOT_INODE:
            return []
        node = self.index.get(inode)
        names = list(self._kvfs_xattrs(node))
        if node.inode != ROOT_INODE:
            names += await self._io(self.store.listxattr, self._path(node), tenant=node.tenant)
        return names

    @handler
    async def setxattr(self, inode: int, name: bytes, value: bytes, ctx: Any) -> None:
        if inode < 1000 or not name.startswith(b"user."):
            raise FUSEError(errno.ENOTSUP if inode >= 1000 else errno.EPERM)
        node = self.index.get(inode)
        if name in control.COMMANDS:
            await self._command(node, name, value, ctx)
        elif name == self.PIN:
            pinned = value.strip() not in (b"0", b"", b"false", b"no")
            await self._pin(node, pinned)
            self._audit(ctx.uid, ctx.pid, node, "pin" if pinned else "unpin")
        elif name in self.LIMIT_XATTRS:
            await self._set_limit(node, self.LIMIT_XATTRS[name], value, ctx)
            self._audit(ctx.uid, ctx.pid, node, "limit", limit=self.LIMIT_XATTRS[name],
                        value=value.decode(errors="replace"))
        elif name.startswith(control.XATTR_PREFIX):
            raise FUSEError(errno.EPERM)  # kvfs's own attributes are read-only
        else:
            await self._io(self.store.setxattr, self._path(node), name, value, tenant=node.tenant)

    @handler
    async def removexattr(self, inode: int, name: bytes, ctx: Any) -> None:
        if inode < 1000 or not name.startswith(b"user."):
            raise FUSEError(errno.ENOTSUP if inode >= 1000 else errno.EPERM)
        node = self.index.get(inode)
        if name == self.PIN:
            await self._pin(node, False)
        elif name in self.LIMIT_XATTRS:
            await self._set_limit(node, self.LIMIT_XATTRS[name], b"none", ctx)
        elif name.startswith(control.XATTR_PREFIX):
            raise FUSEError(errno.EPERM)
        else:
            await self._io(self.store.removexattr, self._path(node), name, tenant=node.tenant)

    async def _pin(self, node: Node, pinned: bool) -> None:
        """Pin (never evict nor expire) or unpin a file. The kernel has checked that the
        caller may write the file."""
        if not node.is_reg or node.tenant == 0:
            raise FUSEError(errno.EINVAL)
        await self._io(self.store.set_pin, self._path(node), pinned, tenant=node.tenant)
        node = self.index.get(node.inode)
        self.index.update(node.inode, pinned=int(pinned))
        self._policy(node.tenant).pin(self._pkey(node), pinned)

    async def _set_limit(self, node: Node, name: str, value: bytes, ctx: Any) -> None:
        """Set a tenant's limit: only root (or the mount's owner), never the tenant itself."""
        if node.inode != node.tenant:
            raise FUSEError(errno.EINVAL)  # limits live on tenant directories
        if ctx.uid not in (0, self.owner_uid):
            raise FUSEError(errno.EPERM)
        try:
            parsed = Limits.parse(name, value.decode())
        except (ValueError, UnicodeDecodeError) as exc:
            log.warning("refused %s=%r on tenant %s: %s", name, value, node.name, exc)
            raise FUSEError(errno.EINVAL) from None
        limits = self.limits.setdefault(node.inode, Limits())
        text = None if parsed is None else Limits(**{name: parsed}).render(name)
        await self._io(self.store.write_limit, node.name, name, text)
        setattr(limits, name, parsed)
        log.info("tenant %s: %s = %s", node.name.decode(errors="replace"), name, text or "none")
        if name == "quota" and limits.quota is not None:
            over = max(0, self.stats.tenant_bytes(node.inode) - limits.quota)
            if over:
                await self.evict(over, node.inode)
        elif name in ("max_idle", "max_age"):
            await self.expire()

    # -- the direct path's control commands --------------------------------------------------

    async def _command(self, dnode: Node, name: bytes, value: bytes, ctx: Any) -> None:
        # The kernel has checked write permission on the directory (default_permissions).
        if not dnode.is_dir or dnode.ns == 0:
            raise FUSEError(errno.EINVAL)  # commands address a model-namespace directory
        op = name.decode().rpartition(".")[2]
        blocks = len(value) // control.HASH_LEN if name != control.ACCESS else 0
        self._audit(ctx.uid, ctx.pid, dnode, op, blocks=blocks)
        await self._listed(dnode.inode)
        try:
            if name == control.PUBLISH:
                await self._publish(dnode, control.unpack_hashes(value), ctx)
            elif name == control.ACCESS:
                access = control.Access.unpack(value)
                await self._listed_fans(dnode, access.hashes)
                self._access(dnode, access)
            elif name == control.CORRUPT:
                await self._corrupt(dnode, control.unpack_hashes(value))
            elif name == control.FETCH:
                await self._fetch_many(dnode, *control.unpack_fetch(value))
            elif self._nursery is not None:
                self._nursery.start_soon(self._fetch_many, dnode,
                                         control.unpack_hashes(value))
        except control.ControlError as exc:
            log.warning("refused %s from uid %d: %s", name.decode(), ctx.uid, exc)
            raise FUSEError(errno.EINVAL) from None

    async def _listed_fans(self, dnode: Node, hashes: list[bytes]) -> None:
        """Make sure the fan-out directories of these blocks are indexed (see _listed)."""
        if not self.unlisted:
            return
        for fan in sorted({h[:1].hex().encode() for h in hashes}):
            fnode = self.index.lookup(dnode.inode, fan)
            if fnode is not None:
                await self._listed(fnode.inode)

    def _inspect_blocks(self, dpath: bytes, rels: list[bytes]
                        ) -> list[tuple[Any, os.stat_result | None, bool]]:
        """Thread: header and stat of each published file (or the error that refuses it),
        and whether its parent block's file is there (placed, or being published by another
        request at the same time)."""
        out: list[tuple[Any, os.stat_result | None, bool]] = []
        for rel in rels:
            try:
                # One verified fd: the header and the stat are of the same regular file.
                head, st = self.store.head(rel, blockfile.HEADER_SIZE)
                hdr = blockfile.check_head(head, st.st_size)
                p = hdr.parent_hash
                parent = p == hashing.ROOT_PARENT or self._is_file(
                    self._join(dpath, hashing.block_relpath(p).encode()))
                out.append((hdr, st, parent))
            except (OSError, blockfile.BlockFormatError) as exc:
                out.append((exc, None, False))
        return out

    def _is_file(self, rel: bytes) -> bool:
        """Thread: whether `rel` is a regular file (reached through no symlink)."""
        try:
            return stat.S_ISREG(self.store.lstat(rel).st_mode)
        except OSError:
            return False

    def _fan_stats(self, dpath: bytes, fans: list[bytes]) -> dict[bytes, os.stat_result]:
        """Thread: the stat of each fan-out directory that is one (not a link to one)."""
        out = {}
        for f in fans:
            try:
                st = self.store.lstat(self._join(dpath, f))
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode):
                out[f] = st
        return out

    async def _publish(self, dnode: Node, hashes: list[bytes], ctx: Any) -> None:
        """Index blocks that a client wrote and renamed into place below `dnode`."""
        await self._listed_fans(dnode, hashes)
        dpath = self._path(dnode)
        rels = [self._join(dpath, hashing.block_relpath(h).encode()) for h in hashes]
        fans = sorted({h[:1].hex().encode() for h in hashes})
        fan_stats = await self._io(self._fan_stats, dpath, fans, tenant=dnode.tenant)
        inspected = await self._io(self._inspect_blocks, dpath, rels, tenant=dnode.tenant)
        fresh, dropped = [], []
        policy, now = self._policy(dnode.tenant), time.time()
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
            fnode = self.index.lookup(dnode.inode, h[:1].hex().encode())
            if fnode is not None and self.index.lookup(
                    fnode.inode, hashing.block_filename(h).encode()) is not None:
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
                self.stats.by_ns[self._key(dnode)].refused_blocks += 1
                continue
            placed.add(h)
            fresh.append((h, rel, hdr, st))
        if dropped:
            await self._io(self.store.unlink_many, dropped)
        try:
            sizes = [st.st_size for _, _, _, st in fresh]
            await self._make_room(dnode, sum(sizes), max(sizes, default=0))
        except FUSEError:
            # Nothing is left behind by a write that cannot be placed.
            await self._io(self.store.unlink_many, [rel for _, rel, _, _ in fresh])
            raise
        dnode = self.index.get(dnode.inode)
        key = self._key(dnode)
        c = self.stats.by_ns[key]
        changed: set[int] = set()  # directories with new entries
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
                if self.index.lookup(fnode.inode, fname) is not None:
                    continue  # content-addressed: publishing twice changes nothing
                node = self.index.insert(parent=fnode.inode, name=fname, mode=st.st_mode,
                                         uid=st.st_uid, gid=st.st_gid, size=st.st_size,
                                         tenant=dnode.tenant, ns=dnode.ns)
                changed.add(fnode.inode)
                self.index.update(node.inode, block_hash=hdr.block_hash,
                                  parent_hash=hdr.parent_hash)
                self._cache_block(node)
                self._publish_shared(node)
                self.stats.account(key, 1, st.st_size)
                c.published_blocks += 1
                c.published_bytes += st.st_size
            self._dir_changed(*changed)

    async def _fetch_many(self, dnode: Node, hashes: list[bytes],
                          budget: float | None = None) -> None:
        """Promote the blocks of `dnode` that the hot tier lacks, concurrently. With a
        `budget` (seconds), return once it is spent: the fetches still running are not
        cancelled (a block is placed and indexed whole, or not at all) but finish in the
        background, and serve the next request."""
        if self.tiering is None or not self.tiering.reachable():
            return  # no tiers, or every tier's circuit is open: misses, at once
        await self._listed_fans(dnode, hashes)
        if budget is not None and self._nursery is not None:
            done = trio.Event()

            async def all_then_done() -> None:
                try:
                    await self._fetch_many(dnode, hashes)
                finally:
                    done.set()

            self._nursery.start_soon(all_then_done)
            with trio.move_on_after(budget):
                await done.wait()
            return

        async def one(h: bytes) -> None:
            try:
                fan = await self._fan_dir(self.index.get(dnode.inode), h[:1].hex().encode())
            except OSError as exc:  # the tenant's tree is not as indexed: a miss
                log.warning("not fetching %s: %s", h.hex(), exc)
                return
            name = hashing.block_filename(h).encode()
            node = self.index.lookup(fan.inode, name)
            if node is None or node.tier:
                await self._fetch_block(fan, name, node)

        try:
            async with trio.open_nursery() as nursery:
                for h in hashes:
                    nursery.start_soon(one, h)
        except Exception:
            log.exception("fetching %d blocks failed", len(hashes))

    def _access(self, dnode: Node, a: control.Access) -> None:
        c = self.stats.by_ns[self._key(dnode)]
        c.lookups += a.lookups
        c.hit_blocks += a.hit_blocks
        c.miss_blocks += a.miss_blocks
        c.hit_tokens += a.hit_tokens
        c.miss_tokens += a.miss_tokens
        c.direct_read_bytes += a.read_bytes
        c.direct_needed_bytes += a.needed_bytes
        if a.hashes:
            now = time.time_ns()
            policy = self._policy(dnode.tenant)
            entered = False
            for h in a.hashes:
                if (dnode.ns, h) not in policy:  # cold (or not cached here: then skipped)
                    node = self.index.find_block(dnode.ns, h)
                    if node is None or node.tier or node.parent == ORPHAN_PARENT:
                        continue
                    self._enter(node, now / 1e9)
                    entered = True
                policy.access((dnode.ns, h), now / 1e9)
                # Access times reach the index in batches (flush_atimes): the control call
                # costs what the policy and the counters cost, not one UPDATE per block.
                self._atimes[(dnode.ns, h)] = now
            if entered:
                self._bound()

    def _verify_block(self, rel: bytes) -> str | None:
        """Thread: None if the block file is sound, else what is wrong with it (read on a
        verified fd of a regular file, bounded by its header)."""
        try:
            blockfile.decode(self.store.read_block(rel))
        except blockfile.BlockFormatError as exc:
            return str(exc)
        return None

    async def _corrupt(self, dnode: Node, hashes: list[bytes]) -> None:
        """A client found these blocks bad: check, and quarantine the ones that are."""
        await self._listed_fans(dnode, hashes)
        for h in hashes:
            node = self.index.find_block(dnode.ns, h)
            if node is None:
                continue
            rel = self._path(node)
            try:
                problem = await self._io(self._verify_block, rel, tenant=dnode.tenant)
            except OSError as exc:
                log.warning("not checking %s: %s", rel.decode(errors="replace"), exc)
                continue
            if problem is None:
                continue  # the client's read was bad, not the file
            await self._io(self.store.quarantine, rel, tenant=dnode.tenant)
            node = self.index.find(node.inode)
            if node is not None and node.parent != ORPHAN_PARENT:
                self._drop(node)
            self.stats.by_ns[self._key(dnode)].checksum_failures += 1
            log.warning("quarantined %s: %s", rel.decode(errors="replace"), problem)

    # -- the filesystem as a whole --------------------------------------------------------

    @handler
    async def statfs(self, ctx: Any) -> pyfuse3.StatvfsData:
        st = await self._io(self.store.statvfs)
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

    @handler
    async def access(self, inode: int, mode: int, ctx: Any) -> bool:
        return True  # default_permissions: the kernel checks modes itself

    def names_of(self, inodes: set[int]) -> dict[int, str]:
        out = {}
        for inode in inodes:
            node = self.index.find(inode)
            if node is not None:
                out[inode] = node.name.decode(errors="replace")
        return out

    async def _visible_tenants(self, ctx: Any) -> set[int] | None:
        """The tenants whose counters a caller may see: those whose directory it may enter
        (search permission, by its uid, gid and supplementary groups); None (all) for root
        and the mount's owner. Model names and usage are the tenant's data too."""
        if ctx.uid in (0, self.owner_uid):
            return None
        groups = {ctx.gid} | await self._io(_groups_of, ctx.pid)
        out = set()
        for t in self.index.tenants():
            if t.uid == ctx.uid:
                bit = stat.S_IXUSR
            elif t.gid in groups:
                bit = stat.S_IXGRP
            else:
                bit = stat.S_IXOTH
            if t.mode & bit:
                out.add(t.inode)
        return out

    def snapshot(self, tenants: set[int] | None = None) -> dict[str, Any]:
        """Everything `.kvfs/stats.json` shows; the counters of `tenants` only (None: all)."""
        keys = set(self.stats.by_ns)
        names = self.names_of({t for t, _ in keys} | {n for _, n in keys if n > 0})
        return {
            "version": __version__,
            "pid": self.info.pid,
            "mountpoint": self.info.mountpoint,
            "backing": self.info.backing,
            "uptime_s": round(time.time() - self.info.started, 3),
            "capacity_bytes": self.info.capacity,
            "used_bytes": self.stats.used_bytes,
            "files": self.stats.total_files,
            "open_files": len(self.open_files),
            # Files with eviction state in memory (at most policy_entries); the others are
            # cold: cached, known to the index only, evicted first.
            "policy": {"name": self.info.policy, "entries_limit": self.info.policy_entries,
                       "entries": sum(len(p) for p in self.policies.values())},
            "tenants": self.stats.render(names, tenants),
            "tiers": self._tiers_snapshot(),
            # A tree adopted at its first mount until every directory is indexed: usage and
            # eviction see only what is indexed so far.
            "indexing": {"directories_left": len(self.unlisted),
                         "entries_indexed": self.reconciler.report.entries},
        }

    def _tiers_snapshot(self) -> list[dict[str, Any]]:
        if self.tiering is None:
            return []
        out = self.tiering.snapshot()
        known = self.index.tier_usage()
        for i, t in enumerate(out, start=1):
            t["known_files"], t["known_bytes"] = known.get(i, (0, 0))
        return out

    def _stats_json(self, tenants: set[int] | None = None) -> bytes:
        return json.dumps(self.snapshot(tenants), indent=2, sort_keys=True).encode() + b"\n"


def _groups_of(pid: int) -> set[int]:
    """Thread: the supplementary groups of a process (none if it is gone)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Groups:"):
                    return {int(g) for g in line.split()[1:]}
    except (OSError, ValueError):
        pass
    return set()
