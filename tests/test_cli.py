"""The command line: clear errors with documented exit codes, config files."""

from __future__ import annotations

import os

import pytest

from kvfs.format.config import ConfigError, parse_size

from .conftest import kvfs


def test_parse_size():
    assert parse_size("4096") == 4096
    assert parse_size("1G") == 1 << 30
    assert parse_size("1.5TiB") == 3 << 39
    assert parse_size("10 MB") == 10 << 20
    for bad in ("", "ten", "-1G", "5X"):
        with pytest.raises(ConfigError):
            parse_size(bad)


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


def test_python_m_kvfs_cli_is_the_kvfs_program():
    """The daemon and the tests start `python -m kvfs.cli`; a benchmark record names that
    entry point `kvfs`, as the console script."""
    import subprocess
    import sys

    from kvfs.bench.common import portable
    from kvfs.bench.report import command_line

    res = subprocess.run([sys.executable, "-m", "kvfs.cli", "--version"], capture_output=True,
                         text=True, check=True)
    assert res.stdout.startswith("kvfs ")
    argv0 = os.path.join(os.path.dirname(__import__("kvfs.cli").cli.__file__), "__main__.py")
    assert portable([argv0, "bench", "trace"]) == ["kvfs", "bench", "trace"]
    assert command_line([argv0, "bench", "trace"]) == "kvfs bench trace"
