"""Tests for kvfs.format.blockfile: round trips, every rejection reason, and bit-flip detection."""

from __future__ import annotations

import dataclasses
import struct
from array import array

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfs.format import blockfile as bf
from kvfs.format.blockfile import ALIGN, HEADER_SIZE, BlockFormatError, BlockMismatchError

BH, PH, FP = bytes(range(16)), bytes(16), bytes.fromhex("d63a9e59af86df24757cd7b66c825fbc")
ARGS = dict(
    block_hash=BH, parent_hash=PH, fingerprint=FP, token_count=4, dtype="float16", shape=(2, 3)
)
PAYLOAD = bytes(range(12))
GOOD = bf.encode(**ARGS, payload=PAYLOAD)

# Pinned: the first 176 bytes of GOOD (the rest of the 4096-byte header is zero).
V_HEADER = (
    "4b564653424c4b000100000000100000000102030405060708090a0b0c0d0e0f"
    "00000000000000000000000000000000d63a9e59af86df24757cd7b66c825fbc"
    "0400000002000000666c6f617431360000000000000000000200000000000000"
    "0300000000000000000000000000000000000000000000000000000000000000"
    "0000000000000000000000000000000000000000000000000c00000000000000"
    "4b89101c516ace5aca8e7c76da026184"
)


def expect(reason: str, data: bytes | bytearray) -> BlockFormatError:
    with pytest.raises(BlockFormatError) as ei:
        bf.decode(data)
    assert ei.value.reason == reason, str(ei.value)
    return ei.value


def patch(data: bytes, off: int, new: bytes, *, fix_header: bool = True) -> bytearray:
    """Overwrite bytes at ``off``; optionally recompute the header checksum afterwards."""
    buf = bytearray(data)
    buf[off : off + len(new)] = new
    if fix_header:
        buf[168:176] = bytes(8)
        buf[168:176] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(buf[:HEADER_SIZE])))
    return buf


def test_layout_and_vector() -> None:
    assert len(GOOD) == 2 * ALIGN and len(GOOD) % ALIGN == 0
    assert GOOD[:176].hex() == V_HEADER
    assert GOOD[176:HEADER_SIZE] == bytes(HEADER_SIZE - 176)
    assert GOOD[HEADER_SIZE : HEADER_SIZE + 12] == PAYLOAD
    assert GOOD[HEADER_SIZE + 12 :] == bytes(ALIGN - 12)
    assert struct.unpack_from("<Q", GOOD, 160)[0] == xxhash.xxh3_64_intdigest(PAYLOAD)


def test_round_trip() -> None:
    h, payload = bf.decode(GOOD)
    assert bytes(payload) == PAYLOAD
    assert h == bf.make_header(**ARGS, payload=PAYLOAD)
    assert (h.block_hash, h.parent_hash, h.fingerprint) == (BH, PH, FP)
    assert (h.token_count, h.dtype, h.shape, h.payload_len) == (4, "float16", (2, 3), 12)
    assert h.file_size == len(GOOD)
    assert bf.decode_header(GOOD[:HEADER_SIZE]) == h
    assert bf.decode_header(memoryview(GOOD)) == h
    assert bf.encode_header(h) == GOOD[:HEADER_SIZE]


def test_encode_parts_and_buffers() -> None:
    payload = array("H", range(6))  # a non-byte buffer is viewed as its raw bytes
    head, body, pad = bf.encode_parts(**ARGS, payload=payload)
    assert len(head) == HEADER_SIZE and body.nbytes == 12 and len(pad) == ALIGN - 12
    assert bf.encode(**ARGS, payload=payload) == head + bytes(body) + pad
    assert bytes(bf.decode(bytearray(head + bytes(body) + pad))[1]) == payload.tobytes()


@pytest.mark.parametrize(
    ("n", "padded"), [(1, 4096), (4095, 4096), (4096, 4096), (4097, 8192), (0, 0)]
)
def test_padded_size(n: int, padded: int) -> None:
    assert bf.padded_size(n) == padded


def test_exact_multiple_has_no_padding() -> None:
    data = bf.encode(**{**ARGS, "shape": (4, 512)}, payload=bytes(4096))
    assert len(data) == HEADER_SIZE + 4096
    assert bf.decode(data)[0].file_size == len(data)


@given(
    st.sampled_from(sorted(bf.DTYPE_SIZES)),
    st.lists(st.integers(1, 5), min_size=1, max_size=8),
    st.integers(0, 2**32 - 1),
    st.data(),
)
def test_round_trip_property(dtype: str, shape: list[int], tokens: int, data) -> None:
    n = bf.DTYPE_SIZES[dtype]
    for d in shape:
        n *= d
    payload = data.draw(st.binary(min_size=n, max_size=n))
    args = {**ARGS, "dtype": dtype, "shape": shape, "token_count": tokens}
    blob = bf.encode(**args, payload=payload)
    assert len(blob) % ALIGN == 0
    h, got = bf.decode(blob)
    assert bytes(got) == payload and h.shape == tuple(shape) and h.token_count == tokens


@settings(max_examples=300)
@given(st.integers(0, len(GOOD) * 8 - 1))
def test_any_bit_flip_is_detected(bit: int) -> None:
    buf = bytearray(GOOD)
    buf[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(BlockFormatError):
        bf.decode(buf)


def test_every_byte_flip_is_detected() -> None:
    buf = bytearray(GOOD)
    for off in range(len(buf)):
        for mask in (0x01, 0x80):
            buf[off] ^= mask
            with pytest.raises(BlockFormatError):
                bf.decode(buf)
            buf[off] ^= mask
    bf.decode(buf)


def test_short() -> None:
    expect("short", GOOD[: HEADER_SIZE - 1])
    expect("short", b"")


def test_magic() -> None:
    expect("magic", patch(GOOD, 0, b"KVFSBLK\x01"))


def test_version() -> None:
    err = expect("version", patch(GOOD, 8, struct.pack("<I", 4)))
    assert "4" in str(err)
    expect("version", patch(GOOD, 8, struct.pack("<I", 0)))
    # Version 3 (encoded) with no encoding fields: no codec 0.
    expect("header", patch(GOOD, 8, struct.pack("<I", 3)))
    # Version 2 (payload sums) with the sums left zero: a wrong version-2 header, never a
    # version-1 one (its sums are checked where a reader checks them).
    with pytest.raises(BlockFormatError, match="checksum"):
        bf.decode(patch(GOOD, 8, struct.pack("<I", 2)), sums=True)


@pytest.mark.parametrize(
    ("off", "new"),
    [
        (12, struct.pack("<I", 8192)),  # header size
        (68, struct.pack("<I", 0)),  # ndim 0
        (68, struct.pack("<I", 9)),  # ndim 9
        (72, b"float4".ljust(16, b"\0")),  # unknown dtype
        (72, b"float16\0x".ljust(16, b"\0")),  # junk after the NUL
        (104, struct.pack("<Q", 1)),  # unused shape dim 2 nonzero
    ],
)
def test_header_sanity(off: int, new: bytes) -> None:
    expect("header", patch(GOOD, off, new))


def test_header_checksum() -> None:
    expect("header-checksum", patch(GOOD, 64, struct.pack("<I", 5), fix_header=False))
    expect("header-checksum", patch(GOOD, 2000, b"\x01", fix_header=False))  # reserved area
    expect("header-checksum", patch(GOOD, 168, bytes(8), fix_header=False))


def test_reserved_must_be_zero() -> None:
    # Even with a correct header checksum: a writer using the reserved area is a newer format.
    expect("header", patch(GOOD, 2000, b"\x01"))


def test_shape_vs_length() -> None:
    err = expect("shape", patch(GOOD, 152, struct.pack("<Q", 100)))
    assert str(err) == (
        "shape: payload length 100 does not match shape (2, 3) of float16 (12 bytes)"
    )
    expect("shape", patch(GOOD, 96, struct.pack("<Q", 0)))  # zero dim


def test_length() -> None:
    err = expect("length", GOOD[:-1])
    assert "8191" in str(err) and "8192" in str(err)
    expect("length", GOOD + bytes(ALIGN))
    expect("length", GOOD[:HEADER_SIZE])


def test_checksum() -> None:
    expect("checksum", patch(GOOD, HEADER_SIZE + 5, b"\xff", fix_header=False))
    expect("checksum", patch(GOOD, 160, struct.pack("<Q", 1)))


def test_padding() -> None:
    expect("padding", patch(GOOD, len(GOOD) - 1, b"\x01", fix_header=False))
    expect("padding", patch(GOOD, HEADER_SIZE + 12, b"\x80", fix_header=False))


def test_verify_helpers() -> None:
    h = bf.decode_header(GOOD)
    bf.verify_payload(h, PAYLOAD)
    bf.verify_file_size(h, 8192)
    bf.verify_padding(h, bytes(ALIGN - 12))
    with pytest.raises(BlockFormatError, match="length"):
        bf.verify_payload(h, PAYLOAD[:-1])
    with pytest.raises(BlockFormatError, match="checksum"):
        bf.verify_payload(h, PAYLOAD[::-1])
    with pytest.raises(BlockFormatError, match="length"):
        bf.verify_file_size(h, 4096)
    with pytest.raises(BlockFormatError, match="padding"):
        bf.verify_padding(h, bytes(10))


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"shape": (2, 4)}, "shape"),
        ({"shape": ()}, "header"),
        ({"shape": (1,) * 9}, "header"),
        ({"shape": (0, 6)}, "shape"),
        ({"dtype": "float4"}, "header"),
        ({"block_hash": bytes(15)}, "header"),
        ({"fingerprint": "x" * 16}, "header"),
        ({"token_count": -1}, "header"),
        ({"token_count": 2**32}, "header"),
    ],
)
def test_encode_rejects(change: dict, reason: str) -> None:
    with pytest.raises(BlockFormatError) as ei:
        bf.encode(**{**ARGS, **change}, payload=PAYLOAD)
    assert ei.value.reason == reason


def test_encode_header_validates() -> None:
    h = bf.decode_header(GOOD)
    with pytest.raises(BlockFormatError, match="shape"):
        bf.encode_header(dataclasses.replace(h, payload_len=13))


def test_check() -> None:
    h = bf.decode_header(GOOD)
    bf.check(h)
    bf.check(h, block_hash=BH, fingerprint=FP, dtype="float16", shape=[2, 3])
    for kw in (
        {"block_hash": PH},
        {"fingerprint": BH},
        {"dtype": "bfloat16"},
        {"shape": (3, 2)},
    ):
        with pytest.raises(BlockMismatchError) as ei:
            bf.check(h, **kw)
        assert ei.value.reason == "mismatch"
        assert isinstance(ei.value, BlockFormatError) and isinstance(ei.value, ValueError)
