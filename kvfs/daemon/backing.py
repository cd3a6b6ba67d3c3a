"""Resolving paths in a hostile tree: from a trusted directory fd, never through a symlink.

The tenants' part of the backing tree is written by untrusted processes at any moment, between
any two system calls of the daemon (see docs/architecture.md, "The backing tree is hostile").
Every path the daemon, fsck and the tiers use in it is resolved here, relative to a directory
fd the caller trusts (the backing root), with `openat2(2)` and RESOLVE_BENEATH |
RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV | RESOLVE_NO_MAGICLINKS: a symlink anywhere on the way,
the leaf included, fails with ELOOP; a mount point crossed fails with EXDEV. One resolution is
one system call, so nothing can be swapped between the check of a component and its use.

Where the kernel lacks openat2 (ENOSYS: Linux before 5.6) the same rule holds by a walk one
component at a time with O_NOFOLLOW | O_DIRECTORY, each opened relative to the last, and the
device of each compared with the root's. Paths of PATH_MAX or more (deep trees; the kernel
takes at most PATH_MAX per call) are resolved in chunks, each relative to the last chunk's fd.

Pure system calls, no policy: `kvfs.daemon.store` builds the backing operations on these.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import stat

#: openat2 resolve flags (linux/openat2.h).
RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
RESOLVE_CACHED = 0x20
STRICT = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV | RESOLVE_NO_MAGICLINKS

#: openat2 is system call 437 on every architecture that has it (the unified numbering).
_SYS_OPENAT2 = {"x86_64": 437, "aarch64": 437, "arm64": 437, "riscv64": 437,
                "ppc64le": 437, "s390x": 437}.get(platform.machine(), 437)
#: Bytes of path handed to one call: below PATH_MAX (4096 with its NUL), with room to spare.
CHUNK = 3072
#: Flags of an intermediate directory: read-only (fchown, fsetxattr and scandir need a real
#: fd, not O_PATH), never a symlink, never a terminal.
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_syscall.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p,
                     ctypes.c_size_t]


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64)]


_HOW_SIZE = ctypes.sizeof(_OpenHow)

#: Whether openat2 is used; False after the kernel said ENOSYS once (tests set it to check
#: the fallback walk).
use_openat2 = True
#: Whether `open_cached` tries RESOLVE_CACHED; False after the kernel refused it once
#: (EINVAL: Linux before 5.12).
use_cached = True


def openat2(dirfd: int, path: bytes, flags: int, mode: int = 0, resolve: int = STRICT) -> int:
    """openat2(2): an fd, or OSError (ENOSYS where the kernel lacks it)."""
    how = _OpenHow(flags | os.O_CLOEXEC, mode if flags & (os.O_CREAT | os.O_TMPFILE) else 0,
                   resolve)
    for _ in range(8):
        fd = _syscall(_SYS_OPENAT2, dirfd, path, ctypes.addressof(how), _HOW_SIZE)
        if fd >= 0:
            return int(fd)
        err = ctypes.get_errno()
        if err not in (errno.EINTR, errno.EAGAIN):  # EAGAIN: a race the kernel asks to retry
            raise OSError(err, os.strerror(err), path)
    raise OSError(errno.EAGAIN, os.strerror(errno.EAGAIN), path)


def open_cached(dirfd: int, rel: bytes, flags: int) -> int | None:
    """`open_beneath`'s resolution with RESOLVE_CACHED too: an fd only when every component
    of `rel` is in the kernel's dentry cache, so that the lookup does no I/O and cannot wait
    (fit for the daemon's event loop); None when it would need the disk (EAGAIN), and for
    anything else (a link, a missing name, a kernel without it, a long path): the caller
    then opens in a worker thread as usual, which gives the error. Never O_CREAT or O_TRUNC
    (the kernel refuses them with RESOLVE_CACHED)."""
    global use_cached
    if not (use_openat2 and use_cached) or len(rel) > CHUNK or flags & (
            os.O_CREAT | os.O_TRUNC | os.O_TMPFILE):
        return None
    try:
        components(rel)
    except OSError:
        return None
    how = _OpenHow(flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0, STRICT | RESOLVE_CACHED)
    for _ in range(2):  # EAGAIN also when a concurrent rename or mount disturbed the walk
        fd = _syscall(_SYS_OPENAT2, dirfd, rel, ctypes.addressof(how), _HOW_SIZE)
        if fd >= 0:
            return int(fd)
        err = ctypes.get_errno()
        if err in (errno.EINVAL, errno.ENOSYS):
            use_cached = False
        if err not in (errno.EAGAIN, errno.EINTR):
            break
    return None


def components(rel: bytes) -> list[bytes]:
    """The names of a relative path; '', '.', '..' and absolute paths are refused (EINVAL):
    the daemon's own paths never have them, so one that does is an attack or a bug."""
    if not rel:
        return []
    parts = rel.split(b"/")
    if b"" in parts or b"." in parts or b".." in parts or b"\0" in rel:  # ('' covers '/a')
        raise OSError(errno.EINVAL, "not a plain relative path", rel)
    return parts


def _chunks(parts: list[bytes]) -> list[bytes]:
    """Consecutive components joined into paths of at most CHUNK bytes each."""
    out: list[bytes] = []
    cur: list[bytes] = []
    size = 0
    for p in parts:
        if cur and size + 1 + len(p) > CHUNK:
            out.append(b"/".join(cur))
            cur, size = [], 0
        cur.append(p)
        size += len(p) + 1
    if cur:
        out.append(b"/".join(cur))
    return out


def _walk_one(dirfd: int, path: bytes, flags: int, mode: int, root_dev: int) -> int:
    """Fallback for one chunk: component by component, O_NOFOLLOW everywhere, no mount
    crossed."""
    parts = path.split(b"/")
    cur = dirfd
    try:
        for name in parts[:-1]:
            try:
                nxt = os.open(name, DIR_FLAGS, dir_fd=cur)
            except NotADirectoryError:
                if stat.S_ISLNK(os.stat(name, dir_fd=cur, follow_symlinks=False).st_mode):
                    raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path) from None
                raise
            if cur != dirfd:
                os.close(cur)
            cur = nxt
            if os.fstat(cur).st_dev != root_dev:
                raise OSError(errno.EXDEV, "crosses a mount point", path)
        fd = os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=cur)
    finally:
        if cur != dirfd:
            os.close(cur)
    try:
        if os.fstat(fd).st_dev != root_dev:
            raise OSError(errno.EXDEV, "crosses a mount point", path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_chunk(dirfd: int, path: bytes, flags: int, mode: int, root_dev: int) -> int:
    global use_openat2
    if use_openat2:
        try:
            return openat2(dirfd, path, flags | os.O_NOFOLLOW, mode)
        except OSError as exc:
            if exc.errno != errno.ENOSYS:
                raise
            use_openat2 = False
    return _walk_one(dirfd, path, flags, mode, root_dev)


def open_beneath(dirfd: int, rel: bytes, flags: int, mode: int = 0,
                 root_dev: int | None = None) -> int:
    """Open `rel` below the directory `dirfd` without following any symlink (the leaf
    included) and without leaving `dirfd`'s mount; '' opens `dirfd` itself again. Long
    paths are resolved a chunk at a time."""
    parts = components(rel)
    if not parts:
        return os.open(".", flags | os.O_CLOEXEC, dir_fd=dirfd)
    if use_openat2 and len(rel) <= CHUNK:  # the common case: one system call
        try:
            return openat2(dirfd, rel, flags | os.O_NOFOLLOW, mode)
        except OSError as exc:
            if exc.errno != errno.ENOSYS:
                raise
    if root_dev is None:
        root_dev = os.fstat(dirfd).st_dev
    chunks = _chunks(parts)
    cur = dirfd
    try:
        for chunk in chunks[:-1]:
            nxt = _open_chunk(cur, chunk, DIR_FLAGS, 0, root_dev)
            if cur != dirfd:
                os.close(cur)
            cur = nxt
        return _open_chunk(cur, chunks[-1], flags, mode, root_dev)
    finally:
        if cur != dirfd:
            os.close(cur)


#: renameat2(2) flags (`os.rename` has none), and the "current directory" fd for paths.
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
AT_FDCWD = -100


def renameat2(olddirfd: int, old: bytes, newdirfd: int, new: bytes, flags: int = 0) -> None:
    """renameat2(2) between two directory fds (RENAME_NOREPLACE / RENAME_EXCHANGE)."""
    if flags == 0:
        os.rename(old, new, src_dir_fd=olddirfd, dst_dir_fd=newdirfd)
        return
    if _libc.renameat2(olddirfd, old, newdirfd, new, ctypes.c_uint(flags)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), old)
