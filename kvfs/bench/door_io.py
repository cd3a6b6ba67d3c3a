"""The engines' file patterns of `kvfs bench door` (see its module text): each file written
and read as the engine writes and reads it, on any directory (the mount, the plain one, the
peer's)."""

from __future__ import annotations

import mmap
import os
import threading
import uuid

MiB = 1 << 20
#: The calls of the `file-chunked` pattern: as cp, cat and dd move a file (128 KiB).
CHUNK = 128 << 10


def aligned(size: int) -> mmap.mmap:
    """A page-aligned buffer (what O_DIRECT asks for), filled with non-zero bytes."""
    buf = mmap.mmap(-1, size)
    buf.write(os.urandom(min(size, MiB)) * max(1, size // MiB))
    return buf


def direct_ok(directory: str) -> bool:
    """Whether `directory` takes O_DIRECT (vLLM's probe: a hidden temporary)."""
    path = os.path.join(directory, f".o_direct_probe_{uuid.uuid4().hex[:8]}.tmp")
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_DIRECT, 0o644)
    except OSError:
        return False
    os.close(fd)
    os.unlink(path)
    return True


def _write_all(fd: int, buf: memoryview) -> None:
    done = 0
    while done < len(buf):
        done += os.write(fd, buf[done:])


def write_files(pattern: str, directory: str, names: list[str], buf: mmap.mmap,
                direct: bool) -> None:
    """Write every file of `names` in `directory` as the pattern's engine does."""
    view = memoryview(buf)
    odirect = os.O_DIRECT if direct else 0
    for name in names:
        path = os.path.join(directory, name)
        if pattern == "small":
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            _write_all(fd, view)
            os.close(fd)
        elif pattern == "file-chunked":
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            for at in range(0, len(view), CHUNK):
                _write_all(fd, view[at:at + CHUNK])
            os.close(fd)
        elif pattern in ("vllm", "sglang"):
            if os.path.exists(path):
                continue
            if pattern == "vllm":
                tmp = f"{path}_{uuid.uuid4().hex[:8]}.tmp"
                flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_TRUNC | odirect
            else:
                tmp = f"{path}.tmp.{os.getpid()}.{threading.get_ident()}.{uuid.uuid4().hex}"
                flags = os.O_CREAT | os.O_WRONLY | os.O_TRUNC
            fd = os.open(tmp, flags, 0o644)
            _write_all(fd, view)
            os.close(fd)
            os.replace(tmp, path)
        else:  # lmcache: in place at the final name
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | odirect, 0o644)
            _write_all(fd, view)
            os.close(fd)


def read_files(directory: str, names: list[str], buf: mmap.mmap, direct: bool,
               chunk: int = 0) -> None:
    """Read every file whole into `buf` (readinto / readv; O_DIRECT when `direct`), in calls
    of at most `chunk` bytes where given."""
    view = memoryview(buf)
    size = len(buf)
    step = chunk or size
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    for name in names:
        fd = os.open(os.path.join(directory, name), flags)
        got = 0
        while got < size:
            n = os.readv(fd, [view[got:got + step]])
            if n == 0:
                os.close(fd)
                raise RuntimeError(f"{name}: short file ({got} of {size} bytes)")
            got += n
        os.close(fd)
