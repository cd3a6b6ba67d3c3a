"""The hot tier: a local backing directory laid out exactly as the mount's namespace.

Every function here blocks (it is file I/O); the daemon calls them in worker threads
(`Tree.io`), never on the event-loop thread; two exceptions are built not to block:
`open_cached` (a read-only open of a path the kernel has cached whole: no I/O) and closes,
handed to `kvfs.daemon.closer`'s thread. Paths are bytes relative to the
backing root. The daemon runs as root, so ownership and modes are mirrored onto the backing
tree: the kernel enforces tenant isolation in the backing directory exactly as in the mount.

The tenants write their part of this tree themselves (the direct path), at any moment, so the
tree is hostile (docs/architecture.md): every path is resolved from the root's fd without
following a symlink (`kvfs.daemon.backing`); a leaf operation runs on an fd of the leaf (chmod,
chown, truncate, xattrs, reads) or relative to an fd of its verified parent directory
(unlink, rename, mkdir, symlink); a file is opened O_NOFOLLOW | O_NONBLOCK and refused unless
`fstat` shows the kind the index expects; reads of a block are bounded by its header.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
import time
from collections.abc import Iterator

from ..format import blockfile
from ..format.config import ConfigError
from ..format.layout import PINS_MARK, QUARANTINE, STAGING, STATE_DIR, TEMP_PREFIX
from . import backing
from .capacity import Limits
from .closer import closer

log = logging.getLogger(__name__)

_KINDS = {stat.S_IFREG: "a regular file", stat.S_IFDIR: "a directory"}


class Refused(OSError):
    """A backing entry is not what the index says it is (a FIFO, a device, a directory
    where a file should be): the operation is refused and nothing is changed."""


def _split(rel: bytes) -> tuple[bytes, bytes]:
    d, _, name = rel.rpartition(b"/")
    return d, name


class BackingStore:
    """Blocking operations on the backing directory, safe against its tenants."""

    def __init__(self, root: str | bytes) -> None:
        self.root = os.fsencode(os.path.abspath(root))
        self.state_dir = os.path.join(self.root, STATE_DIR)
        self._root_fd = -1
        self._root_dev = 0
        try:
            self.root_fd  # noqa: B018 - opened once, before threads share it
        except OSError:
            pass  # not there yet: opened at first use

    @property
    def root_fd(self) -> int:
        """An fd of the backing root, opened once: every path is resolved from it."""
        if self._root_fd < 0:
            fd = os.open(self.root, backing.DIR_FLAGS)
            self._root_dev = os.fstat(fd).st_dev
            self._root_fd = fd
        return self._root_fd

    def close(self) -> None:
        if self._root_fd >= 0:
            os.close(self._root_fd)
            self._root_fd = -1

    def path(self, rel: bytes) -> bytes:
        """The absolute path of `rel`: to show (logs, user.kvfs.backing), never to open."""
        return self.root + b"/" + rel if rel else self.root

    # -- resolution -------------------------------------------------------------------------

    def _open(self, rel: bytes, flags: int, mode: int = 0) -> int:
        return backing.open_beneath(self.root_fd, rel, flags, mode, self._root_dev)

    def opendir(self, rel: bytes) -> int:
        """An fd of directory `rel` (b"": the root), reached through no symlink."""
        return self._open(rel, backing.DIR_FLAGS)

    @contextlib.contextmanager
    def parent(self, rel: bytes) -> Iterator[tuple[int, bytes]]:
        """(fd of `rel`'s verified parent directory, leaf name): for *at calls."""
        d, name = _split(rel)
        backing.components(name)
        fd = self.opendir(d)
        try:
            yield fd, name
        finally:
            os.close(fd)

    @staticmethod
    def _check(fd: int, kind: int, what: bytes) -> os.stat_result:
        """fstat an fd just opened, and close it (then raise Refused) unless it is of `kind`."""
        try:
            st = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        if stat.S_ISREG(st.st_mode) and st.st_nlink > 1 and kind == stat.S_IFREG:
            # kvfs never makes hard links (EPERM through the mount): a second name was made
            # in the backing tree, perhaps to a file of someone else that the kernel let the
            # tenant link (writable by it). Never chmod, chown, read or serve it.
            os.close(fd)
            log.warning("refused %s: a regular file with %d links", what.decode(
                errors="replace"), st.st_nlink)
            raise Refused(errno.EMLINK, "a hard-linked file", what)
        if stat.S_IFMT(st.st_mode) != kind:
            os.close(fd)
            log.warning("refused %s: it is not %s (mode %o)", what.decode(errors="replace"),
                        _KINDS.get(kind, "what the index says"), st.st_mode)
            err = errno.EISDIR if stat.S_ISDIR(st.st_mode) else errno.EIO
            raise Refused(err, f"not {_KINDS.get(kind, 'the expected kind')}", what)
        return st

    def open_at(self, dirfd: int, name: bytes, flags: int, kind: int = stat.S_IFREG
                ) -> tuple[int, os.stat_result]:
        """Open one entry of a verified directory: O_NOFOLLOW (a symlink is ELOOP), O_NONBLOCK
        (a FIFO never blocks the open), refused unless it is of `kind`. (fd, its fstat.)
        O_NONBLOCK stays on: it changes nothing for a regular file of a local file system;
        `open` clears it on the handles the daemon serves reads and writes from."""
        backing.components(name)
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY,
                     dir_fd=dirfd)
        return fd, self._check(fd, kind, name)

    @classmethod
    def _blocking_or_close(cls, fd: int, flags: int) -> None:
        try:
            cls._blocking(fd, flags)
        except BaseException:
            os.close(fd)
            raise

    @staticmethod
    def _blocking(fd: int, flags: int) -> None:
        if not flags & os.O_NONBLOCK:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)

    def open_node(self, rel: bytes, flags: int, kind: int = stat.S_IFREG
                  ) -> tuple[int, os.stat_result]:
        """Open `rel` (resolved from the root through no symlink) as `open_at` does."""
        if kind == stat.S_IFDIR:
            fd = self._open(rel, backing.DIR_FLAGS)
            return fd, self._check(fd, kind, rel)
        fd = self._open(rel, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY)
        return fd, self._check(fd, kind, rel)

    @contextlib.contextmanager
    def _fd(self, rel: bytes, flags: int = os.O_RDONLY, kind: int = stat.S_IFREG
            ) -> Iterator[int]:
        fd, _ = self.open_node(rel, flags, kind)
        try:
            yield fd
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _any_fd(self, rel: bytes) -> Iterator[int | None]:
        """An fd of a regular file or a directory (None for a symlink: xattrs of symlinks
        are not tenants' business); anything else is refused."""
        try:
            fd = self._open(rel, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY)
        except OSError as exc:
            if exc.errno != errno.ELOOP or not stat.S_ISLNK(self.lstat(rel).st_mode):
                raise
            yield None
            return
        st = os.fstat(fd)
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
            self._check(fd, stat.S_IFREG, rel)  # closes it and raises
        try:
            yield fd
        finally:
            os.close(fd)

    # -- files and directories ------------------------------------------------------------

    def open(self, rel: bytes, flags: int) -> int:
        """Open an indexed regular file for a handle; anything else is refused."""
        fd = self.open_node(rel, flags)[0]
        self._blocking_or_close(fd, flags)
        return fd

    def open_cached(self, rel: bytes, flags: int) -> int | None:
        """`open` for the event loop, without a thread: a read-only open of a file whose path
        the kernel has cached whole (`backing.open_cached`: no I/O), and only when the fd is
        a regular file with one link, as `open` checks. None otherwise (the caller opens in
        a thread with `open`, which refuses what must be refused, and says why)."""
        if flags & os.O_ACCMODE != os.O_RDONLY or self._root_fd < 0:
            return None
        fd = backing.open_cached(self._root_fd, rel, flags | os.O_NONBLOCK | os.O_NOCTTY)
        if fd is None:
            return None
        try:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
                self._blocking(fd, flags)
                return fd
        except OSError:
            pass
        closer.close(fd)  # (not on the event loop: see kvfs.daemon.closer)
        return None

    def create(self, rel: bytes, flags: int, mode: int, uid: int, gid: int) -> int:
        """Create a regular file owned by uid:gid; returns an fd. A stray entry of that name
        (one the index does not know: left by a tenant) is unlinked first, never opened:
        it may be a symlink to anything. A directory there is EEXIST."""
        flags = (flags & ~os.O_TRUNC) | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        with self.parent(rel) as (dfd, name):
            for attempt in range(3):
                try:
                    fd = os.open(name, flags | os.O_NONBLOCK, mode, dir_fd=dfd)
                    break
                except FileExistsError:
                    if attempt == 2:
                        raise
                    try:
                        os.unlink(name, dir_fd=dfd)  # a directory: EISDIR, refused
                    except FileNotFoundError:
                        pass
                    except IsADirectoryError:
                        raise FileExistsError(errno.EEXIST, "a directory is there", rel) from None
            try:
                self._blocking(fd, flags)  # (O_EXCL made it: a regular file of ours)
                os.fchown(fd, uid, gid)
                os.fchmod(fd, mode)
            except BaseException:
                os.close(fd)
                raise
        return fd

    def mkdir(self, rel: bytes, mode: int, uid: int, gid: int) -> None:
        with self.parent(rel) as (dfd, name):
            os.mkdir(name, mode, dir_fd=dfd)
            fd, _ = self.open_at(dfd, name, backing.DIR_FLAGS, stat.S_IFDIR)
            try:
                os.fchown(fd, uid, gid)
                os.fchmod(fd, mode)
            finally:
                os.close(fd)

    def symlink(self, target: bytes, rel: bytes, uid: int, gid: int) -> None:
        with self.parent(rel) as (dfd, name):
            os.symlink(target, name, dir_fd=dfd)
            os.chown(name, uid, gid, dir_fd=dfd, follow_symlinks=False)

    def readlink(self, rel: bytes) -> bytes:
        with self.parent(rel) as (dfd, name):
            return os.readlink(name, dir_fd=dfd)

    def unlink(self, rel: bytes) -> None:
        with self.parent(rel) as (dfd, name):
            os.unlink(name, dir_fd=dfd)

    def unlink_many(self, rels: list[bytes]) -> None:
        """Unlink files the daemon chose to remove; ones already gone are fine, and so are
        ones a tenant moved out of reach (a parent swapped for a symlink: nothing of another
        tree is touched; logged)."""
        for rel in rels:
            try:
                self.unlink(rel)
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("not unlinking %s: %s", rel.decode(errors="replace"), exc)

    def rmdir(self, rel: bytes) -> None:
        with self.parent(rel) as (dfd, name):
            os.rmdir(name, dir_fd=dfd)

    def rename(self, old: bytes, new: bytes, flags: int) -> None:
        with self.parent(old) as (ofd, oname), self.parent(new) as (nfd, nname):
            backing.renameat2(ofd, oname, nfd, nname, flags)

    def setattr(
        self,
        rel: bytes,
        *,
        is_link: bool,
        is_dir: bool = False,
        fd: int | None = None,
        mode: int | None = None,
        uid: int | None = None,
        gid: int | None = None,
        size: int | None = None,
        times_ns: tuple[int, int] | None = None,
    ) -> None:
        """Change attributes on an fd of the entry (a symlink: relative to its parent's fd,
        never followed)."""
        if is_link:
            with self.parent(rel) as (dfd, name):
                if uid is not None or gid is not None:
                    os.chown(name, -1 if uid is None else uid, -1 if gid is None else gid,
                             dir_fd=dfd, follow_symlinks=False)
                if times_ns is not None:
                    os.utime(name, ns=times_ns, dir_fd=dfd, follow_symlinks=False)
            return
        kind = stat.S_IFDIR if is_dir else stat.S_IFREG
        if size is not None and fd is not None and all(
                v is None for v in (mode, uid, gid, times_ns)):
            os.ftruncate(fd, size)  # the caller's open handle: nothing to resolve
            return
        with self._fd(rel, os.O_WRONLY if size is not None else os.O_RDONLY, kind) as own:
            if size is not None:
                os.ftruncate(fd if fd is not None else own, size)
            if uid is not None or gid is not None:
                os.fchown(own, -1 if uid is None else uid, -1 if gid is None else gid)
            if mode is not None:
                os.fchmod(own, mode)
            if times_ns is not None:
                os.utime(own, ns=times_ns)

    def lstat(self, rel: bytes) -> os.stat_result:
        if not rel:
            return os.fstat(self.root_fd)
        with self.parent(rel) as (dfd, name):
            return os.stat(name, dir_fd=dfd, follow_symlinks=False)

    def statvfs(self) -> os.statvfs_result:
        return os.fstatvfs(self.root_fd)

    def listdir(self, rel: bytes) -> tuple[list[tuple[bytes, os.stat_result]], bool]:
        """A directory's entries with their lstat (read on its fd, never through a link),
        and whether it holds pins. An entry that vanishes meanwhile is left out."""
        fd = self.opendir(rel)
        try:
            return self.listdir_fd(fd), self.marked(fd)
        finally:
            os.close(fd)

    @staticmethod
    def listdir_fd(dirfd: int) -> list[tuple[bytes, os.stat_result]]:
        out = []
        with os.scandir(dirfd) as it:  # (it reads a duplicate, from the start)
            for entry in it:
                try:
                    out.append((os.fsencode(entry.name), entry.stat(follow_symlinks=False)))
                except FileNotFoundError:
                    continue
        return out

    # -- reading blocks: on a verified fd, bounded ------------------------------------------

    @staticmethod
    def _pread_all(fd: int, length: int, offset: int = 0) -> bytes:
        parts, done = [], 0
        while done < length:
            chunk = os.pread(fd, length - done, offset + done)
            if not chunk:
                break
            parts.append(chunk)
            done += len(chunk)
        return b"".join(parts)

    def head_at(self, dirfd: int, name: bytes, length: int) -> tuple[bytes, os.stat_result]:
        fd, st = self.open_at(dirfd, name, os.O_RDONLY)
        try:
            return self._pread_all(fd, min(length, st.st_size)), st
        finally:
            os.close(fd)

    def head(self, rel: bytes, length: int) -> tuple[bytes, os.stat_result]:
        """The first `length` bytes of a regular file and its fstat."""
        fd, st = self.open_node(rel, os.O_RDONLY)
        try:
            return self._pread_all(fd, min(length, st.st_size)), st
        finally:
            os.close(fd)

    def read_head(self, rel: bytes, length: int) -> tuple[bytes, int]:
        """The first `length` bytes of a regular file and its size."""
        head, st = self.head(rel, length)
        return head, st.st_size

    def read_block_fd(self, fd: int, size: int) -> bytearray:
        """A whole block file from an fd, bounded by its header's length and its size: a
        header that promises more than the file holds (or a file larger than its header
        says) is a BlockFormatError before anything more is read. Read into one buffer (the
        one copy out of the page cache), which an upload may seal in place."""
        head = self._pread_all(fd, min(blockfile.HEADER_SIZE, size))
        hdr = blockfile.check_head(head, size)
        buf = bytearray(hdr.file_size)
        buf[:len(head)] = head
        done, view = len(head), memoryview(buf)
        while done < len(buf):
            n = os.preadv(fd, [view[done:]], done)
            if not n:
                del view
                del buf[done:]  # the file shrank meanwhile: short, as read
                break
            done += n
        return buf

    def read_block(self, rel: bytes) -> bytearray:
        fd, st = self.open_node(rel, os.O_RDONLY)
        try:
            return self.read_block_fd(fd, st.st_size)
        finally:
            os.close(fd)

    def read_block_at(self, dirfd: int, name: bytes) -> bytearray:
        fd, st = self.open_at(dirfd, name, os.O_RDONLY)
        try:
            return self.read_block_fd(fd, st.st_size)
        finally:
            os.close(fd)

    # -- the daemon's own places ------------------------------------------------------------

    def _state_subdir(self, name: bytes) -> int:
        """An fd of STATE_DIR/name (made 0700 if missing): root's alone."""
        for rel in (STATE_DIR, STATE_DIR + b"/" + name):
            try:
                with self.parent(rel) as (dfd, leaf):
                    os.mkdir(leaf, 0o700, dir_fd=dfd)
            except FileExistsError:
                pass
        return self.opendir(STATE_DIR + b"/" + name)

    def quarantine(self, rel: bytes) -> bytes:
        """Move a bad file out of the namespace into the state directory; never served."""
        qfd = self._state_subdir(QUARANTINE)
        try:
            dest = rel.replace(b"/", b"%")[-200:] + b".%d" % time.time_ns()
            with self.parent(rel) as (dfd, name):
                backing.renameat2(dfd, name, qfd, dest, backing.RENAME_NOREPLACE)
        finally:
            os.close(qfd)
        return os.path.join(self.state_dir, QUARANTINE, dest)

    def staging(self) -> bytes:
        """The directory fetched blocks are received in (root's alone; see Placement)."""
        os.close(self._state_subdir(STAGING))
        return os.path.join(self.state_dir, STAGING)

    def clear_staging(self) -> None:
        """Remove what fetches left in the staging directory (at mount: none runs)."""
        fd = self._state_subdir(STAGING)
        try:
            for name in os.listdir(fd):
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=fd)
        finally:
            os.close(fd)

    def placement(self, rel: bytes) -> Placement:
        return Placement(self, rel)

    # -- trusted.kvfs.* attributes: kvfs's own metadata, beyond the reach of tenants ------

    def read_limits(self, tenant: bytes) -> Limits:
        limits = Limits()
        fd = self.opendir(tenant)
        try:
            for name in Limits.names():
                try:
                    value = os.getxattr(fd, b"trusted.kvfs." + name.encode())
                except OSError:
                    continue
                try:
                    setattr(limits, name, Limits.parse(name, value.decode()))
                except (ConfigError, UnicodeDecodeError):
                    log.warning("tenant %s: ignoring bad %s %r",
                                tenant.decode(errors="replace"), name, value)
        finally:
            os.close(fd)
        return limits

    def write_limit(self, tenant: bytes, name: str, value: str | None) -> None:
        key = b"trusted.kvfs." + name.encode()
        fd = self.opendir(tenant)
        try:
            if value is None:
                try:
                    os.removexattr(fd, key)
                except OSError as exc:
                    if exc.errno != errno.ENODATA:
                        raise
            else:
                os.setxattr(fd, key, value.encode())
        finally:
            os.close(fd)

    def set_pin(self, rel: bytes, pinned: bool) -> None:
        with self._fd(rel) as fd:
            if pinned:
                self.mark_pins(rel.rpartition(b"/")[0])
                os.setxattr(fd, b"trusted.kvfs.pin", b"1")
            else:
                try:
                    os.removexattr(fd, b"trusted.kvfs.pin")
                except OSError as exc:
                    if exc.errno != errno.ENODATA:
                        raise

    def mark_pins(self, dir_rel: bytes) -> None:
        """Mark a directory as one that holds (or held) pinned files: fsck asks a file for
        its pin only in such directories, not a million times."""
        fd = self.opendir(dir_rel)
        try:
            os.setxattr(fd, PINS_MARK, b"1")
        finally:
            os.close(fd)

    @staticmethod
    def marked(dirfd: int) -> bool:
        try:
            os.getxattr(dirfd, PINS_MARK)
        except OSError:
            return False
        return True

    def has_pins(self, dir_rel: bytes) -> bool:
        try:
            fd = self.opendir(dir_rel)
        except OSError:
            return False
        try:
            return self.marked(fd)
        finally:
            os.close(fd)

    def is_pinned_at(self, dirfd: int, name: bytes) -> bool:
        try:
            fd, _ = self.open_at(dirfd, name, os.O_RDONLY)
        except OSError:
            return False
        try:
            return os.getxattr(fd, b"trusted.kvfs.pin") == b"1"
        except OSError:
            return False
        finally:
            os.close(fd)

    def is_pinned(self, rel: bytes) -> bool:
        try:
            with self.parent(rel) as (dfd, name):
                return self.is_pinned_at(dfd, name)
        except OSError:
            return False

    # -- extended attributes (user.* only; stored on the backing files themselves) -------

    def getxattr(self, rel: bytes, name: bytes) -> bytes:
        with self._any_fd(rel) as fd:
            if fd is None:
                raise OSError(errno.ENODATA, os.strerror(errno.ENODATA))
            return os.getxattr(fd, name)

    def setxattr(self, rel: bytes, name: bytes, value: bytes, flags: int = 0) -> None:
        with self._any_fd(rel) as fd:
            if fd is None:
                raise OSError(errno.EPERM, "no user attributes on a symlink")
            os.setxattr(fd, name, value, flags)

    def removexattr(self, rel: bytes, name: bytes) -> None:
        with self._any_fd(rel) as fd:
            if fd is None:
                raise OSError(errno.ENODATA, os.strerror(errno.ENODATA))
            os.removexattr(fd, name)

    def listxattr(self, rel: bytes) -> list[bytes]:
        with self._any_fd(rel) as fd:
            if fd is None:
                return []
            try:
                names = os.listxattr(fd)
            except OSError as exc:
                if exc.errno in (errno.ENOTSUP, errno.EPERM):
                    return []
                raise
        return [n.encode() for n in names if n.startswith("user.")]


class Placement:
    """Where a fetched block goes: received in the staging directory (root's alone), then
    renamed into the verified parent directory of `rel`, resolved at that moment from the
    root through no symlink. A tenant that swaps a directory on the way gets ELOOP, never a
    block placed in another tree."""

    def __init__(self, store: BackingStore, rel: bytes) -> None:
        self.store = store
        self.rel = rel
        self.name = os.fsdecode(_split(rel)[1])

    def temporary(self, tag: str) -> str:
        return os.fsdecode(os.path.join(self.store.staging(), TEMP_PREFIX + tag.encode()))

    def place(self, tmp: str) -> None:
        sfd = self.store._state_subdir(STAGING)
        try:
            with self.store.parent(self.rel) as (dfd, name):
                backing.renameat2(sfd, os.fsencode(os.path.basename(tmp)), dfd, name)
        finally:
            os.close(sfd)
