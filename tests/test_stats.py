"""Counters and the daemon's own files, as each user sees them: a caller sees the counters of
the tenants whose directory it may enter (root: all), and only root reads the daemon's state
(index, log, audit log)."""

from __future__ import annotations

import errno
import json
import os
import stat

import pytest

from .conftest import in_child, kvfs


def read_stats(mnt) -> dict:
    return json.loads((mnt / ".kvfs" / "stats.json").read_bytes())


def test_stats_show_a_caller_only_the_tenants_it_may_enter(mount_factory, tmp_path):
    m = mount_factory()
    kvfs("tenant", "add", str(m.mnt), "a", "--uid", "1000", "--gid", "1000")
    kvfs("tenant", "add", str(m.mnt), "b", "--uid", "1001", "--gid", "1001")
    kvfs("tenant", "add", str(m.mnt), "shared", "--uid", "1003", "--gid", "2000",
         "--mode", "0750")
    for t, uid, gid in (("a", 1000, 1000), ("b", 1001, 1001), ("shared", 1003, 2000)):
        def save(t=t):
            os.makedirs(f"{m.mnt}/{t}/secret-model@{t}")
            with open(f"{m.mnt}/{t}/secret-model@{t}/blk", "wb") as f:
                f.write(b"x" * 100)
        in_child(uid, gid, save)

    def seen(uid, gid, groups=()):
        return sorted(in_child(uid, gid, lambda: read_stats(m.mnt)["tenants"], groups))

    assert seen(1000, 1000) == ["a"]
    assert seen(1001, 1001) == ["b"]
    assert seen(1002, 1002, (2000,)) == ["shared"]  # by a supplementary group
    assert seen(1004, 1004) == []
    assert sorted(read_stats(m.mnt)["tenants"]) == ["a", "b", "shared"]
    res = kvfs("status", str(m.mnt))
    assert "secret-model@b" in res.stdout and "secret-model@a" in res.stdout


def mode_of(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_daemon_state_is_root_only(mount_factory, tmp_path):
    audit = tmp_path / "audit.log"
    m = mount_factory(extra=["--audit", str(audit)])
    kvfs("tenant", "add", str(m.mnt), "a", "--uid", "1000", "--gid", "1000")
    (m.mnt / "a" / "f").write_bytes(b"x")
    state = m.backing / ".kvfs"

    def check():
        assert mode_of(state) == 0o700
        for name in ("index.db", "lock"):
            assert mode_of(state / name) == 0o600, name
        assert mode_of(m.log) == mode_of(audit) == 0o600
        for path in (state / "index.db", m.log, audit):
            with pytest.raises(OSError) as exc:
                in_child(1000, 1000, lambda p=path: open(p, "rb").read(1) and None)
            assert exc.value.errno == errno.EACCES

    check()
    # A state directory left readable (by an older version, or by hand) is closed again.
    m.stop()
    os.chmod(state, 0o755)
    for path in (state / "index.db", state / "lock", m.log, audit):
        os.chmod(path, 0o644)
    m.start()
    check()


def test_removed_namespaces_keep_their_counters_apart(mount_factory):
    m = mount_factory()
    kvfs("tenant", "add", str(m.mnt), "t", "--uid", "0", "--gid", "0")
    for ns, n in (("one", 3), ("two", 5)):
        (m.mnt / "t" / ns).mkdir()
        for i in range(n):
            (m.mnt / "t" / ns / f"f{i}").write_bytes(b"x" * 10)
        for f in os.listdir(m.mnt / "t" / ns):
            os.unlink(m.mnt / "t" / ns / f)
        os.rmdir(m.mnt / "t" / ns)
    (m.mnt / "t" / "top").write_bytes(b"y" * 7)  # a file above any namespace
    rows = read_stats(m.mnt)["tenants"]["t"]
    assert rows["(removed namespaces)"]["writes"] == 8  # both, added up
    assert rows["(removed namespaces)"]["files"] == 0
    assert rows[""]["writes"] == 1 and rows[""]["bytes"] == 7
