"""POSIX through a real mount, driven by ordinary tools and system calls."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest

from kvfs.format import blockfile, hashing

from .conftest import force_unmount, kvfs, run_as

UID_A, GID_A = 1000, 1000
UID_B, GID_B = 1001, 1001


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(list(argv), capture_output=True, text=True)
    if check and res.returncode != 0:
        raise AssertionError(f"{argv} failed: {res.stderr}")
    return res


@pytest.fixture
def tenant(mount):
    kvfs("tenant", "add", str(mount.mnt), "acme", "--uid", "0", "--gid", "0", "--mode", "0755")
    return mount.mnt / "acme"


def make_block(i: int, parent: bytes = hashing.ROOT_PARENT, size: int = 8192
               ) -> tuple[bytes, bytes]:
    h = hashing.block_hashes([i] * 16, 16, parent=parent)[0]
    payload = bytes([i % 251]) * size
    data = blockfile.encode(block_hash=h, parent_hash=parent, fingerprint=bytes(16),
                            token_count=16, dtype="uint8", shape=(size,), payload=payload)
    return h, data


def test_tools_see_a_local_filesystem(tenant, mount):
    ns = tenant / "model@0123456789abcdef"
    ns.mkdir()
    (ns / "ab").mkdir()
    data = os.urandom(3 * 1024 * 1024 + 17)
    src = mount.backing.parent / "src.bin"
    src.write_bytes(data)
    sh("cp", str(src), str(ns / "ab" / "f.bin"))
    assert (ns / "ab" / "f.bin").read_bytes() == data
    assert (mount.backing / "acme" / "model@0123456789abcdef" / "ab" / "f.bin").read_bytes() == data
    sh("mv", str(ns / "ab" / "f.bin"), str(ns / "g.bin"))
    out = sh("ls", "-l", str(ns)).stdout
    assert "g.bin" in out and str(len(data)) in out
    assert sh("find", str(tenant), "-name", "g.bin").stdout.strip() == str(ns / "g.bin")
    st = os.stat(ns / "g.bin")
    assert st.st_size == len(data)
    assert st.st_blocks * 512 >= len(data) and st.st_blocks * 512 < len(data) + 8192
    du = int(sh("du", "-sk", str(ns / "g.bin")).stdout.split()[0])
    assert du == -(-len(data) // 4096) * 4
    assert sh("stat", "-c", "%s %F", str(ns / "g.bin")).stdout.split()[0] == str(len(data))
    sh("rm", str(ns / "g.bin"))
    assert not (ns / "g.bin").exists()
    assert not (mount.backing / "acme" / "model@0123456789abcdef" / "g.bin").exists()
    sh("rm", "-r", str(ns))
    assert os.listdir(tenant) == []


def test_df_reports_capacity(mount_factory):
    m = mount_factory(extra=["--capacity", "1G"])
    out = sh("df", "-B1", "--output=size,avail", str(m.mnt)).stdout.split("\n")[1].split()
    assert int(out[0]) == 1 << 30
    vfs = os.statvfs(m.mnt)
    assert vfs.f_bsize == 4096 and vfs.f_namemax == 255
    kvfs("tenant", "add", str(m.mnt), "t", "--uid", "0", "--gid", "0")
    (m.mnt / "t" / "f").write_bytes(b"\0" * (100 << 20))
    avail = os.statvfs(m.mnt).f_bavail * 4096
    assert avail == (1 << 30) - (100 << 20)


def test_capacity_refuses_writes_with_enospc(mount_factory):
    m = mount_factory(extra=["--capacity", "1M"])
    kvfs("tenant", "add", str(m.mnt), "t", "--uid", "0", "--gid", "0")
    # A file larger than the whole capacity can never fit: EFBIG.
    with pytest.raises(OSError) as exc:
        (m.mnt / "t" / "big").write_bytes(b"x" * (2 << 20))
    assert exc.value.errno == errno.EFBIG
    with pytest.raises(OSError) as exc:
        os.truncate(m.mnt / "t" / "big", 10 << 20)
    assert exc.value.errno == errno.EFBIG
    # One that would fit an empty store, but not beside what cannot be evicted: ENOSPC.
    (m.mnt / "t" / "open").write_bytes(b"o" * (600 << 10))  # evicts what big holds
    (m.mnt / "t" / "small").write_bytes(b"")
    with open(m.mnt / "t" / "open", "rb"), pytest.raises(OSError) as exc:
        os.truncate(m.mnt / "t" / "small", 600 << 10)
    assert exc.value.errno == errno.ENOSPC
    assert os.path.getsize(m.mnt / "t" / "small") == 0


def test_names(tenant, mount):
    ok = tenant / ("n" * 255)
    ok.write_bytes(b"1")
    assert ok.read_bytes() == b"1"
    with pytest.raises(OSError) as exc:
        (tenant / ("n" * 256)).write_bytes(b"1")
    assert exc.value.errno == errno.ENAMETOOLONG
    # Engines' own names: flat, with @ _ . and hidden temporaries renamed over existing names.
    ns = tenant / "llama@abc"
    ns.mkdir()
    for name in ["vllm@model@0_1_rank0.safetensors", "k_layer.0.bin", "a.b.c", "_x"]:
        (ns / name).write_bytes(name.encode())
        assert (ns / name).read_bytes() == name.encode()
    (ns / "target").write_bytes(b"old")
    (ns / ".tmp_123").write_bytes(b"new")
    os.replace(ns / ".tmp_123", ns / "target")
    assert (ns / "target").read_bytes() == b"new"
    assert not (ns / ".tmp_123").exists()
    deep = ns / "a" / "b" / "c" / "d"
    deep.mkdir(parents=True)
    (deep / "f").write_bytes(b"deep")
    assert (mount.backing / "acme/llama@abc/a/b/c/d/f").read_bytes() == b"deep"


def test_top_level_is_tenants_only(mount):
    with pytest.raises(OSError) as exc:
        (mount.mnt / "file").write_bytes(b"x")
    assert exc.value.errno == errno.EPERM
    with pytest.raises(OSError) as exc:
        os.mkdir(mount.mnt / "bad name")
    assert exc.value.errno == errno.EINVAL
    with pytest.raises(OSError):
        os.mkdir(mount.mnt / ".hidden")
    res = run_as(UID_B, GID_B, ["mkdir", str(mount.mnt / "sneaky")])
    assert res.returncode != 0 and not (mount.mnt / "sneaky").exists()


def test_tenant_isolation(mount):
    kvfs("tenant", "add", str(mount.mnt), "a", "--uid", str(UID_A), "--gid", str(GID_A))
    kvfs("tenant", "add", str(mount.mnt), "b", "--uid", str(UID_B), "--gid", str(GID_B))
    st = os.stat(mount.mnt / "a")
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (UID_A, GID_A, 0o700)
    bst = os.stat(mount.backing / "a")
    assert (bst.st_uid, bst.st_gid, stat.S_IMODE(bst.st_mode)) == (UID_A, GID_A, 0o700)
    res = run_as(UID_A, GID_A, ["sh", "-c", f"mkdir {mount.mnt}/a/ns && echo secret > "
                                            f"{mount.mnt}/a/ns/f"])
    assert res.returncode == 0, res.stderr
    assert os.stat(mount.backing / "a" / "ns" / "f").st_uid == UID_A
    secret = str(mount.mnt / "a" / "ns" / "f")
    for argv in (["ls", str(mount.mnt / "a")], ["cat", secret], ["stat", secret],
                 ["sh", "-c", f"echo x > {secret}"], ["mv", secret, str(mount.mnt / "b")],
                 ["getfattr", "-n", "user.kvfs.backing", secret],
                 ["setfattr", "-n", "user.x", "-v", "1", secret],
                 ["ls", str(mount.backing / "a")], ["cat", str(mount.backing / "a/ns/f")]):
        res = run_as(UID_B, GID_B, argv)
        assert res.returncode != 0, argv
        assert "denied" in res.stderr or "not permitted" in res.stderr, (argv, res.stderr)
    assert (mount.mnt / "a" / "ns" / "f").read_text() == "secret\n"
    # Tenant B works in its own directory.
    res = run_as(UID_B, GID_B, ["sh", "-c", f"echo mine > {mount.mnt}/b/f && cat {mount.mnt}/b/f"])
    assert res.returncode == 0 and res.stdout == "mine\n"
    # Renames across tenants are refused (mv then copies, as across filesystems).
    with pytest.raises(OSError) as exc:
        os.rename(mount.mnt / "a" / "ns" / "f", mount.mnt / "b" / "f2")
    assert exc.value.errno == errno.EXDEV


def test_attributes(tenant):
    f = tenant / "f"
    f.write_bytes(b"abc")
    os.chmod(f, 0o640)
    assert stat.S_IMODE(os.stat(f).st_mode) == 0o640
    os.chown(f, 1234, 5678)
    st = os.stat(f)
    assert (st.st_uid, st.st_gid) == (1234, 5678)
    os.utime(f, ns=(1_000_000_000_000_000_000, 1_500_000_000_000_000_000))
    st = os.stat(f)
    assert st.st_mtime_ns == 1_500_000_000_000_000_000
    assert st.st_atime_ns == 1_000_000_000_000_000_000
    os.truncate(f, 1)
    assert f.read_bytes() == b"a"
    os.truncate(f, 5)
    assert f.read_bytes() == b"a\0\0\0\0"
    os.symlink("f", tenant / "link")
    assert os.readlink(tenant / "link") == "f"
    assert (tenant / "link").read_bytes() == b"a\0\0\0\0"
    assert stat.S_ISLNK(os.lstat(tenant / "link").st_mode)
    with pytest.raises(OSError) as exc:
        os.link(f, tenant / "hard")
    assert exc.value.errno == errno.EPERM
    with pytest.raises(OSError) as exc:
        os.mkfifo(tenant / "fifo")
    assert exc.value.errno == errno.EPERM


def test_huge_truncate_does_not_allocate(tenant, mount):
    f = tenant / "sparse"
    f.write_bytes(b"")
    os.truncate(f, 1 << 40)
    assert os.stat(f).st_size == 1 << 40
    with open(f, "rb") as fh:
        fh.seek((1 << 40) - 4)
        assert fh.read() == b"\0" * 4
    os.unlink(f)
    assert mount.stats()["used_bytes"] == 0


def test_xattrs(tenant):
    f = tenant / "f"
    f.write_bytes(b"x")
    os.setxattr(f, "user.engine", b"v1")
    assert os.getxattr(f, "user.engine") == b"v1"
    assert "user.engine" in os.listxattr(f)
    assert os.getxattr(f, "user.kvfs.tier") == b"hot"
    os.removexattr(f, "user.engine")
    with pytest.raises(OSError) as exc:
        os.getxattr(f, "user.engine")
    assert exc.value.errno == errno.ENODATA
    with pytest.raises(OSError) as exc:
        os.setxattr(f, "user.kvfs.tier", b"cold")
    assert exc.value.errno == errno.EPERM
    out = sh("getfattr", "-d", str(f)).stdout
    assert 'user.kvfs.tier="hot"' in out
    # Only the user namespace exists: other names are ENOTSUP (not ENODATA), which is what
    # lets `ls -l` stop asking for SELinux labels and ACLs after the first file.
    for name in ("security.selinux", "system.posix_acl_access", "trusted.x"):
        with pytest.raises(OSError) as exc:
            os.getxattr(f, name)
        assert exc.value.errno == errno.ENOTSUP, name


def test_blocks_written_through_the_mount(tenant, mount):
    ns = tenant / "m@0123456789abcdef"
    ns.mkdir()
    h0, d0 = make_block(1)
    h1, d1 = make_block(2, parent=h0)
    for h, d in ((h0, d0), (h1, d1)):
        p = ns / hashing.block_relpath(h)
        p.parent.mkdir(exist_ok=True)
        tmp = p.parent / ".tmp"
        tmp.write_bytes(d)
        os.replace(tmp, p)
    p1 = ns / hashing.block_relpath(h1)
    assert os.getxattr(p1, "user.kvfs.block_hash") == h1.hex().encode()
    assert os.getxattr(p1, "user.kvfs.parent_hash") == h0.hex().encode()
    assert os.getxattr(p1, "user.kvfs.backing").decode() == str(
        mount.backing / "acme" / "m@0123456789abcdef" / hashing.block_relpath(h1))
    # A file named like a block that is not one is kept, but never served as a block.
    bad = ns / hashing.block_relpath(hashing.block_hashes([9] * 16, 16)[0])
    bad.parent.mkdir(exist_ok=True)
    bad.write_bytes(b"not a block")
    with pytest.raises(OSError):
        os.getxattr(bad, "user.kvfs.block_hash")
    # Opened for writing, a block stays one until it is written; written, it is not one.
    with open(p1, "r+b") as f:
        assert os.getxattr(p1, "user.kvfs.block_hash") == h1.hex().encode()
        f.write(b"K")
        f.flush()
        with pytest.raises(OSError):
            os.getxattr(p1, "user.kvfs.block_hash")


def test_o_direct_and_dd(tenant, mount):
    f = tenant / "d.bin"
    data = os.urandom(1 << 20)
    f.write_bytes(data)
    out = mount.backing.parent / "out.bin"
    sh("dd", f"if={f}", f"of={out}", "bs=64k", "iflag=direct", "status=none")
    assert out.read_bytes() == data
    sh("dd", f"if={out}", f"of={tenant / 'e.bin'}", "bs=64k", "oflag=direct", "status=none")
    assert (tenant / "e.bin").read_bytes() == data


def test_readdir_large_directory_stable(tenant):
    d = tenant / "big"
    d.mkdir()
    n = 20_000
    for i in range(n):
        os.close(os.open(d / f"f{i:06d}", os.O_CREAT | os.O_WRONLY, 0o644))
    names = os.listdir(d)
    assert len(names) == n and len(set(names)) == n
    # Deleting entries while listing neither repeats nor skips the survivors.
    seen = []
    with os.scandir(d) as it:
        for i, entry in enumerate(it):
            seen.append(entry.name)
            if i == 100:
                for j in range(0, n, 2):
                    os.unlink(d / f"f{j:06d}")
    survivors = {f"f{j:06d}" for j in range(1, n, 2)}
    assert survivors <= set(seen) and len(seen) == len(set(seen))
    assert len(os.listdir(d)) == n // 2


def test_rename_flags(tenant):
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    a, b = tenant / "a", tenant / "b"
    a.write_bytes(b"A")
    b.write_bytes(b"B")

    def renameat2(x, y, flags):
        r = libc.renameat2(-100, os.fsencode(x), -100, os.fsencode(y), flags)
        return 0 if r == 0 else ctypes.get_errno()

    assert renameat2(a, b, 1) == errno.EEXIST  # RENAME_NOREPLACE
    assert renameat2(a, b, 2) == 0  # RENAME_EXCHANGE
    assert a.read_bytes() == b"B" and b.read_bytes() == b"A"
    (tenant / "d1").mkdir()
    (tenant / "d1" / "x").write_bytes(b"x")
    (tenant / "d2").mkdir()
    (tenant / "d2" / "y").write_bytes(b"y")
    with pytest.raises(OSError) as exc:
        os.rename(tenant / "d1", tenant / "d2")
    assert exc.value.errno == errno.ENOTEMPTY
    os.rename(tenant / "d1", tenant / "d3")
    assert (tenant / "d3" / "x").read_bytes() == b"x"
    with pytest.raises(OSError) as exc:
        os.rmdir(tenant / "d3")
    assert exc.value.errno == errno.ENOTEMPTY


def test_unlinked_open_file_stays_readable(tenant):
    f = tenant / "f"
    f.write_bytes(b"still here")
    with open(f, "rb") as fh:
        assert os.fstat(fh.fileno()).st_nlink == 1
        os.unlink(f)
        assert not f.exists()
        assert fh.read() == b"still here"
        assert os.fstat(fh.fileno()).st_nlink == 0  # as on ext4: no name left


def test_fallocate_is_refused_and_posix_fallocate_writes(mount_factory):
    """fallocate(2) is refused in every mode (pyfuse3 has no fallocate handler): EOPNOTSUPP,
    nothing changed. posix_fallocate(3) then falls back to writing, which kvfs accounts and
    refuses past the capacity like any write (docs/architecture.md)."""
    m = mount_factory(extra=["--capacity", "1M"])
    kvfs("tenant", "add", str(m.mnt), "t", "--uid", "0", "--gid", "0")
    f = m.mnt / "t" / "f"
    f.write_bytes(b"abc")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fd = os.open(f, os.O_RDWR)
    try:
        # 0, KEEP_SIZE, PUNCH_HOLE | KEEP_SIZE, ZERO_RANGE
        for mode in (0, 0x01, 0x02 | 0x01, 0x10):
            assert libc.fallocate(fd, mode, 0, 64 << 10) == -1, mode
            assert ctypes.get_errno() == errno.EOPNOTSUPP, mode
            assert f.read_bytes() == b"abc"
        os.posix_fallocate(fd, 0, 300 << 10)
        assert os.fstat(fd).st_size == 300 << 10
        with pytest.raises(OSError) as exc:
            os.posix_fallocate(fd, 0, 2 << 20)  # larger than the capacity
        assert exc.value.errno == errno.EFBIG
    finally:
        os.close(fd)
    assert f.read_bytes()[:3] == b"abc" and not f.read_bytes()[3:300 << 10].strip(b"\0")
    assert m.stats()["used_bytes"] <= 1 << 20


def test_directory_link_counts(tenant, mount):
    """A directory has 2 + its subdirectories links (find and other tools rely on it)."""
    d = tenant / "d"
    d.mkdir()
    assert os.stat(d).st_nlink == 2
    (d / "a").mkdir()
    (d / "b").mkdir()
    (d / "f").write_bytes(b"")
    assert os.stat(d).st_nlink == 4
    os.rmdir(d / "a")
    assert os.stat(d).st_nlink == 3
    (tenant / "e").mkdir()
    os.rename(d / "b", tenant / "e" / "b")
    assert os.stat(d).st_nlink == 2 and os.stat(tenant / "e").st_nlink == 3
    assert os.stat(tenant).st_nlink == 4
    assert os.stat(mount.mnt).st_nlink == 2 + 1 + 1  # the tenant, and .kvfs
    assert os.stat(mount.mnt / ".kvfs").st_nlink == 2
    found = sh("find", str(tenant), "-type", "d").stdout.split()
    assert sorted(found) == sorted(str(p) for p in (tenant, d, tenant / "e", tenant / "e" / "b"))


def test_directory_times_follow_its_entries(tenant):
    """Creating, removing or renaming an entry changes its directory's mtime and ctime."""
    d, other = tenant / "d", tenant / "other"
    d.mkdir()
    other.mkdir()

    def changed(path, action) -> bool:
        before = os.stat(path)
        time.sleep(0.02)
        action()
        after = os.stat(path)
        return (after.st_mtime_ns > before.st_mtime_ns
                and after.st_ctime_ns > before.st_ctime_ns)

    assert changed(d, lambda: (d / "f").write_bytes(b"x"))
    assert changed(d, lambda: (d / "sub").mkdir())
    assert changed(d, lambda: os.symlink("f", d / "l"))
    assert changed(d, lambda: os.rename(d / "f", d / "g"))
    assert changed(d, lambda: os.rename(d / "g", other / "g"))
    assert changed(other, lambda: os.rename(other / "g", d / "g"))
    assert changed(d, lambda: os.unlink(d / "l"))
    assert changed(d, lambda: os.rmdir(d / "sub"))
    before = os.stat(d / "g").st_ctime_ns
    time.sleep(0.02)
    os.rename(d / "g", d / "h")
    assert os.stat(d / "h").st_ctime_ns > before  # the moved file's ctime too


def test_virtual_files(mount, tenant):
    (tenant / "ns").mkdir()
    (tenant / "ns" / "f").write_bytes(b"12345")
    (tenant / "ns" / "f").read_bytes()
    stats = json.loads((mount.mnt / ".kvfs" / "stats.json").read_bytes())
    c = stats["tenants"]["acme"]["ns"]
    assert (c["files"], c["bytes"], c["write_bytes"], c["read_bytes"]) == (1, 5, 5, 5)
    assert (mount.mnt / ".kvfs" / "version").read_text().strip()
    assert sorted(os.listdir(mount.mnt / ".kvfs")) == ["stats.json", "version"]
    with pytest.raises(OSError):
        (mount.mnt / ".kvfs" / "stats.json").write_bytes(b"x")
    with pytest.raises(OSError):
        os.unlink(mount.mnt / ".kvfs" / "version")
    out = kvfs("status", str(mount.mnt)).stdout
    assert "acme" in out and "ns" in out


def test_remount_keeps_everything(mount, tenant):
    (tenant / "ns" / "x").mkdir(parents=True)
    (tenant / "ns" / "x" / "f").write_bytes(b"data")
    os.chmod(tenant / "ns" / "x" / "f", 0o600)
    os.symlink("x/f", tenant / "ns" / "l")
    before = sh("ls", "-lR", "--time-style=+%s", str(tenant)).stdout
    mount.restart()
    assert sh("ls", "-lR", "--time-style=+%s", str(tenant)).stdout == before
    assert (tenant / "ns" / "l").read_bytes() == b"data"


def test_sigkill_during_writes_recovers(mount, tenant):
    ns = tenant / "ns"
    ns.mkdir()
    (ns / "done").write_bytes(b"complete")
    writer = subprocess.Popen(
        ["python3", "-c", f"import time\nf=open({str(ns / 'partial')!r},'wb')\n"
                          "f.write(b'x'*100000); f.flush()\nprint('ok', flush=True)\n"
                          "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    assert writer.stdout.readline().strip() == "ok"
    assert (mount.backing / "acme" / "ns" / "partial").exists()
    os.kill(mount.pid(), 9)
    force_unmount(mount.mnt)  # before waiting on the writer: see conftest.abort_connection
    writer.kill()
    writer.wait()
    stray = mount.backing / "acme" / "ns" / ".kvfs-tmp.abc"
    stray.write_bytes(b"temporary of a direct-path writer")
    mount.start()
    assert (ns / "done").read_bytes() == b"complete"
    assert not (ns / "partial").exists()
    assert not (mount.backing / "acme" / "ns" / "partial").exists()
    assert not stray.exists()
    assert "removed partial" in mount.log_text() or "1 partial" in mount.log_text()


def test_sigkill_keeps_files_opened_but_not_written(mount, tenant):
    """A complete file only opened read-write when the daemon dies is intact at the next
    mount; one written since its open is removed (it may be half-written). Through
    passthrough the daemon sees no write, only that the file changed by the next close: a
    file changed and closed through one descriptor while another is open for writing may
    have been changed through either, so it is removed too."""
    passthrough = mount.stats()["passthrough"]["state"] == "on"
    ns = tenant / "ns"
    ns.mkdir()
    h, data = make_block(3)
    block = ns / hashing.block_relpath(h)
    block.parent.mkdir()
    block.write_bytes(data)
    for name in ("opened", "written", "closed", "two"):
        (ns / name).write_bytes(b"complete")
    holder = subprocess.Popen(
        ["python3", "-c", f"import time\na=open({str(ns / 'opened')!r},'r+b')\n"
                          f"b=open({str(block)!r},'r+b')\n"
                          f"c=open({str(ns / 'written')!r},'r+b')\n"
                          "c.write(b'X'); c.flush()\n"
                          # written and closed, while another descriptor is open, unwritten
                          f"d=open({str(ns / 'closed')!r},'r+b')\n"
                          f"e=open({str(ns / 'closed')!r},'r+b'); e.write(b'C'); e.close()\n"
                          # written through two descriptors, one of them still open
                          f"f=open({str(ns / 'two')!r},'r+b'); f.write(b'T'); f.flush()\n"
                          f"g=open({str(ns / 'two')!r},'r+b'); g.write(b'U'); g.close()\n"
                          "print('ok', flush=True)\ntime.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "ok"
    os.kill(mount.pid(), 9)
    force_unmount(mount.mnt)
    holder.kill()
    holder.wait()
    mount.start()
    assert (ns / "opened").read_bytes() == b"complete"
    assert block.read_bytes() == data
    assert os.getxattr(block, "user.kvfs.block_hash") == h.hex().encode()
    assert not (ns / "written").exists()
    if passthrough:
        assert not (ns / "closed").exists()
    else:
        assert (ns / "closed").read_bytes() == b"Complete"
    assert not (ns / "two").exists()


def test_fsck_reconciles_backing_changes(mount, tenant):
    ns = tenant / "ns"
    ns.mkdir()
    (ns / "keep").write_bytes(b"k")
    (ns / "gone").write_bytes(b"g")
    mount.stop()
    (mount.backing / "acme" / "ns" / "gone").unlink()
    (mount.backing / "acme" / "ns" / "new").write_bytes(b"new!")
    h, data = make_block(7)
    blk = mount.backing / "acme" / "ns" / hashing.block_relpath(h)
    blk.parent.mkdir()
    blk.write_bytes(data[:-1] + b"\1")  # a flipped padding byte: caught by --verify
    res = kvfs("fsck", str(mount.backing), "--verify")
    assert "added: acme/ns/new" in res.stdout and "dropped: acme/ns/gone" in res.stdout
    assert "quarantined" in res.stdout
    res = kvfs("fsck", str(mount.backing))
    assert " 0 added, 0 dropped, 0 updated" in res.stdout
    mount.start()
    assert sorted(os.listdir(ns)) == [h[:1].hex(), "keep", "new"]
    assert os.listdir(ns / h[:1].hex()) == []
    assert (ns / "new").read_bytes() == b"new!"


def test_requests_never_end_the_mount(tenant, mount):
    """Bad requests of every kind get an errno; the daemon keeps serving."""
    for fn in (lambda: os.rmdir(mount.mnt / ".kvfs"),
               lambda: os.rename(tenant, mount.mnt / ".kvfs"),
               lambda: os.setxattr(tenant, "user.kvfs.publish", b"123"),
               lambda: os.setxattr(tenant, "trusted.x", b"1"),
               lambda: os.mkdir(tenant / ("x" * 300)),
               lambda: os.open(tenant / "nofile", os.O_RDONLY),
               lambda: os.truncate(tenant, 0)):
        with pytest.raises(OSError):
            fn()
    (tenant / "alive").write_bytes(b"yes")
    assert (tenant / "alive").read_bytes() == b"yes"


def test_no_control_call_crosses_tenants(mount):
    """Tenant B cannot make kvfs act on tenant A's namespace through any control call, and
    identical blocks of two tenants are two files."""
    kvfs("tenant", "add", str(mount.mnt), "a", "--uid", str(UID_A), "--gid", str(GID_A),
         "--mode", "0755")
    kvfs("tenant", "add", str(mount.mnt), "b", "--uid", str(UID_B), "--gid", str(GID_B))
    h, data = make_block(3)
    src = mount.backing.parent / "block.kv"
    src.write_bytes(data)
    for t, uid in (("a", UID_A), ("b", UID_B)):
        ns = mount.mnt / t / "ns"
        script = (f"mkdir -p {ns}/{h[:1].hex()} && cp {src} {ns}/{h[:1].hex()}/.t && "
                  f"mv {ns}/{h[:1].hex()}/.t {ns / hashing.block_relpath(h)}")
        res = run_as(uid, uid, ["sh", "-c", script])
        assert res.returncode == 0, res.stderr
        assert os.getxattr(ns / hashing.block_relpath(h), "user.kvfs.block_hash") == \
            h.hex().encode()
    a_block = mount.backing / "a" / "ns" / hashing.block_relpath(h)
    b_block = mount.backing / "b" / "ns" / hashing.block_relpath(h)
    assert a_block.read_bytes() == b_block.read_bytes()
    assert os.stat(a_block).st_ino != os.stat(b_block).st_ino
    assert os.stat(a_block).st_uid == UID_A and os.stat(b_block).st_uid == UID_B
    a_ns = mount.mnt / "a" / "ns"  # world-readable (0755), yet not writable by B
    for name in ("publish", "access", "corrupt", "fetch", "prefetch", "pin", "quota"):
        res = run_as(UID_B, GID_B, ["setfattr", "-n", f"user.kvfs.{name}", "-v", "0x" + h.hex(),
                                    str(a_ns)])
        assert res.returncode != 0, name
        assert "denied" in res.stderr or "not permitted" in res.stderr, (name, res.stderr)
    res = run_as(UID_B, GID_B, ["setfattr", "-n", "user.kvfs.pin", "-v", "1",
                                str(mount.mnt / "a" / "ns" / hashing.block_relpath(h))])
    assert res.returncode != 0
    assert a_block.exists() and mount.stats()["tenants"]["a"]["ns"]["checksum_failures"] == 0


def _place_tree(backing: Path, dirs: int, files: int) -> int:
    """A tree written straight into a backing directory no index has seen; its byte count."""
    total = 0
    for d in range(dirs):
        sub = backing / "acme" / "ns" / f"d{d:03d}"
        sub.mkdir(parents=True)
        for f in range(files):
            data = b"%d/%d" % (d, f)
            (sub / f"f{f}").write_bytes(data)
            total += len(data)
    return total


def _wait_indexed(m, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = m.stats()
        if stats["indexing"]["directories_left"] == 0:
            return stats
        assert time.monotonic() < deadline, stats["indexing"]
        time.sleep(0.05)


def test_first_mount_serves_a_foreign_tree_while_indexing_it(mount_factory):
    """A tree the index never saw is served at once: what a request names is indexed when
    named, the rest in the background; `kvfs status` says how far it is."""
    m = mount_factory(start=False)
    total = _place_tree(m.backing, 20, 500)
    m.start()
    assert (m.mnt / "acme" / "ns" / "d019" / "f499").read_bytes() == b"19/499"
    found = subprocess.run(["find", str(m.mnt / "acme"), "-type", "f"], capture_output=True,
                           text=True, check=True).stdout.split()
    assert len(found) == 20 * 500
    stats = _wait_indexed(m)
    assert stats["files"] == 20 * 500 and stats["used_bytes"] == total
    def du(root: Path) -> list[str]:
        return subprocess.run(["du", "-a", "-B1", "--exclude=.kvfs", "."], cwd=root,
                              capture_output=True, text=True, check=True).stdout.splitlines()

    files = lambda lines: sorted(ln for ln in lines if "/f" in ln)  # noqa: E731
    assert files(du(m.mnt / "acme")) == files(du(m.backing / "acme"))
    assert "indexing" not in kvfs("status", str(m.mnt)).stdout
    assert "adopting" in m.log_text() and "indexed the backing tree" in m.log_text()
    m.stop()
    m.start()
    assert m.stats()["files"] == 20 * 500 and m.stats()["indexing"]["directories_left"] == 0
    m.stop()
    res = kvfs("fsck", str(m.backing))
    assert " 0 added, 0 dropped, 0 updated" in res.stdout, res.stdout


def test_files_copied_into_an_empty_backing_dir_are_adopted(mount_factory):
    """A backing directory mounted once while empty (its index clean and empty), then
    filled from outside while unmounted: the next mount serves what was copied in."""
    m = mount_factory()
    m.stop()
    total = _place_tree(m.backing, 3, 10)
    m.start()
    assert (m.mnt / "acme" / "ns" / "d002" / "f9").read_bytes() == b"2/9"
    assert _wait_indexed(m)["used_bytes"] == total


def test_first_mount_killed_while_indexing(mount_factory):
    """SIGKILL while a foreign tree is being indexed: the next mount finishes the job,
    nothing indexed twice, nothing lost."""
    m = mount_factory(start=False)
    total = _place_tree(m.backing, 10, 2000)
    m.start()
    pid = m.stats()["pid"]
    os.kill(pid, signal.SIGKILL)
    force_unmount(m.mnt)
    m.start()
    stats = _wait_indexed(m)
    assert stats["files"] == 10 * 2000 and stats["used_bytes"] == total
    found = subprocess.run(["find", str(m.mnt / "acme"), "-type", "f"], capture_output=True,
                           text=True, check=True).stdout.split()
    assert len(found) == 10 * 2000
    m.stop()
    res = kvfs("fsck", str(m.backing))
    assert " 0 added, 0 dropped, 0 updated" in res.stdout, res.stdout
