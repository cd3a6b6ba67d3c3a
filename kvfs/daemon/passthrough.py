"""FUSE passthrough: the kernel reads and writes a hot file's backing file itself.

The daemon authorizes an open (its strict resolution gives the backing fd, the index says
what the file is and who may grow it), registers that fd on /dev/fuse
(FUSE_DEV_IOC_BACKING_OPEN, one backing id per inode while it has passthrough opens) and names
the id in its OPEN/CREATE reply; from then on the file's reads, writes and mmap never reach
the daemon. Lookups, opens, flushes, releases, attributes and the namespace still do.
libfuse 3.14 cannot write those replies, so kvfs's C module `kvfs.daemon._passthrough` completes
them (docs/architecture.md, "The mount door"). Where the kernel, the privileges or the
module refuse, every open takes the daemon's own path, and `kvfs status` says why.

What the daemon has decided once it need not decide again: the module's request thread reads
/dev/fuse and answers in C the read-only opens (and their releases and attributes) of the
complete hot files the daemon *delegated* to it (`delegate`, after the daemon's own
passthrough open of one, or the last close of its writer), until the daemon takes one back
(`revoke`: before anything about it changes, see `Index.changed`). The opens it answered are
collected (`harvest`) and counted as the daemon counts its own. It also answers the lookups
of names missing from the model directories *handed over* to it (`hand_dir`), from an fd of
the backing directory, until the directory goes (`take_dir`); the misses it counted are
collected the same way (`harvest_misses`).

State (event loop only): `ids` (inode -> [backing id, references: passthrough handles, and
one while the inode is delegated or its delegated opens are still open]), `delegated`
(inode -> (stats key, size)), `lingering`, `dirs` (inode -> stats key), `status`.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import struct
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any

import trio

log = logging.getLogger(__name__)

try:
    from . import _passthrough
except ImportError:  # not built: the daemon serves every byte itself
    _passthrough = None  # type: ignore[assignment]

#: _IOW(229, 1, struct fuse_backing_map {i32 fd; u32 flags; u64 padding}) and
#: _IOW(229, 2, u32): include/uapi/linux/fuse.h.
BACKING_OPEN = 0x4010E501
BACKING_CLOSE = 0x4004E502
#: statfs f_type of file systems that are themselves stacked (overlayfs, FUSE, eCryptfs):
#: the kernel then needs a max_stack_depth of 2 to stack the mount on them.
STACKED = {0x794C7630, 0x65735546, 0xF15F}
#: Free bytes a passthrough writer needs in its tenant's quota and in the capacity, beside
#: those of the other passthrough writers (kvfs.daemon.door `Door.room_to_pass`): what it may write
#: before its close settles it. Nearer a limit, writers take the daemon's path.
PASS_HEADROOM = 64 << 20
#: How long after the mount the INIT reply may take before passthrough is given up.
INIT_WAIT = 10.0
#: Slots of the request thread's table (a power of two); at most half are live (the module
#: takes no more): the attributes of MAX_ATTRIBUTES directories (those changed last) and
#: delegated inodes, the least recently delegated taken back first. Each delegated one holds
#: a backing file open in the kernel (no fd of the daemon's). The two limits share the half,
#: so that a mount with many files delegated still has room for the attributes of the
#: directories it creates in: without them the kernel's GETATTR of a directory before each
#: create there (its attributes are stale after every create) is a round trip through the
#: daemon's loop.
TABLE_SLOTS = 1 << 15
MAX_ATTRIBUTES = 2048
MAX_DELEGATED = TABLE_SLOTS // 2 - MAX_ATTRIBUTES
#: Directories handed over at most (the module's table has twice the slots), the least
#: recently handed over taken back first. Each holds an fd of its backing directory (so at
#: most a quarter of the daemon's open-file limit, `hook`).
MAX_DIRS = 2048
#: struct fuse_attr (include/uapi/linux/fuse.h): ino, size, blocks, atime, mtime, ctime,
#: their nanoseconds, mode, nlink, uid, gid, rdev, blksize, flags.
FUSE_ATTR = struct.Struct("=QQQQQQIIIIIIIIII")


def fuse_attr(a: Any) -> bytes:
    """A pyfuse3.EntryAttributes as the kernel's struct fuse_attr."""
    sec = 1_000_000_000
    return FUSE_ATTR.pack(a.st_ino, a.st_size, a.st_blocks, a.st_atime_ns // sec,
                          a.st_mtime_ns // sec, a.st_ctime_ns // sec, a.st_atime_ns % sec,
                          a.st_mtime_ns % sec, a.st_ctime_ns % sec, a.st_mode, a.st_nlink,
                          a.st_uid, a.st_gid, a.st_rdev, a.st_blksize, 0)


def fuse_fd() -> int:
    """The fd of /dev/fuse that pyfuse3's session reads (the daemon opens no other)."""
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == "/dev/fuse":
                return int(name)
        except OSError:
            continue
    raise OSError(errno.EBADF, "no /dev/fuse fd in this process")


def backing_open(dev: int, fd: int) -> int:
    """Register `fd` (a regular file) on the FUSE connection `dev`: its backing id."""
    return fcntl.ioctl(dev, BACKING_OPEN, bytearray(struct.pack("=iIQ", fd, 0, 0)))


def backing_close(dev: int, backing_id: int) -> None:
    fcntl.ioctl(dev, BACKING_CLOSE, bytearray(struct.pack("=I", backing_id)))


REFUSALS = {
    errno.EPERM: "the kernel refused to register a backing file (passthrough not negotiated, "
                 "or the daemon lacks CAP_SYS_ADMIN)",
    errno.ENOTTY: "this kernel has no FUSE passthrough (Linux 6.9 or later has it)",
    errno.EINVAL: "this kernel has no FUSE passthrough (Linux 6.9 or later has it)",
    errno.ELOOP: "the backing directory's file system is stacked too deep for passthrough",
    errno.EOPNOTSUPP: "the backing directory's file system cannot back passthrough files",
}


@dataclass
class Passthrough:
    """Whether this mount passes files through, and the backing ids of its open files."""

    wanted: bool = True
    state: str = "off"  # "on", "off", or "starting" (mounted, INIT not answered yet)
    reason: str = "turned off (--no-passthrough)"
    dev: int = -1
    ids: dict[int, list[int]] = field(default_factory=dict)
    registered: int = 0  # backing files registered since the mount
    refused: int = 0  # registrations the kernel refused after the probe (served by the daemon)
    cut: int = 0  # writers cut back at close: their growth crossed a quota or the capacity
    # Bytes counted as read (a reader's file size at its open) and written (a writer's
    # growth, at its flushes) by passthrough handles: in the tenants' counters too, but
    # none of them crossed /dev/fuse.
    read_bytes: int = 0
    write_bytes: int = 0
    writers: Counter[int] = field(default_factory=Counter)  # open passthrough writers by tenant
    # Set once the state is known ("on" or "off"): an open that comes while it is
    # "starting" waits for it, so that no inode starts on the daemon's path by accident.
    ready: trio.Event = field(default_factory=trio.Event)
    routed: bool = False  # the request thread runs (`hook`)
    # Without passthrough: libfuse's replies hooked for the INIT reply's killpriv flag alone.
    init_only: bool = False
    # The kernel's lookup counts (Tree.lookups): the LOOKUPs the thread answered are added.
    kernel_lookups: dict[int, int] = field(default_factory=dict)
    # Inodes whose read-only opens the request thread answers: (stats key, size), oldest
    # delegation first.
    delegated: OrderedDict[int, tuple[Any, int]] = field(default_factory=OrderedDict)
    # Opens the thread answered of inodes revoked since the last harvest, as it returns them.
    unharvested: list[tuple[int, Any, int, int, int]] = field(default_factory=list)
    # Directories whose GETATTR the request thread answers (`put_attrs`), the one changed
    # least recently first.
    attributes: OrderedDict[int, None] = field(default_factory=OrderedDict)
    # Revoked while opens the thread gave out are open: their backing id is kept (the kernel
    # wants every passthrough open of an inode on one backing file) until they are released.
    lingering: dict[int, tuple[Any, int]] = field(default_factory=dict)
    # Directories whose missing names the request thread answers: inode -> stats key, oldest
    # first; and the misses it counted in those taken back since the last harvest.
    dirs: OrderedDict[int, Any] = field(default_factory=OrderedDict)
    max_dirs: int = MAX_DIRS  # (fewer where the open-file limit is low: `hook`)
    creates_on: bool = False  # the thread creates files (kvfs.daemon.made, once started)
    creates_halted: str = ""  # why it stopped creating on this mount (kvfs.daemon.made)
    unharvested_misses: list[tuple[Any, int]] = field(default_factory=list)

    @property
    def on(self) -> bool:
        return self.state == "on"

    def hook(self, backing: str, *, writeback_cache: bool, miss_window: float = 60.0,
             fd_limit: int = 1024) -> None:
        """After pyfuse3.init, before the session runs: have the INIT reply offer passthrough
        (and, with or without it, take FUSE_HANDLE_KILLPRIV_V2: kvfs.daemon._passthrough)."""
        if not self.wanted:
            self.hook_init()
            return
        # Directories' fds take at most a quarter of the daemon's open-file limit.
        self.max_dirs = max(0, min(MAX_DIRS, fd_limit // 4))
        if writeback_cache:
            self.reason = "off with --writeback-cache (the kernel allows one or the other)"
            self.hook_init()
            return
        if _passthrough is None:
            self.reason = "kvfs.daemon._passthrough is not built (gcc, python3-dev?)"
            return
        try:
            depth = 2 if _passthrough.fstype(backing) in STACKED else 1
            fd = fuse_fd()
            try:
                self.dev = _passthrough.hook(fd, depth, True, TABLE_SLOTS, miss_window)
                self.routed = True
            except OSError as exc:
                log.warning("no request thread (%s): every request goes through the daemon's "
                            "loop", exc)
                self.dev = _passthrough.hook(fd, depth)
        except OSError as exc:
            self.reason = f"cannot hook libfuse's replies: {exc}"
            return
        self.state, self.reason = "starting", "waiting for the kernel's INIT"

    def hook_init(self) -> None:
        """Without passthrough: libfuse's replies hooked for the INIT reply's
        FUSE_HANDLE_KILLPRIV_V2 alone, so that a write(2) through the daemon costs its WRITE
        requests and no GETXATTR before each (max_stack_depth 0: passthrough not offered)."""
        if _passthrough is None:
            return
        try:
            _passthrough.hook(fuse_fd(), 0)
            self.init_only = True
        except OSError as exc:
            log.info("libfuse's replies are its own (%s): the kernel asks the daemon for "
                     "security.capability before each write", exc)

    async def probe(self, path: str) -> None:
        """Once INIT is answered: register one regular file (`path`, root's) and release it,
        so that the state is known before the first open, and say it in the log."""
        try:
            await self._probe(path)
        finally:
            self.ready.set()

    async def _probe(self, path: str) -> None:
        if self.state != "starting":
            if self.wanted:
                log.warning("passthrough off: %s; the daemon serves every byte", self.reason)
            return
        with trio.move_on_after(INIT_WAIT):
            while not _passthrough.state()["init_seen"]:
                await trio.sleep(0.005)
        st = _passthrough.state()
        if not st["init_offered"]:
            self.off("the INIT reply could not offer passthrough" if st["init_seen"]
                     else "the kernel's INIT never came")
            return
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                backing_close(self.dev, backing_open(self.dev, fd))
            finally:
                os.close(fd)
        except OSError as exc:
            self.off(REFUSALS.get(exc.errno, f"registering a backing file failed: {exc}"))
            return
        self.state, self.reason = "on", "the kernel reads and writes hot files itself"
        log.info("passthrough on: opened files are read and written by the kernel")

    def unhook(self) -> None:
        """The session is closed: the request thread ends, libfuse gets its own writev and
        read back."""
        if _passthrough is not None and (self.dev >= 0 or self.init_only):
            _passthrough.unhook()
            self.init_only = False
            self.dev = -1
            self.routed = False
            self.delegated.clear()
            self.lingering.clear()
            self.attributes.clear()
            self.unharvested.clear()
            self.dirs.clear()  # (their fds closed by unhook)
            self.unharvested_misses.clear()
            self.creates_on = False
        if self.state != "off":
            self.state, self.reason = "off", "unmounted"

    def off(self, reason: str) -> None:
        self.state, self.reason = "off", reason
        log.warning("passthrough off: %s; the daemon serves every byte", reason)

    def register(self, inode: int, fd: int) -> int | None:
        """A passthrough open of `inode` served from `fd`: its backing id (the inode's, shared
        by all its passthrough opens), or None where the kernel refuses (the daemon serves
        that open)."""
        entry = self.ids.get(inode)
        if entry is None:
            try:
                backing_id = backing_open(self.dev, fd)
            except OSError as exc:
                self.refused += 1
                log.warning("passthrough refused for inode %d (%s): served by the daemon",
                            inode, exc)
                return None
            entry = self.ids[inode] = [backing_id, 0]
            self.registered += 1
        entry[1] += 1
        return entry[0]

    def arm(self, fh: int, backing_id: int, *, noflush: bool = False) -> None:
        """The reply about to be sent for `fh` names `backing_id` (0: none, the daemon serves
        it), and with `noflush` asks for no FLUSH at its closes (a read-only open: nothing to
        flush, one round trip fewer per close): the very last step of an open or create
        handler (no await after it). Nothing where libfuse's replies are not hooked."""
        if self.dev >= 0 and (backing_id or noflush):
            _passthrough.arm(fh, backing_id, noflush)

    # -- the request thread's part ------------------------------------------------------------

    def delegate(self, inode: int, key: Any, size: int, attrs: Any, parent: int,
                 name: bytes) -> None:
        """Let the request thread answer the read-only opens of `inode` (a complete hot file
        with a passthrough handle open, so a backing id), its GETATTR (`attrs`, as the
        daemon answers it) and the LOOKUP of `name` in `parent`, until `revoke`."""
        if not self.routed or inode in self.lingering:
            return
        entry = self.ids.get(inode)
        if entry is None:
            return
        if inode in self.delegated:
            self.delegated.move_to_end(inode)
            _passthrough.ready_put(inode, entry[0], fuse_attr(attrs), parent, name)
            return
        while len(self.delegated) >= MAX_DELEGATED:
            self.revoke(next(iter(self.delegated)))
        if _passthrough.ready_put(inode, entry[0], fuse_attr(attrs), parent, name):
            entry[1] += 1
            self.delegated[inode] = (key, size)

    def revoke(self, inode: int | None) -> None:
        """The request thread answers no more opens of `inode` (None: of any, nor any
        directory's missing names): called before anything about it changes. Opens it gave
        out stay open; the backing id is kept for them until they are released (`harvest`)."""
        if inode is None and self.dirs:
            for i in list(self.dirs):
                self.take_dir(i)
        if self.attributes and (inode is None or inode in self.attributes):
            for i in list(self.attributes) if inode is None else (inode,):
                _passthrough.ready_drop(i)
                self.attributes.pop(i, None)
        if not self.delegated:
            return
        for i in list(self.delegated) if inode is None else (inode,):
            got = self.delegated.pop(i, None)
            if got is None:
                continue
            dropped = _passthrough.ready_drop(i)
            opens, lookups, answered, last_ns = dropped if dropped is not None else (0,) * 4
            if lookups:
                self.kernel_lookups[i] = self.kernel_lookups.get(i, 0) + lookups
            if answered:  # counted at the next harvest
                self.unharvested.append((i, got[0], got[1], answered, last_ns))
            if opens > 0:
                self.lingering[i] = got
            else:
                self.release(i)

    def hand_dir(self, inode: int, key: Any, fd: int, *, below: bool = False,
                 tenant: int = 0) -> bool:
        """Let the request thread answer LOOKUPs of names missing from directory `inode`
        (ENOENT where its backing directory, `fd`, has no such entry; a miss counted for
        `key`), with `below` (lower tiers) but for names of blocks and fan-out directories,
        until `take_dir`; with `tenant`, its creates too, while that tenant has a grant
        (kvfs.daemon.made). True: the module owns `fd` now; False: the caller closes it (not
        routed, or handed over already)."""
        if not self.routed:
            return False
        if inode in self.dirs:
            self.dirs.move_to_end(inode)
            return False
        if not self.max_dirs:
            return False
        while len(self.dirs) >= self.max_dirs:
            self.take_dir(next(iter(self.dirs)))
        if not _passthrough.dir_put(inode, fd, below, tenant):
            return False
        self.dirs[inode] = key
        return True

    def take_dir(self, inode: int) -> None:
        """The request thread answers no more missing names of directory `inode` (it is
        removed, or the oldest handed over); its misses are kept for the next harvest."""
        key = self.dirs.pop(inode, None)
        if key is not None:
            misses = _passthrough.dir_drop(inode)
            if misses:
                self.unharvested_misses.append((key, misses))

    def harvest_misses(self) -> list[tuple[Any, int]]:
        """(stats key, misses) the request thread counted since the last harvest."""
        out, self.unharvested_misses = self.unharvested_misses, []
        if self.routed:
            for inode, misses in _passthrough.dir_harvest():
                key = self.dirs.get(inode)
                if key is not None:
                    out.append((key, misses))
        return out

    def put_miss(self, parent: int, name: bytes, age: float, lookups: int) -> None:
        """The daemon's recent misses of `name` in `parent` (seconds since the first,
        LOOKUPs), counted by it: the request thread's count goes on from them."""
        if self.routed:
            _passthrough.miss_put(parent, name, age, lookups)

    def take_miss(self, parent: int, name: bytes) -> tuple[float, int] | None:
        """(seconds since, LOOKUPs) of the request thread's recent misses of `name` in
        `parent`, forgotten (a create of it follows); None if it has none."""
        return _passthrough.miss_take(parent, name) if self.routed else None

    def put_attrs(self, inode: int, attrs: Any) -> None:
        """Let the request thread answer GETATTR of directory `inode` with `attrs` (its
        attributes now, after a change of its entries), until `revoke`."""
        if not self.routed or inode in self.delegated or inode in self.lingering:
            return
        if inode in self.attributes:
            self.attributes.move_to_end(inode)
        else:
            while len(self.attributes) >= MAX_ATTRIBUTES:
                _passthrough.ready_drop(self.attributes.popitem(last=False)[0])
        if _passthrough.ready_put(inode, 0, fuse_attr(attrs)):
            self.attributes[inode] = None
        elif inode in self.attributes:  # (its old attributes must not stay answered)
            del self.attributes[inode]
            _passthrough.ready_drop(inode)

    def hold(self, inode: int) -> bool:
        """Keep `inode`'s backing id registered (a reference more, given back with `release`)
        across a change that revokes it: whether it had one."""
        entry = self.ids.get(inode)
        if entry is not None:
            entry[1] += 1
        return entry is not None

    def take_lookups(self, inode: int) -> None:
        """Add the LOOKUPs of `inode` the request thread answered to the daemon's count (the
        kernel holds them: before a FORGET of it is counted)."""
        if self.routed and (inode in self.delegated or inode in self.lingering):
            n = _passthrough.ready_lookups(inode)
            if n:
                self.kernel_lookups[inode] = self.kernel_lookups.get(inode, 0) + n

    def thread_opens(self, inode: int) -> int:
        """Opens of `inode` the request thread gave out that the kernel still holds."""
        if not self.routed or (inode not in self.delegated and inode not in self.lingering):
            return 0
        return _passthrough.ready_outstanding(inode)

    def harvest(self) -> list[tuple[int, Any, int, int, int]]:
        """The request thread's opens since the last harvest: (inode, stats key, size,
        opens, last open in ns) each; and the backing ids of revoked inodes whose opens are
        all released, let go."""
        if not self.routed:
            return []
        out, self.unharvested = self.unharvested, []
        for inode, opens, last_ns, lookups in _passthrough.ready_harvest():
            if lookups:
                self.kernel_lookups[inode] = self.kernel_lookups.get(inode, 0) + lookups
            got = self.delegated.get(inode) or self.lingering.get(inode)
            if got is not None and opens:
                out.append((inode, got[0], got[1], opens, last_ns))
        for inode in [i for i in self.lingering if _passthrough.ready_outstanding(i) == 0]:
            del self.lingering[inode]
            self.release(inode)
        return out

    def release(self, inode: int) -> None:
        """A passthrough handle of `inode` closed; its backing id goes with the last one (the
        kernel holds the file for opens still in flight)."""
        entry = self.ids[inode]
        entry[1] -= 1
        if entry[1] == 0:
            del self.ids[inode]
            try:
                backing_close(self.dev, entry[0])
            except OSError as exc:
                log.warning("could not release backing id %d: %s", entry[0], exc)

    def snapshot(self) -> dict[str, object]:
        """stats.json "passthrough"."""
        st = _passthrough.state() if _passthrough is not None and self.dev >= 0 else {}
        held = sum(refs > (i in self.delegated or i in self.lingering)
                   for i, (_, refs) in self.ids.items())
        return {"state": self.state, "reason": self.reason, "open_files": held,
                "registered": self.registered, "refused": self.refused, "cut": self.cut,
                "read_bytes": self.read_bytes, "write_bytes": self.write_bytes,
                "replies_patched": st.get("opens_patched", 0),
                "replies_missed": st.get("opens_missed", 0),
                "request_thread": bool(st.get("routed")), "delegated": len(self.delegated),
                "thread_creates": self.creates_on, "thread_creates_halted": self.creates_halted,
                "directories": len(self.dirs), "attributes": len(self.attributes),
                "forwarded": st.get("forwarded", 0)}

    def thread_requests(self) -> dict[str, int]:
        """Requests the request thread answered, by kind (stats.json `requests`, as
        `thread_<kind>`)."""
        if not self.routed:
            return {}
        return {f"thread_{k}": v for k, v in _passthrough.state()["answered"].items() if v}
