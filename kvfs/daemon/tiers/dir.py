"""The directory tier: block files at ``<root>/<key>`` on a local HDD or a POSIX file system
every host mounts (NFS, CephFS, Lustre)."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator

from ..backing import AT_FDCWD, RENAME_NOREPLACE, renameat2
from .base import (
    TMP_PREFIX,
    WRITE_PIECE,
    Tier,
    TierError,
    check_key,
    temp_beside,
    unlink_quietly,
)

_COPY_CHUNK = 16 << 20


def _copy_fd(src: int, dst: int) -> None:
    """Copy from the current position of `src` to its end (sendfile where it can)."""
    try:
        while os.sendfile(dst, src, None, _COPY_CHUNK):
            pass
        return
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise
    while buf := os.read(src, 1 << 20):
        os.write(dst, buf)


def _write_all(fd: int, data: bytes | bytearray) -> None:
    """All of ``data``, WRITE_PIECE bytes a call (see kvfs.daemon.tiers.base)."""
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view[:WRITE_PIECE]):]


def _makedirs(path: str, top: str) -> None:
    """Create `path` and its missing parents below `top`, every one 0700."""
    if path == top or os.path.isdir(path):
        return
    _makedirs(os.path.dirname(path), top)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass



class DirTier(Tier):
    """Files at ``<root>/<key>``: a local HDD, or a POSIX file system every host mounts (NFS,
    CephFS, Lustre). It holds every tenant's data, so directories are 0700 and files 0600."""

    hands_files = True

    def __init__(self, root: str, name: str = "cold", *, fsync: bool = False) -> None:
        self.root = os.path.abspath(root)
        self.name = name
        self.url = f"dir://{self.root}"
        self.fsync = fsync
        os.makedirs(self.root, mode=0o700, exist_ok=True)

    def _path(self, key: str) -> str:
        return os.path.join(self.root, check_key(key))

    def _error(self, op: str, key: str, exc: BaseException) -> TierError:
        return TierError(self.name, op, key, exc)

    def put(self, key: str, src: str | bytes | bytearray, *, probe: bool = True) -> bool:
        dest = self._path(key)
        if os.path.lexists(dest):
            return False
        tmp = None
        try:
            _makedirs(os.path.dirname(dest), self.root)
            with contextlib.nullcontext(src) if not isinstance(src, str) else open(src, "rb") as f:
                tmp, fd = temp_beside(dest)
                try:
                    if isinstance(f, bytes | bytearray):
                        _write_all(fd, f)
                    else:
                        _copy_fd(f.fileno(), fd)
                    if self.fsync:
                        os.fsync(fd)
                finally:
                    os.close(fd)
            published = _publish(tmp, dest)
            tmp = None if published else tmp
            return published
        except OSError as exc:
            raise self._error("put", key, exc) from exc
        finally:
            if tmp is not None:
                unlink_quietly(tmp)

    def get(self, key: str, dest: str) -> bool:
        path = self._path(key)
        tmp = None
        try:
            try:
                src = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                return False
            try:
                tmp, fd = temp_beside(dest)
                try:
                    _copy_fd(src, fd)
                finally:
                    os.close(fd)
            finally:
                os.close(src)
            os.rename(tmp, dest)
            tmp = None
            return True
        except OSError as exc:
            raise self._error("get", key, exc) from exc
        finally:
            if tmp is not None:
                unlink_quietly(tmp)

    def read(self, key: str, limit: int) -> bytearray | None:
        """The file's bytes, read into one buffer (the one copy out of the page cache)."""
        try:
            try:
                fd = os.open(self._path(key), os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                return None
            try:
                size = os.fstat(fd).st_size
                if size > limit:
                    raise TierError(self.name, "get", key, f"{size} bytes, over {limit}")
                buf = bytearray(size)
                view, done = memoryview(buf), 0
                while done < size:
                    n = os.preadv(fd, [view[done:]], done)
                    if not n:
                        raise TierError(self.name, "get", key, f"short: {done} of {size} bytes")
                    done += n
                del view
                return buf
            finally:
                os.close(fd)
        except OSError as exc:
            raise self._error("get", key, exc) from exc

    def open_block(self, key: str) -> tuple[int, int] | None:
        try:
            fd = os.open(self._path(key), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                return None  # absent, or not a file kvfs wrote (a link)
            raise self._error("open", key, exc) from exc
        try:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode):
                return fd, st.st_size
        except OSError:
            pass
        os.close(fd)
        return None

    def exists(self, key: str) -> bool:
        return self.size(key) is not None

    def delete(self, key: str) -> None:
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise self._error("delete", key, exc) from exc

    def size(self, key: str) -> int | None:
        try:
            st = os.stat(self._path(key))
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            raise self._error("stat", key, exc) from exc
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    def list(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        """Sorted by key within each directory; walks only below the prefix's directory."""
        base = prefix.rpartition("/")[0]
        start = os.path.join(self.root, base) if base else self.root
        try:
            yield from self._walk(start, base, prefix)
        except OSError as exc:
            raise self._error("list", prefix, exc) from exc

    def _walk(self, path: str, rel: str, prefix: str) -> Iterator[tuple[str, int]]:
        try:
            entries = sorted(os.scandir(path), key=lambda e: e.name)
        except (FileNotFoundError, NotADirectoryError):
            return
        for entry in entries:
            if entry.name.startswith(TMP_PREFIX):
                continue
            key = f"{rel}/{entry.name}" if rel else entry.name
            if entry.is_dir(follow_symlinks=False):
                if key.startswith(prefix) or prefix.startswith(key + "/"):
                    yield from self._walk(entry.path, key, prefix)
            elif entry.is_file(follow_symlinks=False) and key.startswith(prefix):
                try:
                    yield key, entry.stat(follow_symlinks=False).st_size
                except FileNotFoundError:
                    continue


def _publish(tmp: str, dest: str) -> bool:
    """Move `tmp` to `dest` unless `dest` exists; exactly one of concurrent writers wins.
    renameat2(RENAME_NOREPLACE) where the file system has it, link+unlink (NFS) otherwise."""
    try:
        renameat2(AT_FDCWD, tmp.encode(), AT_FDCWD, dest.encode(), RENAME_NOREPLACE)
        return True
    except FileExistsError:
        return False
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise
    try:
        os.link(tmp, dest)
    except FileExistsError:
        return False
    unlink_quietly(tmp)
    return True


