"""The scanner of the backing tree: reconciles the index with the tree, which is the truth.

The one scanner of a tree the index does not know, in the daemon's folder because the mount
runs it: at mount (the quick form after an unclean stop; `adopt` for a tree never indexed)
and on first listing (kvfs.daemon.adoption, through :class:`Reconciler`). `kvfs fsck
BACKING_DIR` (kvfs.cli.fsck) runs the full form above it on an unmounted backing directory.
A tree the index has never seen is adopted instead
(`adopt`): the mount lists its top level and serves at once, and the daemon indexes every
other directory with the same checks when a request first names something in it, or in the
background (`Reconciler.prepare` off the event loop, `walk_entries` on it). It:

- drops orphans (nodes the kernel still held when the daemon died);
- removes files that were open for writing when the daemon died (half-written, never complete;
  one only passthrough writers held is kept where its backing file is as they found it)
  and temporaries of the direct path;
- adds what the backing tree has and the index lacks, drops what the index has and the tree
  lacks, and refreshes sizes and types that changed behind the daemon's back;
- checks the header and size of every kvfs-native block it (re)indexes, and with ``verify``
  the payload checksum of every block; what fails is moved to ``.kvfs/quarantine`` and is
  never served.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from ..format import blockfile, hashing
from ..format.layout import HANDOUT_SOCKET, STATE_DIR, TEMP_PREFIX
from .index import ORPHAN_PARENT, ROOT_INODE, WATCHED, Index, Node, ensure_root
from .store import BackingStore

log = logging.getLogger(__name__)


@dataclass
class Changes:
    """One kind of change: how many, and the first few paths (a million-file rebuild must
    not keep a million strings)."""

    count: int = 0
    examples: list[str] = field(default_factory=list)
    keep = 100

    def add(self, path: str | bytes) -> None:
        self.count += 1
        if len(self.examples) < self.keep:
            self.examples.append(path if isinstance(path, str) else
                                 path.decode(errors="replace"))


@dataclass
class FsckReport:
    orphans: int = 0
    added: Changes = field(default_factory=Changes)
    dropped: Changes = field(default_factory=Changes)
    updated: Changes = field(default_factory=Changes)
    removed_partial: Changes = field(default_factory=Changes)
    removed_temp: Changes = field(default_factory=Changes)
    quarantined: Changes = field(default_factory=Changes)
    blocks_verified: int = 0
    entries: int = 0
    seconds: float = 0.0

    @property
    def changes(self) -> int:
        return self.orphans + sum(c.count for c in (
            self.added, self.dropped, self.updated, self.removed_partial, self.removed_temp,
            self.quarantined))

    def summary(self) -> str:
        return (
            f"{self.entries} entries checked in {self.seconds:.1f} s: "
            f"{self.added.count} added, {self.dropped.count} dropped, "
            f"{self.updated.count} updated, "
            f"{self.removed_partial.count} partial files removed, "
            f"{self.removed_temp.count} temporaries removed, "
            f"{self.quarantined.count} quarantined, {self.orphans} orphans purged, "
            f"{self.blocks_verified} block checksums verified"
        )


Progress = Callable[[int], None]


@dataclass
class Listing:
    """One directory as the backing tree has it: its entries with their lstat and whether it
    holds pins; from `Reconciler.prepare` also what indexing them reads from the files (block
    headers, link targets, pins), read off the event loop, temporaries left out."""

    entries: list[tuple[bytes, os.stat_result]]
    pins: bool
    blocks: dict[bytes, tuple[bytes, bytes] | None | bool] | None = None
    targets: dict[bytes, bytes] = field(default_factory=dict)
    pinned: set[bytes] = field(default_factory=set)
    #: Files named as blocks that are not (name -> what is wrong): not indexed; quarantined
    #: by `quarantine_bad` unless the daemon knows them (a file it is writing).
    bad: dict[bytes, str] = field(default_factory=dict)

#: A thread reads the next directories (listing, lstat) while one is indexed, so that a
#: cold walk waits less on the disk; more threads only contend for the interpreter.
SCAN_THREADS = 1
SCAN_AHEAD = 8


class Reconciler:
    def __init__(self, index: Index, store: BackingStore, *, verify: bool,
                 progress: Progress | None, lazy: bool = False) -> None:
        self.index = index
        self.store = store
        self.verify = verify
        self.progress = progress
        self.report = FsckReport()
        #: lazy: leave directories that were never listed to the mount (it lists them on
        #: demand); else list them now, like any other.
        self.lazy = lazy
        self.unlisted = set(index.unlisted())

    @staticmethod
    def _show(rel: bytes) -> str:
        return rel.decode(errors="replace")

    def quarantine(self, rel: bytes, reason: str) -> None:
        self.store.quarantine(rel)
        log.warning("quarantined %s: %s", self._show(rel), reason)
        self.report.quarantined.add(self._show(rel))

    def check_block(self, rel: bytes, name: bytes, *, quarantine: bool = True,
                    dirfd: int | None = None) -> tuple[bytes, bytes] | None | bool | str:
        """(hash, parent) for a good kvfs-native block; None for a file that is not named as
        one; for a bad block False (quarantined) or, without `quarantine`, what is wrong. The
        file is read on a verified fd (relative to `dirfd`, the directory's, when given),
        bounded by its header; one that is no longer a regular file (swapped for a link, a
        FIFO) raises FileNotFoundError: gone from what this walk may index."""
        if not name.endswith(b".kv"):
            return None  # cheap first: most names of a big foreign tree are not blocks
        block_hash = hashing.parse_block_filename(name.decode(errors="replace"))
        if block_hash is None:
            return None
        try:
            if self.verify:
                data = (self.store.read_block_at(dirfd, name) if dirfd is not None
                        else self.store.read_block(rel))
                hdr = blockfile.verify_file(data)  # a sealed one: all but its tag
                blockfile.check(hdr, block_hash=block_hash)
                self.report.blocks_verified += 1
            else:
                head, st = (self.store.head_at(dirfd, name, blockfile.HEADER_SIZE)
                            if dirfd is not None else
                            self.store.head(rel, blockfile.HEADER_SIZE))
                hdr = blockfile.check_head(head, st.st_size, block_hash)
        except FileNotFoundError:
            raise
        except OSError as exc:
            log.warning("not indexing %s: %s", self._show(rel), exc)
            raise FileNotFoundError(errno.ENOENT, "not a regular file any more", rel) from exc
        except blockfile.BlockFormatError as exc:
            if not quarantine:
                return str(exc)
            self.quarantine(rel, str(exc))
            return False
        return hdr.block_hash, hdr.parent_hash

    def drop_subtree(self, node: Node, rel: bytes) -> None:
        if node.is_dir:
            for name, inode in self.index.child_names(node.inode).items():
                child = self.index.find(inode)
                if child is not None:
                    self.drop_subtree(child, rel + b"/" + name)
        self.index.delete(node.inode)
        self.report.dropped.add(self._show(rel))

    def add(self, parent: Node, name: bytes, rel: bytes, st: os.stat_result,
            batch: list[tuple] | None = None, pins: bool = True,
            pre: Listing | None = None) -> Node | None:
        """Index a new entry. Files and symlinks go into `batch` (inserted with one statement
        per directory); a directory is inserted at once (its children need its inode).
        What `pre` read already is not read again."""
        target = None
        if stat.S_ISLNK(st.st_mode):
            target = (pre.targets[name] if pre is not None
                      else self.store.readlink(rel))
        elif not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
            log.warning("ignoring %s: not a file, directory or symlink", self._show(rel))
            return None
        block = None
        if stat.S_ISREG(st.st_mode):
            block = (pre.blocks.get(name) if pre is not None and pre.blocks is not None
                     else self.check_block(rel, name))
        if block is False:
            return None
        tenant = parent.tenant if parent.inode != ROOT_INODE else 0
        ns = parent.ns if parent.inode != parent.tenant else 0
        if batch is not None and not stat.S_ISDIR(st.st_mode):
            if pre is not None:
                pinned = name in pre.pinned
            else:
                pinned = pins and stat.S_ISREG(st.st_mode) and self.store.is_pinned(rel)
            size = len(target) if target is not None else st.st_size
            batch.append((parent.inode, name, st.st_mode, st.st_uid, st.st_gid, size,
                          st.st_mtime_ns, st.st_mtime_ns, target, tenant, ns,
                          block[0] if block else None, block[1] if block else None,
                          int(pinned)))
            self.report.added.add(rel)
            return None
        node = self.index.insert(
            parent=parent.inode, name=name, mode=st.st_mode, uid=st.st_uid, gid=st.st_gid,
            size=len(target) if target is not None else (st.st_size if stat.S_ISREG(st.st_mode)
                                                         else 0),
            target=target, tenant=tenant, ns=ns, atime_ns=st.st_mtime_ns,
            mtime_ns=st.st_mtime_ns)
        if block:
            self.index.update(node.inode, block_hash=block[0], parent_hash=block[1])
        if stat.S_ISREG(st.st_mode) and (name in pre.pinned if pre is not None
                                         else self.store.is_pinned(rel)):
            self.index.update(node.inode, pinned=1)
        self.report.added.add(self._show(rel))
        return node

    def scan(self, drel: bytes) -> Listing:
        """Thread: a directory's entries with their lstat, and whether it holds pins. An
        entry that vanishes meanwhile is left out (the next fsck sees the tree as it is)."""
        # Read on an fd of the directory, reached from the root through no symlink: a
        # directory swapped for a link since its parent was listed is ELOOP, not followed.
        out, pins = self.store.listdir(drel)
        return Listing(out, pins)  # no pins: no file is asked for one

    def prepare(self, drel: bytes, names: list[bytes] | None = None,
                temp_before_ns: int | None = None) -> Listing:
        """Thread (the mount's on-demand listing): scan a directory (or only `names` in it)
        and read what indexing its entries needs, so that the event loop only writes the
        index. Bad blocks are only noted (`quarantine_bad` moves them). Temporaries are never
        indexed; they are removed if older than `temp_before_ns` (left by a daemon or client
        before this mount; a newer one is a write under way) or, without it, all."""
        # Everything below is read relative to one fd of the directory, reached from the
        # root through no symlink, and every entry is opened O_NOFOLLOW relative to it.
        try:
            dfd = self.store.opendir(drel)
        except (NotADirectoryError, OSError) as exc:
            if names is not None and exc.errno in (errno.ELOOP, errno.ENOTDIR):
                return Listing([], False, {})  # swapped for a link: nothing of it is indexed
            raise
        try:
            return self._prepare(dfd, drel, names, temp_before_ns)
        finally:
            os.close(dfd)

    def _prepare(self, dfd: int, drel: bytes, names: list[bytes] | None,
                 temp_before_ns: int | None) -> Listing:
        if names is None:
            listing = Listing(self.store.listdir_fd(dfd), self.store.marked(dfd))
        else:
            listing = Listing([], self.store.marked(dfd))
            for name in names:
                try:
                    listing.entries.append(
                        (name, os.stat(name, dir_fd=dfd, follow_symlinks=False)))
                except (FileNotFoundError, NotADirectoryError):
                    continue
        listing.blocks = {}
        kept = []
        for name, st in listing.entries:
            if not drel and name in (STATE_DIR, HANDOUT_SOCKET):
                continue
            rel = drel + b"/" + name if drel else name
            try:
                if name.startswith(TEMP_PREFIX):
                    if temp_before_ns is None or st.st_mtime_ns < temp_before_ns:
                        os.unlink(name, dir_fd=dfd)
                        self.report.removed_temp.add(self._show(rel))
                    continue
                if stat.S_ISREG(st.st_mode):
                    block = self.check_block(rel, name, quarantine=False, dirfd=dfd)
                    if isinstance(block, str):
                        listing.bad[name] = block
                        block = False
                    listing.blocks[name] = block
                    if listing.pins and self.store.is_pinned_at(dfd, name):
                        listing.pinned.add(name)
                elif stat.S_ISLNK(st.st_mode):
                    listing.targets[name] = os.readlink(name, dir_fd=dfd)
            except (FileNotFoundError, IsADirectoryError):
                continue  # gone meanwhile (or swapped for something else)
            kept.append((name, st))
        listing.entries = kept
        return listing

    def quarantine_bad(self, drel: bytes, listing: Listing, known: set[bytes]) -> None:
        """Thread: quarantine the bad blocks a `prepare` found, but those in `known`."""
        for name, reason in listing.bad.items():
            if name not in known:
                try:
                    self.quarantine(drel + b"/" + name if drel else name, reason)
                except FileNotFoundError:
                    pass

    def walk(self) -> None:
        root = ensure_root(self.index, os.lstat(self.store.root))
        stack: list[tuple[Node, bytes]] = [(root, b"")]
        # The next directories' listings and stats are read by threads while this one is
        # indexed: the walk costs about the syscalls or the indexing, not their sum.
        with ThreadPoolExecutor(SCAN_THREADS, thread_name_prefix="fsck-scan") as pool:
            scans: dict[bytes, Future] = {}
            while stack:
                dnode, drel = stack.pop()
                pending = scans.pop(drel, None) or pool.submit(self.scan, drel)
                for _, ahead in stack[-SCAN_AHEAD:]:
                    if ahead not in scans:
                        scans[ahead] = pool.submit(self.scan, ahead)
                try:
                    listing = pending.result()
                except OSError as exc:
                    # Swapped for a link (ELOOP) or a file since its parent was listed: not
                    # followed; its index entries stay until a walk finds it again.
                    log.warning("not listing %s: %s", self._show(drel), exc)
                    continue
                self.walk_dir(dnode, drel, listing, stack)
                if dnode.inode in self.unlisted:
                    self.index.mark_listed(dnode.inode)

    def walk_dir(self, dnode: Node, drel: bytes, listing: Listing,
                 stack: list[tuple[Node, bytes]]) -> None:
        """Reconcile one directory's entries; push its subdirectories onto `stack`."""
        known = self.known(dnode)
        self.walk_entries(dnode, drel, listing, stack, known)
        self.drop_missing(drel, known)

    def known(self, dnode: Node) -> dict[bytes, Node]:
        """What the index has in a directory, whole rows in one query (not one per entry)."""
        return {n.name: n for n in self.index.children(dnode.inode, limit=1 << 62)}

    def walk_entries(self, dnode: Node, drel: bytes, listing: Listing,
                     stack: list[tuple[Node, bytes]], known: dict[bytes, Node],
                     entries: list[tuple[bytes, os.stat_result]] | None = None,
                     refresh: bool = True) -> list[tuple]:
        """Reconcile `entries` (default: all) of a directory with the index's `known` rows
        (each found is taken out of `known`); push subdirectories onto `stack` (with `lazy`,
        not those left to the mount). Returns the rows of the files and links it added.
        Without `refresh` a known file is left as the index has it (the mount's listings:
        the daemon indexed it itself, and may be writing it)."""
        pins = listing.pins
        pre = listing if listing.blocks is not None else None
        batch: list[tuple] = []
        for name, st in listing.entries if entries is None else entries:
            if dnode.inode == ROOT_INODE and name in (STATE_DIR, HANDOUT_SOCKET):
                continue
            rel = drel + b"/" + name if drel else name
            self.report.entries += 1
            if self.progress is not None and self.report.entries % 10000 == 0:
                self.progress(self.report.entries)
            if name.startswith(TEMP_PREFIX):
                try:
                    self.store.unlink(rel)
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    log.warning("not removing %s: %s", self._show(rel), exc)
                self.report.removed_temp.add(self._show(rel))
                continue
            node = known.pop(name, None)
            if node is not None and stat.S_IFMT(node.mode) != stat.S_IFMT(st.st_mode):
                self.drop_subtree(node, rel)
                node = None
            if node is None:
                if dnode.inode == ROOT_INODE and not stat.S_ISDIR(st.st_mode):
                    log.warning("ignoring %s: only tenant directories live at the top",
                                self._show(rel))
                    continue
                try:
                    node = self.add(dnode, name, rel, st, batch, pins, pre)
                except FileNotFoundError:
                    continue  # gone (or no longer what its lstat said) since the listing
                if node is None:
                    continue
            elif refresh and node.is_reg and (node.size != st.st_size or self.verify
                                              or node.tier):
                try:
                    self.refresh(node, rel, st)
                except FileNotFoundError:
                    known[name] = node  # not there as a file: dropped below
                    continue
            if stat.S_ISDIR(st.st_mode) and not (self.lazy and node.inode in self.unlisted):
                stack.append((node, rel))
        self.index.insert_many(batch)
        return batch

    def drop_missing(self, drel: bytes, known: dict[bytes, Node]) -> None:
        """Drop what the index has in a directory and the backing tree no longer has."""
        for name, node in known.items():
            if not node.tier:  # lower-tier blocks have no local file
                self.drop_subtree(node, drel + b"/" + name if drel else name)

    def _unchanged(self, node: Node, rel: bytes) -> bool:
        """Whether a WATCHED file's backing file is as its passthrough writers found it."""
        try:
            st = self.store.lstat(rel)
        except OSError:
            return False
        return (st.st_size, st.st_mtime_ns, st.st_ctime_ns) == (
            node.size, node.mtime_ns, node.ctime_ns)

    def refresh(self, node: Node, rel: bytes, st: os.stat_result) -> None:
        block = self.check_block(rel, node.name)
        if block is False:
            self.index.delete(node.inode)
            return
        changed = node.size != st.st_size or node.tier != 0
        self.index.update(node.inode, size=st.st_size, mtime_ns=st.st_mtime_ns, tier=0,
                          block_hash=block[0] if block else None,
                          parent_hash=block[1] if block else None)
        if changed:
            self.report.updated.add(self._show(rel))

    def remove_partial(self) -> None:
        for node in self.index.writing_nodes():
            rel = self.path_of(node)
            if rel is not None and node.writing == WATCHED and self._unchanged(node, rel):
                self.index.update(node.inode, writing=0)  # opened for writing, not written
                continue
            if rel is not None:
                try:
                    self.store.unlink(rel)
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    log.warning("not removing %s: %s", self._show(rel), exc)
                self.report.removed_partial.add(self._show(rel))
            self.index.delete(node.inode)

    def path_of(self, node: Node) -> bytes | None:
        return path_of(self.index, node)


def path_of(index: Index, node: Node) -> bytes | None:
    """A node's path in the backing tree, from the index (None: not in the namespace)."""
    parts = []
    while node.inode != ROOT_INODE:
        if node.parent == ORPHAN_PARENT:
            return None
        parts.append(node.name)
        parent = index.find(node.parent)
        if parent is None:
            return None
        node = parent
    return b"/".join(reversed(parts))


def reconcile(index: Index, store: BackingStore, *, verify: bool = False,
              progress: Progress | None = None, lazy: bool = False) -> FsckReport:
    """Bring the index in line with the backing tree; return what changed. With `lazy` (the
    mount's quick form) directories never listed are left to the mount, which lists them."""
    start = time.monotonic()
    r = Reconciler(index, store, verify=verify, progress=progress, lazy=lazy)
    bulk = contextlib.nullcontext() if index.has_entries() else index.bulk_load()
    with bulk, index.transaction():
        r.report.orphans = index.purge_orphans()
        r.remove_partial()
        r.walk()
    r.report.seconds = time.monotonic() - start
    return r.report


def adopt(index: Index, store: BackingStore) -> FsckReport:
    """The first mount of a backing tree (an index that holds nothing yet): index its top
    level, the tenants, and leave every tenant directory to be listed by the mount, on
    demand and in the background. A million-file tree mounts in the time of one directory."""
    start = time.monotonic()
    r = Reconciler(index, store, verify=False, progress=None)
    with index.transaction():
        root = ensure_root(index, os.lstat(store.root))
        tenants: list[tuple[Node, bytes]] = []
        listing = r.prepare(b"")
        r.walk_dir(root, b"", listing, tenants)
        r.quarantine_bad(b"", listing, set())
        index.mark_unlisted([t.inode for t, _ in tenants])
    r.report.seconds = time.monotonic() - start
    return r.report
