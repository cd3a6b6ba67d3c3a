"""Block codecs: more blocks in the same bytes, and never a wrong byte out.

One lossless codec, ``planes-zstd`` (docs/format.md, "Encodings"): a payload of k-byte
elements is split into k byte planes; each plane is stored as is or, where that makes it
smaller, as a run of standard zstd frames (one per :data:`CHUNK` elements, level
:data:`LEVEL`). For 16-bit KV (bfloat16, float16) the high byte (sign, exponent) takes a few
dozen values and compresses to ~3 bits; the low byte is close to random and is kept as is.
A block whose file does not shrink below :data:`KEEP` of its size (stored bytes are padded
to a page, as a payload is) is stored as is (format versions 1 and 2); one that does becomes a
version 3 file whose header keeps every field of the block's own header, so decoding gives
back the original file byte for byte.

Both checksums are checked on every decode: the stored bytes' before they are decoded (a
torn or corrupt object never reaches the decoder), the decoded payload's as it is written
(hashed in the same pass, in cache), so a codec bug is a counted miss, never wrong KV.

The loops are in C (:mod:`kvfs._codec`, against libzstd), without the GIL, so a load's
threads decode its blocks side by side. Where it is not built, blocks are stored as is, and
stored encoded blocks are decoded with python-zstandard (about half the speed).

Where bytes cost more than CPU (the cold and shared tiers: kvfs.tiers.mover) blocks are
stored encoded by default; the hot tier keeps them as is.
"""

from __future__ import annotations

import struct
from dataclasses import replace
from typing import Any

import xxhash

from . import blockfile
from .blockfile import BlockFormatError, BlockHeader, Encoding

try:
    from . import _codec
except ImportError:  # not built (no libzstd-dev at install): stored as is, decoded in Python
    _codec = None  # type: ignore[assignment]

#: Elements per zstd frame: 64 Ki (128 KiB of a 16-bit plane pair, cache-resident while
#: decoded and merged). Frames this size compress as well as one frame per plane (measured:
#: docs/benchmarks.md, "Block codecs").
CHUNK = 1 << 16
#: zstd level: 1 compresses these planes as well as 3 and encodes and decodes faster.
LEVEL = 1
#: A block is stored encoded only if that takes less than this fraction of its bytes.
KEEP = 0.95
#: The codec names a tier may be given (``--tier-codec``).
NAMES = ("planes", "none")

_VERDICTS = {1: "plane table", 2: "zstd frame", 3: "decoded length"}
_LEN_MASK = (1 << 48) - 1
_ZSTD_BIT = 1 << 63


def available() -> bool:
    """Whether this install can encode (kvfs._codec built)."""
    return _codec is not None


def encode_payload(payload: object, element_size: int, *, level: int = LEVEL,
                   keep: float = KEEP) -> bytes | None:
    """The stored bytes of ``payload`` (planes-zstd), or None if it does not pay (or the
    encoder is not built)."""
    if _codec is None:
        return None
    return _codec.encode(payload, element_size, CHUNK, level, keep)  # type: ignore[no-any-return]


def encode_file(data: Any, *, level: int = LEVEL, keep: float = KEEP) -> bytes | None:
    """A whole block file (version 1 or 2, checked first) as a version 3 file, or None where
    it stays as is: the encoder is not built, the block does not shrink below ``keep``, or
    it is encoded already. Raises BlockFormatError for a file that is not a sound block."""
    h, payload = blockfile.decode(data)
    if h.encoding is not None or _codec is None:
        return None
    k = blockfile.DTYPE_SIZES[h.dtype]
    stored = encode_payload(payload, k, level=level, keep=keep)
    # What counts is the file: stored bytes are padded to a page as a payload is.
    if stored is None or (blockfile.padded_size(len(stored))
                          >= keep * blockfile.padded_size(h.payload_len)):
        return None
    enc = Encoding(blockfile.CODEC_PLANES, k, CHUNK, len(stored),
                   xxhash.xxh3_64_intdigest(stored))
    pad = bytes(blockfile.padded_size(len(stored)) - len(stored))
    return b"".join((blockfile.encode_header(replace(h, encoding=enc)), stored, pad))


def decode_file(data: Any) -> bytes:
    """A whole version 3 file decoded back into the block file it was made from (version 1
    or 2), both checksums checked; any other sound block file is returned as it is."""
    h, payload = blockfile.decode(data)
    return bytes(data) if h.encoding is None else raw_file(h, payload)


def raw_file(h: BlockHeader, payload: Any) -> bytes:
    """The block file an encoded block ``h`` was made from, given its decoded payload."""
    pad = bytes(blockfile.padded_size(h.payload_len) - h.payload_len)
    return b"".join((blockfile.encode_header(replace(h, encoding=None)), payload, pad))


def decode_payload(h: BlockHeader, stored: Any, dest: Any = None) -> Any:
    """Decode a version 3 block's stored bytes (after checking their length and checksum)
    into ``dest`` (a writable buffer, or a list of them filled in order, the payload's size
    in all; None: new memory, returned), checking the decoded payload's checksum. Raises
    BlockFormatError ("checksum", "length", "codec"); ``dest`` is then not to be used."""
    e = h.encoding
    assert e is not None
    blockfile.verify_stored(h, stored)
    out = bytearray(h.payload_len) if dest is None else dest
    if _codec is not None:
        verdict, digest = _codec.decode(stored, e.element_size, e.chunk, out)
        if verdict:
            raise BlockFormatError("codec", f"bad {_VERDICTS.get(verdict, verdict)} in a "
                                   f"{e.stored_len}-byte stored block")
    else:
        digest = _py_decode(stored, e, out, h.payload_len)
    if digest != h.checksum:
        raise BlockFormatError("checksum", f"decoded payload checksum {digest:#018x}, "
                               f"header says {h.checksum:#018x}")
    return out


def _py_decode(stored: Any, e: Encoding, dest: Any, n: int) -> int:
    """The decoder without kvfs._codec: python-zstandard and slice assignment (a copy more)."""
    try:
        import zstandard
    except ImportError:
        raise BlockFormatError("codec", "an encoded block, and neither kvfs._codec nor "
                               "zstandard is installed to decode it") from None
    k, mv = e.element_size, memoryview(stored).cast("B")
    if n % k or mv.nbytes < 8 * k:
        raise BlockFormatError("codec", "bad plane table")
    words = struct.unpack_from(f"<{k}Q", mv)
    out, at, elems = bytearray(n), 8 * k, n // k
    for p, w in enumerate(words):
        length = w & _LEN_MASK
        if w & ~(_ZSTD_BIT | _LEN_MASK) or at + length > mv.nbytes:
            raise BlockFormatError("codec", "bad plane table")
        plane = mv[at:at + length]
        if w & _ZSTD_BIT:
            try:
                got = zstandard.ZstdDecompressor().decompressobj(
                    read_across_frames=True).decompress(plane)
            except zstandard.ZstdError as exc:
                raise BlockFormatError("codec", f"bad zstd frame: {exc}") from None
            plane = memoryview(got)
        if plane.nbytes != elems:
            raise BlockFormatError("codec", "bad decoded length")
        out[p::k] = plane
        at += length
    if at != mv.nbytes:
        raise BlockFormatError("codec", "bad plane table")
    parts = dest if isinstance(dest, list | tuple) else [dest]
    off = 0
    for part in parts:
        v = memoryview(part).cast("B")
        v[:] = out[off:off + v.nbytes]
        off += v.nbytes
    return xxhash.xxh3_64_intdigest(out)


def ratio(raw: int, stored: int) -> float | None:
    """Raw bytes per stored byte (None before anything is stored)."""
    return round(raw / stored, 3) if stored else None
