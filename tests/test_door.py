"""The mount door's kernel caching (write-back cache, kept page cache) through a real mount:
limits stay exact, errors reach the writer, nothing stale is ever served."""

from __future__ import annotations

import errno
import mmap
import os
import time

import pytest

from .conftest import kvfs, resident_pages

K = 1024
WB = ["--writeback-cache"]


def requests(m) -> dict[str, int]:
    return m.stats().get("requests", {})


def write_then_close(path, data: bytes) -> int:
    """Write `data` to a new file at `path` and close it, in a child of uid 1000; the errno
    it met at open, write or close (0: none), and where ('write' or 'close')."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.setgroups([])
            os.setgid(1000)
            os.setuid(1000)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.write(fd, data)
            except OSError as exc:
                os.write(wfd, b"write")
                code = exc.errno or 250
            try:
                os.close(fd)
            except OSError as exc:
                if not code:
                    os.write(wfd, b"close")
                    code = exc.errno or 250
        finally:
            os._exit(code)
    os.close(wfd)
    _, status = os.waitpid(pid, 0)
    with os.fdopen(rfd, "rb") as r:
        where = r.read().decode()
    return os.waitstatus_to_exitcode(status), where


@pytest.fixture
def quota(mount_factory):
    m = mount_factory(extra=WB)
    kvfs("tenant", "add", str(m.mnt), "a", "--uid", "1000", "--gid", "1000", "--quota", "300K")
    return m


def test_writeback_is_off_by_default_and_can_be_turned_on(mount_factory):
    """With the write-back cache a small write reaches the daemon at close (one WRITE for
    many write(2) calls); without it (the default), each write(2) the daemon serves (not
    passthrough's) is a request."""
    on = mount_factory("on", extra=WB)
    off = mount_factory("off", extra=["--no-passthrough"])
    for m in (on, off):
        kvfs("tenant", "add", str(m.mnt), "t", "--uid", "0", "--gid", "0")
        before = requests(m).get("write", 0)
        with open(m.mnt / "t" / "f", "wb", buffering=0) as f:
            for _ in range(16):
                f.write(b"x" * 4096)
        m.writes = requests(m).get("write", 0) - before
        assert (m.mnt / "t" / "f").read_bytes() == b"x" * 16 * 4096
    assert on.writes == 1
    assert off.writes == 16


def test_quota_overrun_reaches_the_writer_and_is_not_kept(quota):
    """A write past the quota, cached by the kernel, is refused when it reaches the daemon:
    the writer gets EDQUOT (at write or at close), the tenant's usage stays within the
    quota, and what was refused is neither stored nor readable through the mount."""
    m = quota
    code, where = write_then_close(m.mnt / "a" / "big", b"q" * (400 * K))
    assert code == errno.EDQUOT, (code, where)
    used = int(os.getxattr(m.mnt / "a", "user.kvfs.used"))
    assert used <= 300 * K
    backing = m.backing / "a" / "big"
    stored = backing.stat().st_size if backing.exists() else 0
    assert stored <= 300 * K
    if (m.mnt / "a" / "big").exists():
        data = (m.mnt / "a" / "big").read_bytes()
        assert len(data) <= 300 * K and set(data) <= {ord("q")}
    # Room within the quota is still usable: a file that fits is written whole.
    code, where = write_then_close(m.mnt / "a" / "fits", b"f" * (100 * K))
    assert code == 0, (code, where)
    assert (m.mnt / "a" / "fits").read_bytes() == b"f" * (100 * K)


def test_quota_overrun_reaches_fsync(quota):
    m = quota
    fd = os.open(m.mnt / "a" / "x", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        try:
            os.write(fd, b"z" * (400 * K))
        except OSError as exc:  # refused at once: as good
            assert exc.errno == errno.EDQUOT
        else:
            with pytest.raises(OSError) as info:
                os.fsync(fd)
            assert info.value.errno == errno.EDQUOT
    finally:
        try:
            os.close(fd)
        except OSError:
            pass
    assert int(os.getxattr(m.mnt / "a", "user.kvfs.used")) <= 300 * K


def test_capacity_overrun_reaches_the_writer(mount_factory):
    """Capacity full of pinned files: a cached write past it gets ENOSPC at close."""
    m = mount_factory(extra=["--capacity", "1M", *WB])
    kvfs("tenant", "add", str(m.mnt), "a", "--uid", "1000", "--gid", "1000")
    for i in range(3):
        p = m.mnt / "a" / f"p{i}"
        p.write_bytes(b"p" * (300 * K))
        os.setxattr(p, "user.kvfs.pin", b"1")
    code, where = write_then_close(m.mnt / "a" / "over", b"o" * (300 * K))
    assert code == errno.ENOSPC, (code, where)
    assert m.stats()["used_bytes"] <= 1 << 20
    # What is left of it: what was kept, never the refused bytes. (The kernel keeps the size
    # it made up for them until it forgets the inode: zeros, see docs/architecture.md.)
    kept = (m.backing / "a" / "over").stat().st_size
    assert kept < 300 * K
    data = (m.mnt / "a" / "over").read_bytes()
    assert data[:kept] == b"o" * kept and data[kept:] == bytes(len(data) - kept)
    for i in range(3):
        assert (m.mnt / "a" / f"p{i}").read_bytes() == b"p" * (300 * K)


def test_warm_read_after_write_is_served_by_the_kernel(mount_factory):
    """A file just written and closed is read again from the page cache the writer left
    (kept across its close and the reader's open): no READ reaches the daemon. Without the
    write-back cache libfuse's auto_inval_data drops those pages when the kernel sees the
    file's new mtime."""
    m = mount_factory(extra=WB)
    kvfs("tenant", "add", str(m.mnt), "t", "--uid", "0", "--gid", "0")
    data = os.urandom(1 << 20)
    (m.mnt / "t" / "f").write_bytes(data)
    own = -requests(m).get("read", 0) + requests(m).get("read", 0)  # reading stats.json
    before = requests(m).get("read", 0)
    for _ in range(3):
        assert (m.mnt / "t" / "f").read_bytes() == data
    assert requests(m).get("read", 0) - before == own


def test_evicted_then_recreated_reads_new_content(mount_factory):
    """A file whose pages the kernel keeps, evicted by the daemon and written again under
    the same name with other content, reads the new content; between the two, the name is
    gone (never the old bytes)."""
    m = mount_factory(extra=["--capacity", "1M", "--high-watermark", "0.9",
                             "--low-watermark", "0.5", "--scan-interval", "0.2", *WB])
    kvfs("tenant", "add", str(m.mnt), "t", "--uid", "0", "--gid", "0")
    f = m.mnt / "t" / "f"
    old = b"O" * (300 * K)
    f.write_bytes(old)
    assert f.read_bytes() == old  # its pages are cached now
    time.sleep(0.05)
    for i in range(3):  # push it out: it is the least recently used
        (m.mnt / "t" / f"g{i}").write_bytes(b"g" * (300 * K))
        time.sleep(0.05)
    deadline = time.monotonic() + 10
    while (m.backing / "t" / "f").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not (m.backing / "t" / "f").exists()
    with pytest.raises(FileNotFoundError):
        f.read_bytes()
    new = b"N" * (200 * K)
    f.write_bytes(new)
    assert f.read_bytes() == new


def cached_bytes(path) -> int:
    """Bytes of `path` in the page cache (conftest.resident_pages: mincore, reads nothing)."""
    return min(os.path.getsize(path), resident_pages(path) * mmap.PAGESIZE)


def test_a_cold_open_asks_for_the_whole_file(mount_factory):
    """A file larger than one read request (1 MiB), opened for reading where its backing
    path is not in the kernel's cache, has its data asked for by the open itself: the disk
    starts on the whole file before the first read arrives. A smaller one is left to its
    read, and a warm open (its path cached) asks for nothing."""
    from kvfs.bench.harness import can_drop_caches, drop_caches

    if not can_drop_caches():
        pytest.skip("dropping the kernel's caches needs root")
    m = mount_factory(extra=["--no-passthrough"])  # passthrough: the kernel's own read-ahead
    kvfs("tenant", "add", str(m.mnt), "t", "--uid", "0", "--gid", "0")
    data = {"big": os.urandom(3 << 20), "small": os.urandom(256 * K)}
    for name, d in data.items():
        (m.mnt / "t" / name).write_bytes(d)
    backing = {name: m.backing / "t" / name for name in data}
    drop_caches(3, daemon_pid=m.pid())  # (nothing here opens a backing file before the mount)
    fds = {name: os.open(m.mnt / "t" / name, os.O_RDONLY) for name in data}
    try:
        deadline = time.monotonic() + 10
        while cached_bytes(backing["big"]) < len(data["big"]) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert cached_bytes(backing["big"]) == len(data["big"])  # no read was made
        assert cached_bytes(backing["small"]) == 0
        for name, d in data.items():
            assert os.pread(fds[name], len(d) + 1, 0) == d
    finally:
        for fd in fds.values():
            os.close(fd)
    # Warm: the path is cached now, the open does no I/O and asks for nothing.
    os.posix_fadvise(os.open(backing["big"], os.O_RDONLY), 0, 0, os.POSIX_FADV_DONTNEED)
    assert cached_bytes(backing["big"]) == 0
    fd = os.open(m.mnt / "t" / "big", os.O_RDONLY)
    time.sleep(0.3)
    os.close(fd)
    assert cached_bytes(backing["big"]) == 0


@pytest.mark.mount
def test_bench_door_writes_a_record(tmp_path):
    """`kvfs bench door` at a tiny scale: every pattern through a real mount against a plain
    directory, a record with a ratio per figure and the FUSE floor."""
    from .conftest import fuse_available

    if fuse_available():
        pytest.skip(fuse_available())
    out = tmp_path / "door.json"
    kvfs("bench", "door", "--files", "20", "--scale", "0.05", "--repeats", "1", "--aged", "100",
         "--round-trips", "50", "--no-cold", "--dir", str(tmp_path), "--json", str(out))
    import json

    record = json.loads(out.read_text())
    assert record["benchmark"] == "door" and record["conditions"]["cores"]
    assert record["aged_files"] == 100  # the mount and the plain side saw them first
    figures = {r["figure"] for r in record["rows"]}
    assert "small: create+write+close per file" in figures
    assert {"vllm: write", "sglang: warm read", "lmcache-direct: write",
            "file-chunked: write"} <= figures
    assert all(r["ratio"] > 0 for r in record["rows"] if r.get("ratio") is not None)
    variant = record["variants"]["default"]
    small = variant["patterns"]["small"]
    made = small["write_per_file"]["requests"]
    # One create each: the daemon's, or its request thread's (kvfs.daemon.made).
    assert small["files"] == 20 and made.get("create", 0) + made.get("thread_create", 0) == 1
    assert "lookup of a missing name (stat)" in figures
    if variant["passthrough"]["state"] == "on":  # no byte crossed, no READ or WRITE request
        assert small["write_per_file"]["bytes"] == 0
        # The lookup before each create is answered by the request thread (but the first in
        # the directory: the daemon's, which hands the directory over).
        assert small["write_per_file"]["requests"].get("thread_lookup", 0) >= 0.9
        # ... and so are the creates and their flushes (the first, again, the daemon's).
        assert made.get("thread_create", 0) >= 0.9 and made.get("thread_flush", 0) >= 0.9
        data = [r for r in record["rows"] if "READ+WRITE requests" in r["figure"]]
        assert len(data) == 9 and all(r["kvfs"] == 0 for r in data), data
        # 32 MiB in 256 writes of 128 KiB: at most one GETXATTR (FUSE_HANDLE_KILLPRIV_V2).
        chunked = variant["patterns"]["file-chunked"]["write_per_file"]["requests"]
        assert chunked.get("thread_getxattr", 0) + chunked.get("getxattr", 0) <= 1, chunked
    else:
        assert small["write_per_file"]["bytes"] == 128 << 10  # each file's bytes crossed once
    warm = small["warm_per_file"]["requests"]  # one open each: the daemon's or its thread's
    assert warm.get("open", 0) + warm.get("thread_open", 0) == 1
    # Every figure but the O_DIRECT patterns' has a floor: the plain time plus a round trip
    # per request waited for and a copy per byte crossed, so a create costs more than plain.
    rows = {r["figure"]: r for r in record["rows"]}
    creates = rows["small: create+write+close per file"]
    assert creates["floor"] > 1 and isinstance(creates["reachable"], bool)
    assert "requests waited for" in creates["note"]
    assert 0 < rows["sglang: write"]["floor"] < 1 and 0 < rows["small: warm read"]["floor"] < 1
    assert "floor" not in rows["lmcache-direct: write"]
    # The peer, libfuse's passthrough_ll built from the libfuse3-dev examples, took the same
    # patterns (not O_DIRECT: its backing writes refuse libfuse's unaligned buffers).
    from kvfs.bench import door_peer

    assert record["peer"]["measured"] == (door_peer.missing() is None)
    assert (record["peer"]["why_not"] is None) == record["peer"]["measured"]
    if record["peer"]["measured"]:
        assert rows["small: create+write+close per file"]["peer_ratio"] > 1
        assert 0 < rows["lmcache: warm read"]["peer_ratio"]
        assert "peer_ratio" not in rows["vllm: write"]
        # Its CPU per create is there (clock ticks: 20 small files may take none).
        assert rows["daemon CPU per create+write+close"]["peer"] >= 0
    assert not [ln for ln in open("/proc/self/mountinfo") if str(tmp_path) in ln]
    assert not record["problems"]
    bad = kvfs("bench", "door", "--patterns", "nope", "--dir", str(tmp_path), check=False)
    assert bad.returncode == 2 and "nope" in bad.stderr
    bad = kvfs("bench", "door", "--aged", "-1", "--dir", str(tmp_path), check=False)
    assert bad.returncode == 2 and "--aged" in bad.stderr


def test_no_keep_cache_drops_the_pages_at_each_open(mount_factory):
    """By default a reader's second open of an unchanged file is served from the page cache
    (no READ reaches the daemon); with --no-keep-cache each open drops those pages."""
    reads = {}
    for name, extra in (("keep", []), ("drop", ["--no-keep-cache"])):
        m = mount_factory(name, extra=[*extra, "--no-passthrough"])  # the daemon's reads
        kvfs("tenant", "add", str(m.mnt), "t", "--uid", "0", "--gid", "0")
        data = os.urandom(1 << 20)
        (m.mnt / "t" / "f").write_bytes(data)
        assert (m.mnt / "t" / "f").read_bytes() == data  # its pages are cached now
        first = requests(m).get("read", 0)
        before = requests(m).get("read", 0)
        own = before - first  # the READs of stats.json itself, per look at it
        assert (m.mnt / "t" / "f").read_bytes() == data
        reads[name] = requests(m).get("read", 0) - before - own
    assert reads["keep"] == 0
    assert reads["drop"] > 0


def test_dropping_the_pages_of_an_inode_the_kernel_forgot_is_no_error(monkeypatch, caplog):
    """A refused write-back drops the file's pages; when the kernel has forgotten the inode
    first (its last close won the race), the notification's ENOENT must not escape into the
    daemon's task group, which would end the mount for everyone."""
    from kvfs.daemon import tree  # noqa: PLC0415

    def forgotten(inode: int, attr_only: bool) -> None:
        raise FileNotFoundError(errno.ENOENT, "fuse_lowlevel_notify_inval_inode returned")

    monkeypatch.setattr(tree.pyfuse3, "invalidate_inode", forgotten)
    tree.drop_pages(1234)  # nothing to drop, nothing raised, nothing logged
    assert "could not drop" not in caplog.text

    def broken(inode: int, attr_only: bool) -> None:
        raise OSError(errno.EIO, "notify failed")

    monkeypatch.setattr(tree.pyfuse3, "invalidate_inode", broken)
    tree.drop_pages(1234)  # still not raised: said once in the log
    assert "could not drop the kernel's pages of inode 1234" in caplog.text
