"""The files the request thread creates, their flushes, releases and renames: what the daemon
keeps of them.

With the bytes passing through, a new file's cost was its CREATE, FLUSH and RELEASE (and for
a temporary renamed into place, its RENAME), each a round trip through pyfuse3's loop. In a
model directory handed over to the request thread (kvfs.daemon.passthrough `hand_dir`) and
while its tenant holds a *grant*, the thread answers them in C (kvfs.daemon._passthrough,
section 3): it makes the backing file O_EXCL in the
directory's fd, owned by the caller, registers it as a backing file and numbers the inode
from a range the daemon leased it from the index's sequence (`lease`); at the FLUSH it takes
the file's growth from the grant, bytes the daemon reserved for that tenant against its
quota and the mount's capacity (`Residency.granted`, `cap_granted`): a growth the grant
cannot cover is the daemon's to settle, evicting or refusing as before. It answers the
RELEASE of a file it settled at its last flush, unchanged since, and a RENAME of a regular
file to a name its directory lacks (renameat2 RENAME_NOREPLACE on the directory's fd).

Before it replies, the thread appends a record to the *journal* (`.kvfs/made.journal`) and
queues it. The daemon `harvest`s the queue at the start of every request it serves (any
request about the new file comes after the reply, so after the record), indexes the files
(being written, as its own create does), registers their handles, counts their growth,
closes what was released and moves what was renamed, in one transaction that also stores
the last record's number (`made_seq`); then it empties the journal. A daemon killed in
between leaves records past `made_seq`: the next mount `replay`s them before it reconciles,
so a file the thread created and nobody flushed is removed as a half-written one, and a
flushed one is kept (under the name a rename gave it), as for the daemon's own.

State (event loop only): `granted` and `cap_granted` live in the residency (they count as
used where room is planned); `by_inode` (inode -> the handle of its creator, while open).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import struct
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from . import scanner
from .handlers import is_full
from .index import Index
from .passthrough import PASS_HEADROOM, _passthrough
from .tree import Tree

if TYPE_CHECKING:
    from .openfiles import OpenFiles
    from .store import BackingStore

log = logging.getLogger(__name__)

#: struct record of the C module: magic, kind, seq, inode, parent, backing inode, size,
#: time_ns, growth, mode, uid, gid, name length, new name length (a rename's), padding,
#: name, new name.
RECORD = struct.Struct("=IIQQQQQqqIIIIII256s256s")
MAGIC = 0x6B76666A
EV_CREATE, EV_FLUSH, EV_RELEASE, EV_RENAME = 1, 2, 3, 4
KINDS = {EV_CREATE: "create", EV_FLUSH: "flush", EV_RELEASE: "release", EV_RENAME: "rename"}
#: The handles the thread gives its files (kvfs.daemon._passthrough C_MADE).
C_MADE = 1 << 62
JOURNAL = "made.journal"
META_SEQ = "made_seq"
#: Inode numbers leased to the thread at once (a new lease when a quarter is left).
LEASE = 4096
#: Bytes granted to a tenant with a quota at once, and to the thread of the capacity.
GRANT = 256 << 20
#: The grant of a tenant without a quota (its growth is limited by the capacity alone).
UNLIMITED = 1 << 60
#: Tenants with a grant at most (the C module's table; beyond, creates are the daemon's).
MAX_TENANTS = 256
#: Free bytes of the backing filesystem below which the thread creates no file: its records
#: must reach the index, which shares that disk; the daemon's own creates are refused there
#: with ENOSPC, and nothing is recorded that the index cannot take.
INDEX_ROOM = 64 << 20


def journal_path(store: BackingStore) -> str:
    return os.path.join(os.fsdecode(store.state_dir), JOURNAL)


def read_journal(path: str) -> list[tuple]:
    """The whole records of a journal, in order (a torn one at its end is left out)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return []
    out = []
    for off in range(0, len(data) - RECORD.size + 1, RECORD.size):
        rec = RECORD.unpack_from(data, off)
        if rec[0] != MAGIC:
            break
        out.append(rec)
    return out


def _backing_ino(index: Index, store: BackingStore, parent: int, name: bytes) -> int | None:
    """The inode number of a regular file `name` in directory `parent`'s backing directory."""
    pnode = index.find(parent)
    prel = scanner.path_of(index, pnode) if pnode is not None else None
    try:
        st = store.lstat(prel + b"/" + name) if prel else None
    except OSError:
        return None
    return st.st_ino if st is not None and stat.S_ISREG(st.st_mode) else None


def replay(index: Index, store: BackingStore) -> int:
    """At mount, before the index is reconciled: what a journal holds past the last harvest
    (a daemon killed between the thread's reply and its harvest), applied as the harvest
    would have: a file created is indexed as being written (the reconcile then removes it,
    half-written, unless a flush record follows, which marks it complete), a rename moves
    its row. Only backing files that are still the ones recorded (their inode numbers) are
    taken. Returns the records read."""
    path = journal_path(store)
    done = int(index.get_meta(META_SEQ) or 0)
    recs = [r for r in read_journal(path) if r[2] > done]
    applied = 0
    if recs:
        created: dict[int, int] = {}  # inode -> backing inode, checked at the end
        with index.transaction():
            for (_, kind, _, ino, parent, bino, size, t, _, mode, uid, gid, nlen, n2len, _,
                 raw, raw2) in recs:
                name = raw[:nlen]
                if kind == EV_CREATE:
                    pnode = index.find(parent)
                    if (pnode is None or not pnode.is_dir or index.find(ino) is not None
                            or index.lookup(parent, name) is not None):
                        continue
                    tenant, ns = Tree.child_place(pnode, stat.S_IFREG)
                    index.insert(parent=parent, name=name, mode=mode, uid=uid, gid=gid,
                                 tenant=tenant, ns=ns, writing=1, inode=ino, atime_ns=t,
                                 mtime_ns=t)
                    created[ino] = bino
                elif kind == EV_FLUSH:
                    node = index.find(ino)
                    if node is None or node.writing != 1:
                        continue
                    index.update(ino, size=size, mtime_ns=t, ctime_ns=t, writing=0)
                elif kind == EV_RENAME:
                    node, new = index.lookup(parent, name), raw2[:n2len]
                    if node is None or not node.is_reg or index.lookup(parent, new) is not None:
                        continue
                    index.move(node.inode, parent, new)
                    if node.inode not in created and _backing_ino(
                            index, store, parent, new) != bino:
                        index.move(node.inode, parent, name)  # not what the thread moved
                        continue
                else:
                    continue
                applied += 1
            for ino, bino in created.items():  # (where renames left them)
                node = index.find(ino)
                if node is not None and _backing_ino(index, store, node.parent,
                                                     node.name) != bino:
                    index.delete(ino)
            index.set_meta(META_SEQ, str(recs[-1][2]))
        log.info("journal of the request thread's creates: %d of %d records applied",
                 applied, len(recs))
    try:
        os.truncate(path, 0)
    except FileNotFoundError:
        pass
    return len(recs)


class Made:
    """The daemon's side of the request thread's creates, flushes, releases and renames
    (module docstring)."""

    def __init__(self, tree: Tree, files: OpenFiles, *, wanted: bool = True) -> None:
        self.tree = tree
        self.files = files
        self.wanted = wanted
        self.started = False
        self.tenants: set[int] = set()  # tenants whose directories the thread creates in
        self.on: set[int] = set()  # those with a grant on
        self.by_inode: dict[int, int] = {}
        # During a harvest: the directories its records changed (-> the last change's time),
        # and those it looked up.
        self._touched: dict[int, int] = {}
        self._parents: dict[int, Any] = {}
        self.leased = 0
        self.creates = self.flushes = self.renames = 0  # harvested
        # A harvest whose transaction failed (the index's disk full): its records stay in
        # the journal for the next mount's replay, and the thread creates nothing more.
        self.halted = False
        self.unindexed: set[int] = set()  # the files of the records the index did not take
        # Set by the owner (kvfs.daemon.door): a name is created (the miss its lookup
        # counted taken back), a passthrough writer is registered, growth to wake eviction
        # for.
        self.creating: Any = lambda parent, name: None
        self.passed: Any = lambda node, h: None
        self.grew: Any = lambda growth: None
        # Whether a tenant may have one more passthrough writer (kvfs.daemon.door
        # `room_to_pass`): near its quota or the capacity, its creates are the daemon's.
        self.room: Any = lambda tenant: True
        # The daemon's release of a handle the thread released, and its check of a file as
        # a block, in the background (kvfs.daemon.fs).
        self.release: Any = lambda fh: None
        self.complete: Any = lambda inode: None
        self.delegate: Any = lambda node: None  # kvfs.daemon.door `delegate`

    # -- starting ---------------------------------------------------------------------------

    def tenant(self, tenant: int) -> int:
        """The tenant a directory handed over now is handed with (0: its creates stay the
        daemon's): started here, once passthrough is known to be on."""
        pt = self.tree.passthrough
        if not (self.wanted and pt.on and pt.routed and tenant):
            return 0
        if not self.started:
            self._start()
        if not self.started or (tenant not in self.tenants and len(self.tenants) >= MAX_TENANTS):
            return 0
        self.tenants.add(tenant)
        self.refresh()
        return tenant

    def _start(self) -> None:
        index = self.tree.index
        try:
            fd = os.open(journal_path(self.tree.store),
                         os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
                         0o600)
        except OSError as exc:
            log.warning("the request thread answers no creates: its journal cannot be opened "
                        "(%s)", exc)
            self.wanted = False
            return
        _passthrough.made_start(fd, int(index.get_meta(META_SEQ) or 0))
        if self.tree.info.capacity is not None:
            _passthrough.cap_add(0)  # flushes here are limited by the capacity's grant
        self.started = self.tree.passthrough.creates_on = True
        self._lease()

    def _lease(self) -> None:
        index = self.tree.index
        if index.db.in_transaction:
            return
        with index.transaction():
            first = index.lease_inodes(LEASE)
        _passthrough.lease(first, first + LEASE)
        self.leased = LEASE

    # -- grants -------------------------------------------------------------------------------

    def refresh(self) -> None:
        """Top up each tenant's grant (a quarter left: up to GRANT, within its quota's free
        bytes; a tenant without a quota has no limit of its own) and the capacity's; turn
        creates off for a tenant near its quota or the capacity, where a writer takes the
        daemon's path (kvfs.daemon.door `room_to_pass`)."""
        if not self.started:
            return
        if self.leased < LEASE // 4:
            self._lease()
        tree, res = self.tree, self.tree.residency
        granted = res.granted
        disk = not self.halted and self._disk_room()
        for t in self.tenants:
            if not disk or not self.room(t):
                if t in self.on:
                    granted[t] -= _passthrough.grant_off(t)
                    self.on.discard(t)
                continue
            limits = res.limits.get(t)
            if limits is not None and limits.quota is not None:
                if granted[t] >= UNLIMITED // 2:
                    granted[t] += _passthrough.grant_add(t, -UNLIMITED)
                # Half of what is free beyond the passthrough writers' headroom: the rest
                # stays for the daemon's own opens and settles.
                free = (limits.quota - tree.stats.tenant_bytes(t) - granted[t]
                        - PASS_HEADROOM * (tree.passthrough.writers[t] + 1)) // 2
                add = min(GRANT - granted[t], free) if granted[t] < GRANT // 4 else 0
            else:
                add = UNLIMITED - granted[t] if granted[t] < UNLIMITED // 2 else 0
            if add > 0 or t not in self.on:
                granted[t] += _passthrough.grant_add(t, max(0, add))
                self.on.add(t)
        cap = tree.info.capacity
        if cap is not None and res.cap_granted < GRANT // 4:
            free = (cap - tree.stats.used_bytes - res.cap_granted
                    - PASS_HEADROOM * (tree.passthrough.writers.total() + 1)) // 2
            add = min(GRANT - res.cap_granted, free)
            if add > 0:
                res.cap_granted += _passthrough.cap_add(add)

    def _disk_room(self) -> bool:
        """Whether the backing filesystem has INDEX_ROOM free (said once when it has not)."""
        try:
            st = self.tree.store.statvfs()
        except OSError:
            return False
        room = st.f_bavail * st.f_frsize >= INDEX_ROOM
        if not room and self.on:
            log.info("the backing filesystem has less than %d MiB free: new files are the "
                     "daemon's to create until it has more", INDEX_ROOM >> 20)
        return room

    def take_back(self) -> None:
        """What the grants have left comes back (before the daemon plans room itself, so
        that bytes reserved but not spent stand in nobody's way); `refresh` grants again."""
        if not self.started:
            return
        res = self.tree.residency
        for t, g in res.granted.items():
            limits = res.limits.get(t)
            if g > 0 and limits is not None and limits.quota is not None:
                res.granted[t] += _passthrough.grant_add(t, -g)
        if res.cap_granted > 0:
            res.cap_granted += _passthrough.cap_add(-res.cap_granted)

    # -- the harvest --------------------------------------------------------------------------

    def harvest(self) -> None:
        """Index what the thread created and count what it flushed since the last harvest:
        at the start of every request the daemon serves, before it looks at anything."""
        if not self.started:
            return
        index = self.tree.index
        if index.db.in_transaction:
            return  # (never at a request's start: the next one takes them)
        got, seq, self.leased = _passthrough.made_harvest()
        if not got:
            return
        self._parents.clear()
        self._touched.clear()
        try:
            growth = self._index(got, seq)
        except Exception as exc:
            self._halt(got, exc)
            return
        if not self.halted:
            _passthrough.made_trim(seq)
        if growth:
            self.grew(growth)
        self.refresh()

    def _index(self, got: list[tuple], seq: int) -> int:
        """One transaction for the harvest's records; the growth they flushed."""
        index, growth = self.tree.index, 0
        with index.transaction():
            for ev in got:
                try:
                    if ev[0] == EV_CREATE:
                        self._created(*ev[2:12], ev[14])
                    elif ev[0] == EV_FLUSH:
                        growth += self._flushed(ev[2], ev[13], ev[14], ev[15])
                    elif ev[0] == EV_RELEASE:
                        self._released(ev[2], ev[3])
                    else:
                        self._renamed(ev[4], ev[5], ev[16], ev[7], ev[9], ev[14])
                except Exception:  # one record must not cost the others theirs
                    log.exception("the request thread's %s of inode %d could not be taken",
                                  KINDS.get(ev[0], "record"), ev[3])
            for parent, now in self._touched.items():  # once a directory, at its last change
                self.tree.dir_changed(parent, now=now)
            if not self.halted:  # (else the journal keeps every record from the failed one on)
                index.set_meta(META_SEQ, str(seq))
        return growth

    def _halt(self, got: list[tuple], exc: Exception) -> None:
        """The index could not take a harvest (its transaction failed, a full disk the
        likely cause), and the daemon's state holds what the records did while the index
        does not: the thread creates no more files on this mount, and the journal keeps
        every record from these on (neither `made_seq` nor the journal move again), so that
        the next mount's replay indexes what they created. What the daemon would do to
        those files now goes unrecorded, so it refuses it (`own`: ENOSPC): a close that the
        thread's flush did not record fails, and the replay removes that file as half
        written."""
        self.unindexed.update(ev[3] for ev in got if ev[0] == EV_CREATE)
        if not self.halted:
            self.halted = True
            self.tree.passthrough.creates_on = False
            self.tree.passthrough.creates_halted = (
                f"the index could not take its records ({exc}): the next mount indexes "
                f"the files they name")
            granted = self.tree.residency.granted
            for t in list(self.on):
                granted[t] -= _passthrough.grant_off(t)
                self.on.discard(t)
        log.error("the index could not take %d of the request thread's records (%s): the "
                  "files they name are indexed at the next mount (the journal keeps them); "
                  "until then new files are the daemon's to create", len(got), exc,
                  exc_info=not is_full(exc))  # (a full disk is no bug: no traceback)

    def _created(self, fh: int, ino: int, parent: int, name: bytes, mode: int, uid: int,
                 gid: int, pid: int, fd: int, backing_id: int, time_ns: int) -> None:
        tree = self.tree
        pnode = self._parents.get(parent)
        if pnode is None:
            pnode = self._parents[parent] = tree.index.get(parent)
        tenant, ns = tree.child_place(pnode, stat.S_IFREG)
        node = tree.index.insert(parent=parent, name=name, mode=mode, uid=uid, gid=gid,
                                 tenant=tenant, ns=ns, writing=1, inode=ino, atime_ns=time_ns,
                                 mtime_ns=time_ns)
        self._touch(parent, max(time_ns, pnode.mtime_ns))  # (as the thread answers)
        self.creating(pnode, name)
        tree.stats.account(tree.key(node), 1, 0)
        tree.residency.add_file(node)
        self.files.register(node, fd, True, SimpleNamespace(uid=uid, pid=pid), created=True,
                            fh=fh)
        tree.ref(ino)
        pt = tree.passthrough
        pt.ids[ino] = [backing_id, 1]
        pt.registered += 1
        self.passed(node, self.files.handles[fh])
        self.by_inode[ino] = fh
        self.creates += 1

    def _touch(self, parent: int, time_ns: int) -> None:
        """Directory `parent` changed at `time_ns`: its times are moved once for the whole
        harvest (`Tree.dir_changed`), to the last of its changes."""
        self._touched[parent] = max(time_ns, self._touched.get(parent, 0))

    def _flushed(self, fh: int, size: int, mtime_ns: int, growth: int) -> int:
        """A flush the thread answered, settled as the daemon settles one (kvfs.daemon.door
        `settle`); the growth taken from the grants counted as used now."""
        h = self.files.handles.get(fh)
        if h is None:
            return 0
        tree, res = self.tree, self.tree.residency
        if growth > 0:
            res.granted[h.key[0]] -= growth
            if tree.info.capacity is not None:
                res.cap_granted -= growth
        of = tree.open_files[h.inode]
        delta = size - of.size
        if delta:
            tree.stats.account(h.key, 0, delta)
            of.size = size
            if delta > 0:
                tree.stats.write(h.key, delta)
                tree.passthrough.write_bytes += delta
                h.nwritten += delta
        of.mtime_ns = mtime_ns
        self.files.flushed(h)
        self.flushes += 1
        return max(0, delta)

    def _released(self, fh: int, ino: int) -> None:
        """A release the thread answered: the handle's file was settled at its last flush
        and is unchanged since; the rest is the daemon's release (`release`)."""
        if self.by_inode.get(ino) == fh:
            del self.by_inode[ino]
        self.release(fh)

    def _renamed(self, parent: int, old: bytes, new: bytes, uid: int, pid: int,
                 time_ns: int) -> None:
        """A rename the thread made: a regular file to a name its directory did not have."""
        tree = self.tree
        node = tree.index.lookup(parent, old)
        if node is None:
            log.warning("the request thread renamed %r, which the index does not have", old)
            return
        old_path = tree.path(node) if tree.audit is not None else b""
        held = tree.passthrough.hold(node.inode)  # delegated, it stays so (as at fs.rename)
        tree.index.move(node.inode, parent, new)
        tree.index.update(node.inode, ctime_ns=max(time_ns, node.ctime_ns))  # (as answered)
        self._touch(parent, time_ns)
        node = tree.index.get(node.inode)
        if held:
            self.delegate(node)
            tree.passthrough.release(node.inode)
        self.renames += 1
        if tree.audit is not None:
            tree.audit_op(uid, pid, node, "rename", path=old_path,
                          to=tree.path(node).decode(errors="replace"))
        if node.inode not in tree.open_files and node.block_hash is not None:
            self.complete(node.inode)  # (a block under another name: the thread renames no
            # file into or out of a block's name, but a hostile tree may name one otherwise)

    # -- the daemon takes over -----------------------------------------------------------------

    def own(self, inode: int) -> None:
        """The daemon is about to change `inode` or open it again: the flushes of its
        creator's handle are the daemon's from now on (what the thread settled before is
        harvested first)."""
        fh = self.by_inode.get(inode)
        if fh is not None:
            _passthrough.made_drop(fh, True)
            self.harvest()
        if inode in self.unindexed:
            raise OSError(errno.ENOSPC, "the index could not take this file (its disk full)")

    def released(self, fh: int, inode: int) -> None:
        """The creator's handle is released: out of the thread's table before its fd is
        closed."""
        if fh & C_MADE and self.started:
            _passthrough.made_drop(fh)
            if self.by_inode.get(inode) == fh:
                del self.by_inode[inode]
