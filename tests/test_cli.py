"""The command line: clear errors with documented exit codes, config files."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvfs.format.config import ConfigError, parse_size

from .conftest import KVFS, force_unmount, fuse_available, kvfs


def test_parse_size():
    assert parse_size("4096") == 4096
    assert parse_size("1G") == 1 << 30
    assert parse_size("1.5TiB") == 3 << 39
    assert parse_size("10 MB") == 10 << 20
    for bad in ("", "ten", "-1G", "5X", "8192P", "9" * 400, 2**63, -1):
        with pytest.raises(ConfigError):
            parse_size(bad)
    assert parse_size(2**63 - 1) == 2**63 - 1
    from kvfs.daemon.capacity import MAX_DURATION, parse_duration
    assert parse_duration("7d") == 7 * 86400 and parse_duration(str(MAX_DURATION)) > 0
    for bad in ("soon", "-1", "5300w", "18446744073709551616"):
        with pytest.raises(ConfigError):
            parse_duration(bad)


def test_bad_config_is_refused_with_key(tmp_path):
    conf = tmp_path / "k.toml"
    conf.write_text('backing = "/x"\nmountpoint = "/y"\ncapacty = "1G"\n')
    res = kvfs("mount", "--config", str(conf), check=False)
    assert res.returncode == 2 and "unknown key 'capacty'" in res.stderr
    conf.write_text('capacity = "lots"\n')
    res = kvfs("mount", "--config", str(conf), check=False)
    assert res.returncode == 2 and "not a size" in res.stderr
    conf.write_text("capacity = [1\n")
    res = kvfs("mount", "--config", str(conf), check=False)
    assert res.returncode == 2 and "not valid TOML" in res.stderr
    # A bad value names the file and the key, before anything is mounted.
    conf.write_text(f'backing = "{tmp_path}"\nmountpoint = "{tmp_path}"\nscan_interval = 0\n')
    res = kvfs("mount", "--config", str(conf), check=False)
    assert res.returncode == 2 and f"config {conf}: scan_interval must be positive" in res.stderr


def test_mount_errors_are_one_clear_line(tmp_path):
    res = kvfs("mount", str(tmp_path / "nope"), str(tmp_path), check=False)
    assert res.returncode == 1 and "does not exist" in res.stderr
    assert "Traceback" not in res.stderr
    res = kvfs("status", str(tmp_path), check=False)
    assert res.returncode == 3 and "not mounted" in res.stderr
    res = kvfs("umount", str(tmp_path), check=False)
    assert res.returncode == 3
    res = kvfs("fsck", str(tmp_path / "nope"), check=False)
    assert res.returncode == 1 and res.stderr == (
        f"kvfs: backing directory {tmp_path / 'nope'} does not exist\n")
    res = kvfs("warm", str(tmp_path / "nope"), check=False)
    assert res.returncode == 1 and "is not a directory" in res.stderr
    (tmp_path / "file").write_bytes(b"")
    # What the system refuses is one line naming the path, not a traceback.
    res = kvfs("bench", "door", "--dir", str(tmp_path / "file" / "x"), check=False)
    assert res.returncode == 1 and res.stderr == f"kvfs: Not a directory: {tmp_path}/file/x\n"
    res = kvfs("demo", str(tmp_path / "file" / "demo"), check=False)
    assert res.returncode == 1 and res.stderr == (
        f"kvfs demo: cannot make {tmp_path / 'file' / 'demo'}: Not a directory\n")


def test_mount_from_config_and_second_daemon_refused(mount_factory, tmp_path):
    m = mount_factory(start=False)
    conf = tmp_path / "k.toml"
    conf.write_text(f'backing = "{m.backing}"\nmountpoint = "{m.mnt}"\ncapacity = "2G"\n'
                    f'log = "{m.log}"\n')
    kvfs("mount", "--config", str(conf))
    assert os.path.ismount(m.mnt)
    assert m.stats()["capacity_bytes"] == 2 << 30
    other = tmp_path / "other"
    other.mkdir()
    res = kvfs("mount", str(m.backing), str(other), check=False)
    assert res.returncode == 1 and "in use by another kvfs process" in res.stderr
    res = kvfs("mount", str(m.backing), str(m.mnt), check=False)
    assert res.returncode == 1 and "already a mount point" in res.stderr
    # Through a path whose parent is a link (the mount table has the resolved one).
    (tmp_path / "link").symlink_to(m.mnt.parent)
    assert kvfs("status", str(tmp_path / "link" / m.mnt.name)).stdout.startswith("kvfs ")
    # A process inside the mount keeps it busy: said, with how to find it; still mounted.
    holder = subprocess.Popen(["sleep", "30"], cwd=m.mnt)
    try:
        res = kvfs("umount", str(m.mnt), check=False)
        assert res.returncode == 1 and "Device or resource busy" in res.stderr
        assert f"(fuser -vm {m.mnt} names it)" in res.stderr and os.path.ismount(m.mnt)
    finally:
        holder.kill()
        holder.wait()
    kvfs("umount", str(m.mnt))
    assert not os.path.ismount(m.mnt)


def test_python_m_kvfs_cli_is_the_kvfs_program():
    """The daemon and the tests start `python -m kvfs.cli`; a benchmark record names that
    entry point `kvfs`, as the console script."""
    from kvfs.bench.common import portable
    from kvfs.bench.report import command_line

    res = subprocess.run([sys.executable, "-m", "kvfs.cli", "--version"], capture_output=True,
                         text=True, check=True)
    assert res.stdout.startswith("kvfs ")
    argv0 = os.path.join(os.path.dirname(__import__("kvfs.cli").cli.__file__), "__main__.py")
    assert portable([argv0, "bench", "trace"]) == ["kvfs", "bench", "trace"]
    assert command_line([argv0, "bench", "trace"]) == "kvfs bench trace"


@contextlib.contextmanager
def _demo_mount(base: Path) -> Iterator[Path]:
    """`kvfs demo`'s mount under `base`, unmounted (by force if need be) at the end, its
    daemon's log checked for tracebacks."""
    why = fuse_available()
    if why:
        pytest.skip(why)
    mnt = base / "mnt"
    try:
        yield mnt
    finally:
        if os.path.ismount(mnt):
            kvfs("umount", str(mnt), check=False)
        if os.path.ismount(mnt):
            force_unmount(mnt)
        log = base / "backing" / ".kvfs" / "daemon.log"
        assert "Traceback" not in (log.read_text() if log.exists() else "")


def test_the_readmes_first_command_runs_the_demo(tmp_path):
    """`kvfs demo` (what tools/quickstart.sh runs): a mount over the default backing
    directory, a model's conversation saved through it and taken up by a second process
    whose tokens match a full recompute, and what an operator sees (ls, du, df, getfattr,
    kvfs status). Run again, it mounts the same directory afresh and finds every block."""
    with _demo_mount(tmp_path / "demo") as mnt:
        out = kvfs("demo", str(mnt.parent), timeout=600).stdout
        ns = mnt / "demo" / "kvfs--models--tinylm@551daff0e4a5063d"
        assert "restored KV equals the recomputed KV bit for bit: yes" in out, out
        assert "identical: yes (against the full recompute in process 1)" in out, out
        saved = re.findall(r"saved (\d+) blocks \((\d+) new\)", out)
        assert [int(n) for n, _ in saved] == [74, 88, 101], out
        assert re.search(rf"^\S+\t{re.escape(str(mnt / 'demo'))}$", out, re.M), out  # du -sh
        assert re.search(r"^-rw-r--r-- 1 \S+ \S+ 69632 .* [0-9a-f]{32}\.kv$", out, re.M), out
        assert 'user.kvfs.tier="hot"' in out and "tenant demo" in out, out
        assert os.path.ismount(mnt) and len(list(ns.glob("*/*.kv"))) == 101
        again = kvfs("demo", str(mnt.parent), timeout=600).stdout
        assert f"kvfs: unmounted {mnt}" in again, again
        assert re.findall(r"saved \d+ blocks \((\d+) new\)", again) == ["0", "0", "0"], again
        assert "identical: yes" in again, again


def test_the_demo_without_torch_writes_synthetic_blocks(tmp_path):
    """Where torch is not installed, the demo still mounts and writes real block files
    through the mount, as an engine's file backend would, and shows them."""
    with _demo_mount(tmp_path / "demo") as mnt:
        code = ("import sys; sys.modules['torch'] = None; from kvfs.cli import main; "
                f"sys.argv = ['kvfs', 'demo', {str(mnt.parent)!r}]; sys.exit(main())")
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=300)
        assert res.returncode == 0, res.stdout + res.stderr
        assert "torch is not installed" in res.stdout
        assert "wrote 10 + 7 blocks of 16 tokens (4 shared by both conversations)" in res.stdout
        assert re.search(rf"^\S+\t{re.escape(str(mnt / 'demo'))}$", res.stdout, re.M)
        assert "Traceback" not in res.stderr
        ns = next((mnt / "demo").glob("*@*"))
        assert len(list(ns.glob("*/*.kv"))) == 13  # 10 + 7, the 4 shared written once
        assert json.loads(kvfs("status", str(mnt), "--json").stdout)["files"] == 14
        # Its output read by a reader that went away (`kvfs status | head`): 141, as other
        # tools killed by SIGPIPE, and no traceback.
        r, w = os.pipe()
        os.close(r)
        try:
            res = subprocess.run([*KVFS, "status", "--json", str(mnt)], stdout=w,
                                 stderr=subprocess.PIPE, text=True, timeout=60)
        finally:
            os.close(w)
        assert res.returncode == 141 and res.stderr == "", res.stderr


def test_tenant_commands_refuse_bad_input_and_change_nothing(mount):
    """A tenant name that is a path (`../x`, `a/b`), a dot name, a negative uid or a bad
    mode is refused before anything is made (exit 2), and never reaches outside the mount; a
    tenant whose limit the daemon refuses is not left behind; `tenant set` with one bad
    limit puts back the ones it set before it."""
    mnt = str(mount.mnt)
    outside = mount.mnt.parent / "x"
    for name in ("../x", "a/b", ".kvfs", "..", "", "@a", "x" * 65):
        res = kvfs("tenant", "add", mnt, name, "--uid", "1", "--gid", "1", check=False)
        assert res.returncode == 2 and "is not a tenant name" in res.stderr, (name, res.stderr)
        res = kvfs("tenant", "set", mnt, name, "--quota", "1G", check=False)
        assert res.returncode == 2 and "is not a tenant name" in res.stderr, (name, res.stderr)
    assert not outside.exists()
    for bad, why in ((["--uid", "-5", "--gid", "1"], "--uid -5 is not a uid"),
                     (["--uid", "1", "--gid", str(2**32)], f"--gid {2**32} is not a gid"),
                     (["--uid", "1", "--gid", "1", "--mode", "999"], "not an octal mode")):
        res = kvfs("tenant", "add", mnt, "t", *bad, check=False)
        assert res.returncode == 2 and why in res.stderr and "Traceback" not in res.stderr
    res = kvfs("tenant", "add", mnt, "t", "--uid", "1001", "--gid", "1001", "--quota", "lots",
               check=False)
    assert res.returncode == 1 and "cannot set quota=lots" in res.stderr
    assert os.listdir(mnt) == [".kvfs"]  # nothing left behind
    out = kvfs("tenant", "add", mnt, "t", "--uid", "1001", "--gid", "1001", "--quota", "2G",
               "--max-idle", "1h").stdout
    assert out.splitlines()[0].startswith("kvfs: tenant t (uid 1001, gid 1001, mode 0700)")
    assert os.stat(mount.mnt / "t").st_uid == 1001
    res = kvfs("tenant", "set", mnt, "t", "--quota", "3G", "--max-age", "soon", check=False)
    assert res.returncode == 1 and "cannot set max_age=soon" in res.stderr
    assert os.getxattr(mount.mnt / "t", "user.kvfs.quota") == b"2147483648"  # put back
    assert kvfs("tenant", "set", mnt, "t", "--quota", "3G").stdout == (
        "kvfs: t: quota = 3221225472\n")


def test_mount_refuses_directories_that_overlap(tmp_path):
    """A backing directory that is the mount point, holds it or lies inside it (and a
    directory tier inside the mount point or the backing directory) would have the daemon
    read its own mount and hang: refused before anything is made or mounted."""
    why = fuse_available()
    if why:
        pytest.skip(why)
    b, m = tmp_path / "b", tmp_path / "m"
    b.mkdir()
    m.mkdir()
    (b / "sub").mkdir()
    cases = [
        ((b, b), "overlap (one is the other or inside it): the daemon would read its own mount"),
        ((b, tmp_path), "the daemon would read its own mount"),
        ((b, b / "sub"), "the daemon would read its own mount"),
        ((b, m, "--cold", f"dir://{m}/cold"), f"the cold tier's directory {m}/cold and the "
                                              f"mount point {m} overlap"),
        ((b, m, "--cold", f"dir://{b}/cold"), f"the cold tier's directory {b}/cold and the "
                                              f"backing directory {b} overlap"),
        ((b, m, "--shared", f"eu=dir://{tmp_path}"), f"the eu tier's directory {tmp_path} and "
                                                     f"the mount point {m} overlap"),
    ]
    for args, why in cases:
        res = kvfs("mount", *map(str, args), check=False, timeout=60)
        assert res.returncode == 1 and why in res.stderr, (args, res.stderr)
        assert not any(os.path.ismount(p) for p in (b, m, tmp_path, b / "sub"))
    assert sorted(os.listdir(b)) == [".kvfs", "sub"] and os.listdir(m) == []
    # Logs that cannot be written: one line each, nothing mounted.
    nowhere = b / "sub" / "f" / "x.log"  # below a file
    (b / "sub" / "f").write_bytes(b"")
    for args, why in ((("--audit", nowhere), f"cannot open the audit log {nowhere}"),
                      (("--log", nowhere), f"cannot write the log {nowhere}"),
                      (("--foreground", "--log", nowhere), f"cannot write the log {nowhere}")):
        res = kvfs("mount", str(b), str(m), *map(str, args), check=False, timeout=60)
        assert res.returncode == 1 and why in res.stderr and "Traceback" not in res.stderr, (
            args, res.stderr)
        assert not os.path.ismount(m)


def _in_mountinfo(path: Path) -> bool:
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == str(path) for line in f)


def test_a_daemon_that_does_not_answer_is_said_and_force_unmounted(mount):
    """A stopped (or hung) daemon: `kvfs status` says so after its deadline instead of
    waiting for ever, `kvfs umount` refuses and names `--force`, which aborts the connection
    and unmounts; the daemon, run again, exits, and the next mount serves the files."""
    (mount.mnt / "t").mkdir()
    (mount.mnt / "t" / "f").write_bytes(b"kept")
    pid = mount.pid()
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        res = kvfs("status", str(mount.mnt), check=False, timeout=60)
        assert res.returncode == 1 and "does not answer after 10 s" in res.stderr, res.stderr
        assert time.monotonic() - t0 < 30
        res = kvfs("umount", str(mount.mnt), check=False, timeout=60)
        assert res.returncode == 1 and f"kvfs umount --force {mount.mnt}" in res.stderr
        assert res.stdout == "" and _in_mountinfo(mount.mnt)  # (a stat would wait)
        out = kvfs("umount", "--force", str(mount.mnt), timeout=60).stdout
        assert out == f"kvfs: unmounted {mount.mnt}\n" and not _in_mountinfo(mount.mnt)
    finally:
        os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{pid}")
    mount.start()
    assert (mount.mnt / "t" / "f").read_bytes() == b"kept"
