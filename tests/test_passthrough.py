"""FUSE passthrough through a real mount: the kernel reads and writes an open hot file's
backing file itself (kvfs.daemon.passthrough), and nothing kvfs promises weakens.

Each test that needs the kernel's passthrough checks first that the mount has it on
(`passthrough_on`); on a kernel or in a container without it they skip, saying why.
"""

from __future__ import annotations

import errno
import mmap
import os
import random
import shutil
import subprocess
import time

import pytest

from .conftest import MOUNT_ARGS, in_child, kvfs

MiB = 1 << 20
ALIGN = 4096
pytestmark = pytest.mark.mount


def _kernel() -> tuple[int, int]:
    major, minor = os.uname().release.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def passthrough_on(m) -> None:
    pt = m.stats()["passthrough"]
    for _ in range(100):  # (the daemon's probe after the kernel's INIT may still be running)
        if pt["state"] != "starting":
            break
        time.sleep(0.05)
        pt = m.stats()["passthrough"]
    if pt["state"] != "on":
        if os.environ.get("KVFS_TEST_MOUNT_ARGS") or _kernel() < (6, 9):
            pytest.skip(f"passthrough is {pt['state']}: {pt['reason']}")
        pytest.fail(f"passthrough is {pt['state']} on Linux {os.uname().release}: "
                    f"{pt['reason']}")


def requests(m) -> dict[str, int]:
    return m.stats()["requests"]


def data_requests(m) -> int:
    r = requests(m)
    return r.get("read", 0) + r.get("write", 0)


def write_mib(path, n: int) -> str:
    """Create (or truncate) `path` and write `n` MiB to it: "ok", or which call failed and
    with what ("write EDQUOT", "close EDQUOT": a passthrough writer is refused at close)."""
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    chunk = b"q" * MiB
    try:
        for _ in range(n):
            os.write(fd, chunk)
    except OSError as exc:
        os.close(fd)
        return f"write {errno.errorcode[exc.errno]}"
    try:
        os.close(fd)
    except OSError as exc:
        return f"close {errno.errorcode[exc.errno]}"
    return "ok"


def aligned(n: int) -> mmap.mmap:
    """An anonymous, page-aligned buffer of n bytes (O_DIRECT needs one)."""
    return mmap.mmap(-1, n)


@pytest.fixture
def ns(mount):
    d = mount.mnt / "t" / "ns"
    d.mkdir(parents=True)
    return d


def test_status_and_stats_say_passthrough_is_on(mount, ns):
    passthrough_on(mount)
    out = kvfs("status", str(mount.mnt)).stdout
    assert "passthrough: on" in out, out
    assert "passthrough on" in mount.log_text()


def test_no_passthrough_option_turns_it_off(mount_factory):
    m = mount_factory(extra=["--no-passthrough"])
    pt = m.stats()["passthrough"]
    assert pt["state"] == "off" and "--no-passthrough" in pt["reason"]
    assert "passthrough: off (turned off (--no-passthrough))" in kvfs("status", str(m.mnt)).stdout
    (m.mnt / "t" / "n").mkdir(parents=True)
    f = m.mnt / "t" / "n" / "x"
    f.write_bytes(b"a" * 300_000)
    before = requests(m)
    assert f.read_bytes() == b"a" * 300_000
    assert requests(m).get("read", 0) > before.get("read", 0)  # the daemon served them


def test_writeback_cache_turns_it_off_and_says_why(mount_factory):
    if "--no-passthrough" in MOUNT_ARGS:
        pytest.skip("every mount has --no-passthrough (KVFS_TEST_MOUNT_ARGS)")
    m = mount_factory(extra=["--writeback-cache"])
    pt = m.stats()["passthrough"]
    assert pt["state"] == "off" and "writeback" in pt["reason"]


def test_no_byte_crosses_the_daemon(mount, ns):
    """Buffered, O_DIRECT and mmap, written and read: no READ or WRITE request, the bytes
    identical, the size and the usage counters right."""
    passthrough_on(mount)
    data = os.urandom(8 * MiB + 123)
    before = data_requests(mount)
    (ns / "buffered").write_bytes(data)
    assert (ns / "buffered").read_bytes() == data
    assert os.stat(ns / "buffered").st_size == len(data)

    buf = aligned(4 * MiB)
    buf.write(data[:4 * MiB])
    fd = os.open(ns / "direct", os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o644)
    try:
        assert os.pwritev(fd, [buf], 0) == 4 * MiB
        back = aligned(4 * MiB)
        assert os.preadv(fd, [back], 0) == 4 * MiB
        assert bytes(back) == data[:4 * MiB]
    finally:
        os.close(fd)

    with open(ns / "buffered", "r+b") as f:
        with mmap.mmap(f.fileno(), 0) as mm:
            assert mm[:4096] == data[:4096] and mm[-100:] == data[-100:]
            mm[5000:5005] = b"HELLO"
            mm.flush()
    data = data[:5000] + b"HELLO" + data[5005:]
    assert (ns / "buffered").read_bytes() == data
    assert data_requests(mount) == before
    used = mount.stats()["tenants"]["t"]["ns"]
    assert used["bytes"] == len(data) + 4 * MiB and used["files"] == 2
    st = mount.stats()
    pt = st["passthrough"]
    # Five opens, each a passthrough open: the daemon's reply completed, or (a file already
    # opened for passthrough) answered by the request thread.
    opens = pt["replies_patched"] + st["requests"].get("thread_open", 0)
    assert pt["replies_missed"] == 0 and opens >= 5 and pt["open_files"] == 0


def _xattr_asks(m) -> int:
    r = requests(m)
    return r.get("getxattr", 0) + r.get("thread_getxattr", 0)


def test_writes_in_small_calls_ask_the_daemon_nothing(mount, ns):
    """The kernel asks `security.capability` before a write(2) may keep a file's privileges;
    with FUSE_HANDLE_KILLPRIV_V2 in the INIT reply (kvfs keeps no set-user/group-ID bits on
    files and no xattr outside `user.`) it asks once per inode, not before every write: a
    file written in 200 calls of 4 KiB, then truncated and written again, costs at most two
    GETXATTR requests (without the flag: 400), and its bytes are whole."""
    passthrough_on(mount)
    before = _xattr_asks(mount)
    chunk = os.urandom(4096)
    for name, flags in (("new", os.O_CREAT | os.O_EXCL), ("new", os.O_TRUNC)):
        fd = os.open(ns / name, os.O_WRONLY | flags, 0o644)
        try:
            for _ in range(200):
                assert os.write(fd, chunk) == 4096
        finally:
            os.close(fd)
    assert (ns / "new").read_bytes() == chunk * 200
    assert _xattr_asks(mount) - before <= 2, requests(mount)


@pytest.mark.parametrize("off", ["--no-passthrough", "--writeback-cache"])
def test_without_passthrough_a_write_asks_no_xattr_either(mount_factory, off):
    """The daemon's own path takes the INIT reply's killpriv flag too: its writes cost their
    WRITE requests (or, with the write-back cache, fewer), and no GETXATTR before each."""
    m = mount_factory(extra=[off])
    assert m.stats()["passthrough"]["state"] == "off"
    d = m.mnt / "t" / "ns"
    d.mkdir(parents=True)
    before = _xattr_asks(m)
    chunk = os.urandom(4096)
    with open(d / "f", "wb", buffering=0) as f:
        for _ in range(100):
            f.write(chunk)
    assert (d / "f").read_bytes() == chunk * 100
    assert _xattr_asks(m) - before <= 1, requests(m)


def test_files_keep_no_set_user_or_group_id(mount_factory):
    """Set-user-ID and set-group-ID are dropped from a file's mode, created or changed,
    through the daemon and through the request thread, in the mount and in the backing
    file; a directory keeps set-group-ID (its new entries take its group)."""
    for extra in ([], ["--no-thread-creates"]):
        m = mount_factory(f"m{len(extra)}", extra)
        d = m.mnt / "t" / "ns"
        d.mkdir(parents=True)
        assert not (d / "missing").exists()  # (hands the directory to the request thread)
        os.close(os.open(d / "made", os.O_CREAT | os.O_WRONLY, 0o6755))
        (d / "changed").write_bytes(b"x")
        os.chmod(d / "changed", 0o6777)
        for name in ("made", "changed"):
            assert os.stat(d / name).st_mode & 0o7777 in (0o755, 0o777), name
            backing = os.stat(m.backing / "t" / "ns" / name).st_mode
            assert not backing & 0o6000, (name, oct(backing))
        os.chmod(d, 0o2755)
        assert os.stat(d).st_mode & 0o7777 == 0o2755
        m.stop()


def test_rewrite_truncate_and_sparse(mount, ns):
    passthrough_on(mount)
    f = ns / "f"
    f.write_bytes(b"x" * 100_000)
    with open(f, "r+b") as fh:  # in place
        fh.seek(10)
        fh.write(b"abc")
        fh.truncate(50_000)  # by descriptor: the daemon's setattr
        fh.seek(3 * MiB)  # a hole, then a tail
        fh.write(b"tail")
    os.truncate(f, 3 * MiB + 2)  # by path
    want = b"x" * 10 + b"abc" + b"x" * (50_000 - 13) + bytes(3 * MiB - 50_000) + b"ta"
    assert f.read_bytes() == want
    st = os.stat(f)
    assert st.st_size == len(want)
    # The hole takes no space in the backing file (the kernel wrote it there itself).
    assert os.stat(mount.backing / "t" / "ns" / "f").st_blocks * 512 < 1 * MiB
    assert mount.stats()["tenants"]["t"]["ns"]["bytes"] == len(want)
    assert data_requests(mount) == 0


def test_size_is_live_while_a_passthrough_writer_writes(mount, ns):
    """stat and ls see what the kernel wrote before the writer's close; du and the usage
    counters settle at the close."""
    passthrough_on(mount)
    with open(ns / "growing", "wb") as fh:
        fh.write(b"z" * 1_000_000)
        fh.flush()
        assert os.stat(ns / "growing").st_size == 1_000_000
        fh.write(b"z" * 1_000_000)
        fh.flush()
        assert os.stat(ns / "growing").st_size == 2_000_000
    assert mount.stats()["tenants"]["t"]["ns"]["bytes"] == 2_000_000
    assert mount.stats()["tenants"]["t"]["ns"]["write_bytes"] == 2_000_000


def test_a_writer_past_its_quota_is_refused_at_close_and_cut_back(mount):
    """A passthrough writer's growth is settled at its close: past the tenant's quota (with
    nothing of the tenant's it could evict: open files are never evicted) it is refused
    there (EDQUOT, as NFS reports it), the file cut back to what was accounted, and the
    tenant holds no more than its quota. Near the quota writers take the daemon's path."""
    passthrough_on(mount)
    kvfs("tenant", "add", str(mount.mnt), "q", "--uid", "1000", "--gid", "1000",
         "--quota", "100M")
    d = mount.mnt / "q" / "ns"
    in_child(1000, 1000, lambda: os.mkdir(d))

    def write(name: str, n: int) -> str:
        return write_mib(d / name, n)

    def usage() -> int:
        return sum(c["bytes"] for c in mount.stats()["tenants"]["q"].values())

    assert in_child(1000, 1000, lambda: write("ok", 20)) == "ok"
    with open(d / "ok", "rb"):  # open: not evictable
        before = data_requests(mount)
        assert in_child(1000, 1000, lambda: write("big", 90)) == "close EDQUOT"
        assert in_child(1000, 1000, lambda: write("huge", 150)) == "close EDQUOT"
        assert data_requests(mount) == before  # through passthrough, refused at close
        assert os.stat(d / "big").st_size == 0  # cut back to what was accounted: nothing
        assert os.stat(d / "huge").st_size == 0
        assert (d / "ok").stat().st_size == 20 * MiB  # what fit is kept
        assert usage() == 20 * MiB
        assert mount.stats()["passthrough"]["cut"] == 2
        assert in_child(1000, 1000, lambda: write("near", 60)) == "ok"
        with open(d / "near", "rb"):
            before = requests(mount).get("write", 0)
            assert in_child(1000, 1000, lambda: write("over", 30)) == "write EDQUOT"
            assert requests(mount).get("write", 0) > before  # the daemon's path
    assert usage() <= 100 * MiB
    du = subprocess.run(["du", "-sb", str(mount.mnt / "q")], capture_output=True, text=True)
    assert int(du.stdout.split()[0]) <= 100 * MiB


def test_past_the_capacity_is_refused_at_close(mount_factory):
    m = mount_factory(extra=["--capacity", "128M"])
    passthrough_on(m)
    (m.mnt / "t" / "ns").mkdir(parents=True)
    f = m.mnt / "t" / "ns" / "huge"
    fd = os.open(f, os.O_CREAT | os.O_WRONLY, 0o644)
    os.write(fd, b"h" * (200 * MiB))
    with pytest.raises(OSError) as exc:
        os.close(fd)
    assert exc.value.errno == errno.EFBIG  # larger than the whole capacity
    assert os.stat(f).st_size == 0
    assert m.stats()["used_bytes"] <= 128 * MiB


def test_eviction_and_unlink_leave_an_open_reader_its_bytes(mount_factory):
    m = mount_factory(extra=["--capacity", "96M"])
    passthrough_on(m)
    d = m.mnt / "t" / "ns"
    d.mkdir(parents=True)
    first = os.urandom(16 * MiB)
    (d / "first").write_bytes(first)
    (d / "second").write_bytes(first[::-1])
    with open(d / "first", "rb") as a, open(d / "second", "rb") as b:
        for i in range(8):  # capacity pressure: 128 MiB more into 96 MiB
            (d / f"more{i}").write_bytes(bytes([i]) * (16 * MiB))
        os.unlink(d / "second")
        assert a.read() == first  # open: never evicted
        assert b.read() == first[::-1]  # unlinked while open: the kernel holds the file
    assert m.stats()["used_bytes"] <= 96 * MiB


def test_a_swapped_backing_file_changes_nothing_for_open_files(mount):
    """The backing file is the one the daemon's strict resolution opened: replacing its
    name in the backing tree (a symlink to a secret, another file) after the open reaches
    neither the reader nor the writer."""
    passthrough_on(mount)
    d = mount.mnt / "t" / "ns"
    d.mkdir(parents=True)
    (d / "blk").write_bytes(b"good" * 1000)
    backing = mount.backing / "t" / "ns" / "blk"
    with open(d / "blk", "rb") as r, open(d / "blk", "r+b") as w:
        os.rename(backing, mount.backing / "t" / "moved")
        os.symlink("/etc/shadow", backing)
        assert r.read() == b"good" * 1000
        w.write(b"BAD!")
        w.flush()
    assert (mount.backing / "t" / "moved").read_bytes()[:4] == b"BAD!"
    assert os.path.islink(backing)
    with open("/etc/shadow", "rb") as f:
        assert b"BAD!" not in f.read(4)


# -- the randomized tester ------------------------------------------------------------------


class Model:
    """The file as it must be: a bytearray beside the real file, every result checked."""

    def __init__(self, path, rng: random.Random, max_size: int) -> None:
        self.path, self.rng, self.max = path, rng, max_size
        self.data = bytearray()
        self.fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o644)
        self.ops: list[str] = []

    def check(self, got: bytes, off: int, n: int, what: str) -> None:
        want = bytes(self.data[off:off + n])
        if got != want:
            diff = next(i for i in range(min(len(got), len(want)) + 1)
                        if i >= len(got) or i >= len(want) or got[i] != want[i])
            raise AssertionError(f"{what} at {off}+{n}: differs from byte {diff} (got "
                                 f"{len(got)} bytes, want {len(want)}); last ops: "
                                 f"{self.ops[-12:]}")

    def step(self) -> None:
        r, size = self.rng, len(self.data)
        op = r.choices(["write", "read", "truncate", "mread", "mwrite", "fsync", "reopen",
                        "dwrite", "dread", "stat"], [30, 25, 8, 8, 8, 3, 6, 4, 4, 4])[0]
        off = r.randrange(0, self.max)
        n = r.randrange(1, 65536)
        if op == "write":
            buf = r.randbytes(n)
            assert os.pwrite(self.fd, buf, off) == n
            if off > size:
                self.data.extend(bytes(off - size))
            self.data[off:off + n] = buf
        elif op == "read":
            self.check(os.pread(self.fd, n, off), off, n, "read")
        elif op == "truncate":
            new = r.randrange(0, self.max)
            os.ftruncate(self.fd, new)
            del self.data[new:]
            self.data.extend(bytes(new - len(self.data)))
        elif op in ("mread", "mwrite") and size:
            with mmap.mmap(self.fd, size) as mm:
                off = r.randrange(0, size)
                n = min(n, size - off)
                if op == "mread":
                    self.check(mm[off:off + n], off, n, "mmap read")
                else:
                    buf = r.randbytes(n)
                    mm[off:off + n] = buf
                    self.data[off:off + n] = buf
                    if r.random() < 0.5:
                        mm.flush()
        elif op == "fsync":
            os.fsync(self.fd)
        elif op == "reopen":
            os.close(self.fd)
            self.fd = os.open(self.path, os.O_RDWR)
        elif op in ("dwrite", "dread"):
            off, n = off // ALIGN * ALIGN, max(ALIGN, n // ALIGN * ALIGN)
            fd = os.open(self.path, os.O_RDWR | os.O_DIRECT)
            buf = aligned(n)
            try:
                if op == "dwrite":
                    payload = r.randbytes(n)
                    buf.write(payload)
                    assert os.pwritev(fd, [buf], off) == n
                    if off > len(self.data):
                        self.data.extend(bytes(off - len(self.data)))
                    self.data[off:off + n] = payload
                else:
                    got = os.preadv(fd, [buf], off)
                    self.check(bytes(buf[:got]), off, n, "O_DIRECT read")
            finally:
                os.close(fd)
        elif op == "stat":
            assert os.stat(self.path).st_size == len(self.data), self.ops[-12:]
        self.ops.append(f"{op}@{off}+{n}")

    def close(self) -> None:
        os.close(self.fd)
        with open(self.path, "rb") as f:
            self.check(f.read(), 0, len(self.data) + 1, "final read")


@pytest.mark.parametrize("door", ["passthrough", "daemon"])
def test_randomized_operations_match_a_model(mount_factory, door):
    """In the manner of fsx: thousands of seeded random writes, reads, truncates, mmap reads
    and writes, O_DIRECT reads and writes, fsyncs, closes and reopens of files, each checked
    against an in-memory model; on the passthrough path and on the daemon's."""
    m = mount_factory(extra=[] if door == "passthrough" else ["--no-passthrough"])
    if door == "passthrough":
        passthrough_on(m)
    d = m.mnt / "t" / "ns"
    d.mkdir(parents=True)
    seed = int(os.environ.get("KVFS_FSX_SEED", "20261202"))
    for k in range(3):
        rng = random.Random(seed + k)
        model = Model(d / f"fsx{k}", rng, max_size=[256 * 1024, 2 * MiB, 9 * MiB][k])
        for _ in range(1500):
            model.step()
        model.close()
    if door == "passthrough":
        assert data_requests(m) == 0
        assert m.stats()["passthrough"]["replies_missed"] == 0
    total = sum(os.stat(d / f"fsx{k}").st_size for k in range(3))
    assert m.stats()["tenants"]["t"]["ns"]["bytes"] == total


def test_killed_daemon_under_passthrough_writes_loses_no_complete_file(mount_factory):
    """SIGKILL while passthrough writers are writing: complete files (closed before) are
    kept at the next mount, the one being written goes, no stray is left."""
    m = mount_factory()
    passthrough_on(m)
    d = m.mnt / "t" / "ns"
    d.mkdir(parents=True)
    for i in range(20):
        (d / f"done{i}").write_bytes(bytes([i]) * 300_000)
    fd = os.open(d / "partial", os.O_CREAT | os.O_WRONLY, 0o644)
    os.write(fd, b"p" * 500_000)
    os.kill(m.pid(), 9)
    try:
        os.close(fd)
    except OSError:
        pass
    m.stop(check=False)
    m.start()
    names = sorted(p.name for p in d.iterdir())
    assert names == sorted(f"done{i}" for i in range(20))
    for i in range(20):
        assert (d / f"done{i}").read_bytes() == bytes([i]) * 300_000
    left = sorted(os.listdir(m.backing / "t" / "ns"))
    assert left == names
    shutil.rmtree(d)
