"""In-process tests of the Operations and the index: no mount, handlers called directly."""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
import stat
import threading
from types import SimpleNamespace

import pyfuse3
import pytest
import trio

from kvfs.daemon import backing, scanner
from kvfs.daemon.closer import closer
from kvfs.daemon.fs import MountInfo, Operations
from kvfs.daemon.index import ORPHAN_PARENT, ROOT_INODE, WAL_BACKSTOP_PAGES, Index
from kvfs.daemon.store import BackingStore

ROOT = SimpleNamespace(uid=0, gid=0, pid=1, umask=0o022)
USER = SimpleNamespace(uid=1000, gid=1000, pid=2, umask=0o022)


@pytest.fixture
def ops(tmp_path):
    backing = tmp_path / "backing"
    (backing / ".kvfs").mkdir(parents=True)
    index = Index(str(backing / ".kvfs" / "index.db"))
    store = BackingStore(str(backing))
    scanner.reconcile(index, store)
    o = Operations(index, store, MountInfo(str(tmp_path / "mnt"), str(backing), capacity=None))
    yield o
    index.close()


def run(fn, *args):
    return trio.run(fn, *args)


def make_file(ops, data: bytes = b"") -> int:
    async def go():
        t = await ops.mkdir(ROOT_INODE, b"t", 0o755, ROOT)
        fi, attrs = await ops.create(t.st_ino, b"f", 0o644, os.O_WRONLY, ROOT)
        if data:
            await ops.write(fi.fh, 0, data)
        await ops.release(fi.fh)
        return attrs.st_ino

    return run(go)


def test_create_write_read(ops):
    ino = make_file(ops, b"hello")

    async def go():
        fi = await ops.open(ino, os.O_RDONLY, ROOT)
        assert await ops.read(fi.fh, 0, 100) == b"hello"
        await ops.release(fi.fh)
        return await ops.getattr(ino, ROOT)

    attrs = run(go)
    assert attrs.st_size == 5 and stat.S_ISREG(attrs.st_mode)
    node = ops.index.get(ino)
    assert node.size == 5 and node.writing == 0
    assert (ops.store.root + b"/t/f") and open(ops.store.root + b"/t/f", "rb").read() == b"hello"


def test_writing_flag_is_persisted_until_the_writers_close(ops):
    """The flag marks a file changed through a descriptor not closed yet: set by the first
    change (not the open), cleared once every descriptor that changed it is closed."""
    ino = make_file(ops)

    async def go():
        a = await ops.open(ino, os.O_WRONLY, ROOT)
        b = await ops.open(ino, os.O_WRONLY, ROOT)
        assert ops.index.get(ino).writing == 0  # opened, nothing changed yet
        await ops.write(a.fh, 0, b"xy")
        await ops.write(b.fh, 2, b"z")
        assert ops.index.get(ino).writing == 1
        assert (await ops.getattr(ino, ROOT)).st_size == 3  # the in-memory size
        await ops.flush(a.fh)
        await ops.release(a.fh)
        assert ops.index.get(ino).writing == 1  # b has changed it too, and is open
        await ops.flush(b.fh)
        assert ops.index.get(ino).writing == 0
        await ops.write(b.fh, 3, b"!")  # changed again
        assert ops.index.get(ino).writing == 1
        await ops.release(b.fh)
        assert ops.index.get(ino).writing == 0
        assert ops.index.get(ino).size == 4

    run(go)


def test_create_write_close_writes_the_index_twice(ops):
    """A create commits its row and its directory's times in one transaction; the flush of
    the only writer writes the size, times and the end of writing; the release that follows
    finds all of it in the index and writes nothing."""
    db = ops.index.db

    async def go():
        t = await ops.mkdir(ROOT_INODE, b"t", 0o755, ROOT)
        commits = []
        db.set_trace_callback(lambda sql: commits.append(sql) if sql.startswith(
            ("COMMIT", "UPDATE", "INSERT", "DELETE")) else None)
        fi, attrs = await ops.create(t.st_ino, b"f", 0o644, os.O_WRONLY, ROOT)
        created = list(commits)
        await ops.write(fi.fh, 0, b"hello")
        await ops.flush(fi.fh)
        flushed = len(commits)
        changes = db.total_changes
        await ops.release(fi.fh)
        db.set_trace_callback(None)
        return t.st_ino, attrs.st_ino, created, commits[flushed:], changes

    parent, ino, created, after_flush, changes = run(go)
    assert [c.split()[0] for c in created] == ["INSERT", "UPDATE", "COMMIT"]
    assert after_flush == [] and db.total_changes == changes
    node = ops.index.get(ino)
    assert (node.size, node.writing) == (5, 0)
    assert ops.index.get(parent).mtime_ns >= node.atime_ns  # (its creation time)


def test_what_a_kill_would_leave_is_committed_before_each_step(ops, monkeypatch):
    """Seen from another connection (what a daemon killed at that moment leaves): the new
    row, marked as being written, is committed before the backing file exists; the flush's
    size and end of writing are committed when the flush returns, so the release that is
    not written any more loses nothing."""
    other = sqlite3.connect(ops.index.path, check_same_thread=False)

    def committed(ino):
        return other.execute("SELECT size, writing FROM nodes WHERE inode=?",
                             (ino,)).fetchone()

    seen = []
    real_create = ops.store.create

    def create(rel, *a):
        seen.append(other.execute("SELECT inode, writing FROM nodes WHERE name=?",
                                  (rel.rsplit(b"/", 1)[-1],)).fetchone())
        return real_create(rel, *a)

    monkeypatch.setattr(ops.store, "create", create)

    async def go():
        t = await ops.mkdir(ROOT_INODE, b"t", 0o755, ROOT)
        fi, attrs = await ops.create(t.st_ino, b"f", 0o644, os.O_WRONLY, ROOT)
        await ops.write(fi.fh, 0, b"hello")
        assert committed(attrs.st_ino) == (0, 1)
        await ops.flush(fi.fh)
        after_flush = committed(attrs.st_ino)
        await ops.release(fi.fh)
        return attrs.st_ino, after_flush

    ino, after_flush = run(go)
    assert seen == [(ino, 1)]
    assert after_flush == (5, 0) == committed(ino)
    other.close()


def test_a_failed_create_leaves_the_directory_as_it_was(ops, monkeypatch):
    async def go():
        t = await ops.mkdir(ROOT_INODE, b"t", 0o755, ROOT)
        return t.st_ino

    parent = run(go)
    before = ops.index.get(parent)

    def refuse(*a):
        raise OSError(errno.ELOOP, "a link")

    monkeypatch.setattr(ops.store, "create", refuse)
    with pytest.raises(pyfuse3.FUSEError):
        run(ops.create, parent, b"f", 0o644, os.O_WRONLY, ROOT)
    after = ops.index.get(parent)
    assert ops.index.lookup(parent, b"f") is None
    assert (after.mtime_ns, after.ctime_ns) == (before.mtime_ns, before.ctime_ns)


def test_an_open_access_time_is_batched(ops):
    """An open's access time is shown at once (getattr) and reaches the index with the next
    batch of access times, not one commit per open; times set explicitly win over it."""
    ino = make_file(ops, b"x")
    old = ops.index.get(ino).atime_ns

    async def go():
        fi = await ops.open(ino, os.O_RDONLY, ROOT)
        await ops.release(fi.fh)
        return (await ops.getattr(ino, ROOT)).st_atime_ns

    shown = run(go)
    assert shown > old and ops.index.get(ino).atime_ns == old
    ops.residency.flush_atimes()
    assert ops.index.get(ino).atime_ns == shown and ops.residency.file_atimes == {}

    async def utime():
        fi = await ops.open(ino, os.O_RDONLY, ROOT)
        await ops.release(fi.fh)
        attr = pyfuse3.EntryAttributes()
        attr.st_atime_ns, attr.st_mtime_ns = 7_000_000_000, 8_000_000_000
        fields = SimpleNamespace(update_size=False, update_mode=False, update_uid=False,
                                 update_gid=False, update_atime=True, update_mtime=True)
        return (await ops.setattr(ino, attr, fields, None, ROOT)).st_atime_ns

    assert run(utime) == 7_000_000_000
    ops.residency.flush_atimes()
    assert ops.index.get(ino).atime_ns == 7_000_000_000


def test_unexpected_errors_become_eio_with_traceback(ops, caplog, monkeypatch):
    ino = make_file(ops, b"x")

    def boom(rel):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(ops.store, "unlink", boom)
    with caplog.at_level(logging.ERROR), pytest.raises(pyfuse3.FUSEError) as exc:
        run(ops.unlink, ops.index.get(ino).parent, b"f", ROOT)
    assert exc.value.errno == errno.EIO
    assert "disk on fire" in caplog.text and "Traceback" in caplog.text
    assert ops.index.find(ino) is not None  # nothing changed


def test_blocking_io_runs_off_the_event_loop(ops, monkeypatch):
    """Opens that may touch the disk run in worker threads: every open for writing, and a
    read whose path the kernel has not cached (RESOLVE_CACHED said EAGAIN); closes run in
    the closer's thread."""
    ino = make_file(ops, b"x")
    threads, closes = [], []
    real_open, real_close = ops.store.open, os.close

    def spy(rel, flags):
        threads.append(threading.current_thread())
        return real_open(rel, flags)

    def spy_close(fd):
        closes.append(threading.current_thread())
        real_close(fd)

    monkeypatch.setattr(ops.store, "open", spy)
    monkeypatch.setattr(backing, "open_cached", lambda *a: None)  # as if nothing is cached

    async def go():
        for flags in (os.O_RDONLY, os.O_WRONLY):
            fi = await ops.open(ino, flags, ROOT)
            await ops.release(fi.fh)
        return threading.current_thread()

    assert closer.drain(10)  # make_file's close, queued: not one of the closes counted here
    monkeypatch.setattr(os, "close", spy_close)
    loop_thread = run(go)
    assert closer.drain(10)
    assert len(threads) == 2 and all(t is not loop_thread for t in threads)
    assert all(t is not loop_thread for t in closes)
    assert sum(t.name == "kvfs-closer" for t in closes) == 2


def test_a_cached_read_only_open_needs_no_thread(ops, monkeypatch):
    """A read-only open of a file whose path is in the kernel's dentry cache opens on the
    event loop (no worker thread's round trip); its fd is a blocking one of that file."""
    ino = make_file(ops, b"cached")
    monkeypatch.setattr(ops.store, "open", lambda *a: pytest.fail("opened in a thread"))

    async def go():
        fi = await ops.open(ino, os.O_RDONLY, ROOT)
        fd = ops.handles[fi.fh].fd
        blocking = os.get_blocking(fd)
        data = await ops.read(fi.fh, 0, 100)
        await ops.release(fi.fh)
        return data, blocking

    data, blocking = run(go)
    assert data == b"cached" and blocking


def test_open_cached_refuses_what_open_refuses(tmp_path):
    """The event loop's open (RESOLVE_CACHED) opens nothing `BackingStore.open` would refuse:
    a link (leaf or on the way), a FIFO (without blocking), a directory, a hard-linked file,
    an open for writing; each is None, for the worker thread to refuse with its reason."""
    root = tmp_path / "b"
    (root / "t" / "d").mkdir(parents=True)
    (root / "t" / "d" / "f").write_bytes(b"x")
    (root / "t" / "ln").symlink_to(root / "t" / "d" / "f")
    (root / "t" / "dl").symlink_to(root / "t" / "d")
    os.mkfifo(root / "t" / "fifo")
    (root / "t" / "h1").write_bytes(b"y")
    os.link(root / "t" / "h1", root / "t" / "h2")
    store = BackingStore(str(root))
    os.stat(root / "t" / "d" / "f")  # (in the dentry cache)
    fd = store.open_cached(b"t/d/f", os.O_RDONLY)
    assert fd is not None and os.read(fd, 10) == b"x" and os.get_blocking(fd)
    os.close(fd)
    for rel in (b"t/ln", b"t/dl/f", b"t/fifo", b"t/d", b"t/h1", b"t/missing", b"t/../t/d/f"):
        assert store.open_cached(rel, os.O_RDONLY) is None, rel
    assert store.open_cached(b"t/d/f", os.O_WRONLY) is None
    assert store.open_cached(b"t/d/f", os.O_RDWR) is None
    assert closer.drain(10)
    store.close()


def test_huge_truncate(ops):
    ino = make_file(ops)

    async def go():
        attr = pyfuse3.EntryAttributes()
        attr.st_size = 1 << 50
        fields = SimpleNamespace(update_size=True, update_mode=False, update_uid=False,
                                 update_gid=False, update_atime=False, update_mtime=False)
        return await ops.setattr(ino, attr, fields, None, ROOT)

    try:
        attrs = run(go)
    except pyfuse3.FUSEError as exc:  # a backing filesystem with a smaller size limit
        assert exc.errno == errno.EFBIG
    else:
        assert attrs.st_size == 1 << 50


def test_unlink_of_a_looked_up_inode_orphans_until_forget(ops):
    ino = make_file(ops, b"x")
    parent = ops.index.get(ino).parent
    run(ops.lookup, parent, b"f", ROOT)
    refs = ops.lookups[ino]
    run(ops.unlink, parent, b"f", ROOT)
    assert ops.index.get(ino).parent == ORPHAN_PARENT
    run(ops.forget, [(ino, refs)])
    assert ops.index.find(ino) is None


def test_inodes_are_never_reused(ops):
    ino = make_file(ops, b"x")
    parent = ops.index.get(ino).parent
    run(ops.unlink, parent, b"f", ROOT)
    ops.lookups.clear()

    async def go():
        fi, attrs = await ops.create(parent, b"g", 0o644, os.O_WRONLY, ROOT)
        await ops.release(fi.fh)
        return attrs.st_ino

    assert run(go) > ino


def test_only_root_or_owner_makes_tenants(ops):
    with pytest.raises(pyfuse3.FUSEError) as exc:
        run(ops.mkdir, ROOT_INODE, b"t2", 0o755, USER)
    assert exc.value.errno == errno.EACCES
    with pytest.raises(pyfuse3.FUSEError) as exc:
        run(ops.mkdir, ROOT_INODE, b"-bad/", 0o755, ROOT)
    assert exc.value.errno == errno.EINVAL


def test_tenant_and_namespace_columns(ops):
    async def go():
        t = await ops.mkdir(ROOT_INODE, b"t", 0o755, ROOT)
        ns = await ops.mkdir(t.st_ino, b"m@1", 0o755, ROOT)
        sub = await ops.mkdir(ns.st_ino, b"ab", 0o755, ROOT)
        fi, f = await ops.create(sub.st_ino, b"f", 0o644, os.O_WRONLY, ROOT)
        await ops.release(fi.fh)
        return t.st_ino, ns.st_ino, f.st_ino

    t, ns, f = run(go)
    node = ops.index.get(f)
    assert (node.tenant, node.ns) == (t, ns)
    assert ops.index.get(ns).ns == ns and ops.index.get(t).tenant == t
    assert ops.snapshot()["tenants"]["t"]["m@1"]["files"] == 1


def test_index_schema_version_is_checked(tmp_path):
    path = str(tmp_path / "i.db")
    Index(path).set_meta("schema_version", "999")
    with pytest.raises(RuntimeError, match="schema version 999"):
        Index(path)


# -- model-based: random operation sequences against a dict model --------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

NAMES = st.sampled_from([b"a", b"b", b"c", b"d"])
OPS = st.one_of(
    st.tuples(st.just("write"), NAMES, st.binary(max_size=64)),
    st.tuples(st.just("unlink"), NAMES),
    st.tuples(st.just("rename"), NAMES, NAMES),
    st.tuples(st.just("truncate"), NAMES, st.integers(0, 100)),
)


@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seq=st.lists(OPS, max_size=25))
def test_random_sequences_match_a_model(tmp_path_factory, seq):
    backing = tmp_path_factory.mktemp("b")
    (backing / ".kvfs").mkdir()
    index = Index(str(backing / ".kvfs" / "index.db"))
    store = BackingStore(str(backing))
    scanner.reconcile(index, store)
    ops = Operations(index, store, MountInfo("/nonexistent", str(backing), capacity=None))
    model: dict[bytes, bytes] = {}

    async def go():
        t = (await ops.mkdir(ROOT_INODE, b"t", 0o755, ROOT)).st_ino
        for op in seq:
            name = op[1]
            node = ops.index.lookup(t, name)
            try:
                if op[0] == "write":
                    if node is None:
                        fi, _ = await ops.create(t, name, 0o644, os.O_WRONLY, ROOT)
                    else:
                        fi = await ops.open(node.inode, os.O_WRONLY | os.O_TRUNC, ROOT)
                    await ops.write(fi.fh, 0, op[2])
                    await ops.release(fi.fh)
                    model[name] = op[2]
                elif op[0] == "unlink":
                    await ops.unlink(t, name, ROOT)
                    del model[name]
                elif op[0] == "rename":
                    await ops.rename(t, name, t, op[2], 0, ROOT)
                    if name != op[2]:
                        model[op[2]] = model.pop(name)
                else:
                    if node is None:
                        raise pyfuse3.FUSEError(errno.ENOENT)
                    attr = pyfuse3.EntryAttributes()
                    attr.st_size = op[2]
                    fields = SimpleNamespace(update_size=True, update_mode=False,
                                             update_uid=False, update_gid=False,
                                             update_atime=False, update_mtime=False)
                    await ops.setattr(node.inode, attr, fields, None, ROOT)
                    model[name] = model[name][: op[2]].ljust(op[2], b"\0")
            except pyfuse3.FUSEError as exc:
                assert exc.errno == errno.ENOENT and name not in model
            ops.lookups.clear()
        return t

    t = run(go)
    listed = {n: ops.index.get(i) for n, i in ops.index.child_names(t).items()}
    assert set(listed) == set(model)
    for name, data in model.items():
        assert listed[name].size == len(data)
        assert (backing / "t" / name.decode()).read_bytes() == data
    assert ops.stats.used_bytes == sum(len(d) for d in model.values())
    report = scanner.reconcile(index, store)
    assert report.changes == 0, report.summary()
    index.close()


# -- a tree adopted at its first mount: indexed a directory at a time ---------------------


def _foreign_tree(backing) -> dict:
    """A backing tree no index has seen: a tenant with a model namespace of blocks (one of
    them bad), plain files, a symlink, a temporary and nested directories."""
    from kvfs.format import blockfile, hashing
    from kvfs.format.layout import TEMP_PREFIX

    ns = backing / "acme" / "llama@0123456789abcdef"
    blocks = []
    parent = hashing.ROOT_PARENT
    for i in range(3):
        h = hashing.block_hashes([i] * 16, 16, parent=parent)[0]
        data = blockfile.encode(block_hash=h, parent_hash=parent, fingerprint=bytes(16),
                                token_count=16, dtype="uint8", shape=(100,),
                                payload=bytes([i]) * 100)
        path = ns / hashing.block_relpath(h)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        blocks.append((h, path))
        parent = h
    bad = ns / "ee" / ("ee" * 16 + ".kv")
    bad.parent.mkdir()
    bad.write_bytes(b"not a block")
    deep = backing / "acme" / "a" / "b" / "c"
    deep.mkdir(parents=True)
    for k in range(50):
        (deep / f"f{k}").write_bytes(b"x" * k)
    (backing / "acme" / "a" / (TEMP_PREFIX.decode() + "half")).write_bytes(b"half")
    os.symlink("b/c/f1", backing / "acme" / "a" / "link")
    files = 3 + 50
    size = sum(p.stat().st_size for _, p in blocks) + sum(range(50))
    return {"ns": ns, "blocks": blocks, "bad": bad, "files": files, "bytes": size}


def _adopt_foreign(tmp_path) -> tuple[dict, Index, BackingStore, MountInfo]:
    """A foreign tree in a fresh backing directory, adopted as a first mount does."""
    backing = tmp_path / "backing"
    (backing / ".kvfs").mkdir(parents=True)
    tree = _foreign_tree(backing)
    index = Index(str(backing / ".kvfs" / "index.db"))
    store = BackingStore(str(backing))
    report = scanner.adopt(index, store)
    assert report.added.count == 1  # the tenant; nothing below it yet
    return tree, index, store, MountInfo(str(tmp_path / "mnt"), str(backing), capacity=None)


@pytest.fixture
def adopted(tmp_path):
    tree, index, store, info = _adopt_foreign(tmp_path)
    yield Operations(index, store, info), tree
    index.close()


def _walk(ops, inode=ROOT_INODE, path=b""):
    """Every path below `inode` through the handlers, as `find` would see it."""
    async def go():
        out = []

        async def rec(ino, prefix):
            fh = await ops.opendir(ino, ROOT)
            names = []

            class Tok:
                pass

            orig = pyfuse3.readdir_reply
            try:
                pyfuse3.readdir_reply = lambda tok, name, attrs, off: names.append(
                    (name, attrs)) or True
                await ops.readdir(fh, 0, Tok())
            finally:
                pyfuse3.readdir_reply = orig
            for name, attrs in names:
                if name == b".kvfs":
                    continue
                p = prefix + b"/" + name if prefix else name
                out.append(p)
                if stat.S_ISDIR(attrs.st_mode):
                    await rec(attrs.st_ino, p)

        await rec(inode, path)
        return sorted(out)

    return run(go)


def test_adopted_tree_is_listed_when_first_named(adopted):
    from kvfs.format.layout import TEMP_PREFIX

    ops, tree = adopted
    tenant = ops.index.lookup(ROOT_INODE, b"acme")
    assert ops.adoption.unlisted == {tenant.inode}
    assert ops.stats.total_files == 0  # nothing below the tenant is indexed yet

    async def go():
        # A lookup indexes the one name it asks for (one lstat), not the directory.
        ns = await ops.lookup(tenant.inode, b"llama@0123456789abcdef", ROOT)
        assert ns.st_ino in ops.adoption.unlisted and tenant.inode in ops.adoption.unlisted
        assert ops.index.lookup(tenant.inode, b"a") is None
        with pytest.raises(pyfuse3.FUSEError) as e:
            await ops.lookup(tenant.inode, b"nothing", ROOT)
        assert e.value.errno == errno.ENOENT
        a = await ops.lookup(tenant.inode, b"a", ROOT)
        # A temporary named is removed, never indexed; the symlink keeps its target.
        with pytest.raises(pyfuse3.FUSEError) as e:
            await ops.lookup(a.st_ino, TEMP_PREFIX + b"half", ROOT)
        assert e.value.errno == errno.ENOENT
        assert not os.path.exists(ops.store.path(b"acme/a/" + TEMP_PREFIX + b"half"))
        link = await ops.lookup(a.st_ino, b"link", ROOT)
        assert await ops.readlink(link.st_ino, ROOT) == b"b/c/f1"
        b = await ops.lookup(a.st_ino, b"b", ROOT)
        c = await ops.lookup(b.st_ino, b"c", ROOT)
        assert c.st_ino in ops.adoption.unlisted and ops.index.children(c.st_ino) == []
        f3 = await ops.lookup(c.st_ino, b"f3", ROOT)
        assert f3.st_size == 3 and ops.stats.total_files == 1
        # A change to an unlisted directory lists it whole first: creating a name the
        # backing tree has is EEXIST, and every entry is then indexed and counted.
        with pytest.raises(pyfuse3.FUSEError) as e:
            await ops.create(c.st_ino, b"f5", 0o644, os.O_WRONLY | os.O_EXCL, ROOT)
        assert e.value.errno == errno.EEXIST
        assert c.st_ino not in ops.adoption.unlisted and len(ops.index.children(c.st_ino)) == 50
        assert ops.stats.total_files == 50 and ops.stats.used_bytes == sum(range(50))
        # Renaming over a name replaces it (and accounts for it).
        await ops.rename(c.st_ino, b"f3", c.st_ino, b"f4", 0, ROOT)
        assert ops.stats.total_files == 49 and ops.stats.used_bytes == sum(range(50)) - 4
        # rmdir of a directory whose entries are not indexed yet: not empty.
        with pytest.raises(pyfuse3.FUSEError) as e:
            await ops.rmdir(tenant.inode, b"llama@0123456789abcdef", ROOT)
        assert e.value.errno == errno.ENOTEMPTY
        assert ns.st_ino not in ops.adoption.unlisted  # listed to know

    run(go)
    assert ops.stats.total_files == 49  # (only c's files are indexed so far)
    # find sees the whole tree; the bad block is quarantined, never listed.
    paths = _walk(ops)
    assert b"acme/a/b/c/f49" in paths and b"acme/a/link" in paths
    for _h, p in tree["blocks"]:
        assert str(p.relative_to(p.parents[3])).encode() in paths
    assert not any(p.endswith(b"ee" * 16 + b".kv") for p in paths)
    assert not tree["bad"].exists()
    assert not ops.adoption.unlisted and ops.index.unlisted() == []
    assert ops.stats.total_files == tree["files"] - 1  # f3 was renamed over f4
    assert ops.stats.used_bytes == tree["bytes"] - 4
    # The index now equals what a full fsck builds: a full fsck finds nothing to change.
    report = scanner.reconcile(ops.index, ops.store)
    assert report.changes == 0, report.summary()


def test_adopted_tree_is_indexed_in_the_background(adopted):
    import time

    from kvfs.format.layout import TEMP_PREFIX

    ops, tree = adopted
    ops.adoption.LIST_CHUNK = 7  # several transactions per directory
    # A temporary written after the mount began is a write under way: left alone.
    time.sleep(0.05)  # (file times come from a coarser clock)
    fresh = ops.store.path(b"acme/a/b/c/" + TEMP_PREFIX + b"new")
    with open(fresh, "wb") as f:
        f.write(b"under way")

    async def go():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ops.adoption.run)
            # Requests are served meanwhile, and wait for a directory being listed.
            t = ops.index.lookup(ROOT_INODE, b"acme")
            for _ in range(3):
                await ops.lookup(t.inode, b"a", ROOT)

    run(go)
    assert not ops.adoption.unlisted and ops.index.unlisted() == []
    assert ops.stats.total_files == tree["files"]
    assert ops.stats.used_bytes == tree["bytes"]
    assert ops.snapshot()["indexing"]["directories_left"] == 0
    assert os.path.exists(fresh) and ops.adoption.reconciler.report.removed_temp.count == 1
    os.unlink(fresh)
    assert scanner.reconcile(ops.index, ops.store).changes == 0


def test_adoption_cut_short_resumes(tmp_path):
    """A listing cut short (the daemon killed between two of its transactions) is finished
    by the next mount: nothing twice, nothing lost; the quick fsck leaves it to the mount."""
    tree, index, store, info = _adopt_foreign(tmp_path)
    ops = Operations(index, store, info)
    c_dir = None

    async def list_part():
        nonlocal c_dir
        t = ops.index.lookup(ROOT_INODE, b"acme")
        a = await ops.lookup(t.inode, b"a", ROOT)
        b = await ops.lookup(a.st_ino, b"b", ROOT)
        c_dir = (await ops.lookup(b.st_ino, b"c", ROOT)).st_ino
        # Half of c's entries indexed, c still marked unlisted: as a crash would leave it.
        node = ops.index.get(c_dir)
        listing = ops.adoption.reconciler.prepare(ops.tree.path(node))
        with ops.index.transaction():
            reconciler = ops.adoption.reconciler
            reconciler.walk_entries(node, ops.tree.path(node), listing, [],
                                    reconciler.known(node), listing.entries[:20])

    run(list_part)
    assert len(ops.index.children(c_dir)) == 20 and c_dir in ops.index.unlisted()
    report = scanner.reconcile(index, store, lazy=True)  # the mount's quick fsck
    assert len(ops.index.children(c_dir)) == 20 and c_dir in ops.index.unlisted()
    assert report.dropped.count == 0
    ops2 = Operations(index, store, info)
    run(ops2.adoption.run)
    assert len(ops2.index.children(c_dir)) == 50 and not ops2.adoption.unlisted
    assert ops2.stats.total_files == tree["files"]
    assert scanner.reconcile(index, store).changes == 0


def test_full_fsck_lists_what_the_mount_left_unlisted(tmp_path):
    tree, index, store, info = _adopt_foreign(tmp_path)
    assert scanner.reconcile(index, store, lazy=True).added.count == 0  # left to the mount
    report = scanner.reconcile(index, store)
    assert index.unlisted() == [] and report.quarantined.count == 1
    assert report.removed_temp.count == 1
    ops = Operations(index, store, info)
    assert ops.stats.total_files == tree["files"] and ops.stats.used_bytes == tree["bytes"]


def _gate_listing(ops, monkeypatch, suffix: bytes, *, after_read: bool = False):
    """Hold the next full listing of a directory ending in `suffix` until released: before
    it reads the directory, or `after_read`; returns the (holding, release) events."""
    holding, release = threading.Event(), threading.Event()
    prepare = ops.adoption.reconciler.prepare

    def held_prepare(drel, names=None, temp_before_ns=None):
        held = names is None and drel.endswith(suffix)
        if held and not after_read:
            holding.set()
            assert release.wait(10)
        out = prepare(drel, names, temp_before_ns)
        if held and after_read:
            holding.set()
            assert release.wait(10)
        return out

    monkeypatch.setattr(ops.adoption.reconciler, "prepare", held_prepare)
    return holding, release


async def _until(event: threading.Event) -> None:
    with trio.fail_after(5):
        while not event.is_set():
            await trio.sleep(0.01)


def test_changes_wait_for_a_listing_under_way_and_usage_stays_true(adopted, monkeypatch):
    """A create, an unlink and a rename in a directory being listed wait for the listing
    (never two writers of one directory's rows); an entry that a lookup indexed and that
    then left the backing tree behind kvfs's back is dropped by the listing, and the usage
    is counted again."""
    ops, tree = adopted
    ops.adoption.LIST_CHUNK = 5
    reading, release = _gate_listing(ops, monkeypatch, b"/c")
    changed = trio.Event()

    async def go():
        t = ops.index.lookup(ROOT_INODE, b"acme")
        a = await ops.lookup(t.inode, b"a", ROOT)
        b = await ops.lookup(a.st_ino, b"b", ROOT)
        c = (await ops.lookup(b.st_ino, b"c", ROOT)).st_ino
        await ops.lookup(c, b"f10", ROOT)
        os.unlink(ops.store.path(b"acme/a/b/c/f10"))  # behind kvfs's back
        assert ops.stats.total_files == 1

        async def change():
            fi, _ = await ops.create(c, b"new", 0o644, os.O_WRONLY, ROOT)
            await ops.write(fi.fh, 0, b"12345")
            await ops.release(fi.fh)
            await ops.unlink(c, b"f1", ROOT)
            await ops.rename(c, b"f2", c, b"g2", 0, ROOT)
            changed.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ops.adoption.ensure_listed, c)
            await _until(reading)
            nursery.start_soon(change)
            await trio.sleep(0.2)
            assert not changed.is_set() and c in ops.adoption.unlisted  # waiting for the listing
            release.set()
        names = {n.name for n in ops.index.children(c)}
        assert len(names) == 49 and {b"new", b"g2"} <= names
        assert not {b"f1", b"f2", b"f10"} & names
        assert ops.stats.total_files == 49
        assert ops.stats.used_bytes == sum(range(50)) - 10 - 1 + 5

    run(go)


def test_a_lookup_is_not_held_up_by_a_listing_still_reading(adopted, monkeypatch):
    """While a listing reads a big directory, lookups in it index their one name and return;
    the listing then finds those entries known (no duplicate, usage counted once)."""
    ops, tree = adopted
    reading, release = _gate_listing(ops, monkeypatch, b"/c")

    async def go():
        t = ops.index.lookup(ROOT_INODE, b"acme")
        a = await ops.lookup(t.inode, b"a", ROOT)
        b = await ops.lookup(a.st_ino, b"b", ROOT)
        c = (await ops.lookup(b.st_ino, b"c", ROOT)).st_ino
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ops.adoption.ensure_listed, c)
            await _until(reading)
            with trio.fail_after(5):  # (it used to wait for the whole listing)
                f7 = await ops.lookup(c, b"f7", ROOT)
            assert f7.st_size == 7 and c in ops.adoption.unlisted
            release.set()
        assert c not in ops.adoption.unlisted and len(ops.index.children(c)) == 50
        assert ops.stats.total_files == 50 and ops.stats.used_bytes == sum(range(50))

    run(go)


def test_a_fetch_into_a_directory_being_listed_waits_for_the_listing(tmp_path, monkeypatch):
    """A lookup that fetches a block from a lower tier changes its directory: in a directory
    being listed it waits, so that the listing (which read the directory before the block
    arrived) does not drop the fetched block's entry as gone."""
    from kvfs.daemon.tiers import DirTier
    from kvfs.daemon.tiers.mover import Tiering
    from kvfs.format import blockfile, hashing

    backing = tmp_path / "backing"
    (backing / ".kvfs").mkdir(parents=True)
    ns_rel = "acme/llama@0123456789abcdef"
    h = hashing.block_hashes([7] * 16, 16)[0]
    data = blockfile.encode(block_hash=h, parent_hash=hashing.ROOT_PARENT,
                            fingerprint=bytes(16), token_count=16, dtype="uint8",
                            shape=(100,), payload=bytes(100))
    fan = h[:1].hex()
    (backing / ns_rel / fan).mkdir(parents=True)
    (backing / ns_rel / fan / "other").write_bytes(b"x")
    cold = tmp_path / "cold" / ns_rel / fan
    cold.mkdir(parents=True)
    (cold / hashing.block_filename(h)).write_bytes(data)
    index = Index(str(backing / ".kvfs" / "index.db"))
    store = BackingStore(str(backing))
    scanner.adopt(index, store)


    async def go():
        tiering = Tiering([DirTier(str(tmp_path / "cold"))], trio.CapacityLimiter(4))
        ops = Operations(index, store, MountInfo(str(tmp_path / "mnt"), str(backing),
                                                 capacity=None), tiering=tiering)
        reading, release = _gate_listing(ops, monkeypatch, fan.encode(), after_read=True)
        t = ops.index.lookup(ROOT_INODE, b"acme")
        ns = await ops.lookup(t.inode, b"llama@0123456789abcdef", ROOT)
        f = (await ops.lookup(ns.st_ino, fan.encode(), ROOT)).st_ino
        got = []

        async def fetch():
            got.append(await ops.lookup(f, hashing.block_filename(h).encode(), ROOT))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ops.adoption.ensure_listed, f)
            await _until(reading)  # the listing has read the directory: no block there yet
            nursery.start_soon(fetch)
            await trio.sleep(0.3)
            release.set()
        node = ops.index.find(got[0].st_ino)
        assert node is not None and node.block_hash == h  # still indexed
        assert {n.name for n in ops.index.children(f)} == {
            b"other", hashing.block_filename(h).encode()}
        assert ops.stats.total_files == 2
        tiering.close()

    run(go)
    index.close()


def test_eviction_in_a_directory_being_listed_waits_for_the_listing(adopted, monkeypatch):
    """Eviction removes files: in a directory being listed it waits, so that the listing
    (which read the directory while the files were there) does not index them again."""
    ops, tree = adopted
    reading, release = _gate_listing(ops, monkeypatch, b"/c", after_read=True)

    async def go():
        t = ops.index.lookup(ROOT_INODE, b"acme")
        a = await ops.lookup(t.inode, b"a", ROOT)
        b = await ops.lookup(a.st_ino, b"b", ROOT)
        c = (await ops.lookup(b.st_ino, b"c", ROOT)).st_ino
        for k in (40, 41):
            await ops.lookup(c, b"f%d" % k, ROOT)
        freed = []

        async def evict():
            freed.append(await ops.reclaim.evict(1, t.inode))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ops.adoption.ensure_listed, c)
            await _until(reading)
            nursery.start_soon(evict)
            await trio.sleep(0.3)
            release.set()
        assert freed and freed[0] > 0
        names = {n.name for n in ops.index.children(c)}
        on_disk = set(os.listdir(ops.store.path(b"acme/a/b/c")))
        assert names == on_disk and len(names) < 50  # nothing evicted is indexed again
        assert ops.stats.total_files == len(names)

    run(go)


def test_a_listing_leaves_a_file_being_written_alone(adopted):
    """A block file open for writing through the mount when its directory is listed (its
    size and header on disk are mid-change): the listing leaves it as the daemon knows it,
    never refreshed from what it read, never quarantined."""
    from kvfs.format import hashing

    ops, tree = adopted
    h, path = tree["blocks"][0]

    async def go():
        t = ops.index.lookup(ROOT_INODE, b"acme")
        ns = await ops.lookup(t.inode, b"llama@0123456789abcdef", ROOT)
        fan = (await ops.lookup(ns.st_ino, hashing.hash_hex(h)[:2].encode(), ROOT)).st_ino
        f = await ops.lookup(fan, path.name.encode(), ROOT)
        size = f.st_size
        fi = await ops.open(f.st_ino, os.O_WRONLY, ROOT)
        await ops.write(fi.fh, 0, b"\0" * 16)  # the header, mid-rewrite
        await ops.write(fi.fh, size, b"more")
        await ops.adoption.ensure_listed(fan)
        assert ops.index.get(f.st_ino).parent == fan  # still there, not quarantined
        await ops.release(fi.fh)
        assert path.exists() and path.stat().st_size == size + 4
        assert ops.index.get(f.st_ino).size == size + 4

    run(go)


def test_the_index_checkpoints_in_a_thread_not_in_the_commits(tmp_path):
    """The index's write-ahead log is copied into the database by `Index.checkpoint` (the
    background's thread), not by the commit that passes SQLite's default 1,000 pages (on the
    event loop): commits let the log grow past that; a checkpoint in another thread takes it
    all and lets the next commit start it over; the backstop still bounds a log that no
    checkpoint reaches."""
    path = str(tmp_path / "index.db")
    index = Index(path)
    wal = path + "-wal"

    def checkpoint() -> tuple[int, int]:
        out: list[tuple[int, int]] = []
        t = threading.Thread(target=lambda: out.append(index.checkpoint()))
        t.start()
        t.join()
        return out[0]

    try:
        for i in range(3000):  # about 2 log pages each
            index.set_meta(f"k{i}", "v" * 100)
        log, done = checkpoint()
        assert log > 1000 and done == log, (log, done)  # no commit checkpointed on its own
        index.set_meta("after", "1")
        assert checkpoint()[0] <= 4  # the log started over: only the commit since
        for i in range(3 * WAL_BACKSTOP_PAGES // 2):  # no checkpoint at all: the backstop
            index.set_meta(f"j{i}", "v" * 100)
        assert checkpoint()[0] < WAL_BACKSTOP_PAGES
    finally:
        index.close()
    assert not os.path.exists(wal)  # closed cleanly: the log folded in
