"""In-process tests of the Operations and the index: no mount, handlers called directly."""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
from types import SimpleNamespace

import pyfuse3
import pytest
import trio

from kvfs import fsck
from kvfs.fs import MountInfo, Operations
from kvfs.index import ORPHAN_PARENT, ROOT_INODE, Index
from kvfs.store import BackingStore

ROOT = SimpleNamespace(uid=0, gid=0, pid=1, umask=0o022)
USER = SimpleNamespace(uid=1000, gid=1000, pid=2, umask=0o022)


@pytest.fixture
def ops(tmp_path):
    backing = tmp_path / "backing"
    (backing / ".kvfs").mkdir(parents=True)
    index = Index(str(backing / ".kvfs" / "index.db"))
    store = BackingStore(str(backing))
    fsck.reconcile(index, store)
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


def test_writing_flag_is_persisted_until_last_close(ops):
    ino = make_file(ops)

    async def go():
        a = await ops.open(ino, os.O_WRONLY, ROOT)
        b = await ops.open(ino, os.O_WRONLY, ROOT)
        await ops.write(a.fh, 0, b"xy")
        assert ops.index.get(ino).writing == 1
        assert (await ops.getattr(ino, ROOT)).st_size == 2  # the in-memory size
        await ops.release(a.fh)
        assert ops.index.get(ino).writing == 1
        await ops.release(b.fh)
        assert ops.index.get(ino).writing == 0

    run(go)


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
    ino = make_file(ops, b"x")
    threads = []
    real_open = ops.store.open

    def spy(rel, flags):
        threads.append(threading.current_thread())
        return real_open(rel, flags)

    monkeypatch.setattr(ops.store, "open", spy)

    async def go():
        loop_thread = threading.current_thread()
        fi = await ops.open(ino, os.O_RDONLY, ROOT)
        await ops.release(fi.fh)
        return loop_thread

    loop_thread = run(go)
    assert threads and all(t is not loop_thread for t in threads)


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
    fsck.reconcile(index, store)
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
    report = fsck.reconcile(index, store)
    assert report.changes == 0, report.summary()
    index.close()
