"""Capacity, eviction, pins, quotas and retention through a real mount."""

from __future__ import annotations

import errno
import os
import subprocess
import time

import pytest

from .conftest import kvfs, run_as

K = 1024


def wait_for(pred, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


@pytest.fixture
def small(mount_factory):
    """A mount of 1 MiB capacity, background eviction from 90 % down to 50 %."""
    m = mount_factory(extra=["--capacity", "1M", "--high-watermark", "0.9",
                             "--low-watermark", "0.5", "--scan-interval", "0.2"])
    kvfs("tenant", "add", str(m.mnt), "t", "--uid", "0", "--gid", "0")
    (m.mnt / "t" / "ns").mkdir()
    return m


def write(path, size, fill=b"x"):
    with open(path, "wb") as f:
        f.write(fill * size)


def test_writes_evict_least_recently_used(small):
    ns = small.mnt / "t" / "ns"
    for i in range(4):
        write(ns / f"f{i}", 200 * K)
    (ns / "f0").read_bytes()  # f0 is now more recent than f1
    for i in range(4, 10):
        write(ns / f"f{i}", 200 * K)
        assert small.stats()["used_bytes"] <= 1 << 20
    left = set(os.listdir(ns))
    assert "f9" in left and "f1" not in left
    assert small.stats()["tenants"]["t"]["ns"]["evictions"] >= 5
    # The backing directory holds exactly what the mount shows.
    assert set(os.listdir(small.backing / "t" / "ns")) == left


def test_background_eviction_down_to_low_watermark(small):
    ns = small.mnt / "t" / "ns"
    for i in range(19):
        write(ns / f"f{i}", 50 * K)  # 950 KiB: above the high watermark (921.6 KiB)
    assert wait_for(lambda: small.stats()["used_bytes"] <= 512 * K)
    assert "f18" in os.listdir(ns)


def test_pinned_and_open_files_are_never_evicted(small):
    ns = small.mnt / "t" / "ns"
    write(ns / "pinned", 300 * K)
    kvfs("pin", str(ns / "pinned"))
    assert os.getxattr(ns / "pinned", "user.kvfs.pin") == b"1"
    write(ns / "open", 300 * K)
    with open(ns / "open", "rb") as held:
        for i in range(10):
            write(ns / f"f{i}", 150 * K)
        assert held.read(3) == b"xxx"
        assert {"pinned", "open"} <= set(os.listdir(ns))
    # With everything else pinned, a write that cannot fit is refused and leaves nothing.
    kvfs("pin", "-r", str(ns))
    with pytest.raises(OSError) as exc:
        write(ns / "toobig", 600 * K)
    assert exc.value.errno == errno.ENOSPC
    assert small.stats()["used_bytes"] <= 1 << 20
    kvfs("unpin", str(ns / "pinned"))
    with pytest.raises(OSError):
        os.getxattr(ns / "pinned", "user.kvfs.pin")


def test_pins_survive_remount_and_fsck(small):
    ns = small.mnt / "t" / "ns"
    write(ns / "p", 10 * K)
    write(ns / "q", 10 * K)
    kvfs("pin", str(ns / "p"), str(ns / "q"))
    (ns / "sub").mkdir()
    os.rename(ns / "q", ns / "sub" / "q")  # a pin travels with its file
    write(ns / "sub" / "plain", 10 * K)
    small.stop()
    (small.backing / ".kvfs" / "index.db").unlink()  # rebuild the index from the tree
    small.start()
    assert os.getxattr(ns / "p", "user.kvfs.pin") == b"1"
    assert os.getxattr(ns / "sub" / "q", "user.kvfs.pin") == b"1"
    assert "user.kvfs.pin" not in os.listxattr(ns / "sub" / "plain")


def test_quota_evicts_own_files_then_edquot(mount_factory):
    m = mount_factory()
    kvfs("tenant", "add", str(m.mnt), "a", "--uid", "1000", "--gid", "1000",
         "--quota", "300K")
    kvfs("tenant", "add", str(m.mnt), "b", "--uid", "1001", "--gid", "1001")
    assert os.getxattr(m.mnt / "a", "user.kvfs.quota") == str(300 * K).encode()
    res = run_as(1001, 1001, ["sh", "-c", f"head -c 400000 /dev/zero > {m.mnt}/b/big"])
    assert res.returncode == 0, res.stderr
    script = (f"for i in 1 2 3 4 5; do head -c 100000 /dev/zero > {m.mnt}/a/f$i || exit 1; "
              "done")
    res = run_as(1000, 1000, ["sh", "-c", script])
    assert res.returncode == 0, res.stderr
    used = int(os.getxattr(m.mnt / "a", "user.kvfs.used"))
    assert used <= 300 * K
    assert "f5" in os.listdir(m.mnt / "a") and "f1" not in os.listdir(m.mnt / "a")
    assert os.path.getsize(m.mnt / "b" / "big") == 400000  # the other tenant is untouched
    # The tenant cannot raise its own quota.
    res = run_as(1000, 1000, ["setfattr", "-n", "user.kvfs.quota", "-v", "10G", str(m.mnt / "a")])
    assert res.returncode != 0
    assert os.getxattr(m.mnt / "a", "user.kvfs.quota") == str(300 * K).encode()
    # Nor pin another tenant's files.
    res = run_as(1000, 1000, ["setfattr", "-n", "user.kvfs.pin", "-v", "1", str(m.mnt / "b/big")])
    assert res.returncode != 0
    # All its files pinned: a write past the quota is refused with EDQUOT.
    res = run_as(1000, 1000, ["sh", "-c", f"setfattr -n user.kvfs.pin -v 1 {m.mnt}/a/f* && "
                                          f"head -c 200000 /dev/zero > {m.mnt}/a/g"])
    assert res.returncode != 0 and "quota" in res.stderr.lower()
    # Lowering the quota evicts down to it at once.
    for f in os.listdir(m.mnt / "a"):
        os.removexattr(m.mnt / "a" / f, "user.kvfs.pin")
    kvfs("tenant", "set", str(m.mnt), "a", "--quota", "100K")
    assert int(os.getxattr(m.mnt / "a", "user.kvfs.used")) <= 100 * K


def test_retention_expires_idle_files_and_namespaces(small):
    t = small.mnt / "t"
    (t / "ns" / "ab").mkdir()
    write(t / "ns" / "ab" / "old", 1 * K)
    write(t / "ns" / "keep", 1 * K)
    kvfs("pin", str(t / "ns" / "keep"))
    (t / "gone" / "cd").mkdir(parents=True)
    write(t / "gone" / "cd" / "x", 1 * K)
    kvfs("tenant", "set", str(small.mnt), "t", "--max-idle", "1s")
    assert os.getxattr(t, "user.kvfs.max_idle") == b"1"
    assert wait_for(lambda: not (t / "gone").exists(), timeout=15)
    assert not (t / "ns" / "ab").exists()
    assert (t / "ns" / "keep").exists()
    assert not (small.backing / "t" / "gone").exists()
    assert small.stats()["tenants"]["t"]["ns"]["expirations"] >= 1


def test_max_age(small):
    ns = small.mnt / "t" / "ns"
    write(ns / "f", K)
    os.utime(ns / "f", (time.time(), time.time() - 3600))
    kvfs("tenant", "set", str(small.mnt), "t", "--max-age", "30m")
    assert wait_for(lambda: not (ns / "f").exists())


def test_client_reads_keep_blocks_from_expiring(small):
    """Access times reported by the kvfs client reach the index, where retention reads them."""
    torch = pytest.importorskip("torch")
    import kvfs as kv

    spec = kv.ModelSpec(model="ret/test", revision="1", kv_dtype="uint8", block_size=4,
                        num_layers=1, num_kv_heads=1, head_dim=8)
    with kv.KVCache.open(small.mnt, tenant="t", spec=spec) as cache:
        used = cache.block_hashes([1] * 4)
        idle = cache.block_hashes([2] * 4)
        for h in (used, idle):
            cache.save(h, torch.zeros(1, *spec.block_shape, dtype=torch.uint8))
        kvfs("tenant", "set", str(small.mnt), "t", "--max-idle", "3s")
        deadline = time.monotonic() + 15
        while os.path.exists(cache.path(idle[0])) and time.monotonic() < deadline:
            assert cache.lookup(used) == 1
            time.sleep(0.3)
        assert not os.path.exists(cache.path(idle[0]))
        assert cache.lookup(used) == 1


def test_bounded_policy_memory_evicts_cold_files_oldest_first(mount_factory):
    """With room for 4 policy entries, the other files are cold (index only): they are
    evicted first, oldest access first, and one that is read again is warm again."""
    m = mount_factory(extra=["--capacity", "1M", "--high-watermark", "1",
                             "--low-watermark", "1", "--policy", "lru",
                             "--policy-entries", "4"])
    kvfs("tenant", "add", str(m.mnt), "t", "--uid", "0", "--gid", "0")
    ns = m.mnt / "t" / "ns"
    ns.mkdir()
    for i in range(8):
        write(ns / f"f{i}", 100 * K)
        time.sleep(0.01)  # distinct access times
    assert m.stats()["policy"]["entries"] <= 4
    (ns / "f0").read_bytes()  # the oldest, cold: now the most recent, warm again
    for i in range(8, 11):
        write(ns / f"f{i}", 100 * K)
        assert m.stats()["used_bytes"] <= 1 << 20
    left = set(os.listdir(ns))
    # 11 files of 100 KiB in 1 MiB: one had to go, the least recently used (f1), not f0.
    assert "f1" not in left and {"f0", "f2", "f10"} <= left, left
    assert m.stats()["policy"]["entries"] <= 4
    assert m.stats()["tenants"]["t"]["ns"]["evictions"] == len({f"f{i}" for i in range(11)}
                                                                 - left)


def test_capacity_eviction_keeps_the_namespace_manifest(small):
    ns = small.mnt / "t" / "ns"
    (ns / "manifest.json").write_text('{"model": "m"}')  # the oldest file of all
    for i in range(10):
        write(ns / f"f{i}", 200 * K)
    assert small.stats()["tenants"]["t"]["ns"]["evictions"] >= 5
    assert (ns / "manifest.json").read_text() == '{"model": "m"}'


def tree(root) -> dict[str, bytes]:
    """Every regular file below `root` (but `.kvfs/`) and its content."""
    out = {}
    for d, dirs, files in os.walk(root):
        if ".kvfs" in dirs:
            dirs.remove(".kvfs")
        for f in files:
            p = os.path.join(d, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = fh.read()
    return out


def errno_of(uid: int, code: str) -> int:
    """Run `code` (Python, with `os` at hand) in a child process of uid:gid `uid`; the errno
    of the OSError it raised, or 0."""
    pid = os.fork()
    if pid == 0:
        status = 0
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            exec(code, {"os": os})
        except OSError as exc:
            status = exc.errno or 250
        except BaseException:
            status = 251
        os._exit(status)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    assert code < 250, "the child failed without an OSError"
    return code


@pytest.fixture
def two(mount_factory):
    """1 MiB of capacity (no background eviction) shared by tenants a (uid 1000) and b
    (uid 1001); fair shares: 512 KiB each while both hold bytes."""
    m = mount_factory(extra=["--capacity", "1M", "--high-watermark", "1",
                             "--low-watermark", "1"])
    for name, uid in (("a", 1000), ("b", 1001)):
        kvfs("tenant", "add", str(m.mnt), name, "--uid", str(uid), "--gid", str(uid))
    return m


def fill(m, tenant: str, uid: int, sizes: list[int]) -> None:
    for i, size in enumerate(sizes):
        code = f"open('{m.mnt}/{tenant}/f{i}', 'wb').write(b'{tenant}' * {size})"
        assert errno_of(uid, code) == 0
        time.sleep(0.01)  # distinct access times


def test_impossible_request_evicts_nothing(two):
    """A write, truncate or preallocation that can never fit is refused at once with
    EFBIG, and nothing of any tenant is evicted; one that could fit only by taking other
    tenants below their fair share is refused with ENOSPC, again evicting nothing."""
    m = two
    fill(m, "a", 1000, [200 * K, 200 * K])
    fill(m, "b", 1001, [200 * K])
    before = tree(m.mnt)
    # The case: one byte 2 MiB into a new file, with a capacity of 1 MiB.
    res = run_as(1001, 1001, ["dd", "if=/dev/zero", f"of={m.mnt}/b/x", "bs=1", "count=1",
                              "seek=2M", "status=none"])
    assert res.returncode != 0 and "too large" in res.stderr.lower(), res.stderr
    # Truncating an existing file past the capacity: refused, the file stays as it was.
    assert errno_of(1001, f"os.truncate('{m.mnt}/b/f0', 2 << 20)") == errno.EFBIG
    # 900 KiB more fits the capacity, but only by evicting a's files below a's share.
    code = f"fd = os.open('{m.mnt}/b/y', os.O_WRONLY | os.O_CREAT)\nos.pwrite(fd, b'y', {900 * K})"
    assert errno_of(1001, code) == errno.ENOSPC
    assert errno_of(1001, f"os.truncate('{m.mnt}/b/f0', {900 * K})") == errno.ENOSPC
    after = tree(m.mnt)
    after.pop("b/x", None)  # the empty files the refused requests created
    if after.get("b/y") == b"":
        after.pop("b/y")
    assert after == before
    stats = m.stats()["tenants"]
    assert all(c["evictions"] == 0 for t in stats.values() for c in t.values())
    assert m.stats()["used_bytes"] == 600 * K


def test_growth_evicts_others_only_down_to_their_share(two):
    m = two
    fill(m, "a", 1000, [100 * K] * 7)  # 700 KiB: 188 KiB above its share of 512
    fill(m, "b", 1001, [100 * K] * 2)
    # b grows by 300 KiB: 176 KiB over the capacity. Of a's excess one file can go (a second
    # would take a below its share); the rest comes from b's own files.
    assert errno_of(1001, f"os.truncate('{m.mnt}/b/f0', {400 * K})") == 0
    assert int(os.getxattr(m.mnt / "a", "user.kvfs.used")) == 600 * K
    assert set(os.listdir(m.mnt / "a")) == {f"f{i}" for i in range(1, 7)}  # its oldest went
    assert set(os.listdir(m.mnt / "b")) == {"f0"}
    # b's next growth finds no file of a above its share: b's own files go, not a's.
    assert errno_of(1001, f"open('{m.mnt}/b/g', 'wb').write(b'g' * {300 * K})") == 0
    assert int(os.getxattr(m.mnt / "a", "user.kvfs.used")) == 600 * K
    assert set(os.listdir(m.mnt / "b")) == {"g"}
    assert m.stats()["used_bytes"] <= 1 << 20


def test_quota_refuses_at_once_what_cannot_fit(mount_factory):
    m = mount_factory()
    kvfs("tenant", "add", str(m.mnt), "a", "--uid", "1000", "--gid", "1000", "--quota", "300K")
    fill(m, "a", 1000, [100 * K, 100 * K])
    before = tree(m.mnt)
    # Past the quota by itself: refused; nothing of the tenant's evicted for it.
    code = f"fd = os.open('{m.mnt}/a/x', os.O_WRONLY | os.O_CREAT)\nos.pwrite(fd, b'x', {400 * K})"
    assert errno_of(1000, code) == errno.EDQUOT
    # Within the quota only if a pinned file went: refused too.
    os.setxattr(m.mnt / "a" / "f0", "user.kvfs.pin", b"1")
    assert errno_of(1000, f"os.truncate('{m.mnt}/a/x', {250 * K})") == errno.EDQUOT
    after = tree(m.mnt)
    assert after.pop("a/x") == b""
    assert after == before


def test_fair_shares_and_room_order():
    from kvfs.daemon.capacity import UNLIMITED, fair_shares, room_order

    usage = {1: 700, 2: 200, 3: 0}
    shares = fair_shares(usage, 1000, {2: 300}, grower=3)
    assert shares == {1: 333, 2: 300, 3: 333}  # tenant 3 counts: it is about to hold bytes
    assert room_order(usage, shares, 3, 100) == [(1, 367, 367), (3, UNLIMITED, UNLIMITED)]
    # Background eviction: the excess first, then the rest in proportion to what is held.
    shares = fair_shares(usage, 1000, {}, None)
    assert shares == {1: 500, 2: 500}
    assert room_order(usage, shares, None, 400) == [(1, 200, 200), (1, 143, UNLIMITED),
                                                    (2, 58, UNLIMITED)]


def test_publish_that_cannot_fit_evicts_nothing(two):
    """The client's save (a publish) is refused whole, with the files it wrote removed and
    nothing of anyone evicted: EFBIG for a block larger than the capacity, ENOSPC for blocks
    that would fit only by taking the other tenant below its fair share."""
    torch = pytest.importorskip("torch")
    import kvfs as kv
    from kvfs.client import CacheFull

    m = two
    fill(m, "a", 1000, [200 * K] * 3)  # 600 KiB: above its share only once b holds bytes
    before = tree(m.mnt / "a")
    os.chown(m.mnt / "b", 0, 0)  # the client below runs in this (root) process
    huge = kv.ModelSpec(model="huge", revision="1", kv_dtype="uint8", block_size=16,
                        num_layers=1, num_kv_heads=1, head_dim=64 << 10)  # 2 MiB a block
    with kv.KVCache.open(m.mnt, tenant="b", spec=huge) as cache:
        with pytest.raises(CacheFull) as exc:
            cache.save(cache.block_hashes([1] * 16), torch.zeros(1, *huge.block_shape,
                                                                  dtype=torch.uint8))
        assert exc.value.errno == errno.EFBIG
    small = kv.ModelSpec(model="small", revision="1", kv_dtype="uint8", block_size=16,
                         num_layers=1, num_kv_heads=1, head_dim=3 << 10)  # 100 KiB a block
    with kv.KVCache.open(m.mnt, tenant="b", spec=small) as cache:
        hashes = cache.block_hashes(list(range(16 * 6)))  # 6 blocks, 600 KiB: a would go to 424
        with pytest.raises(CacheFull) as exc:
            cache.save(hashes, torch.zeros(6, *small.block_shape, dtype=torch.uint8))
        assert exc.value.errno == errno.ENOSPC
        assert not any(os.path.exists(cache.path(h)) for h in hashes)
        assert cache.save(hashes[:4], torch.zeros(4, *small.block_shape, dtype=torch.uint8)) == 4
    assert tree(m.mnt / "a") == before  # 600 + 400 KiB fit without a single eviction


def test_a_full_backing_filesystem_answers_enospc_and_recovers(mount_factory):
    """Without --capacity the hot tier is the backing filesystem: once it is full (a 3 MiB
    tmpfs here), creates, mkdirs and closes are refused with ENOSPC, never EIO (the index's
    commits failed with SQLite's "disk is full", which reached the handlers' last resort);
    space freed, everything works again, and no transaction was left open."""
    m = mount_factory(start=False)
    m.backing.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(m.backing)],
                   check=True)
    try:
        m.start()
        kvfs("tenant", "add", str(m.mnt), "t", "--uid", "0", "--gid", "0")
        ns = m.mnt / "t" / "ns"
        ns.mkdir()
        seen: set[int] = set()
        for i in range(40):
            try:
                (ns / f"f{i}").write_bytes(os.urandom(128 << 10))
            except OSError as exc:
                seen.add(exc.errno)
        for i in range(100):
            for make in (lambda p: os.close(os.open(p, os.O_CREAT | os.O_WRONLY, 0o644)),
                         os.mkdir):
                try:
                    make(ns / f"g{i}")
                except OSError as exc:
                    seen.add(exc.errno)
        assert seen == {errno.ENOSPC}, [errno.errorcode[e] for e in seen]
        status = kvfs("status", str(m.mnt)).stdout
        assert "of the backing filesystem (0 B free: full, writes are refused)" in status
        for f in ns.glob("f*"):
            f.unlink()
        (ns / "after").write_bytes(b"room again")
        (ns / "d").mkdir()
        assert (ns / "after").read_bytes() == b"room again"
        assert "free: full" not in kvfs("status", str(m.mnt)).stdout
        assert "unexpected error" not in m.log_text()
        m.stop()
    finally:
        if os.path.ismount(m.mnt):
            m.stop(check=False)
        subprocess.run(["umount", "-l", str(m.backing)], check=False)
