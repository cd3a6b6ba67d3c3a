"""The backing tree is hostile: a tenant that writes its own part of it cannot make the root
daemon (nor fsck, nor the tiers) follow its links.

Each attack is run as a real second uid on a real mount: the attacker (uid 1002) swaps
entries of its own backing directory for symlinks, FIFOs and directories, then asks the
mount to act on them. Nothing outside its subtree may change, and the other tenant's reads
never stall.
"""

from __future__ import annotations

import errno
import os
import random
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvfs.format import blockfile, control, hashing

from .conftest import kvfs, run_as
from .s3server import s3  # noqa: F401 - the fixture

UID_A, GID_A = 1002, 1002  # the attacker
UID_B, GID_B = 1003, 1003  # the victim
FP = bytes(range(16))
#: Generous: a request that has not answered by then is stalled, not slow.
DEADLINE = 30
#: The tenants' scripts need only the standard library, and an interpreter other uids may
#: run (a virtual environment below a private home is not one).
PY = next((p for p in ("/usr/bin/python3", "/bin/python3")
           if os.access(p, os.X_OK)), sys.executable)


def setup(mount_factory, extra: list[str] | None = None):
    m = mount_factory(extra=extra)
    kvfs("tenant", "add", str(m.mnt), "a", "--uid", str(UID_A), "--gid", str(GID_A))
    kvfs("tenant", "add", str(m.mnt), "b", "--uid", str(UID_B), "--gid", str(GID_B))
    return m


def sh_a(script: str, timeout: float = DEADLINE) -> subprocess.CompletedProcess:
    return run_as(UID_A, GID_A, ["sh", "-c", script], timeout=timeout)


def sh_b(script: str, timeout: float = DEADLINE) -> subprocess.CompletedProcess:
    res = run_as(UID_B, GID_B, ["sh", "-c", script], timeout=timeout)
    assert res.returncode == 0, res.stderr
    return res


def py_as(uid: int, gid: int, code: str, *args: str, timeout: float = DEADLINE,
          **kw) -> subprocess.CompletedProcess:
    return run_as(uid, gid, [PY, "-c", code, *args], timeout=timeout, cwd="/",
                  **kw)


SETX = "import os, sys; os.setxattr(sys.argv[1], sys.argv[2], bytes.fromhex(sys.argv[3]))"


def command_as_a(path: Path, name: bytes, value: bytes, **kw) -> subprocess.CompletedProcess:
    return py_as(UID_A, GID_A, SETX, str(path), name.decode(), value.hex(), **kw)


def make_block(seed: int, *, fill: int = 1, parent: bytes = hashing.ROOT_PARENT,
               tokens: int = 16) -> tuple[bytes, bytes]:
    """(hash, bytes) of a valid block; `fill` varies the payload, not the hash."""
    h = hashing.block_hashes(range(seed, seed + tokens), tokens)[0]
    payload = bytes([fill]) * (2 * tokens * 2 * 64 * 2)
    data = blockfile.encode(block_hash=h, parent_hash=parent, fingerprint=FP,
                            token_count=tokens, dtype="float16", shape=(2, tokens, 2, 64),
                            payload=payload)
    return h, data


def put_block_as(uid: int, gid: int, m, rel_ns: str, data: bytes, h: bytes) -> Path:
    """Write a block through the mount as a tenant (indexed as a block when closed)."""
    src = m.backing.parent / f"src-{h.hex()}-{uid}"
    src.write_bytes(data)
    os.chmod(src, 0o644)
    dest = m.mnt / rel_ns / hashing.block_relpath(h)
    res = run_as(uid, gid, ["sh", "-c", f"mkdir -p {dest.parent} && cp {src} {dest}"],
                 timeout=DEADLINE)
    assert res.returncode == 0, res.stderr
    return dest


def snapshot(root: Path, skip: tuple[Path, ...] = ()) -> dict[str, tuple]:
    """Every entry below `root` (links not followed): type, mode, owner, content, xattrs."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        d = Path(dirpath)
        if any(d == s or s in d.parents for s in skip):
            dirnames[:] = []
            continue
        for name in dirnames + filenames:
            p = d / name
            if p in skip:
                continue
            st = os.lstat(p)
            content = p.read_bytes() if stat.S_ISREG(st.st_mode) else (
                os.readlink(p) if stat.S_ISLNK(st.st_mode) else None)
            try:
                xattrs = sorted(os.listxattr(p, follow_symlinks=False))
            except OSError:
                xattrs = []
            out[str(p.relative_to(root))] = (st.st_mode, st.st_uid, st.st_gid, content, xattrs)
    return out


def stop(p: subprocess.Popen, fifos: Path) -> None:
    """Kill a tenant's process, releasing FIFOs until it ends (at most a minute)."""
    p.kill()
    end = time.monotonic() + 60
    while p.poll() is None and time.monotonic() < end:
        release_fifos(fifos)
        time.sleep(0.1)


def release_fifos(top: Path) -> None:
    """Open every FIFO below `top` for writing and close it: whatever waits to read one (a
    thread of a daemon that followed it) goes on."""
    for dirpath, _dirs, files in os.walk(top):
        for name in files:
            p = os.path.join(dirpath, name)
            try:
                if stat.S_ISFIFO(os.lstat(p).st_mode):
                    os.close(os.open(p, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                continue


def read_as_b(path: Path, fifos: Path) -> str | None:
    """`cat` as the victim; None if it did not finish by DEADLINE (stalled). A process
    waiting on a FUSE request the daemon has taken cannot be killed: the FIFOs below `fifos`
    are released until it ends, so that a stalled test ends too."""
    def drop() -> None:
        os.setgroups([])
        os.setgid(GID_B)
        os.setuid(UID_B)

    p = subprocess.Popen(["cat", str(path)], stdout=subprocess.PIPE, text=True,
                         preexec_fn=drop, cwd="/")
    try:
        out, _ = p.communicate(timeout=DEADLINE)
        return out
    except subprocess.TimeoutExpired:
        stop(p, fifos)
        return None


def secret_file(m, name: str = "secret") -> Path:
    """A root-only file beside the backing directory (same file system)."""
    p = m.backing.parent / name
    p.write_text(f"root {name}\n")
    os.chmod(p, 0o600)
    return p


# -- the attacks of the issue, one by one ----------------------------------------------------


def test_1_a_swapped_file_reads_nothing_else(mount_factory):
    m = setup(mount_factory)
    secret = secret_file(m)
    sh_b(f"echo b-private > {m.mnt}/b/f")
    targets = [secret, m.backing / "b" / "f", m.backing / ".kvfs" / "index.db"]
    for i, target in enumerate(targets):
        res = sh_a(f"echo x > {m.mnt}/a/f{i} && truncate -s 65536 {m.mnt}/a/f{i} && "
                   f"rm {m.backing}/a/f{i} && ln -s {target} {m.backing}/a/f{i} && "
                   f"cat {m.mnt}/a/f{i}")
        assert b"root secret" not in res.stdout.encode(), target
        assert "b-private" not in res.stdout and "SQLite" not in res.stdout, target
        # Refused (ELOOP: the daemon resolves the path again), or, where the daemon had let
        # its request thread open the file (its writer closed it), the file's own bytes:
        # the backing file it opened then, whatever the name holds now.
        assert res.returncode != 0 or res.stdout == "x\n" + "\0" * (65536 - 2), res.stdout
    assert secret.read_text() == "root secret\n"


def test_2_a_swapped_file_is_never_written_chmodded_or_created(mount_factory):
    m = setup(mount_factory)
    secret, other = secret_file(m), secret_file(m, "other")
    sh_b(f"echo b-private > {m.mnt}/b/f")
    before = {p: (p.read_bytes(), os.stat(p)) for p in (secret, other, m.backing / "b" / "f")}
    for i, target in enumerate((secret, m.backing / "b" / "f")):
        sh_a(f"echo x > {m.mnt}/a/g{i}; rm {m.backing}/a/g{i}; "
             f"ln -s {target} {m.backing}/a/g{i}; echo pwn >> {m.mnt}/a/g{i}; "
             f"truncate -s 0 {m.mnt}/a/g{i}; chmod 666 {m.mnt}/a/g{i}; "
             f"chown {UID_A} {m.mnt}/a/g{i}; touch {m.mnt}/a/g{i}; true")
    # A name the index does not know, planted as a link, then created through the mount.
    res = sh_a(f"ln -s {other} {m.backing}/a/new && echo hi > {m.mnt}/a/new && "
               f"cat {m.mnt}/a/new")
    assert res.returncode == 0 and res.stdout == "hi\n", res.stderr
    assert not os.path.islink(m.backing / "a" / "new")
    for p, (data, st) in before.items():
        now = os.stat(p)
        assert p.read_bytes() == data, p
        assert (now.st_mode, now.st_uid, now.st_gid) == (st.st_mode, st.st_uid, st.st_gid), p


def test_2_a_hard_link_to_a_file_the_tenant_may_write_is_refused(mount_factory):
    """protected_hardlinks lets a user link a file it may read and write: such a link, put
    where the index has a file of the tenant, must not let root chown or chmod the original."""
    m = setup(mount_factory)
    shared = m.backing.parent / "world-writable"
    shared.write_text("root's\n")
    os.chmod(shared, 0o666)
    res = sh_a(f"echo x > {m.mnt}/a/h && rm {m.backing}/a/h && ln {shared} {m.backing}/a/h && "
               f"chmod 600 {m.mnt}/a/h; chown {UID_A} {m.mnt}/a/h; echo mine > {m.mnt}/a/h; "
               f"cat {m.mnt}/a/h; true")
    assert os.stat(m.backing / "a" / "h").st_ino == os.stat(shared).st_ino, res.stderr
    st = os.stat(shared)
    assert (stat.S_IMODE(st.st_mode), st.st_uid) == (0o666, 0)
    assert shared.read_text() == "root's\n"
    assert "root's" not in res.stdout


def test_3_a_swapped_directory_deletes_and_moves_nothing_else(mount_factory):
    m = setup(mount_factory)
    sh_b(f"mkdir {m.mnt}/b/ns && echo vx > {m.mnt}/b/ns/x && echo vy > {m.mnt}/b/ns/y")
    sh_a(f"mkdir {m.mnt}/a/ns && echo ax > {m.mnt}/a/ns/x && echo ay > {m.mnt}/a/ns/y")
    sh_a(f"mv {m.backing}/a/ns {m.backing}/a/ns.real && ln -s {m.backing}/b/ns {m.backing}/a/ns"
         f" && rm {m.mnt}/a/ns/x; mv {m.mnt}/a/ns/y {m.mnt}/a/ns/z; true")
    assert (m.backing / "b/ns/x").read_text() == "vx\n"
    assert (m.backing / "b/ns/y").read_text() == "vy\n"
    assert not (m.backing / "b/ns/z").exists()
    # A fan-out directory made a link into the victim's namespace, and a publish the daemon
    # refuses (the block's parent is not cached): its refusal unlinks nothing of the victim.
    parent, _ = make_block(100)
    h, data = make_block(200, parent=parent)
    victim = put_block_as(UID_B, GID_B, m, "b/ns2", data, h)
    sh_a(f"mkdir {m.mnt}/a/ns2")
    fan = hashing.block_relpath(h).split("/")[0]
    sh_a(f"ln -s {m.backing}/b/ns2/{fan} {m.backing}/a/ns2/{fan}")
    command_as_a(m.mnt / "a" / "ns2", control.PUBLISH, h)
    assert (m.backing / "b" / "ns2" / hashing.block_relpath(h)).read_bytes() == data
    assert victim.read_bytes() == data


def wait_key(s3, prefix: str, seconds: float) -> list[str]:  # noqa: F811
    """Keys of the bucket under `prefix`, polled for up to `seconds`."""
    client = s3.client()
    deadline = time.monotonic() + seconds
    while True:
        keys = [o["Key"] for o in client.list_objects_v2(Bucket=s3.bucket).get("Contents", [])]
        found = [k for k in keys if f"/{prefix}" in f"/{k}" and "/.kvfs/keys/" not in f"/{k}"]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def test_4_published_links_copy_nothing(mount_factory, s3):  # noqa: F811
    m = setup(mount_factory, ["--shared", s3.url])
    hashes = []
    for seed in range(3):
        h, data = make_block(seed * 16)
        put_block_as(UID_B, GID_B, m, "b/ns", data, h)
        hashes.append(h)
    assert wait_key(s3, "b/ns/", 20), "the victim's blocks never reached the bucket"
    sh_a(f"mkdir {m.mnt}/a/ns")
    for h in hashes:
        rel = hashing.block_relpath(h)
        sh_a(f"mkdir -p {m.backing}/a/ns/{rel.split('/')[0]} && "
             f"ln -s {m.backing}/b/ns/{rel} {m.backing}/a/ns/{rel}")
    command_as_a(m.mnt / "a" / "ns", control.PUBLISH, b"".join(hashes))
    counters = m.stats()["tenants"].get("a", {}).get("ns", {})
    assert counters.get("published_blocks", 0) == 0, counters
    for h in hashes:
        res = sh_a(f"cat {m.mnt}/a/ns/{hashing.block_relpath(h)} | wc -c")
        assert res.stdout.strip() == "0", "the attacker got a copy of the victim's block"
    assert wait_key(s3, "a/", 5) == [], "the victim's bytes were uploaded as the attacker's"


def test_5_a_fetch_never_places_a_block_in_another_tree(mount_factory, s3):  # noqa: F811
    m = setup(mount_factory, ["--shared", s3.url])
    h, victim_data = make_block(7, fill=1)
    _, evil_data = make_block(7, fill=2)  # the same hash, other values
    put_block_as(UID_B, GID_B, m, "b/ns", victim_data, h)
    put_block_as(UID_A, GID_A, m, "a/ns", evil_data, h)
    assert wait_key(s3, "a/ns/", 20), "the attacker's block never reached the bucket"
    rel = hashing.block_relpath(h)
    fan = rel.split("/")[0]
    sh_a(f"rm {m.mnt}/a/ns/{rel} && mv {m.backing}/a/ns/{fan} {m.backing}/a/ns/{fan}.x && "
         f"ln -s {m.backing}/b/ns/{fan} {m.backing}/a/ns/{fan}")
    command_as_a(m.mnt / "a" / "ns", control.FETCH, h)
    assert (m.backing / "b" / "ns" / rel).read_bytes() == victim_data
    res = sh_b(f"cat {m.mnt}/b/ns/{rel} | od -An -tx1 -j 4096 -N 1")
    assert res.stdout.split() == ["01"]


def test_6_fsck_never_follows_a_directory_swapped_after_its_listing(mount_factory, monkeypatch):
    from kvfs.daemon import scanner
    from kvfs.daemon.index import ROOT_INODE, Index
    from kvfs.daemon.store import BackingStore

    m = setup(mount_factory)
    sh_b(f"mkdir {m.mnt}/b/ns && echo v > {m.mnt}/b/ns/victim-file")
    sh_a(f"mkdir -p {m.mnt}/a/ns/sub && echo a > {m.mnt}/a/ns/sub/mine")
    m.stop()
    walk_dir = scanner.Reconciler.walk_dir

    def racing(self, dnode, drel, listing, stack):
        walk_dir(self, dnode, drel, listing, stack)
        if drel == b"a/ns":  # `sub` was listed as a directory: swap it now
            sh_a(f"mv {m.backing}/a/ns/sub {m.backing}/a/ns/sub.real && "
                 f"ln -s {m.backing}/b/ns {m.backing}/a/ns/sub")

    monkeypatch.setattr(scanner.Reconciler, "walk_dir", racing)
    index = Index(str(m.backing / ".kvfs" / "index.db"))
    try:
        scanner.reconcile(index, BackingStore(str(m.backing)), verify=True)
        names, todo = set(), [index.lookup(ROOT_INODE, b"a")]
        while todo:  # everything indexed under the attacker's tenant
            for child in index.children(todo.pop().inode, limit=1 << 30):
                names.add(child.name)
                if child.is_dir:
                    todo.append(child)
    finally:
        index.close()
    assert b"mine" in names and b"victim-file" not in names


def test_7_fifos_and_endless_files_stall_nobody(mount_factory):
    m = setup(mount_factory)
    sh_b(f"echo b-data > {m.mnt}/b/f")
    h, data = make_block(3)
    rel = hashing.block_relpath(h)
    fan = rel.split("/")[0]
    n = 34  # more than the daemon's I/O threads
    script = " && ".join(f"mkdir {m.mnt}/a/ns{i} && mkdir {m.backing}/a/ns{i}/{fan} && "
                         f"mkfifo {m.backing}/a/ns{i}/{rel}" for i in range(n))
    assert sh_a(script).returncode == 0
    # An indexed block swapped for a FIFO, then reported corrupt; one for /dev/zero.
    put_block_as(UID_A, GID_A, m, "a/nsc", data, h)
    sh_a(f"rm {m.backing}/a/nsc/{rel} && mkfifo {m.backing}/a/nsc/{rel}")
    procs = []
    try:
        for i in range(n):
            procs.append(subprocess.Popen(
                [PY, "-c", SETX, str(m.mnt / f"a/ns{i}"), control.PUBLISH.decode(),
                 h.hex()], preexec_fn=_drop_to_a, cwd="/", stderr=subprocess.DEVNULL))
        procs.append(subprocess.Popen(
            [PY, "-c", SETX, str(m.mnt / "a/nsc"), control.CORRUPT.decode(),
             h.hex()], preexec_fn=_drop_to_a, cwd="/", stderr=subprocess.DEVNULL))
        time.sleep(1)
        assert read_as_b(m.mnt / "b/f", m.backing / "a") == "b-data\n", (
            "the other tenant's read stalled")
        end = time.monotonic() + DEADLINE
        while any(p.poll() is None for p in procs) and time.monotonic() < end:
            time.sleep(0.1)
        assert all(p.poll() is not None for p in procs), "the attacker's own calls stalled"

        # A publish naming a link to an endless device reads nothing of it.
        sh_a(f"mkdir {m.mnt}/a/nsz && mkdir {m.backing}/a/nsz/{fan} && "
             f"ln -s /dev/zero {m.backing}/a/nsz/{rel}")
        assert command_as_a(m.mnt / "a/nsz", control.PUBLISH, h).returncode == 0
    finally:
        for p in procs:  # release whatever still waits on a FIFO (a daemon that opened one)
            stop(p, m.backing / "a")


def _drop_to_a() -> None:
    os.setgroups([])
    os.setgid(GID_A)
    os.setuid(UID_A)


def test_8_a_pin_sets_nothing_on_a_link_target(mount_factory):
    m = setup(mount_factory)
    secret = secret_file(m)
    sh_b(f"echo b > {m.mnt}/b/f")
    for i, target in enumerate((secret, m.backing / "b" / "f")):
        sh_a(f"echo x > {m.mnt}/a/p{i} && rm {m.backing}/a/p{i} && "
             f"ln -s {target} {m.backing}/a/p{i}")
        command_as_a(m.mnt / f"a/p{i}", b"user.kvfs.pin", b"1")
        with pytest.raises(OSError) as exc:
            os.getxattr(target, "trusted.kvfs.pin")
        assert exc.value.errno == errno.ENODATA


# -- paths: deeper than PATH_MAX, and the resolver itself ------------------------------------

DEEP = """
import os, sys
os.chdir(sys.argv[1])
name = "d" * 250
for depth in range(1, 21):  # 20 x 251 bytes: past PATH_MAX below the backing root
    os.mkdir(name)
    os.chdir(name)
    if depth in (15, 20):
        with open("f", "w") as f:
            f.write("deep %d" % depth)
        assert open("f").read() == "deep %d" % depth
        os.rename("f", "g")
        os.chmod("g", 0o600)
        os.truncate("g", 3)
        os.setxattr("g", "user.x", b"1")
        assert os.stat("g").st_size == 3 and open("g").read() == "dee"
        os.symlink("g", "l")
        assert os.readlink("l") == "g"
        os.unlink("l")
        os.mkdir("sub")
        os.rmdir("sub")
print("ok")
"""


def test_paths_past_path_max_work(mount_factory):
    m = setup(mount_factory)
    res = py_as(UID_A, GID_A, DEEP, str(m.mnt / "a"))
    assert res.returncode == 0 and res.stdout == "ok\n", res.stderr
    # In the backing tree, as the mount said: reached a directory fd at a time.
    fd = os.open(m.backing / "a", os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(20):
            nxt = os.open("d" * 250, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nxt
        assert os.stat("g", dir_fd=fd).st_size == 3
    finally:
        os.close(fd)
    m.restart()
    res = py_as(UID_A, GID_A, "import os,sys; os.chdir(sys.argv[1]); "
                "[os.chdir('d'*250) for _ in range(20)]; print(open('g').read())",
                str(m.mnt / "a"))
    assert res.stdout == "dee\n", res.stderr


CONTROL_FUZZ = r"""
import os, random, sys
names = [bytes.fromhex(h) for h in sys.argv[3].split(",")]
random.seed(int(sys.argv[2]))
root = sys.argv[1]
targets = [root + p for p in ("", "/a", "/a/ns", "/a/ns/f", "/b", "/.kvfs", "/.kvfs/stats.json")]
done = 0
for _ in range(int(sys.argv[4])):
    name = random.choice(names)
    if random.random() < 0.2:
        name += random.choice([b"x", b".abc", b"." + os.urandom(4).hex().encode()])
    size = random.choice([0, 1, 8, 16, 17, 32, 64, 100, 4096, 65536, random.randrange(200)])
    value = random.choice([os.urandom(size), bytes(size), b"none", b"-1", b"1e309", b"inf",
                           b"18446744073709551616", b"9" * 400,
                           bytes(random.choice(b"0123456789abcdef") for _ in range(size))])
    try:
        if random.random() < 0.7:
            os.setxattr(random.choice(targets), name, value)
        else:
            os.getxattr(random.choice(targets), name)
        done += 1
    except OSError:
        pass
print("ok", done)
"""


def test_malformed_control_requests_are_refused_and_nothing_breaks(mount_factory, tmp_path):
    """kvfs's control attributes (user.kvfs.*: commands, queries, limits) sent malformed
    payloads, seeded at random, by root and by a tenant, on the root, tenants, a namespace,
    a file and the virtual files: each is answered (an errno at worst), nothing reaches the
    handlers' last-resort EIO (a limit beyond what SQLite holds did), and the mount serves
    as before."""
    m = setup(mount_factory, ["--cold", f"dir://{tmp_path / 'cold'}"])
    res = sh_a(f"mkdir {m.mnt}/a/ns && echo kept > {m.mnt}/a/ns/f")
    assert res.returncode == 0, res.stderr
    names = [getattr(control, n) for n in dir(control)
             if isinstance(getattr(control, n), bytes)
             and getattr(control, n).startswith(control.XATTR_PREFIX)]
    names += [control.limit_name(k) for k in ("quota", "max_idle", "max_age", "placement")]
    # FORGET and the key commands would shred or retire what the rest checks: not sent.
    spared = {control.FORGET, control.RETIRE_KEY}
    hexed = ",".join(n.hex() for n in names if n not in spared)
    for seed, uid, gid in ((1, 0, 0), (2, UID_A, GID_A), (3, UID_B, GID_B)):
        res = py_as(uid, gid, CONTROL_FUZZ, str(m.mnt), str(seed), hexed, "1500", timeout=300)
        assert res.returncode == 0 and res.stdout.startswith("ok "), res.stderr
    assert "unexpected error" not in m.log_text() and "Traceback" not in m.log_text()
    # (Root's limits may have evicted or expired a's file: they are cleared, and a new one
    # is written and read.)
    for t in ("a", "b"):
        kvfs("tenant", "set", str(m.mnt), t, "--quota", "none", "--max-idle", "none",
             "--max-age", "none", "--placement", "all")
    res = sh_a(f"mkdir -p {m.mnt}/a/ns2 && echo new > {m.mnt}/a/ns2/g && cat {m.mnt}/a/ns2/g")
    assert res.returncode == 0 and res.stdout == "new\n", res.stderr


def test_tenants_changed_while_unmounted_are_reconciled_at_mount(mount_factory):
    """A tenant's backing directory removed, or replaced by a file or a link, while kvfs was
    not mounted: the next mount reconciles the index (a tenant the index held whose
    directory is gone stopped the mount with a traceback), and the other tenants keep
    their files and limits."""
    m = setup(mount_factory)
    kvfs("tenant", "add", str(m.mnt), "c", "--uid", str(UID_A), "--gid", str(GID_A))
    kvfs("tenant", "set", str(m.mnt), "b", "--quota", "1G")
    (m.mnt / "b" / "ns").mkdir()
    (m.mnt / "b" / "ns" / "f").write_bytes(b"kept")
    (m.mnt / "a" / "ns").mkdir()
    m.stop()
    subprocess.run(["rm", "-rf", str(m.backing / "a")], check=True)
    subprocess.run(["rm", "-rf", str(m.backing / "c")], check=True)
    (m.backing / "c").write_bytes(b"not a tenant")
    m.start()
    assert sorted(os.listdir(m.mnt)) == [".kvfs", "b"]
    assert (m.mnt / "b" / "ns" / "f").read_bytes() == b"kept"
    assert os.getxattr(m.mnt / "b", "user.kvfs.quota") == b"1073741824"
    text = m.log_text()
    assert "tenant a: its backing directory cannot be opened" in text
    assert "reconciling with the backing tree" in text
    # The tenant can be made again, and is usable.
    kvfs("tenant", "add", str(m.mnt), "a", "--uid", str(UID_A), "--gid", str(GID_A))
    res = sh_a(f"mkdir {m.mnt}/a/ns && echo x > {m.mnt}/a/ns/f && cat {m.mnt}/a/ns/f")
    assert res.returncode == 0 and res.stdout == "x\n", res.stderr


@pytest.mark.parametrize("openat2", [True, False], ids=["openat2", "walk"])
def test_resolver_refuses_links_anywhere(tmp_path, monkeypatch, openat2):
    from kvfs.daemon import backing

    monkeypatch.setattr(backing, "use_openat2", openat2)
    root = tmp_path / "root"
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "b" / "f").write_text("f")
    (tmp_path / "outside").write_text("no")
    os.symlink(tmp_path / "outside", root / "a" / "leaf")
    os.symlink(root / "a" / "b", root / "a" / "mid")
    os.symlink("../..", root / "a" / "up")
    rfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fd = backing.open_beneath(rfd, b"a/b/f", os.O_RDONLY)
        assert os.read(fd, 10) == b"f"
        os.close(fd)
        for rel in (b"a/leaf", b"a/mid/f", b"a/up/outside"):
            with pytest.raises(OSError) as exc:
                backing.open_beneath(rfd, rel, os.O_RDONLY)
            assert exc.value.errno == errno.ELOOP, rel
        for rel in (b"../outside", b"/etc/passwd", b"a//b", b"a/./b"):
            with pytest.raises(OSError) as exc:
                backing.open_beneath(rfd, rel, os.O_RDONLY)
            assert exc.value.errno == errno.EINVAL
        # Deeper than PATH_MAX: resolved a chunk at a time.
        parts = [b"x" * 200] * 30
        cur = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        for p in parts:
            os.mkdir(p, dir_fd=cur)
            nxt = os.open(p, os.O_RDONLY | os.O_DIRECTORY, dir_fd=cur)
            os.close(cur)
            cur = nxt
        os.close(os.open(b"f", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=cur))
        os.symlink(b"/etc", b"link", dir_fd=cur)
        os.close(cur)
        deep = b"/".join(parts)
        assert len(deep) > 4096
        os.close(backing.open_beneath(rfd, deep + b"/f", os.O_RDONLY))
        with pytest.raises(OSError) as exc:
            backing.open_beneath(rfd, deep + b"/link/passwd", os.O_RDONLY)
        assert exc.value.errno == errno.ELOOP
    finally:
        os.close(rfd)


# -- a randomized attacker while the daemon and fsck work ------------------------------------

ATTACKER = r"""
import os, random, sys, time
backing, outside = sys.argv[1], sys.argv[2].split(":")
seconds, seed = float(sys.argv[3]), int(sys.argv[4])
rnd = random.Random(seed)
top = os.path.join(backing, "a")
end = time.monotonic() + seconds
while time.monotonic() < end:
    entries = []
    for d, dirs, files in os.walk(top):
        entries += [os.path.join(d, n) for n in dirs + files]
    if not entries:
        time.sleep(0.01)
        continue
    victim = rnd.choice(entries)
    keep = victim + ".k%d" % rnd.randrange(1 << 30)
    try:
        os.rename(victim, keep)
        kind = rnd.randrange(4)
        if kind == 0:
            os.symlink(rnd.choice(outside), victim)
        elif kind == 1:
            os.mkfifo(victim)
        elif kind == 2:
            os.mkdir(victim)
        else:
            os.rename(keep, victim)  # put it back
        if rnd.random() < 0.3 and os.path.lexists(keep):
            time.sleep(0.005)
            if os.path.lexists(victim) and not os.path.isdir(victim) or os.path.islink(victim):
                os.unlink(victim)
            os.rename(keep, victim)  # and back again, between two calls of the daemon
    except OSError:
        pass
"""

OPERATOR = r"""
import os, random, sys, time
mnt, seconds, seed = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
hashes = bytes.fromhex(sys.argv[4])
rnd = random.Random(seed)
top = os.path.join(mnt, "a")
end = time.monotonic() + seconds
n = 0
while time.monotonic() < end:
    n += 1
    try:
        d = os.path.join(top, "ns%d" % rnd.randrange(3))
        os.makedirs(d, exist_ok=True)
        p = os.path.join(d, "file%d" % rnd.randrange(6))
        op = rnd.randrange(10)
        if op == 0:
            with open(p, "ab") as f:
                f.write(b"x" * rnd.randrange(1, 5000))
        elif op == 1:
            with open(p, "rb") as f:
                f.read(1 << 20)
        elif op == 2:
            os.truncate(p, rnd.randrange(0, 70000))
        elif op == 3:
            os.chmod(p, rnd.choice([0o600, 0o644, 0o666]))
        elif op == 4:
            os.rename(p, os.path.join(d, "file%d" % rnd.randrange(6)))
        elif op == 5:
            os.unlink(p)
        elif op == 6:
            os.setxattr(p, rnd.choice(["user.kvfs.pin", "user.x"]), b"1")
        elif op == 7:
            name = rnd.choice(["user.kvfs.publish", "user.kvfs.corrupt", "user.kvfs.fetch"])
            os.setxattr(d, name, hashes)
        elif op == 8:
            os.listdir(d)
            os.utime(p)
        else:
            os.mkdir(os.path.join(d, "s%d" % rnd.randrange(3)))
    except OSError:
        pass
print(n)
"""


def test_random_swaps_change_nothing_outside_and_stall_nobody(mount_factory, s3):  # noqa: F811
    seed = int(os.environ.get("KVFS_HOSTILE_SEED", random.randrange(1 << 30)))
    print("seed", seed)
    m = setup(mount_factory, ["--shared", s3.url])
    secret = secret_file(m)
    sh_b(f"mkdir {m.mnt}/b/ns && for i in 0 1 2 3; do echo b$i > {m.mnt}/b/ns/file$i; done")
    hashes = []
    for seed_i in range(4):
        h, data = make_block(1000 + seed_i * 16)
        put_block_as(UID_B, GID_B, m, "b/ns", data, h)
        put_block_as(UID_A, GID_A, m, "a/ns0", data, h)
        hashes.append(h)
    # The attacker's own namespaces and files, then links to everything it must not touch.
    sh_a(f"for n in 0 1 2; do mkdir -p {m.mnt}/a/ns$n; for f in 0 1 2 3 4 5; do "
         f"echo a > {m.mnt}/a/ns$n/file$f; done; done")
    outside = [str(secret), str(m.backing / "b"), str(m.backing / "b" / "ns"),
               str(m.backing / ".kvfs" / "index.db"), str(m.backing / ".kvfs")]
    # (No link to /dev/zero here: a daemon that followed one would read it without end and
    # take the machine's memory with it; test 7 covers endless files.)
    outside += [str(m.backing / "b" / "ns" / f"file{i}") for i in range(4)]
    outside += [str(m.backing / "b" / "ns" / hashing.block_relpath(h)) for h in hashes]
    outside += [str(m.backing / "b" / "ns" / hashing.block_relpath(h).split("/")[0])
                for h in hashes]
    watched = (m.backing / "b", secret)
    before = {str(p): snapshot(p) if p.is_dir() else p.read_bytes() for p in watched}
    before_mode = os.stat(secret)
    seconds = 12.0
    fifo_dir = m.backing / "a"
    attacker = subprocess.Popen(
        [PY, "-c", ATTACKER, str(m.backing), ":".join(outside), str(seconds + 8),
         str(seed)], preexec_fn=_drop_to_a, cwd="/")
    operator = subprocess.Popen(
        [PY, "-c", OPERATOR, str(m.mnt), str(seconds), str(seed),
         b"".join(hashes).hex()], preexec_fn=_drop_to_a, cwd="/", stdout=subprocess.PIPE,
        text=True)
    try:
        end = time.monotonic() + seconds
        reads = 0
        while time.monotonic() < end:
            i = reads % 4
            assert read_as_b(m.mnt / f"b/ns/file{i}", fifo_dir) == f"b{i}\n", "stalled"
            reads += 1
        out, _ = operator.communicate(timeout=DEADLINE)
        assert operator.returncode == 0 and int(out) > 0
        # fsck (the full one, with checksums) while the attacker goes on.
        m.stop()
        kvfs("fsck", str(m.backing), "--verify", check=False, timeout=DEADLINE * 2)
        m.start()
        assert read_as_b(m.mnt / "b/ns/file0", fifo_dir) == "b0\n"
    finally:
        attacker.kill()
        attacker.wait()
        stop(operator, fifo_dir)
    after = {str(p): snapshot(p) if p.is_dir() else p.read_bytes() for p in watched}
    assert after == before
    st = os.stat(secret)
    assert (st.st_mode, st.st_uid) == (before_mode.st_mode, before_mode.st_uid)
    client = s3.client()
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=s3.bucket).get("Contents", [])]
    for k in keys:  # the attacker's uploads are its own blocks, never anything else
        if "/a/" in f"/{k}" and k.endswith(".kv"):
            body = client.get_object(Bucket=s3.bucket, Key=k)["Body"].read()
            hdr = blockfile.verify_file(body)  # sealed: checked without the tenant's key
            assert hdr.block_hash in hashes


def test_one_tenant_cannot_take_every_io_thread(tmp_path):
    """In-process: a tenant whose backing calls never return holds at most its own share of
    the daemon's I/O threads; another tenant's call still runs."""
    import threading

    import trio

    from kvfs.daemon import scanner
    from kvfs.daemon.fs import MountInfo, Operations
    from kvfs.daemon.index import Index
    from kvfs.daemon.store import BackingStore

    backing_dir = tmp_path / "backing"
    (backing_dir / ".kvfs").mkdir(parents=True)
    index = Index(str(backing_dir / ".kvfs" / "index.db"))
    store = BackingStore(str(backing_dir))
    scanner.reconcile(index, store)
    ops = Operations(index, store, MountInfo(str(tmp_path / "mnt"), str(backing_dir), None),
                     io_threads=8)
    release = threading.Event()

    async def main() -> bool:
        async with trio.open_nursery() as nursery:
            for _ in range(20):  # far more stuck calls than threads
                nursery.start_soon(lambda: ops.tree.io(release.wait, tenant=1001))
            await trio.sleep(0.5)
            with trio.move_on_after(DEADLINE):
                await ops.tree.io(lambda: None, tenant=1002)
                release.set()
                return True
            release.set()
            return False

    try:
        assert trio.run(main), "tenant 1001's stuck calls held every thread"
    finally:
        release.set()
        index.close()
