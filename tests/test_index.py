"""Unit tests of kvfs.daemon.index on a real SQLite file: the batched block lookup, and the
`changed` hook every statement that writes a node's row calls first (the request thread is
told to stop answering for that node: kvfs.daemon.passthrough `revoke`)."""

from __future__ import annotations

import stat

import pytest

from kvfs.daemon.index import ROOT_INODE, Index


@pytest.fixture
def index(tmp_path):
    ix = Index(str(tmp_path / "index.db"))
    yield ix
    ix.close()


def _dir(ix: Index, parent: int, name: bytes) -> int:
    return ix.insert(parent=parent, name=name, mode=stat.S_IFDIR | 0o755, uid=0, gid=0).inode


def _file(ix: Index, parent: int, name: bytes) -> int:
    return ix.insert(parent=parent, name=name, mode=stat.S_IFREG | 0o644, uid=0, gid=0).inode


def test_lookup_blocks_finds_each_pair_in_one_query(index):
    ns = _dir(index, _dir(index, ROOT_INODE, b"t"), b"model")
    ab, cd = _dir(index, ns, b"ab"), _dir(index, ns, b"cd")
    f1, f2 = _file(index, ab, b"ab01.kv"), _file(index, cd, b"cd02.kv")
    _file(index, cd, b"ab03.kv")  # a name under the wrong fan-out: not the pair asked for
    got = index.lookup_blocks(ns, [(b"ab", b"ab01.kv"), (b"cd", b"cd02.kv"),
                                   (b"ab", b"ab03.kv"), (b"ef", b"ef04.kv")])
    assert {k: n.inode for k, n in got.items()} == {(b"ab", b"ab01.kv"): f1,
                                                   (b"cd", b"cd02.kv"): f2}
    assert got[(b"ab", b"ab01.kv")].name == b"ab01.kv" and got[(b"ab", b"ab01.kv")].parent == ab
    assert index.lookup_blocks(ns, []) == {}


def test_every_write_of_a_row_tells_changed_first(index):
    d = _dir(index, ROOT_INODE, b"t")
    e = _dir(index, d, b"e")
    f = _file(index, d, b"f")
    told: list[int | None] = []
    index.changed = told.append
    g = _file(index, d, b"g")
    assert told == [d]  # a new entry: its directory's link count and times
    told.clear()
    index.update(f, size=3)
    index.set_times([d], 5)
    index.move(f, e, b"f2")
    index.orphan(g, d)
    assert told == [f, d, f, e, g, d]
    told.clear()
    index.delete(f)
    assert told == [f, e]  # and its directory, found by the statement itself
    told.clear()
    index.update(e)  # nothing to write: nothing said
    assert told == []
    with pytest.raises(RuntimeError), index.transaction():
        index.update(d, size=1)
        raise RuntimeError
    assert told == [d, None]  # rolled back: everything said before is void
