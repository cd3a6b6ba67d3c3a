"""A first real-mount round trip (the full POSIX suite is in test_posix.py)."""

from __future__ import annotations

import os


def test_write_read_through_mount(mount):
    t = mount.mnt / "acme"
    t.mkdir()
    f = t / "model@0123456789abcdef" / "x.bin"
    f.parent.mkdir()
    f.write_bytes(b"x" * 10000)
    assert f.read_bytes() == b"x" * 10000
    assert (mount.backing / "acme" / "model@0123456789abcdef" / "x.bin").read_bytes() == b"x" * 10000
    mount.restart()
    assert f.read_bytes() == b"x" * 10000
    assert os.stat(f).st_size == 10000
