"""Adoption: indexing files and trees the index never saw.

A backing tree adopted at its first mount is indexed a directory at a time: when a request
first needs one whole (`ensure_listed`), one name for a lookup (`ensure_named`), and in the
background (`run`). Files that appear under a block's name are checked before the index calls
them blocks: closed by their last writer (`complete`), or published by a client that wrote
them straight into the backing tree (`inspect_blocks`, `fan_stats`, used by kvfs.daemon.commands).

Shared state (event loop only; statements between awaits are atomic):
- `unlisted`, `_to_list`: directories not listed yet; filled at mount and by each listing
  (its new subdirectories), emptied by listings (the background `run` task and requests).
- `_listing`: one event per listing in flight, so that a request waits for the running
  listing of a directory instead of starting a second one.
- `_inserting`: listings past their read, writing the index (a lookup then waits for them).
"""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
import stat
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import trio
from pyfuse3 import FUSEError

from ..format import blockfile, hashing
from . import scanner
from .index import ORPHAN_PARENT, Node
from .tree import Tree, join

log = logging.getLogger(__name__)


class Adoption:
    #: Entries indexed per transaction; requests are served between two.
    LIST_CHUNK = 1024

    def __init__(self, tree: Tree) -> None:
        self.tree = tree
        self.index = tree.index
        # Directories of an adopted tree whose entries are not indexed yet.
        self.unlisted: set[int] = set(self.index.unlisted())
        self._to_list: deque[int] = deque(sorted(self.unlisted))
        self._listing: dict[int, trio.Event] = {}
        self._inserting: set[int] = set()  # listings past their read, writing the index
        self.reconciler = scanner.Reconciler(self.index, tree.store, verify=False, progress=None)
        # Temporaries older than this were left before this mount: a listing removes them.
        self._started_ns = time.time_ns()
        #: Called after a listing added usage (kvfs.daemon.reclaim wakes the evictor if over).
        self.after_growth: Callable[[], None] = lambda: None

    async def ensure_listed(self, inode: int) -> None:
        """Make sure the index holds a directory's entries: here, when a request first needs
        one whole (readdir, every change to it, a control command). A request that needs a
        directory being listed waits for that listing (a lookup only for its last part, when
        it writes the index: see `ensure_named`)."""
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

    async def _list_dir(self, inode: int) -> None:
        tree = self.tree
        node = self.index.find(inode)
        if node is None or node.parent == ORPHAN_PARENT or not node.is_dir:
            self.index.mark_listed(inode)  # gone, or moved over meanwhile
            self.unlisted.discard(inode)
            return
        drel = tree.path(node)
        try:
            listing = await tree.io(self.reconciler.prepare, drel, None, self._started_ns,
                                    tenant=node.tenant)
        except FileNotFoundError:
            listing = scanner.Listing([], False, {})  # gone behind our back: nothing to index
        except OSError as exc:
            log.error("cannot list %s in the backing directory: %s",
                      drel.decode(errors="replace"), exc)
            raise FUSEError(errno.EIO) from None
        # Meanwhile lookups may have indexed single names (they are known below); the
        # directory itself may have moved: then read it again at its new place.
        node = self.index.find(inode)
        if node is None or node.parent == ORPHAN_PARENT or tree.path(node) != drel:
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
                await tree.io(self.reconciler.quarantine_bad, drel, listing, before)
        except (sqlite3.Error, OSError, blockfile.BlockFormatError, ValueError):
            log.exception("indexing %s failed", drel.decode(errors="replace"))
            raise FUSEError(errno.EIO) from None
        finally:
            self._inserting.discard(inode)
        for n in gone:
            if n.is_reg:
                tree.unaccount(n)
        if any(n.is_dir for n in gone):  # its indexed files went with it: count again
            tree.stats.reset_usage(self.index.usage_by_namespace())
        self.unlisted.discard(inode)
        self.after_growth()

    def _index_entries(self, node: Node, drel: bytes, listing: scanner.Listing,
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
                self.tree.stats.account((row[9], row[10]), 1, row[5])

    async def ensure_named(self, parent_inode: int, name: bytes) -> None:
        """For a lookup: make sure the index holds `name` in a directory if the backing tree
        has it. In a directory not listed yet that costs one lstat (in a thread), not a
        listing: the entry is indexed alone and the directory stays unlisted (its listing,
        later, finds the entry known). Requests that change a directory list it whole
        (`ensure_listed`) instead: a listing never runs beside a change to the same one."""
        if parent_inode not in self.unlisted:
            return
        # A listing that is reading the directory does not stop this (it takes what the
        # index has once its read is done); one that is writing the index does.
        writing = parent_inode in self._inserting
        if not writing and self.index.lookup(parent_inode, name) is None:
            node = self.index.find(parent_inode)
            if node is None or node.parent == ORPHAN_PARENT or not node.is_dir:
                return
            drel = self.tree.path(node)
            listing = await self.tree.io(self.reconciler.prepare, drel, [name],
                                         self._started_ns, tenant=node.tenant)
            writing = parent_inode in self._inserting
            if (not writing and parent_inode in self.unlisted
                    and self.index.lookup(parent_inode, name) is None):
                self._index_entries(node, drel, listing, {}, set(), listing.entries)
                if listing.bad:
                    await self.tree.io(self.reconciler.quarantine_bad, drel, listing, set())
        if writing:
            await self._listing[parent_inode].wait()  # it has the name, when it is done
            if parent_inode in self.unlisted:  # ... unless it failed
                await self.ensure_named(parent_inode, name)

    async def run(self) -> None:
        """Background task: index the directories of an adopted tree that no request has
        named yet, two listings at a time (one reads the backing tree while the other writes
        the index)."""
        if not self.unlisted:
            return
        start, report = time.monotonic(), self.reconciler.report
        log.info("indexing the backing tree: %d directories to list", len(self.unlisted))

        async def worker() -> None:
            last = 0
            while self._to_list:
                inode = self._to_list.popleft()
                try:
                    await self.ensure_listed(inode)
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

    async def listed_fans(self, dnode: Node, hashes: list[bytes]) -> None:
        """Make sure the fan-out directories of these blocks are indexed."""
        if not self.unlisted:
            return
        for fan in sorted({h[:1].hex().encode() for h in hashes}):
            fnode = self.index.lookup(dnode.inode, fan)
            if fnode is not None:
                await self.ensure_listed(fnode.inode)

    # -- the publish checks ---------------------------------------------------------------

    async def complete(self, inode: int) -> None:
        """The last writer closed a file (or it was renamed): if it is named as a block,
        verify its header and publish it as a block. Anything else stays an ordinary file."""
        tree, residency = self.tree, self.tree.residency
        node = self.index.find(inode)
        if node is None or node.parent == ORPHAN_PARENT:
            return
        block_hash = hashing.parse_block_filename(node.name.decode(errors="replace"))
        if block_hash is None:
            if node.block_hash is not None:
                residency.unblock(node)
                self.index.update(inode, block_hash=None, parent_hash=None)
            return
        try:
            head, size = await tree.io(tree.store.read_head, tree.path(node),
                                       blockfile.HEADER_SIZE, tenant=node.tenant)
        except OSError as exc:
            log.warning("%s is named as a block but cannot be read as one (%s)",
                        tree.path(node).decode(errors="replace"), exc)
            return
        try:
            hdr = blockfile.check_head(head, size, block_hash)
        except blockfile.BlockFormatError as exc:
            log.warning("%s is named as a block but is not one (%s): kept as a plain file",
                        tree.path(node).decode(errors="replace"), exc)
            return
        node = self.index.find(inode)
        if node is not None and inode not in tree.open_files:
            self.index.update(inode, block_hash=hdr.block_hash, parent_hash=hdr.parent_hash)
            residency.enter_block(node)
            tree.publish_shared(node)

    def inspect_blocks(self, dpath: bytes, rels: list[bytes], hashes: list[bytes]
                       ) -> list[tuple[Any, os.stat_result | None, bool]]:
        """Thread: header and stat of each published file `rels[i]` (block `hashes[i]`), or
        the error that refuses it, and whether its parent block's file is there (placed, or
        being published by another request at the same time). A parent published earlier
        in the same batch is not looked for: the batch's own verdict on it decides."""
        out: list[tuple[Any, os.stat_result | None, bool]] = []
        earlier: set[bytes] = set()
        for rel, h in zip(rels, hashes, strict=True):
            try:
                # One verified fd: the header and the stat are of the same regular file.
                head, st = self.tree.store.head(rel, blockfile.HEADER_SIZE)
                hdr = blockfile.check_head(head, st.st_size)
                p = hdr.parent_hash
                parent = p == hashing.ROOT_PARENT or (p not in earlier and self._is_file(
                    join(dpath, hashing.block_relpath(p).encode())))
                out.append((hdr, st, parent))
            except (OSError, blockfile.BlockFormatError) as exc:
                out.append((exc, None, False))
            earlier.add(h)
        return out

    def _is_file(self, rel: bytes) -> bool:
        """Thread: whether `rel` is a regular file (reached through no symlink)."""
        try:
            return stat.S_ISREG(self.tree.store.lstat(rel).st_mode)
        except OSError:
            return False

    def fan_stats(self, dpath: bytes, fans: list[bytes]) -> dict[bytes, os.stat_result]:
        """Thread: the stat of each fan-out directory that is one (not a link to one)."""
        out = {}
        for f in fans:
            try:
                st = self.tree.store.lstat(join(dpath, f))
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode):
                out[f] = st
        return out
