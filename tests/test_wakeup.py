"""The host's FUSE wake-ups (kvfs.daemon.wakeup): a mount turns the `fuse` module's
`wake_here` parameter on, or off, or leaves it, as `--wake-here` asks, says so in
stats.json and `kvfs status`, and goes on where the host refuses."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from kvfs.daemon import wakeup

from .conftest import kvfs


def test_apply_sets_reads_and_says_what_it_did(tmp_path):
    param = str(tmp_path / "wake_here")
    with open(param, "w") as f:
        f.write("N\n")
    assert wakeup.read(param) == "off"
    assert wakeup.apply("keep", param) == "left off (--wake-here keep)"
    assert wakeup.apply("on", param) == "turned on by this mount"
    assert wakeup.read(param) == "on" and open(param).read() == "Y"
    assert wakeup.apply("on", param) == "left on (--wake-here on)"
    assert wakeup.apply("off", param) == "turned off by this mount"
    assert wakeup.snapshot("x", param) == {"wake_here": "off", "mount": "x"}
    missing = str(tmp_path / "none")
    assert wakeup.read(missing) is None
    assert wakeup.apply("on", missing) == "this kernel has no fuse.wake_here parameter"
    assert not os.path.exists(missing)  # nothing made where the kernel has nothing


def test_a_refused_write_leaves_the_parameter_and_says_why(tmp_path):
    """A parameter the host will not let the daemon change (here: on a read-only bind
    mount, EROFS) stays as it was, and the mount is told why."""
    if os.geteuid() != 0:
        pytest.skip("a read-only bind mount needs root")
    src, ro = tmp_path / "src", tmp_path / "ro"
    src.mkdir()
    ro.mkdir()
    (src / "wake_here").write_text("N\n")
    if subprocess.run(["mount", "--bind", str(src), str(ro)]).returncode != 0:
        pytest.skip("cannot bind-mount here")
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(ro)], check=True)
        got = wakeup.apply("on", str(ro / "wake_here"))
        assert got.startswith("left off: turning it on was refused ("), got
        assert wakeup.read(str(ro / "wake_here")) == "off"
    finally:
        subprocess.run(["umount", str(ro)], check=True)


def test_a_mount_sets_the_hosts_wake_ups_as_asked_and_says_so(mount_factory):
    before = wakeup.read()
    if before is None:
        pytest.skip("this kernel's fuse module has no wake_here parameter")
    try:
        with open(wakeup.PARAM, "w") as f:
            f.write("N")
        on = mount_factory("on")  # the default: on
        assert wakeup.read() == "on"
        with open(os.path.join(on.mnt, ".kvfs", "stats.json")) as f:
            assert json.load(f)["fuse_wake"] == {"wake_here": "on",
                                                 "mount": "turned on by this mount"}
        assert ("FUSE wake-ups: on the caller's CPU (fuse.wake_here on: turned on by this "
                "mount)") in kvfs("status", str(on.mnt)).stdout
        on.stop()
        assert wakeup.read() == "on"  # host-wide: not turned back at unmount

        off = mount_factory("off", ["--wake-here", "off"])
        assert wakeup.read() == "off"
        off.stop()
        keep = mount_factory("keep", ["--wake-here", "keep"])
        assert wakeup.read() == "off"
        text = kvfs("status", str(keep.mnt)).stdout
        assert "FUSE wake-ups: on another CPU" in text and "--wake-here on" in text
        assert "left off (--wake-here keep)" in text
        # The mount works either way: a file through it.
        tenant = keep.add_tenant("t")
        (tenant / "m").mkdir()
        (tenant / "m" / "f").write_bytes(b"x" * 4096)
        assert (tenant / "m" / "f").read_bytes() == b"x" * 4096
    finally:
        with open(wakeup.PARAM, "w") as f:
            f.write("Y" if before == "on" else "N")
