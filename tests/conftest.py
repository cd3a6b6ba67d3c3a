"""Shared fixtures: a real kvfs mount run as a subprocess, as users run it.

The mount itself is the benchmarks' harness (:class:`kvfs.bench.harness.Mount`): the same
start, the same reliable unmount. Real-mount tests need root (or a setuid fusermount3) and
/dev/fuse; without them they skip with that reason. The daemon's log is checked after every
test: a traceback fails the test that caused it.

Markers: every test that uses a mount fixture (`mount`, `mount_factory`) or the S3 server
(`s3`) is marked `mount` here, as are the test modules that start mounts or servers of their
own (their `pytestmark`); `pytest -m "not mount"` runs the unit tests alone, in seconds.

KVFS_TEST_MOUNT_ARGS: options added to every mount the fixtures start (tools/test.sh runs the
daemon's mount tests again with `--no-passthrough`: the path where the daemon serves the bytes).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import shlex
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvfs.bench.harness import (  # noqa: F401 - Mount, force_unmount: the tests' API too
    KVFS,
    KvfsError,
    Mount,
    abort_connection,
    force_unmount,
    fuse_available,
    run_kvfs,
)

#: Fixtures that make a test a mount test (real mounts, real servers: slower than a unit).
MOUNT_FIXTURES = {"mount", "mount_factory", "s3"}
#: Options every mount of the fixtures gets (KVFS_TEST_MOUNT_ARGS).
MOUNT_ARGS = shlex.split(os.environ.get("KVFS_TEST_MOUNT_ARGS", ""))
#: The key-encryption key of the fixtures' mounts (made by the first that needs it), so that
#: tests never touch the machine's /etc/kvfs/kek.
TEST_KEK = os.path.join(tempfile.gettempdir(), f"kvfs-test-kek-{os.getuid()}")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark `mount` every test that uses a mount fixture (the unit tests are the rest)."""
    for item in items:
        if MOUNT_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.mount)


def flip_byte(path: str | os.PathLike, offset: int, mask: int = 0xFF) -> None:
    """Flip bits of one byte of a file in place (a damaged block file)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


def resident_pages(path: str | os.PathLike) -> int:
    """How many of a file's pages are in the page cache now (mincore over a mapping, which
    faults nothing in)."""
    size = os.path.getsize(path)
    if size == 0:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap {path}")
        try:
            vec = (ctypes.c_ubyte * (-(-size // mmap.PAGESIZE)))()
            if libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore {path}")
            return sum(b & 1 for b in vec)
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


def drop_cached(path: str | os.PathLike, attempts: int = 50) -> None:
    """Evict a file's pages from the page cache (written back first), and check they are gone:
    the next read is cold. ``POSIX_FADV_DONTNEED`` skips pages the kernel still holds a
    reference to (a CPU's pending LRU batch, a page under writeback), so one call does not
    always drop them all; it is repeated until none is left, and failing that the test fails
    here, not in an assertion about the read."""
    for _ in range(attempts):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        left = resident_pages(path)
        if left == 0:
            return
        time.sleep(0.02)
    raise AssertionError(f"{path}: {left} pages still in the page cache after "
                         f"{attempts} drops")


def kvfs(*args: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    """``kvfs ARGS``; a failure (check) fails the test with the command's output."""
    res = run_kvfs(*args, check=False, **kw)
    if check and res.returncode != 0:
        raise AssertionError(f"kvfs {' '.join(args)} failed ({res.returncode}):\n"
                             f"{res.stdout}\n{res.stderr}")
    return res


@pytest.fixture
def mount_factory() -> Iterator:
    why = fuse_available()
    if why:
        pytest.skip(why)
    mounts: list[Mount] = []
    # Other tenants' uids must be able to reach the mount point: a world-traversable base.
    tmp_path = Path(tempfile.mkdtemp(prefix="kvfs-test-"))
    os.chmod(tmp_path, 0o755)

    def make(name: str = "m", extra: list[str] | None = None, start: bool = True) -> Mount:
        # Every "host" of a test shares one key-encryption key, as hosts sharing a tier must.
        m = Mount.under(tmp_path / name, [*(extra or []), *MOUNT_ARGS], key_file=TEST_KEK)
        mounts.append(m)
        if start:
            m.start()
        return m

    yield make
    problems = []
    for m in mounts:
        try:
            m.stop()  # a daemon that does not unmount is unmounted by force, and said
        except KvfsError as exc:
            problems.append(str(exc))
        text = m.log_text()
        if "Traceback" in text:
            problems.append(f"daemon log of {m.mnt} has a traceback:\n{text[-4000:]}")
    deadline = time.monotonic() + 5
    while any(os.path.ismount(m.mnt) for m in mounts) and time.monotonic() < deadline:
        time.sleep(0.05)
    if not any(os.path.ismount(m.mnt) for m in mounts):
        shutil.rmtree(tmp_path, ignore_errors=True)
    if problems:
        pytest.fail("\n".join(problems))


@pytest.fixture
def mount(mount_factory) -> Mount:
    """One started mount over an empty backing directory."""
    return mount_factory()


def run_as(uid: int, gid: int, argv: list[str], **kw) -> subprocess.CompletedProcess:
    """Run a command as another uid/gid (a real process of another tenant)."""

    def drop() -> None:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)

    return subprocess.run(argv, capture_output=True, text=True, preexec_fn=drop, **kw)


def in_child(uid: int, gid: int, fn, groups: tuple[int, ...] = ()):
    """Call `fn()` in a forked child running as uid:gid (with these supplementary groups),
    as a real process of another user would; returns what it returned (JSON-able), or
    raises the OSError it raised (as an OSError with the same errno)."""
    import json

    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(rfd)
        try:
            os.setgroups(list(groups))
            os.setgid(gid)
            os.setuid(uid)
            out = {"value": fn()}
        except OSError as exc:
            out = {"errno": exc.errno, "error": str(exc)}
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            out = {"failed": repr(exc)}
        os.write(wfd, json.dumps(out).encode())
        os._exit(0)
    os.close(wfd)
    with os.fdopen(rfd, "rb") as f:
        out = json.loads(f.read() or b'{"failed": "no answer"}')
    os.waitpid(pid, 0)
    if "errno" in out:
        raise OSError(out["errno"], out["error"])
    if "failed" in out:
        raise AssertionError(f"child failed: {out['failed']}")
    return out["value"]
