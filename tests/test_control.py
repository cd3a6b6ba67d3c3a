"""The control protocol's payloads."""

from __future__ import annotations

import struct

import pytest

from kvfs.format import control


def test_access_round_trip_and_older_clients():
    a = control.Access(1, 2, 3, 4, 5, 6, 7, (b"x" * 16, b"y" * 16))
    assert control.Access.unpack(a.pack()) == a
    v1 = struct.pack("<4sIIIQQQ", b"KVA1", 1, 2, 3, 4, 5, 6) + b"z" * 16
    assert control.Access.unpack(v1) == control.Access(1, 2, 3, 4, 5, 6, 0, (b"z" * 16,))
    for bad in (b"", b"KVA2", b"KVA9" + bytes(60), a.pack() + b"\0"):
        with pytest.raises(control.ControlError):
            control.Access.unpack(bad)


def test_hash_lists():
    hashes = [bytes([i]) * 16 for i in range(5)]
    assert control.unpack_hashes(control.pack_hashes(hashes)) == hashes
    with pytest.raises(control.ControlError):
        control.unpack_hashes(b"x" * 17)
    with pytest.raises(control.ControlError):
        control.pack_hashes([b"short"])
    with pytest.raises(control.ControlError):
        control.pack_hashes([b"x" * 16] * (control.MAX_HASHES + 1))
    assert len(control.pack_hashes([b"x" * 16] * control.MAX_HASHES)) <= control.XATTR_MAX


def test_fetch_with_and_without_a_budget():
    hashes = [bytes([i]) * 16 for i in range(3)]
    assert control.unpack_fetch(control.pack_fetch(hashes)) == (hashes, None)
    assert control.unpack_fetch(control.pack_fetch(hashes, 0.25)) == (hashes, 0.25)
    # A plain list whose first hash starts with the magic is still a plain list.
    odd = [control.FETCH_MAGIC + bytes(12)] + hashes
    assert control.unpack_fetch(control.pack_fetch(odd)) == (odd, None)
    full = [b"x" * 16] * control.MAX_HASHES
    assert len(control.pack_fetch(full, 1.0)) <= control.XATTR_MAX
    for bad in (-1, 5e6):
        with pytest.raises(control.ControlError):
            control.pack_fetch(hashes, bad)
    with pytest.raises(control.ControlError):
        control.unpack_fetch(control.FETCH_MAGIC + bytes(5))
