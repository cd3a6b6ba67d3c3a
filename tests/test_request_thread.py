"""The mount's request thread (kvfs.daemon._passthrough, through a real mount): the read-only
opens of complete hot files the daemon delegated to it, their releases and their attributes,
and the lookups of names missing from model directories, are answered in C, and nothing the
daemon promises weakens: every change to a file is seen at its next open and stat, its reads
count, a file it opened is not evicted, a miss is counted once per name (and not at all for
a name then created), a name the daemon knows is never missed, and the mount ends cleanly
with files it opened still open.

Each test checks first that the mount passes files through (`passthrough_on`, which skips
where the kernel or `--no-passthrough` turns it off: then there is no request thread).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from .conftest import kvfs
from .test_passthrough import passthrough_on, requests

pytestmark = pytest.mark.mount
K = 1024


def delta(after: dict[str, int], before: dict[str, int], key: str) -> int:
    return after.get(key, 0) - before.get(key, 0)


@pytest.fixture
def ns(mount):
    passthrough_on(mount)
    assert mount.stats()["passthrough"]["request_thread"]
    d = mount.mnt / "t" / "ns"
    d.mkdir(parents=True)
    return d


def test_a_file_read_again_is_opened_by_the_thread_and_counted(mount, ns):
    f = ns / "a"
    data = os.urandom(300_000)
    f.write_bytes(data)  # delegated at its writer's last close
    c0 = mount.stats()["tenants"]["t"]["ns"]
    r0 = requests(mount)
    for _ in range(5):
        assert f.read_bytes() == data
    r1 = requests(mount)
    # (The one open the daemon served is that of stats.json, read for these counters.)
    assert delta(r1, r0, "thread_open") == 5 and delta(r1, r0, "open") == 1
    assert delta(r1, r0, "thread_release") == 5 and delta(r1, r0, "flush") == 0
    # Counted as the daemon counts the opens it serves: reads, bytes, mount hits.
    c1 = mount.stats()["tenants"]["t"]["ns"]
    assert c1["reads"] - c0["reads"] == 5
    assert c1["read_bytes"] - c0["read_bytes"] == 5 * len(data)
    assert c1["mount_hits"] - c0["mount_hits"] == 5
    assert mount.stats()["passthrough"]["delegated"] >= 1
    out = kvfs("status", str(mount.mnt)).stdout
    assert "request thread: " in out and " files it opens itself" in out, out


def test_every_change_is_seen_at_the_next_open_and_stat(mount, ns):
    """After each change, the file is read (and stat'ed) twice: the first open may be the
    daemon's, the second is the thread's (the daemon delegated it again), and both see the
    change."""
    f = ns / "f"

    def twice(path, want: bytes) -> os.stat_result:
        before = requests(mount)
        for _ in range(2):
            assert path.read_bytes() == want
            st = os.stat(path)
            assert st.st_size == len(want)
        assert delta(requests(mount), before, "thread_open") >= 1
        return st

    f.write_bytes(b"one")
    twice(f, b"one")
    with open(f, "ab") as w:  # a writer: the thread answers no more opens of it
        w.write(b" two")
    twice(f, b"one two")
    os.chmod(f, 0o600)
    assert twice(f, b"one two").st_mode & 0o777 == 0o600
    os.utime(f, ns=(1_000_000_000, 2_000_000_000))
    assert twice(f, b"one two").st_mtime_ns == 2_000_000_000
    os.truncate(f, 3)
    twice(f, b"one")
    os.rename(f, ns / "g")
    assert not f.exists()
    twice(ns / "g", b"one")
    os.unlink(ns / "g")
    with pytest.raises(FileNotFoundError):
        open(ns / "g", "rb")
    assert "Traceback" not in mount.log_text()


def test_stat_after_a_thread_open_shows_the_open_as_access_time(mount, ns):
    f = ns / "t"
    f.write_bytes(b"x" * 100)
    f.read_bytes()
    first = os.stat(f).st_atime_ns
    time.sleep(0.05)
    before = requests(mount)
    f.read_bytes()
    assert delta(requests(mount), before, "thread_open") == 1
    assert os.stat(f).st_atime_ns > first


def test_a_file_the_thread_opened_is_not_evicted_while_open(mount_factory):
    m = mount_factory(extra=["--capacity", "1M", "--high-watermark", "0.9",
                             "--low-watermark", "0.5"])
    passthrough_on(m)
    kvfs("tenant", "add", str(m.mnt), "t", "--uid", "0", "--gid", "0")
    ns = m.mnt / "t" / "ns"
    ns.mkdir()
    (ns / "held").write_bytes(b"h" * (300 * K))  # near the capacity: the daemon's writes
    (ns / "held").read_bytes()  # the daemon's passthrough open: delegated from then on
    before = requests(m)
    with open(ns / "held", "rb") as held:
        assert delta(requests(m), before, "thread_open") == 1
        for i in range(10):
            (ns / f"f{i}").write_bytes(b"x" * (150 * K))
        assert held.read(3) == b"hhh"
        assert "held" in os.listdir(ns)
        assert m.stats()["used_bytes"] <= 1 << 20
    for i in range(10, 20):  # closed: it may go now, the oldest file of all
        (ns / f"f{i}").write_bytes(b"x" * (150 * K))
    assert "held" not in os.listdir(ns)


def test_the_mount_ends_with_files_the_thread_opened_still_open(mount, ns):
    """SIGTERM (the daemon unmounts itself, lazily: the mount is busy) while a file the
    thread opened is open: the daemon ends, its thread with it, and the mount is gone; the
    open file answers an error, not a hang."""
    f = ns / "k"
    f.write_bytes(b"k" * 4096)
    before = requests(mount)
    held = open(f, "rb")
    try:
        assert delta(requests(mount), before, "thread_open") == 1
        pid = mount.pid()
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{pid}"), mount.log_text()[-3000:]
        assert not os.path.ismount(mount.mnt)
        got: list[object] = []

        def read() -> None:
            try:
                got.append(os.pread(held.fileno(), 4096, 0))
            except OSError as exc:
                got.append(exc)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(10)
        # The kernel's own read of the backing file, or an error: never a hang.
        assert got, "a read of a file open across the unmount hung"
        assert got[0] == b"k" * 4096 or isinstance(got[0], OSError), got
    finally:
        held.close()
    assert "Traceback" not in mount.log_text()


def drop_dentries() -> None:
    """The kernel forgets its cached names and inodes (FORGETs reach the daemon)."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("2")


def test_names_looked_up_again_are_answered_and_forgotten_right(mount, ns):
    """After the kernel forgot them, a delegated file's name is looked up by the thread;
    the daemon still counts the kernel's references right: a file unlinked while open
    is purged once closed and forgotten, and the mount stays consistent."""
    if os.geteuid() != 0:
        pytest.skip("dropping the kernel's caches needs root")
    files = {ns / f"c{i}": os.urandom(5000 + i) for i in range(8)}
    for f, data in files.items():
        f.write_bytes(data)
        assert f.read_bytes() == data
    for _ in range(2):
        drop_dentries()
        before = requests(mount)
        for f, data in files.items():
            assert f.read_bytes() == data
        after = requests(mount)
        assert delta(after, before, "thread_lookup") >= len(files)
        assert delta(after, before, "thread_open") == len(files)
    victim = ns / "c0"
    held = open(victim, "rb")
    victim.unlink()
    assert held.read() == files[victim]
    held.close()
    drop_dentries()
    assert sorted(p.name for p in ns.iterdir()) == sorted(f.name for f in files if f != victim)
    assert mount.stats()["open_files"] == 0
    assert "Traceback" not in mount.log_text()


def test_a_temporary_renamed_into_place_is_opened_by_the_thread(mount, ns):
    """The engines' way (vLLM's file tier, SGLang's HiCacheFile): written under a temporary
    name, renamed onto its own; its readers need not come to the daemon's loop."""
    data = os.urandom(100_000)
    tmp = ns / "page.tmp"
    tmp.write_bytes(data)
    os.replace(tmp, ns / "page")
    before = requests(mount)
    assert (ns / "page").read_bytes() == data
    after = requests(mount)
    assert delta(after, before, "thread_open") == 1 and delta(after, before, "open") == 1


def misses(mount) -> int:
    return mount.stats()["tenants"]["t"]["ns"]["mount_misses"]


def test_missing_names_are_answered_by_the_thread_and_counted_once(mount, ns):
    """The first miss in a model directory is the daemon's, and hands the directory over;
    the thread answers the next ones (ENOENT), each name counted once as the daemon counts
    it, and a name then created not at all."""
    assert not (ns / "first").exists()
    assert mount.stats()["passthrough"]["directories"] == 1
    m0, r0 = misses(mount), requests(mount)
    own = delta(requests(mount), r0, "lookup")  # what reading the counters costs
    r0 = requests(mount)
    for i in range(20):
        assert not (ns / f"k{i}").exists()
        assert not (ns / f"k{i}").exists()  # again: the same miss
    r1 = requests(mount)
    assert delta(r1, r0, "thread_lookup") == 40 and delta(r1, r0, "lookup") == own
    assert misses(mount) - m0 == 20
    # An engine's way: a miss, then the block computed and written under that name.
    assert not (ns / "k0").exists()
    (ns / "k0").write_bytes(b"x" * 1000)
    # A create with no lookup of its own before it: the kernel's lookup is no miss.
    (ns / "new").write_bytes(b"y" * 1000)
    with pytest.raises(FileExistsError):
        os.open(ns / "new", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    assert misses(mount) - m0 == 20
    assert (ns / "k0").read_bytes() == b"x" * 1000 and (ns / "new").exists()
    out = kvfs("status", str(mount.mnt)).stdout
    assert " 1 directories whose misses it answers" in out, out
    assert "Traceback" not in mount.log_text()


def test_a_name_the_backing_directory_has_is_the_daemons_to_answer(mount, ns):
    """The thread answers only for names its backing directory lacks: a file, a directory
    and a stray entry that the index does not know (left in the backing tree) all go to the
    daemon, which finds the first two and refuses the stray."""
    if os.geteuid() != 0:
        pytest.skip("dropping the kernel's caches needs root")
    assert not (ns / "first").exists()  # handed over
    (ns / "f").write_bytes(b"f")
    (ns / "sub").mkdir()
    (mount.backing / "t" / "ns" / "stray").write_bytes(b"s")
    drop_dentries()
    assert ns.is_dir()  # (its path looked up again)
    r0 = requests(mount)
    own = delta(requests(mount), r0, "lookup")
    r0 = requests(mount)
    assert not (ns / "stray").exists()
    assert delta(requests(mount), r0, "lookup") == own + 1
    r0 = requests(mount)
    assert (ns / "sub").is_dir()
    assert delta(requests(mount), r0, "lookup") == own + 1
    assert (ns / "f").read_bytes() == b"f"
    # In a subdirectory (a fan-out directory of a model) the same holds once handed over.
    assert not (ns / "sub" / "a").exists() and not (ns / "sub" / "b").exists()
    assert mount.stats()["passthrough"]["directories"] == 2
    assert "Traceback" not in mount.log_text()


def test_a_removed_directory_is_taken_back(mount, ns):
    """A directory removed is no longer answered for; one made again under its name (a new
    inode) starts with the daemon."""
    d = ns / "sub"
    d.mkdir()  # (the kernel's lookup of "sub" before it, a miss, hands `ns` over)
    assert not (d / "x").exists()
    assert mount.stats()["passthrough"]["directories"] == 2
    d.rmdir()
    assert mount.stats()["passthrough"]["directories"] == 1
    d.mkdir()
    r0 = requests(mount)
    own = delta(requests(mount), r0, "lookup")
    r0 = requests(mount)
    assert not (d / "x").exists()
    assert delta(requests(mount), r0, "lookup") == own + 1
    (d / "x").write_bytes(b"x")
    assert (d / "x").read_bytes() == b"x"


def test_with_a_lower_tier_the_names_of_blocks_stay_the_daemons(mount_factory, tmp_path):
    """Below the hot tier a block is indexed without a backing file, and a missing block
    may be fetched (with its fan-out directory): those names stay the daemon's; any other
    missing name is the thread's."""
    cold = tmp_path / "cold"
    cold.mkdir()
    m = mount_factory(extra=["--cold", f"dir://{cold}"])
    passthrough_on(m)
    d = m.mnt / "t" / "ns"
    d.mkdir(parents=True)
    assert not (d / "first").exists()
    assert m.stats()["passthrough"]["directories"] == 1
    r0 = requests(m)
    own = delta(requests(m), r0, "lookup")
    r0 = requests(m)
    names = ["k0", "page_3.bin", "0" * 32 + ".KV", "ab" + "c" * 30]  # none a block's
    for n in names:
        assert not (d / n).exists()
    r1 = requests(m)
    assert delta(r1, r0, "lookup") == own and delta(r1, r0, "thread_lookup") == len(names)
    r0 = requests(m)
    assert (d / "ab").is_dir()  # a fan-out directory: made on demand by the daemon's lookup
    assert not (d / "ab" / ("ab" + "c" * 30 + ".kv")).exists()  # a block no tier holds
    assert delta(requests(m), r0, "lookup") == own + 2


def test_many_directories_handed_over_and_taken_back(mount, ns):
    """The thread's table of directories (open addressing, entries moved back as others are
    taken out) keeps every one handed over and none taken back: after half of 300 are
    removed, a miss in each of the others is the thread's, and names there still resolve."""
    if os.geteuid() != 0:
        pytest.skip("dropping the kernel's caches needs root")
    dirs = [ns / f"d{i:03d}" for i in range(300)]
    for d in dirs:
        d.mkdir()
        assert not (d / "x").exists()
    assert mount.stats()["passthrough"]["directories"] == 301  # and `ns`
    for d in dirs[::2]:
        d.rmdir()
    kept = dirs[1::2]
    assert mount.stats()["passthrough"]["directories"] == 151
    r0 = requests(mount)
    own = delta(requests(mount), r0, "lookup")
    r0 = requests(mount)
    for d in kept:
        assert not (d / "y").exists()
    r1 = requests(mount)
    assert delta(r1, r0, "thread_lookup") == len(kept) and delta(r1, r0, "lookup") == own
    for d in kept[:10]:
        (d / "f").write_bytes(b"f")
    drop_dentries()
    assert all((d / "f").read_bytes() == b"f" for d in kept[:10])
    assert not any((d / "f").exists() for d in kept[10:20])


def _open_file_limit(pid: int) -> tuple[int, int]:
    with open(f"/proc/{pid}/limits") as f:
        line = next(x for x in f if x.startswith("Max open files"))
    soft, hard = line.split()[3:5]
    return int(soft), int(hard)


def test_directories_handed_over_stay_within_the_open_file_limit(mount_factory):
    """Each directory handed over holds an fd: the daemon raises its soft open-file limit to
    the hard one, and hands over at most a quarter of it."""
    m = mount_factory("raised", start=False)
    m.prefix = ["prlimit", "--nofile=256:4096", "--"]
    m.start()
    assert _open_file_limit(m.pid()) == (4096, 4096)
    low = mount_factory("low", start=False)
    low.prefix = ["prlimit", "--nofile=64:64", "--"]
    low.start()
    passthrough_on(low)
    assert _open_file_limit(low.pid()) == (64, 64)
    ns = low.mnt / "t" / "ns"
    ns.mkdir(parents=True)
    for i in range(30):
        (ns / f"d{i}").mkdir()
        assert not (ns / f"d{i}" / "x").exists()
    assert low.stats()["passthrough"]["directories"] == 16  # 64 / 4, the oldest taken back
    (ns / "d29" / "x").write_bytes(b"x")
    assert (ns / "d29" / "x").read_bytes() == b"x"
    assert "Traceback" not in low.log_text()


def test_a_full_table_of_delegated_files_leaves_room_for_directories(mount, ns):
    """With as many files delegated as the thread's table takes, a directory created in
    still has its attributes answered by the thread: the kernel asks for them (GETATTR)
    before each create there, its attributes being stale after the last one, and without
    room in the table each of those is a round trip through the daemon's loop (five times
    the cost of the create itself on a mount that has seen tens of thousands of files)."""
    from kvfs.daemon.passthrough import MAX_DELEGATED

    full = ns / "full"
    full.mkdir()
    for i in range(MAX_DELEGATED + 64):  # each delegated once its creator's close is settled
        os.close(os.open(full / f"f{i}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    deadline = time.monotonic() + 60
    while mount.stats()["passthrough"]["delegated"] < MAX_DELEGATED:
        assert time.monotonic() < deadline, mount.stats()["passthrough"]
        time.sleep(0.2)
    fresh = ns / "fresh"
    fresh.mkdir()
    os.close(os.open(fresh / "first", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    r0 = requests(mount)
    own = delta(requests(mount), r0, "getattr")  # what reading the counters costs
    r0 = requests(mount)
    for i in range(50):
        os.close(os.open(fresh / f"f{i}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    r1 = requests(mount)
    assert delta(r1, r0, "thread_create") == 50
    # At most the first GETATTR of the directory after the counters were read is the
    # daemon's (its harvest of the thread's records puts the directory's attributes).
    assert delta(r1, r0, "getattr") <= own + 1, (r0, r1)
    assert delta(r1, r0, "thread_getattr") >= 49
    pt = mount.stats()["passthrough"]
    assert pt["delegated"] == MAX_DELEGATED and pt["attributes"] >= 1
    assert sorted(os.listdir(fresh)) == sorted(["first", *(f"f{i}" for i in range(50))])
