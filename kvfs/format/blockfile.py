"""On-disk format of one KV block file: a fixed 4096-byte header, then the payload.

The payload starts at offset 4096 and is zero-padded to a multiple of 4096 so the whole
file can be read with O_DIRECT or GPUDirect Storage. Everything here is pure: bytes in,
bytes out. The byte layout is specified in ``docs/format.md``.

Three versions are read. Version 1 records the payload's xxh3_64; version 2 records, beside
it, the payload's *sums* (:func:`payload_sums`): a checksum of additions that a GPU computes
over a block where it lands (``kvfs.client.devsum``, torch ops, any summation order giving the same
value), where xxh3's sequential rounds cannot run. Writers that hold the bytes on a device
write version 2; the reference implementation here (stdlib only) is for tests and vectors.
Version 3 is an *encoded* block (:class:`Encoding`, ``kvfs.format.codec``): the header of version 1
or 2 (sums where it had them) plus the encoding's codec, parameters, stored length and the
stored bytes' own xxh3_64; the stored bytes follow the header in place of the payload, so a
file's checksums cover both what is stored and what it decodes to.
"""

from __future__ import annotations

import math
import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

HEADER_SIZE = 4096
ALIGN = 4096
MAGIC = b"KVFSBLK\x00"
#: The version of the model manifest and of a block file without sums.
FORMAT_VERSION = 1
#: The block file version whose header carries the payload sums too.
SUMS_VERSION = 2
#: The block file version of an encoded block (a codec's stored bytes in place of the payload).
ENCODED_VERSION = 3
BLOCK_VERSIONS = (FORMAT_VERSION, SUMS_VERSION, ENCODED_VERSION)
#: Codec ids (version 3). 1: byte planes, each stored as is or as zstd frames (kvfs.format.codec);
#: 2: int8 codes with one float32 scale per group of ``chunk`` elements (lossy: only in a
#: namespace whose model fingerprint names it).
CODEC_PLANES = 1
CODEC_INT8 = 2
#: 0: stored as is; only in a sealed block (encrypted, kvfs.format.seal), which is version 3
#: whether or not a codec shrank it.
CODEC_NONE = 0
CODECS = {CODEC_NONE: "none", CODEC_PLANES: "planes-zstd", CODEC_INT8: "int8"}
#: The dtypes the int8 codec takes.
INT8_DTYPES = ("bfloat16", "float16", "float32")
#: The largest chunk (elements per zstd frame) a version 3 header may name.
MAX_CHUNK = 1 << 26
MAX_NDIM = 8
#: Payload sums: the payload as little-endian signed 32-bit words, in rows of this many words
#: (4 KiB, a page); row and column sums are reduced modulo this prime.
SUMS_ROW_WORDS = 1024
SUMS_PRIME = 2**31 - 1

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
_SUMS = struct.Struct("<QII")  # version 2, at _SUMS_OFF: word sum, row sum, column sum
_SUMS_OFF = _HEADER.size
_SUMS_END = _SUMS_OFF + _SUMS.size
_ZERO8 = bytes(8)
_RESERVED = bytes(HEADER_SIZE - _HEADER.size)  # version 1: after the fields, all zero
_RESERVED_2 = bytes(HEADER_SIZE - _SUMS_END)  # version 2: after the sums, all zero
# version 3, after the sums (zero where the block has none): codec id, flags, element size,
# chunk, tiles (int8; zero for planes), stored length, stored checksum.
_ENC = struct.Struct("<HHIIIQQ")
_ENC_OFF = _SUMS_END
_ENC_END = _ENC_OFF + _ENC.size
_FLAG_SUMS = 1
_FLAG_SEALED = 2
# version 3, sealed (flag 2): key id, nonce, tag of the AES-256-GCM encryption of the stored
# bytes (kvfs.format.seal).
_SEAL = struct.Struct("<I12s16s")
_SEAL_OFF = _ENC_END
_SEAL_END = _SEAL_OFF + _SEAL.size
_U32_MASK = 2**32 - 1
_U32_MAX = 2**32 - 1
_U64_MAX = 2**64 - 1


class BlockFormatError(ValueError):
    """A block file (or the data meant for one) is malformed.

    ``reason`` is one of "short", "magic", "version", "header", "header-checksum", "shape",
    "length", "checksum", "padding", "codec", "sealed" (an encrypted block read without its
    key), "auth" (one whose key does not open it: kvfs.format.seal) (and "mismatch" for
    :class:`BlockMismatchError`).
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


@dataclass(frozen=True)
class Seal:
    """A sealed block's encryption (docs/format.md, "Sealed blocks"): the tenant key it is
    under, and the AES-256-GCM nonce and tag of its stored bytes."""

    key_id: int
    nonce: bytes  # 12 bytes
    tag: bytes  # 16 bytes


@dataclass(frozen=True)
class Encoding:
    """How a version 3 block's payload is stored (docs/format.md, "Encodings")."""

    codec: int  # one of CODECS
    element_size: int  # bytes per element: the number of byte planes
    chunk: int  # elements per zstd frame (int8: per scale)
    stored_len: int  # bytes stored after the header (before the zero padding)
    stored_checksum: int  # xxh3_64 of those bytes
    tiles: int = 0  # int8: how groups lie (0: runs of chunk; else int8_tiles()); planes: 0
    #: Encrypted (the stored bytes are ciphertext; stored_checksum is theirs): None: plain.
    seal: Seal | None = None


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
    #: (word sum, row sum, column sum) of the payload (:func:`payload_sums`); None: version 1.
    sums: tuple[int, int, int] | None = None
    #: How the payload is stored (version 3); None: as is.
    encoding: Encoding | None = None

    @property
    def stored_len(self) -> int:
        """Bytes after the header before the padding: the payload, or its encoding."""
        return self.payload_len if self.encoding is None else self.encoding.stored_len

    @property
    def file_size(self) -> int:
        return HEADER_SIZE + padded_size(self.stored_len)

    @property
    def version(self) -> int:
        if self.encoding is not None:
            return ENCODED_VERSION
        return FORMAT_VERSION if self.sums is None else SUMS_VERSION


def padded_size(payload_len: int) -> int:
    """``payload_len`` rounded up to a multiple of :data:`ALIGN`."""
    return -(-payload_len // ALIGN) * ALIGN


def payload_checksum(payload: object) -> int:
    """xxh3_64 (seed 0) of the payload bytes."""
    return xxhash.xxh3_64_intdigest(_view(payload))


def payload_sums(payload: object) -> tuple[int, int, int]:
    """The payload sums (docs/format.md, version 2): with ``w`` the payload as little-endian
    signed 32-bit words (zero-padded to a multiple of 4 bytes), rows of
    :data:`SUMS_ROW_WORDS` words and P = :data:`SUMS_PRIME`: (sum of w mod 2**64, sum over
    rows r of (r + 1) * (row r's sum mod P) mod P, the same over columns c). The reference
    implementation: exact but slow (tens of MB/s); ``kvfs.client.devsum`` computes the same with
    torch where the bytes are."""
    mv = _view(payload)
    if mv.nbytes % 4:
        mv = memoryview(mv.tobytes() + bytes(-mv.nbytes % 4))
    if sys.byteorder == "little" and array("i").itemsize == 4:
        words: Any = mv.cast("i")
    else:  # pragma: no cover - big-endian or unusual C ints
        words = array("i" if array("i").itemsize == 4 else "l")
        words.frombytes(mv.tobytes())
        if sys.byteorder != "little":
            words.byteswap()
    m, k, p = len(words), SUMS_ROW_WORDS, SUMS_PRIME
    rows = [sum(words[a:a + k]) for a in range(0, m, k)]
    cols = [sum(words[c::k]) for c in range(min(k, m))]
    return (sum(rows) % 2**64, sum((r + 1) * (x % p) for r, x in enumerate(rows)) % p,
            sum((c + 1) * (x % p) for c, x in enumerate(cols)) % p)


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
    if h.sums is not None and (
            len(h.sums) != 3 or not 0 <= h.sums[0] <= _U64_MAX
            or not all(0 <= x < SUMS_PRIME for x in h.sums[1:])):
        raise BlockFormatError("header", f"payload sums {h.sums} out of range")
    if h.encoding is not None:
        _validate_encoding(h.encoding, h)


def int8_tiles(width: int, columns: Sequence[bool]) -> int:
    """An int8 block's tiles word: tiles of ``chunk * width`` elements whose kinds cycle through
    ``columns`` (True: a column tile, ``chunk`` rows of ``width`` whose groups are its columns;
    False: ``width`` runs of ``chunk``). docs/format.md, "Codec 2"."""
    if not 1 <= width <= 0xFFFF or not 1 <= len(columns) <= 8:
        raise ValueError(f"int8 tiles: width {width} not in 1..65535 or {len(columns)} kinds "
                         "not in 1..8")
    mask = sum(1 << i for i, c in enumerate(columns) if c)
    return width | len(columns) << 16 | mask << 24


def tiles_of(tiles: int) -> tuple[int, int, int]:
    """A tiles word's width, number of kinds and column mask."""
    return tiles & 0xFFFF, (tiles >> 16) & 0xFF, (tiles >> 24) & 0xFF


def _validate_encoding(e: Encoding, h: BlockHeader) -> None:
    """An encoding's fields: a known codec whose planes are the dtype's bytes, and stored
    bytes no longer than the payload (a block that does not shrink is stored as is)."""
    if e.codec not in CODECS:
        raise BlockFormatError("header", f"unknown codec {e.codec}")
    if e.seal is not None and (
            not 0 <= e.seal.key_id <= _U32_MAX or not isinstance(e.seal.nonce, bytes)
            or len(e.seal.nonce) != 12 or not isinstance(e.seal.tag, bytes)
            or len(e.seal.tag) != 16):
        raise BlockFormatError("header", f"bad seal {e.seal!r}")
    if e.codec == CODEC_NONE:
        if e.seal is None:
            raise BlockFormatError("header", "codec none in a block that is not sealed")
        if e.stored_len != h.payload_len or e.chunk != 1 or e.tiles:
            raise BlockFormatError("header", f"codec none with stored length {e.stored_len}, "
                                   f"chunk {e.chunk}, tiles {e.tiles} for a "
                                   f"{h.payload_len}-byte payload")
    if e.element_size != DTYPE_SIZES[h.dtype]:
        raise BlockFormatError("header", f"element size {e.element_size} for {h.dtype}")
    if not 1 <= e.chunk <= MAX_CHUNK:
        raise BlockFormatError("header", f"chunk {e.chunk} not in 1..{MAX_CHUNK}")
    if e.codec == CODEC_INT8:
        elems = h.payload_len // e.element_size
        if h.dtype not in INT8_DTYPES or elems % e.chunk:
            raise BlockFormatError("header", f"int8 groups of {e.chunk} for {elems} "
                                   f"{h.dtype} values")
        if e.stored_len != elems + 4 * (elems // e.chunk):
            raise BlockFormatError("header", f"stored length {e.stored_len} for {elems} int8 "
                                   f"codes in groups of {e.chunk}")
        w, n, mask = tiles_of(e.tiles)
        sound = (e.tiles <= _U32_MAX and w and 1 <= n <= 8 and mask >> n == 0
                 and elems % (e.chunk * w) == 0)
        if e.tiles and not sound:
            raise BlockFormatError("header", f"int8 tiles {e.tiles:#x} for {elems} values in "
                                   f"groups of {e.chunk}")
    elif e.tiles:
        raise BlockFormatError("header", f"tiles {e.tiles:#x} for codec {e.codec}")
    elif not 8 * e.element_size <= e.stored_len <= h.payload_len:
        raise BlockFormatError("header", f"stored length {e.stored_len} for a "
                               f"{h.payload_len}-byte payload")
    if not 0 <= e.stored_checksum <= _U64_MAX:
        raise BlockFormatError("header", f"stored checksum {e.stored_checksum} out of range")


def make_header(
    *,
    block_hash: bytes,
    parent_hash: bytes,
    fingerprint: bytes,
    token_count: int,
    dtype: str,
    shape: Sequence[int],
    payload: object,
    sums: bool = False,
) -> BlockHeader:
    """Build (and validate) the header for ``payload``; computes its length and checksum
    (``sums``: and its payload sums, a version 2 header)."""
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
        sums=payload_sums(mv) if sums else None,
    )
    _validate(h)
    return h


def encode_header(h: BlockHeader) -> bytes:
    """The 4096-byte header of ``h`` (version 2 if it has sums, 3 if it is encoded), header
    checksum included."""
    _validate(h)
    buf = bytearray(HEADER_SIZE)
    _HEADER.pack_into(
        buf, 0, MAGIC, h.version, HEADER_SIZE, h.block_hash, h.parent_hash,
        h.fingerprint, h.token_count, len(h.shape), h.dtype.encode("ascii"),
        *h.shape, *(0,) * (MAX_NDIM - len(h.shape)), h.payload_len, h.checksum, 0,
    )  # fmt: skip
    if h.sums is not None:
        _SUMS.pack_into(buf, _SUMS_OFF, *h.sums)
    e = h.encoding
    if e is not None:
        flags = (_FLAG_SUMS if h.sums is not None else 0) | (_FLAG_SEALED if e.seal else 0)
        _ENC.pack_into(buf, _ENC_OFF, e.codec, flags, e.element_size, e.chunk, e.tiles,
                       e.stored_len, e.stored_checksum)
        if e.seal is not None:
            _SEAL.pack_into(buf, _SEAL_OFF, e.seal.key_id, e.seal.nonce, e.seal.tag)
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
    if version not in BLOCK_VERSIONS:
        raise BlockFormatError(
            "version", f"format version {version}, supported {', '.join(map(str, BLOCK_VERSIONS))}")
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
    sums = encoding = None
    reserved = _HEADER.size
    if version == SUMS_VERSION:
        sums = _SUMS.unpack_from(mv, _SUMS_OFF)
        reserved = _SUMS_END
    elif version == ENCODED_VERSION:
        codec, flags, k, chunk, tiles, slen, scsum = _ENC.unpack_from(mv, _ENC_OFF)
        if flags & ~(_FLAG_SUMS | _FLAG_SEALED):
            raise BlockFormatError("header", f"encoding flags {flags:#x}")
        if flags & _FLAG_SUMS:
            sums = _SUMS.unpack_from(mv, _SUMS_OFF)
        elif mv[_SUMS_OFF:_SUMS_END].tobytes() != bytes(_SUMS.size):
            raise BlockFormatError("header", "payload sums set but not flagged")
        seal = None
        reserved = _ENC_END
        if flags & _FLAG_SEALED:
            seal = Seal(*_SEAL.unpack_from(mv, _SEAL_OFF))
            reserved = _SEAL_END
        encoding = Encoding(codec, k, chunk, slen, scsum, tiles, seal)
    if mv[reserved:HEADER_SIZE].tobytes() != bytes(HEADER_SIZE - reserved):
        raise BlockFormatError("header", f"reserved bytes {reserved}..{HEADER_SIZE} not zero")
    if sums is not None and not all(x < SUMS_PRIME for x in sums[1:]):
        raise BlockFormatError("header", f"payload sums {sums} out of range")
    h = BlockHeader(bhash, phash, fp, tokens, name.decode(), tuple(shape8[:ndim]), plen, csum,
                    sums, encoding)
    _validate(h)
    return h


class HeaderCheck:
    """The header every block of one model spec must have, checked by comparing bytes.

    A reader that knows the spec expects every header field but the parent hash, the
    checksums and (version 2) the payload sums: :meth:`payload_checksum` compares those byte
    ranges in place with a header encoded once from the spec, in either version, checks the
    header checksum, and returns the payload checksum the header records. It returns None for
    any other header (a corrupt one, another spec's, or a valid one that differs in a field
    the fast check pins, such as the token count); the caller then runs :func:`decode_header`
    and :func:`check` for the verdict and its reason. So a header it accepts is one those two
    accept: it is a shortcut, never a looser rule.
    """

    def __init__(self, *, fingerprint: bytes, token_count: int, dtype: str,
                 shape: Sequence[int]) -> None:
        plen = _shape_bytes(dtype, tuple(shape))
        head = encode_header(BlockHeader(bytes(16), bytes(16), bytes(fingerprint), token_count,
                                         dtype, tuple(shape), plen, 0))
        self.payload_len = plen
        self.file_size = HEADER_SIZE + padded_size(plen)
        self._lead = head[:_BHASH_OFF]  # magic, version 1, header size
        self._lead2 = MAGIC + struct.pack("<II", SUMS_VERSION, HEADER_SIZE)
        self._mid = head[_FP_OFF:_CSUM_OFF]  # fingerprint .. payload length

    @property
    def expected(self) -> tuple[bytes, bytes, bytes]:
        """What :meth:`payload_checksum` pins, for :mod:`kvfs.client._fastread`, which applies the
        same rule: the version 1 and version 2 lead (magic, version, header size) and the
        bytes from the fingerprint to the payload length."""
        return self._lead, self._lead2, self._mid

    def payload_checksum(self, buf: bytearray, block_hash: bytes) -> int | None:
        """The payload checksum recorded in ``buf`` (a 4096-byte header) if the header is
        exactly this spec's for ``block_hash``; None otherwise."""
        # startswith / endswith at an offset compare in place (slices would copy).
        if not (len(buf) == HEADER_SIZE and buf.startswith(block_hash, _BHASH_OFF)
                and len(block_hash) == 16 and buf.startswith(self._mid, _FP_OFF)
                and buf.endswith(_RESERVED_2)):
            return None
        if buf.startswith(self._lead):  # version 1: no sums, zeros where version 2 has them
            if not buf.startswith(_RESERVED[:_SUMS.size], _SUMS_OFF):
                return None
        elif buf.startswith(self._lead2):
            _, rows, cols = _SUMS.unpack_from(buf, _SUMS_OFF)
            if rows >= SUMS_PRIME or cols >= SUMS_PRIME:
                return None
        else:
            return None
        csum, hcsum = _TAIL.unpack_from(buf, _CSUM_OFF)
        # The header checksum covers the header with its own field zeroed: one copy and one
        # call (a streaming digest costs an allocation and a GIL release per update).
        copy = bytearray(buf)
        copy[_HCSUM_OFF:_SUMS_OFF] = _ZERO8
        if xxhash.xxh3_64_intdigest(copy) != hcsum:
            return None
        return csum  # type: ignore[no-any-return]

    @staticmethod
    def sums(buf: bytearray) -> tuple[int, int, int] | None:
        """The payload sums of a header :meth:`payload_checksum` accepted (None: version 1)."""
        if buf[8] != SUMS_VERSION:
            return None
        return _SUMS.unpack_from(buf, _SUMS_OFF)  # type: ignore[return-value]


def encode_parts(
    *,
    block_hash: bytes,
    parent_hash: bytes,
    fingerprint: bytes,
    token_count: int,
    dtype: str,
    shape: Sequence[int],
    payload: object,
    sums: bool = False,
) -> tuple[bytes, memoryview, bytes]:
    """(header, payload view, zero padding) — write them back to back, e.g. with pwritev.
    ``sums``: a version 2 header (the payload sums computed here, slowly: tests, tools)."""
    mv = _view(payload)
    h = make_header(
        block_hash=block_hash, parent_hash=parent_hash, fingerprint=fingerprint,
        token_count=token_count, dtype=dtype, shape=shape, payload=mv, sums=sums,
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
    sums: bool = False,
) -> bytes:
    """The whole file: header, payload, zero padding (``sums``: version 2)."""
    parts = encode_parts(
        block_hash=block_hash, parent_hash=parent_hash, fingerprint=fingerprint,
        token_count=token_count, dtype=dtype, shape=shape, payload=payload, sums=sums,
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


def verify_sums(h: BlockHeader, payload: object) -> None:
    """Check a version 2 payload's sums against the header (a no-op for version 1)."""
    if h.sums is None:
        return
    actual = payload_sums(payload)
    if actual != h.sums:
        raise BlockFormatError("checksum", f"payload sums {actual}, header says {h.sums}")


def verify_file_size(h: BlockHeader, size: int) -> None:
    if size != h.file_size:
        raise BlockFormatError(
            "length",
            f"file is {size} bytes, expected {h.file_size} for a {h.payload_len}-byte payload",
        )


def verify_padding(h: BlockHeader, tail: object) -> None:
    """Check the bytes after the payload (up to the end of the file) are all zero."""
    mv = _view(tail)
    expected = padded_size(h.stored_len) - h.stored_len
    if mv.nbytes != expected:
        raise BlockFormatError("padding", f"padding is {mv.nbytes} bytes, expected {expected}")
    if mv.nbytes and bytes(mv).count(0) != mv.nbytes:
        raise BlockFormatError("padding", "nonzero bytes in the padding after the payload")


def verify_stored(h: BlockHeader, stored: object) -> None:
    """Check a version 3 block's stored bytes (length, checksum) against its header."""
    assert h.encoding is not None
    mv = _view(stored)
    if mv.nbytes != h.encoding.stored_len:
        raise BlockFormatError("length", f"stored bytes are {mv.nbytes}, header says "
                               f"{h.encoding.stored_len}")
    actual = xxhash.xxh3_64_intdigest(mv)
    if actual != h.encoding.stored_checksum:
        raise BlockFormatError("checksum", f"stored checksum {actual:#018x}, header says "
                               f"{h.encoding.stored_checksum:#018x}")


def decode(data: bytes | bytearray | memoryview, *, sums: bool = False
           ) -> tuple[BlockHeader, memoryview]:
    """Parse a whole block file; returns the header and a view of the payload (a version 3
    block's decoded into new memory, both its checksums checked). ``sums``: check a
    version 2 payload's sums too, after its xxh3 (slow: the reference code)."""
    mv = _view(data)
    h = decode_header(mv)
    verify_file_size(h, mv.nbytes)
    end = HEADER_SIZE + h.stored_len
    payload = mv[HEADER_SIZE:end]
    if h.encoding is not None:
        from . import codec  # the codec needs this module's types: imported when used
        if h.encoding.seal is not None:
            raise BlockFormatError("sealed", "an encrypted block: it is read with its "
                                   "tenant's key (kvfs.format.seal.open_file)")
        verify_padding(h, mv[end:])
        payload = memoryview(codec.decode_payload(h, payload))
    verify_payload(h, payload)
    if sums:
        verify_sums(h, payload)
    verify_padding(h, mv[end:])
    return h, payload


def verify_file(data: bytes | bytearray | memoryview) -> BlockHeader:
    """Check a whole block file without its key: :func:`decode`'s checks for a plain or
    encoded block; for a sealed one (kvfs.format.seal) its header, size, padding and the
    ciphertext's stored checksum (what can be checked without the tenant's key; the tag is
    checked where it is opened)."""
    mv = _view(data)
    h = decode_header(mv)
    if h.encoding is None or h.encoding.seal is None:
        return decode(mv)[0]
    verify_file_size(h, mv.nbytes)
    end = HEADER_SIZE + h.stored_len
    verify_stored(h, mv[HEADER_SIZE:end])
    verify_padding(h, mv[end:])
    return h


def check_head(head: bytes | bytearray | memoryview, size: int,
               block_hash: bytes | None = None) -> BlockHeader:
    """The one check of a block file from its first bytes and its size, without reading its
    payload: a valid header, a size that matches it and, where given, the hash its name
    promises. Raises :class:`BlockFormatError` (reason ``mismatch`` for the hash)."""
    h = decode_header(head)
    verify_file_size(h, size)
    if block_hash is not None and h.block_hash != bytes(block_hash):
        raise BlockFormatError("mismatch", f"header names block {h.block_hash.hex()}")
    return h


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
