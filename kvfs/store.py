"""The hot tier: a local backing directory laid out exactly as the mount's namespace.

Every function here blocks (it is file I/O); the daemon calls them through
`trio.to_thread.run_sync`, never on the event-loop thread. Paths are bytes relative to the
backing root. The daemon runs as root, so ownership and modes are mirrored onto the backing
tree: the kernel enforces tenant isolation in the backing directory exactly as in the mount.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import time

from .capacity import Limits
from .config import ConfigError

log = logging.getLogger(__name__)

#: Where the daemon keeps its own state inside the backing root (index, lock, log,
#: quarantine). Never a tenant: tenant names cannot start with a dot.
STATE_DIR = b".kvfs"
#: Prefix of temporaries that the direct path writes before renaming into place.
TEMP_PREFIX = b".kvfs-tmp."
#: Bad files are moved here, below STATE_DIR.
QUARANTINE = b"quarantine"

RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_libc = ctypes.CDLL(None, use_errno=True)


def renameat2(old: bytes, new: bytes, flags: int) -> None:
    """rename(2) with RENAME_NOREPLACE / RENAME_EXCHANGE, which `os.rename` lacks."""
    if flags == 0:
        os.rename(old, new)
        return
    if _libc.renameat2(_AT_FDCWD, old, _AT_FDCWD, new, ctypes.c_uint(flags)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), old)


#: On a backing directory: some file in it is (or was) pinned.
PINS_MARK = b"trusted.kvfs.pins"

class BackingStore:
    """Blocking operations on the backing directory."""

    def __init__(self, root: str | bytes) -> None:
        self.root = os.fsencode(os.path.abspath(root))
        self.state_dir = os.path.join(self.root, STATE_DIR)

    def path(self, rel: bytes) -> bytes:
        return self.root + b"/" + rel if rel else self.root

    # -- files and directories ------------------------------------------------------------

    def open(self, rel: bytes, flags: int) -> int:
        return os.open(self.path(rel), flags | os.O_CLOEXEC)

    def create(self, rel: bytes, flags: int, mode: int, uid: int, gid: int) -> int:
        """Create (or truncate a stray) regular file owned by uid:gid; returns an fd."""
        fd = os.open(self.path(rel), flags | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
        try:
            os.fchown(fd, uid, gid)
            os.fchmod(fd, mode)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def mkdir(self, rel: bytes, mode: int, uid: int, gid: int) -> None:
        path = self.path(rel)
        os.mkdir(path, mode)
        os.chown(path, uid, gid)
        os.chmod(path, mode)

    def symlink(self, target: bytes, rel: bytes, uid: int, gid: int) -> None:
        path = self.path(rel)
        os.symlink(target, path)
        os.lchown(path, uid, gid)

    def unlink(self, rel: bytes) -> None:
        os.unlink(self.path(rel))

    def unlink_many(self, rels: list[bytes]) -> None:
        """Unlink files the daemon chose to remove; ones already gone are fine."""
        for rel in rels:
            try:
                os.unlink(self.path(rel))
            except FileNotFoundError:
                pass

    def rmdir(self, rel: bytes) -> None:
        os.rmdir(self.path(rel))

    def rename(self, old: bytes, new: bytes, flags: int) -> None:
        renameat2(self.path(old), self.path(new), flags)

    def setattr(
        self,
        rel: bytes,
        *,
        is_link: bool,
        fd: int | None = None,
        mode: int | None = None,
        uid: int | None = None,
        gid: int | None = None,
        size: int | None = None,
        times_ns: tuple[int, int] | None = None,
    ) -> None:
        path = self.path(rel)
        if size is not None:
            if fd is not None:
                os.ftruncate(fd, size)
            else:
                os.truncate(path, size)
        if uid is not None or gid is not None:
            os.lchown(path, -1 if uid is None else uid, -1 if gid is None else gid)
        if mode is not None and not is_link:
            os.chmod(path, mode)
        if times_ns is not None:
            os.utime(path, ns=times_ns, follow_symlinks=False)

    def lstat(self, rel: bytes) -> os.stat_result:
        return os.lstat(self.path(rel))

    def statvfs(self) -> os.statvfs_result:
        return os.statvfs(self.root)

    def read_head(self, rel: bytes, length: int) -> tuple[bytes, int]:
        """The first `length` bytes of a file and its size."""
        fd = os.open(self.path(rel), os.O_RDONLY | os.O_CLOEXEC)
        try:
            return os.pread(fd, length, 0), os.fstat(fd).st_size
        finally:
            os.close(fd)

    def quarantine(self, rel: bytes) -> bytes:
        """Move a bad file out of the namespace into the state directory; never served."""
        qdir = os.path.join(self.state_dir, QUARANTINE)
        os.makedirs(qdir, mode=0o700, exist_ok=True)
        dest = os.path.join(qdir, rel.replace(b"/", b"%") + b".%d" % time.time_ns())
        os.rename(self.path(rel), dest)
        return dest

    # -- trusted.kvfs.* attributes: kvfs's own metadata, beyond the reach of tenants ------

    def read_limits(self, tenant: bytes) -> Limits:
        limits = Limits()
        for name in Limits.names():
            try:
                value = os.getxattr(self.path(tenant), b"trusted.kvfs." + name.encode())
            except OSError:
                continue
            try:
                setattr(limits, name, Limits.parse(name, value.decode()))
            except (ConfigError, UnicodeDecodeError):
                log.warning("tenant %s: ignoring bad %s %r", tenant.decode(errors="replace"),
                            name, value)
        return limits

    def write_limit(self, tenant: bytes, name: str, value: str | None) -> None:
        key = b"trusted.kvfs." + name.encode()
        if value is None:
            try:
                os.removexattr(self.path(tenant), key)
            except OSError as exc:
                if exc.errno != errno.ENODATA:
                    raise
        else:
            os.setxattr(self.path(tenant), key, value.encode())

    def set_pin(self, rel: bytes, pinned: bool) -> None:
        if pinned:
            self.mark_pins(rel.rpartition(b"/")[0])
            os.setxattr(self.path(rel), b"trusted.kvfs.pin", b"1")
        else:
            try:
                os.removexattr(self.path(rel), b"trusted.kvfs.pin")
            except OSError as exc:
                if exc.errno != errno.ENODATA:
                    raise

    def mark_pins(self, dir_rel: bytes) -> None:
        """Mark a directory as one that holds (or held) pinned files: fsck asks a file for
        its pin only in such directories, not a million times."""
        os.setxattr(self.path(dir_rel), PINS_MARK, b"1", follow_symlinks=False)

    def has_pins(self, dir_rel: bytes) -> bool:
        try:
            os.getxattr(self.path(dir_rel), PINS_MARK, follow_symlinks=False)
        except OSError:
            return False
        return True

    def is_pinned(self, rel: bytes) -> bool:
        try:
            return os.getxattr(self.path(rel), b"trusted.kvfs.pin", follow_symlinks=False) == b"1"
        except OSError:
            return False

    # -- extended attributes (user.* only; stored on the backing files themselves) -------

    def getxattr(self, rel: bytes, name: bytes) -> bytes:
        return os.getxattr(self.path(rel), name, follow_symlinks=False)

    def setxattr(self, rel: bytes, name: bytes, value: bytes, flags: int = 0) -> None:
        os.setxattr(self.path(rel), name, value, flags, follow_symlinks=False)

    def removexattr(self, rel: bytes, name: bytes) -> None:
        os.removexattr(self.path(rel), name, follow_symlinks=False)

    def listxattr(self, rel: bytes) -> list[bytes]:
        try:
            names = os.listxattr(self.path(rel), follow_symlinks=False)
        except OSError as exc:
            if exc.errno in (errno.ENOTSUP, errno.EPERM):
                return []
            raise
        return [n.encode() for n in names if n.startswith("user.")]
