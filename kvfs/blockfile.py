"""On-disk format of one KV block file: a fixed 4096-byte header, then the payload.

The payload starts at offset 4096 and is zero-padded to a multiple of 4096 so the whole
file can be read with O_DIRECT or GPUDirect Storage. Everything here is pure: bytes in,
bytes out. The byte layout is specified in ``docs/format.md``.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

HEADER_SIZE = 4096
ALIGN = 4096
MAGIC = b"KVFSBLK\x00"
FORMAT_VERSION = 1
MAX_NDIM = 8

DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
    "int32": 4,
    "float64": 8,
}

# magic, version, header size, block hash, parent hash, fingerprint, token count, ndim,
# dtype, shape[8], payload length, payload checksum, header checksum -> 176 bytes.
_HEADER = struct.Struct("<8sII16s16s16sII16s8QQQQ")
_BHASH_OFF, _PHASH_OFF, _FP_OFF, _CSUM_OFF, _HCSUM_OFF = 16, 32, 48, 160, 168
_TAIL = struct.Struct("<QQ")  # payload checksum, header checksum
_ZERO8 = bytes(8)
_RESERVED = bytes(HEADER_SIZE - _HEADER.size)  # after the fields: all zero
_ZERO_TAIL = bytes(HEADER_SIZE - _HCSUM_OFF)  # a zeroed header checksum, then _RESERVED
_U32_MAX = 2**32 - 1
_U64_MAX = 2**64 - 1


class BlockFormatError(ValueError):
    """A block file (or the data meant for one) is malformed.

    ``reason`` is one of "short", "magic", "version", "header", "header-checksum", "shape",
    "length", "checksum", "padding" (and "mismatch" for :class:`BlockMismatchError`).
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


class BlockMismatchError(BlockFormatError):
    """A well-formed block that was written for another hash, model or layout."""

    def __init__(self, message: str) -> None:
        super().__init__("mismatch", message)


@dataclass(frozen=True)
class BlockHeader:
    block_hash: bytes
    parent_hash: bytes
    fingerprint: bytes
    token_count: int
    dtype: str
    shape: tuple[int, ...]
    payload_len: int
    checksum: int

    @property
    def file_size(self) -> int:
        return HEADER_SIZE + padded_size(self.payload_len)


def padded_size(payload_len: int) -> int:
    """``payload_len`` rounded up to a multiple of :data:`ALIGN`."""
    return -(-payload_len // ALIGN) * ALIGN


def payload_checksum(payload: object) -> int:
    """xxh3_64 (seed 0) of the payload bytes."""
    return xxhash.xxh3_64_intdigest(_view(payload))


def _view(data: object) -> memoryview:
    """A flat byte view of any C-contiguous buffer (bytes, bytearray, array, ndarray...)."""
    mv = memoryview(data)  # type: ignore[arg-type]
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def _as_bytes(value: Any) -> Any:
    return bytes(value) if isinstance(value, bytearray | memoryview) else value


def _shape_bytes(dtype: str, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * DTYPE_SIZES[dtype]


def _validate(h: BlockHeader) -> None:
    for name in ("block_hash", "parent_hash", "fingerprint"):
        value = getattr(h, name)
        if not isinstance(value, bytes) or len(value) != 16:
            raise BlockFormatError("header", f"{name} must be 16 bytes, got {value!r}")
    if not isinstance(h.token_count, int) or not 0 <= h.token_count <= _U32_MAX:
        raise BlockFormatError("header", f"token count {h.token_count} out of u32 range")
    if h.dtype not in DTYPE_SIZES:
        raise BlockFormatError("header", f"unknown dtype {h.dtype!r}")
    if not 1 <= len(h.shape) <= MAX_NDIM:
        raise BlockFormatError("header", f"ndim {len(h.shape)} not in 1..{MAX_NDIM}")
    if any(not isinstance(d, int) or not 1 <= d <= _U64_MAX for d in h.shape):
        raise BlockFormatError("shape", f"shape {h.shape} must have positive integer dims")
    expected = _shape_bytes(h.dtype, h.shape)
    if h.payload_len != expected:
        raise BlockFormatError(
            "shape",
            f"payload length {h.payload_len} does not match shape {h.shape} "
            f"of {h.dtype} ({expected} bytes)",
        )
    if not 0 <= h.checksum <= _U64_MAX:
        raise BlockFormatError("header", f"checksum {h.checksum} out of u64 range")


def make_header(
    *,
    block_hash: bytes,
    parent_hash: bytes,
    fingerprint: bytes,
    token_count: int,
    dtype: str,
    shape: Sequence[int],
    payload: object,
) -> BlockHeader:
    """Build (and validate) the header for ``payload``; computes its length and checksum."""
    mv = _view(payload)
    h = BlockHeader(
        block_hash=_as_bytes(block_hash),
        parent_hash=_as_bytes(parent_hash),
        fingerprint=_as_bytes(fingerprint),
        token_count=token_count,
        dtype=dtype,
        shape=tuple(shape),
        payload_len=mv.nbytes,
        checksum=payload_checksum(mv),
    )
    _validate(h)
    return h


def encode_header(h: BlockHeader) -> bytes:
    """The 4096-byte header of ``h``, header checksum included."""
    _validate(h)
    buf = bytearray(HEADER_SIZE)
    _HEADER.pack_into(
        buf, 0, MAGIC, FORMAT_VERSION, HEADER_SIZE, h.block_hash, h.parent_hash,
        h.fingerprint, h.token_count, len(h.shape), h.dtype.encode("ascii"),
        *h.shape, *(0,) * (MAX_NDIM - len(h.shape)), h.payload_len, h.checksum, 0,
    )  # fmt: skip
    struct.pack_into("<Q", buf, _HCSUM_OFF, xxhash.xxh3_64_intdigest(bytes(buf)))
    return bytes(buf)


def _header_checksum(mv: memoryview) -> int:
    """xxh3_64 of the 4096-byte header in ``mv`` with its own checksum field zeroed (no copy)."""
    x = xxhash.xxh3_64()
    x.update(mv[:_HCSUM_OFF])
    x.update(_ZERO8)
    x.update(mv[_HCSUM_OFF + 8:HEADER_SIZE])
    return x.intdigest()


def decode_header(buf: bytes | bytearray | memoryview) -> BlockHeader:
    """Parse and check the header at the start of ``buf`` (at least 4096 bytes)."""
    mv = _view(buf)
    if mv.nbytes < HEADER_SIZE:
        raise BlockFormatError("short", f"{mv.nbytes} bytes, header needs {HEADER_SIZE}")
    vals = _HEADER.unpack_from(mv)
    magic, version, hsize, bhash, phash, fp, tokens, ndim, raw_dtype = vals[:9]
    shape8, (plen, csum, hcsum) = vals[9:17], vals[17:]
    if magic != MAGIC:
        raise BlockFormatError("magic", f"bad magic {magic!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise BlockFormatError("version", f"format version {version}, supported {FORMAT_VERSION}")
    if hsize != HEADER_SIZE:
        raise BlockFormatError("header", f"header size {hsize}, expected {HEADER_SIZE}")
    if not 1 <= ndim <= MAX_NDIM:
        raise BlockFormatError("header", f"ndim {ndim} not in 1..{MAX_NDIM}")
    if any(shape8[ndim:]):
        raise BlockFormatError("header", f"unused shape dims {shape8[ndim:]} are not zero")
    name = raw_dtype.rstrip(b"\x00")
    if b"\x00" in name or name.decode("latin-1") not in DTYPE_SIZES:
        raise BlockFormatError("header", f"unknown dtype {raw_dtype!r}")
    actual = _header_checksum(mv)
    if actual != hcsum:
        raise BlockFormatError(
            "header-checksum", f"header checksum {hcsum:#018x}, computed {actual:#018x}"
        )
    if mv[_HEADER.size:HEADER_SIZE].tobytes() != _RESERVED:
        raise BlockFormatError("header", f"reserved bytes {_HEADER.size}..{HEADER_SIZE} not zero")
    h = BlockHeader(bhash, phash, fp, tokens, name.decode(), tuple(shape8[:ndim]), plen, csum)
    _validate(h)
    return h


class HeaderCheck:
    """The header every block of one model spec must have, checked by comparing bytes.

    A reader that knows the spec expects every header field but the parent hash and the two
    checksums: :meth:`payload_checksum` compares those byte ranges with a header encoded once
    from the spec, checks the header checksum, and returns the payload checksum the header
    records. It returns None for any other header (a corrupt one, another spec's, or a valid
    one that differs in a field the fast check pins, such as the token count); the caller
    then runs :func:`decode_header` and :func:`check` for the verdict and its reason. So a
    header it accepts is one those two accept: it is a shortcut, never a looser rule.
    """

    def __init__(self, *, fingerprint: bytes, token_count: int, dtype: str,
                 shape: Sequence[int]) -> None:
        plen = _shape_bytes(dtype, tuple(shape))
        head = encode_header(BlockHeader(bytes(16), bytes(16), bytes(fingerprint), token_count,
                                         dtype, tuple(shape), plen, 0))
        self.payload_len = plen
        self.file_size = HEADER_SIZE + padded_size(plen)
        self._lead = head[:_BHASH_OFF]  # magic, version, header size
        self._mid = head[_FP_OFF:_CSUM_OFF]  # fingerprint .. payload length

    def payload_checksum(self, buf: bytearray, block_hash: bytes) -> int | None:
        """The payload checksum recorded in ``buf`` (a 4096-byte header) if the header is
        exactly this spec's for ``block_hash``; None otherwise."""
        # startswith / endswith at an offset compare in place (slices would copy).
        if not (len(buf) == HEADER_SIZE and buf.startswith(self._lead)
                and buf.startswith(block_hash, _BHASH_OFF) and len(block_hash) == 16
                and buf.startswith(self._mid, _FP_OFF) and buf.endswith(_RESERVED)):
            return None
        csum, hcsum = _TAIL.unpack_from(buf, _CSUM_OFF)
        # The header checksum covers the header with its own field zeroed; everything after
        # that field is zero too (checked above), so the hash needs no view of the buffer.
        x = xxhash.xxh3_64(buf[:_HCSUM_OFF])
        x.update(_ZERO_TAIL)
        if x.intdigest() != hcsum:
            return None
        return csum  # type: ignore[no-any-return]


def encode_parts(
    *,
    block_hash: bytes,
    parent_hash: bytes,
    fingerprint: bytes,
    token_count: int,
    dtype: str,
    shape: Sequence[int],
    payload: object,
) -> tuple[bytes, memoryview, bytes]:
    """(header, payload view, zero padding) — write them back to back, e.g. with pwritev."""
    mv = _view(payload)
    h = make_header(
        block_hash=block_hash, parent_hash=parent_hash, fingerprint=fingerprint,
        token_count=token_count, dtype=dtype, shape=shape, payload=mv,
    )  # fmt: skip
    return encode_header(h), mv, bytes(padded_size(h.payload_len) - h.payload_len)


def encode(
    *,
    block_hash: bytes,
    parent_hash: bytes,
    fingerprint: bytes,
    token_count: int,
    dtype: str,
    shape: Sequence[int],
    payload: object,
) -> bytes:
    """The whole file: header, payload, zero padding."""
    parts = encode_parts(
        block_hash=block_hash, parent_hash=parent_hash, fingerprint=fingerprint,
        token_count=token_count, dtype=dtype, shape=shape, payload=payload,
    )  # fmt: skip
    return b"".join(parts)


def verify_payload(h: BlockHeader, payload: object) -> None:
    """Check the payload's length, then its checksum, against the header."""
    mv = _view(payload)
    if mv.nbytes != h.payload_len:
        raise BlockFormatError(
            "length", f"payload is {mv.nbytes} bytes, header says {h.payload_len}"
        )
    actual = payload_checksum(mv)
    if actual != h.checksum:
        raise BlockFormatError(
            "checksum", f"payload checksum {actual:#018x}, header says {h.checksum:#018x}"
        )


def verify_file_size(h: BlockHeader, size: int) -> None:
    if size != h.file_size:
        raise BlockFormatError(
            "length",
            f"file is {size} bytes, expected {h.file_size} for a {h.payload_len}-byte payload",
        )


def verify_padding(h: BlockHeader, tail: object) -> None:
    """Check the bytes after the payload (up to the end of the file) are all zero."""
    mv = _view(tail)
    expected = padded_size(h.payload_len) - h.payload_len
    if mv.nbytes != expected:
        raise BlockFormatError("padding", f"padding is {mv.nbytes} bytes, expected {expected}")
    if mv.nbytes and bytes(mv).count(0) != mv.nbytes:
        raise BlockFormatError("padding", "nonzero bytes in the padding after the payload")


def decode(data: bytes | bytearray | memoryview) -> tuple[BlockHeader, memoryview]:
    """Parse a whole block file; returns the header and a view of the payload."""
    mv = _view(data)
    h = decode_header(mv)
    verify_file_size(h, mv.nbytes)
    end = HEADER_SIZE + h.payload_len
    payload = mv[HEADER_SIZE:end]
    verify_payload(h, payload)
    verify_padding(h, mv[end:])
    return h, payload


def check(
    h: BlockHeader,
    *,
    block_hash: bytes | None = None,
    fingerprint: bytes | None = None,
    dtype: str | None = None,
    shape: Sequence[int] | None = None,
) -> None:
    """Raise :class:`BlockMismatchError` unless ``h`` matches every expectation given."""
    if block_hash is not None and h.block_hash != bytes(block_hash):
        raise BlockMismatchError(
            f"block hash {h.block_hash.hex()}, expected {bytes(block_hash).hex()}"
        )
    if fingerprint is not None and h.fingerprint != bytes(fingerprint):
        raise BlockMismatchError(
            f"model fingerprint {h.fingerprint.hex()}, expected {bytes(fingerprint).hex()}"
        )
    if dtype is not None and h.dtype != dtype:
        raise BlockMismatchError(f"dtype {h.dtype}, expected {dtype}")
    if shape is not None and h.shape != tuple(shape):
        raise BlockMismatchError(f"shape {h.shape}, expected {tuple(shape)}")
