"""New files created and flushed by the mount's request thread (kvfs.daemon.made, section 3
of kvfs.daemon._passthrough), through a real mount: their CREATE and the FLUSH at their close
are answered in C, and nothing the daemon promises weakens: the files are indexed, owned
and counted as the daemon's own creates are, quotas and the capacity hold, a daemon killed
before it harvested what the thread did loses no closed file and leaves no stray, and the
daemon takes a file over wherever it changes it.

Each test checks first that the mount passes files through (`passthrough_on`, which skips
where the kernel or `--no-passthrough` turns it off: then there is no request thread).
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from .conftest import in_child, kvfs
from .test_passthrough import passthrough_on, requests, write_mib

pytestmark = pytest.mark.mount
MiB = 1 << 20


def delta(after: dict[str, int], before: dict[str, int], key: str) -> int:
    return after.get(key, 0) - before.get(key, 0)


def handed_over(m, d) -> None:
    """Make model directory `d` the request thread's: a miss in it hands it over."""
    assert not (d / "no-such-name").exists()
    assert m.stats()["passthrough"]["directories"] >= 1


def model_dir(m):
    """A model directory of tenant `t` on a mount with passthrough, handed over."""
    passthrough_on(m)
    d = m.mnt / "t" / "ns"
    d.mkdir(parents=True)
    handed_over(m, d)
    return d


def killed(m, pid: int, fds: list[int], *, restart: bool = True) -> None:
    """SIGKILL the daemon, close what the test held open, unmount what is left (and mount
    again)."""
    os.kill(pid, 9)
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    m.stop(check=False)
    if restart:
        m.start()


@pytest.fixture
def ns(mount):
    return model_dir(mount)


def test_creates_and_flushes_are_the_threads_and_counted_as_the_daemons(mount, ns):
    r0 = requests(mount)
    files = {f"f{i}": os.urandom(100_000 + i) for i in range(50)}
    for name, data in files.items():
        (ns / name).write_bytes(data)
    r1 = requests(mount)
    assert delta(r1, r0, "thread_create") == 50
    assert delta(r1, r0, "thread_flush") >= 50
    assert delta(r1, r0, "create") == 0 and delta(r1, r0, "flush") == 0
    # ... and their releases (the files settled at their last flush, unchanged since).
    assert delta(r1, r0, "thread_release") >= 49 and delta(r1, r0, "release") <= 1
    assert delta(r1, r0, "write") == 0  # the bytes passed through
    # Indexed, listed and counted as the daemon's own creates are.
    assert sorted(p.name for p in ns.iterdir()) == sorted(files)
    for name, data in files.items():
        assert (ns / name).read_bytes() == data
        assert (mount.backing / "t" / "ns" / name).read_bytes() == data
        assert os.stat(ns / name).st_size == len(data)
    c = mount.stats()["tenants"]["t"]["ns"]
    total = sum(len(v) for v in files.values())
    assert c["files"] == 50 and c["bytes"] == total and c["write_bytes"] == total
    du = subprocess.run(["du", "-sb", "--apparent-size", str(ns)], capture_output=True,
                        text=True, check=True)
    assert int(du.stdout.split()[0]) >= total
    # The same after a remount (the index holds them, complete).
    mount.stop()
    mount.start()
    assert sorted(p.name for p in ns.iterdir()) == sorted(files)
    assert mount.stats()["tenants"]["t"]["ns"]["bytes"] == total
    for name in list(files)[:5]:
        (ns / name).unlink()
    assert mount.stats()["tenants"]["t"]["ns"]["files"] == 45


def test_a_created_file_is_the_callers_with_its_umask(mount):
    passthrough_on(mount)
    kvfs("tenant", "add", str(mount.mnt), "u", "--uid", "1000", "--gid", "1000")
    d = mount.mnt / "u" / "ns"
    in_child(1000, 1000, lambda: os.mkdir(d))
    handed_over(mount, d)
    r0 = requests(mount)

    def make() -> list[int]:
        os.umask(0o027)
        fd = os.open(d / "mine", os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o666)
        os.write(fd, b"m" * 5000)
        os.close(fd)
        st = os.stat(d / "mine")
        return [st.st_uid, st.st_gid, st.st_mode & 0o7777]

    assert in_child(1000, 1000, make) == [1000, 1000, 0o640]
    assert delta(requests(mount), r0, "thread_create") == 1
    st = os.stat(mount.backing / "u" / "ns" / "mine")
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (1000, 1000, 0o640)
    # Another tenant's uid cannot create there (the kernel checks the directory's mode).
    with pytest.raises(PermissionError):
        in_child(1001, 1001, lambda: open(d / "theirs", "wb").close())
    assert not (mount.backing / "u" / "ns" / "theirs").exists()


def test_no_thread_creates_leaves_them_to_the_daemon(mount_factory):
    m = mount_factory(extra=["--no-thread-creates"])
    d = model_dir(m)
    r0 = requests(m)
    for i in range(10):
        (d / f"f{i}").write_bytes(b"x" * 1000)
    r1 = requests(m)
    assert delta(r1, r0, "thread_create") == 0 and delta(r1, r0, "create") == 10
    assert m.stats()["tenants"]["t"]["ns"]["bytes"] == 10_000


def test_a_flush_past_the_grant_is_the_daemons_and_the_quota_holds(mount):
    """A tenant with a quota: small files are created and flushed by the thread within its
    grant; a file whose growth the grant cannot cover is settled by the daemon, refused at
    close past the quota (EDQUOT) and cut back; the tenant never holds more than its
    quota."""
    passthrough_on(mount)
    kvfs("tenant", "add", str(mount.mnt), "q", "--uid", "1000", "--gid", "1000",
         "--quota", "200M")
    d = mount.mnt / "q" / "ns"
    in_child(1000, 1000, lambda: os.mkdir(d))
    handed_over(mount, d)

    def write(name: str, mib: int) -> str:
        return write_mib(d / name, mib)

    def usage() -> int:
        return sum(c["bytes"] for c in mount.stats()["tenants"]["q"].values())

    r0 = requests(mount)
    for i in range(20):
        assert in_child(1000, 1000, lambda i=i: write(f"small{i}", 1)) == "ok"
    r1 = requests(mount)
    assert delta(r1, r0, "thread_create") == 20 and delta(r1, r0, "thread_flush") == 20
    assert usage() == 20 * MiB
    # Larger than the whole quota (nothing the daemon could evict makes it fit).
    assert in_child(1000, 1000, lambda: write("big", 210)) == "close EDQUOT"
    assert os.stat(d / "big").st_size == 0
    assert delta(requests(mount), r1, "flush") >= 1  # the daemon settled it
    assert usage() == 20 * MiB
    assert mount.stats()["passthrough"]["cut"] >= 1
    # What is free again is granted again: more small files, the thread's.
    (d / "big").unlink()
    r2 = requests(mount)
    for i in range(5):
        assert in_child(1000, 1000, lambda i=i: write(f"again{i}", 1)) == "ok"
    assert delta(requests(mount), r2, "thread_flush") >= 1
    assert usage() == 25 * MiB


def test_the_capacity_holds_with_the_threads_flushes(mount_factory):
    m = mount_factory(extra=["--capacity", "160M"])
    d = model_dir(m)
    r0 = requests(m)
    for i in range(80):
        (d / f"f{i}").write_bytes(bytes([i]) * (4 * MiB))
        assert m.stats()["used_bytes"] <= 160 * MiB
    assert delta(requests(m), r0, "thread_create") >= 1
    assert m.stats()["used_bytes"] <= 160 * MiB
    kept = [p for p in d.iterdir()]
    assert kept and all(p.read_bytes() == bytes([int(p.name[1:])]) * (4 * MiB) for p in kept)


def test_the_daemon_takes_over_a_file_it_changes(mount, ns):
    """The creator's handle is the thread's to flush until the daemon changes the file: a
    second writer, a truncate, an fsync. The sizes counted stay the file's."""
    f = ns / "shared"
    fd = os.open(f, os.O_CREAT | os.O_RDWR, 0o644)
    os.write(fd, b"a" * 300_000)
    os.close(os.dup(fd))  # a flush the thread answers
    with open(f, "r+b") as other:  # the daemon opens it: its flushes are the daemon's now
        other.seek(0, 2)
        other.write(b"b" * 200_000)
    os.write(fd, b"c" * 100_000)  # at offset 300,000
    os.truncate(f, 250_000)
    os.pwrite(fd, b"d" * 50_000, 400_000)
    os.fsync(fd)
    os.close(fd)
    want = b"a" * 250_000 + b"\0" * 150_000 + b"d" * 50_000
    assert f.read_bytes() == want
    assert os.stat(f).st_size == len(want)
    assert mount.stats()["tenants"]["t"]["ns"]["bytes"] == len(want)
    mount.stop()
    mount.start()
    assert f.read_bytes() == want
    assert mount.stats()["tenants"]["t"]["ns"]["bytes"] == len(want)


def test_a_stray_in_the_backing_directory_is_the_daemons(mount, ns):
    """A name the backing directory has but the index does not (left by a tenant): the
    thread's O_EXCL create fails there, and the daemon's create replaces the stray."""
    (mount.backing / "t" / "ns" / "stray").write_bytes(b"left here")
    os.symlink("/etc/passwd", mount.backing / "t" / "ns" / "link")
    r0 = requests(mount)
    for name in ("stray", "link"):
        fd = os.open(ns / name, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        os.write(fd, b"new")
        os.close(fd)
        assert (ns / name).read_bytes() == b"new"
    assert delta(requests(mount), r0, "create") >= 1
    assert open("/etc/passwd", "rb").read(3) != b"new"
    assert not os.path.islink(mount.backing / "t" / "ns" / "link")


@pytest.mark.parametrize("then", ["mount", "fsck"])
def test_a_killed_daemon_keeps_what_was_closed_and_no_stray(mount_factory, then):
    """SIGKILL right after the thread created files, before the daemon harvested them (the
    next mount, or `kvfs fsck` before it, replays the journal): files written and closed (a
    flush) are kept whole, files still being written are removed, nothing is left the index
    does not know."""
    m = mount_factory()
    d = model_dir(m)
    pid = m.pid()  # (a request to the daemon: none after this one until the kill)
    journal = m.backing / ".kvfs" / "made.journal"
    fds = []
    for i in range(5):
        fd = os.open(d / f"open{i}", os.O_CREAT | os.O_WRONLY, 0o644)
        os.write(fd, b"o" * 100_000)
        fds.append(fd)
    for i in range(5):
        fd = os.open(d / f"closed{i}", os.O_CREAT | os.O_WRONLY, 0o644)
        os.write(fd, bytes([i]) * 100_000)
        os.close(os.dup(fd))  # close(2) of one descriptor: a FLUSH, no RELEASE yet
        fds.append(fd)
    recorded = journal.stat().st_size
    killed(m, pid, fds, restart=False)
    if then == "fsck":
        out = kvfs("fsck", str(m.backing))
        assert journal.stat().st_size == 0
        assert "removed partial" in out.stdout, out.stdout  # the files still being written
    m.start()
    names = sorted(p.name for p in d.iterdir())
    assert names == [f"closed{i}" for i in range(5)]
    for i in range(5):
        assert (d / f"closed{i}").read_bytes() == bytes([i]) * 100_000
    assert sorted(os.listdir(m.backing / "t" / "ns")) == names
    assert m.stats()["tenants"]["t"]["ns"]["bytes"] == 500_000
    if recorded and then == "mount":  # (a harvest may have come first: a timer's)
        assert "records applied" in m.log.read_text()
    assert journal.stat().st_size == 0


def test_many_creates_past_the_lease_and_the_tables(mount, ns):
    """More files than one inode lease and more creators open at once than the thread's
    table: the numbers stay unique, the files whole."""
    fds = []
    for i in range(300):
        fd = os.open(ns / f"h{i}", os.O_CREAT | os.O_WRONLY, 0o644)
        os.write(fd, i.to_bytes(4, "little") * 100)
        fds.append(fd)
    for fd in fds:
        os.close(fd)
    for i in range(4500):
        (ns / f"n{i}").write_bytes(i.to_bytes(4, "little"))
    inodes = {os.stat(p).st_ino for p in ns.iterdir()}
    assert len(inodes) == 4800
    assert all((ns / f"h{i}").read_bytes() == i.to_bytes(4, "little") * 100
               for i in range(300))
    assert mount.stats()["tenants"]["t"]["ns"]["files"] == 4800


def test_a_block_written_in_place_is_published_as_one(mount, ns):
    """A block file the thread created, flushed and released is checked as a block by the
    daemon after the release (in the background): its hash is served, a bad one is not."""
    from kvfs.format import hashing

    from .test_posix import make_block

    h, data = make_block(7)
    fan = ns / hashing.block_relpath(h).split("/")[0]
    fan.mkdir()
    handed_over(mount, fan)
    r0 = requests(mount)
    p = ns / hashing.block_relpath(h)
    p.write_bytes(data)
    bad = ns / hashing.block_relpath(make_block(8)[0])
    bad.parent.mkdir(exist_ok=True)
    handed_over(mount, bad.parent)
    bad.write_bytes(b"not a block")
    assert delta(requests(mount), r0, "thread_create") == 2
    for _ in range(100):
        try:
            if os.getxattr(p, "user.kvfs.block_hash") == h.hex().encode():
                break
        except OSError:
            pass
        time.sleep(0.05)
    assert os.getxattr(p, "user.kvfs.block_hash") == h.hex().encode()
    with pytest.raises(OSError):
        os.getxattr(bad, "user.kvfs.block_hash")
    assert p.read_bytes() == data


def test_temporaries_renamed_into_place_are_the_threads(mount, ns):
    """vLLM's and SGLang's pattern: a temporary created, written, closed and renamed onto
    its name (missing, checked with exists() first): every request the thread's. A rename
    onto a name that exists replaces it through the daemon."""
    r0 = requests(mount)
    for i in range(30):
        final = ns / f"page{i}"
        assert not final.exists()
        tmp = ns / f"page{i}.tmp.{os.getpid()}"
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_TRUNC, 0o644)
        os.write(fd, bytes([i]) * 70_000)
        os.close(fd)
        os.replace(tmp, final)
    r1 = requests(mount)
    assert delta(r1, r0, "thread_rename") == 30 and delta(r1, r0, "rename") == 0
    assert sorted(p.name for p in ns.iterdir()) == sorted(f"page{i}" for i in range(30))
    assert sorted(os.listdir(mount.backing / "t" / "ns")) == sorted(f"page{i}"
                                                                     for i in range(30))
    for i in range(30):
        assert (ns / f"page{i}").read_bytes() == bytes([i]) * 70_000
    # Onto a name that exists: the daemon's (it replaces the file and counts it gone).
    (ns / "new").write_bytes(b"n" * 1000)
    os.replace(ns / "new", ns / "page0")
    assert delta(requests(mount), r1, "rename") == 1
    assert (ns / "page0").read_bytes() == b"n" * 1000
    c = mount.stats()["tenants"]["t"]["ns"]
    assert c["files"] == 30 and c["bytes"] == 29 * 70_000 + 1000
    mount.stop()
    mount.start()
    assert sorted(p.name for p in ns.iterdir()) == sorted(f"page{i}" for i in range(30))
    assert (ns / "page5").read_bytes() == bytes([5]) * 70_000


def test_the_directory_times_the_thread_answers_are_the_indexed_ones(mount, ns):
    """Each create and rename the thread answers moves its directory's mtime and ctime; the
    daemon keeps the last of them (once a directory per harvest): after a remount, the
    directory's times are those the mount showed."""
    r0 = requests(mount)
    before = os.stat(ns)
    for i in range(40):
        time.sleep(0.001)
        (ns / f"file{i}").write_bytes(b"x" * 100)
    after_creates = os.stat(ns)
    time.sleep(0.01)
    os.replace(ns / "file0", ns / "renamed")
    shown = os.stat(ns)
    assert delta(requests(mount), r0, "thread_create") == 40
    assert delta(requests(mount), r0, "thread_rename") == 1
    assert before.st_mtime_ns < after_creates.st_mtime_ns < shown.st_mtime_ns
    assert after_creates.st_ctime_ns < shown.st_ctime_ns
    mount.stats()  # (the daemon harvests the thread's records)
    mount.stop()
    mount.start()
    again = os.stat(ns)
    assert (again.st_mtime_ns, again.st_ctime_ns) == (shown.st_mtime_ns, shown.st_ctime_ns)


def test_a_killed_daemon_keeps_a_file_renamed_into_place(mount_factory):
    """SIGKILL after the thread created, flushed and renamed a file, before the daemon
    harvested any of it: the next mount finds it at its new name, whole; a temporary still
    being written is gone."""
    m = mount_factory()
    d = model_dir(m)
    pid = m.pid()
    fd = os.open(d / "a.tmp", os.O_CREAT | os.O_WRONLY, 0o644)
    os.write(fd, b"a" * 200_000)
    os.close(os.dup(fd))  # flushed, still open
    os.rename(d / "a.tmp", d / "a")
    partial = os.open(d / "b.tmp", os.O_CREAT | os.O_WRONLY, 0o644)
    os.write(partial, b"b" * 1000)
    killed(m, pid, [fd, partial])
    assert sorted(p.name for p in d.iterdir()) == ["a"]
    assert (d / "a").read_bytes() == b"a" * 200_000
    assert sorted(os.listdir(m.backing / "t" / "ns")) == ["a"]
    assert m.stats()["tenants"]["t"]["ns"]["bytes"] == 200_000


def test_a_disk_filled_under_the_threads_files_loses_none(mount_factory):
    """The backing filesystem (a 96 MiB tmpfs, the index on it too) filled by another writer
    while files the thread created are open, then closed: every close that succeeded keeps
    its file, whole, through the mount or, where the index could not take the thread's
    records, after the next mount (its replay); nothing stray, no traceback. Below
    INDEX_ROOM free the thread creates nothing (the daemon's creates refuse with ENOSPC)."""
    m = mount_factory(start=False)
    fs = m.backing.parent / "fs"
    fs.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96m", "tmpfs", str(fs)], check=True)
    try:
        if m.backing.exists():
            m.backing.rmdir()
        m.backing = fs / "backing"
        m.backing.mkdir()
        m.start()
        kvfs("tenant", "add", str(m.mnt), "t", "--uid", "0", "--gid", "0")
        d = model_dir(m)
        kept: dict[str, bytes] = {}
        for round_ in range(3):
            # (No request to the daemon until the closes: it would harvest and empty the
            # journal, whose next record then finds no room, and the daemon refuses.)
            fds = {}
            for i in range(3):
                name = f"r{round_}-{i}"
                fds[name] = os.open(d / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
                os.write(fds[name], bytes([65 + i]) * 4096)
            filler = fs / f"filler{round_}"
            with open(filler, "wb") as f:  # another writer fills the disk
                try:
                    while True:
                        f.write(b"\0" * (1 << 20))
                        f.flush()
                except OSError:
                    pass
            for name, fd in fds.items():
                try:
                    os.close(fd)
                except OSError:
                    continue  # refused at its close (ENOSPC): nothing promised
                kept[name] = bytes([65 + int(name[-1])]) * 4096
            m.stats()  # (a request: the daemon harvests the thread's records)
            filler.unlink()
        assert kept, "no close succeeded"
        if "could not take" in m.log_text():  # (the index's transaction failed: halted)
            assert "halted: the index could not take" in kvfs("status", str(m.mnt)).stdout
            assert m.stats()["passthrough"]["thread_creates"] is False
        m.stop()
        m.start()
        names = set(os.listdir(d))
        for name, data in kept.items():
            assert name in names, f"{name} was closed and is gone\n{m.log_text()[-3000:]}"
            assert (d / name).read_bytes() == data
        assert names <= {f"r{r}-{i}" for r in range(3) for i in range(3)}
        assert set(os.listdir(m.backing / "t" / "ns")) == names  # nothing stray
        assert "Traceback" not in m.log_text()
        m.stop()
    finally:
        if os.path.ismount(m.mnt):
            m.stop(check=False)
        subprocess.run(["umount", "-l", str(fs)], check=False)
