"""Block codecs: more blocks in the same bytes, and never a wrong byte out.

One lossless codec, ``planes-zstd`` (docs/format.md, "Encodings"): a payload of k-byte
elements is split into k byte planes; each plane is stored as is or, where that makes it
smaller, as a run of standard zstd frames (one per :data:`CHUNK` elements, level
:data:`LEVEL`). For 16-bit KV (bfloat16, float16) the high byte (sign, exponent) takes a few
dozen values and compresses to ~3 bits; the low byte is close to random and is kept as is
(the encoder probes each plane with its first chunk and stops there where it does not shrink).
A block whose file does not shrink below :data:`KEEP` of its size (stored bytes are padded
to a page, as a payload is) is stored as is (format versions 1 and 2); one that does becomes a
version 3 file whose header keeps every field of the block's own header, so decoding gives
back the original file byte for byte.

Both checksums are checked on every decode: the stored bytes' before they are decoded (a
torn or corrupt object never reaches the decoder), the decoded payload's as it is written
(hashed in the same pass, in cache), so a codec bug is a counted miss, never wrong KV.

The loops are in C (:mod:`kvfs.format._codec`, against libzstd), without the GIL, so a load's
threads decode its blocks side by side. Where it is not built, blocks are stored as is, and
stored encoded blocks are decoded with python-zstandard (about half the speed).

Where bytes cost more than CPU (the cold and shared tiers: kvfs.daemon.tiers.mover) blocks are
stored encoded by default; the hot tier keeps them as saved, and clients encode the blocks
they save there where the mount says so (``--hot-codec planes``).

One lossy codec, ``int8``, by choice of a namespace: each group of ``head_dim`` values (one
(token, head) row of a layer's K or V) becomes int8 codes and one float32 scale (max |x| /
127), 1.9x fewer bytes for 16-bit KV. It changes the KV, so it is part of the model
fingerprint (:data:`SPEC_KEY` in ``ModelSpec.extras``): a lossy namespace is another
namespace and never serves a reader that asked for exact KV. A lossy block's header checksum
is that of its decoded payload (the codes times their scales, as this module defines them),
so it is checked on every decode like a lossless one's.
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
#: The codec names a tier may be given (``--tier-codec``, ``--hot-codec``).
NAMES = ("planes", "none")
#: The lossy codecs a namespace may choose, and the ``ModelSpec.extras`` key that names one.
LOSSY = ("int8",)
SPEC_KEY = "kv_codec"
_INT8_DTYPE = {"bfloat16": 1, "float16": 2, "float32": 3}

_VERDICTS = {1: "plane table", 2: "zstd frame", 3: "decoded length"}
_LEN_MASK = (1 << 48) - 1
_ZSTD_BIT = 1 << 63


def available() -> bool:
    """Whether this install can encode (kvfs.format._codec built)."""
    return _codec is not None


def encode_payload(payload: object, element_size: int, *, level: int = LEVEL,
                   keep: float = KEEP) -> bytes | None:
    """The stored bytes of ``payload`` (planes-zstd), or None if it does not pay (or the
    encoder is not built)."""
    if _codec is None:
        return None
    return _codec.encode(payload, element_size, CHUNK, level, keep)  # type: ignore[no-any-return]


def encode_block(h: BlockHeader, payload: Any, name: str = "planes", *, level: int = LEVEL,
                 keep: float = KEEP, tiles: int = 0) -> tuple[BlockHeader, bytes] | None:
    """Block ``h`` (a raw header: its checksum is ``payload``'s) encoded with codec ``name``
    ("planes" or "int8"): its version 3 header and stored bytes, or None where it stays as
    is (the encoder is not built; planes: the file does not shrink below ``keep``; int8: a
    dtype it does not take, or a value that is not finite).

    int8 takes one scale per ``h.shape[-1]`` values (a (token, head) row of head_dim): runs of
    them where ``tiles`` is 0, else as ``tiles`` (:func:`blockfile.int8_tiles`) lays them out,
    for an engine whose bytes keep some rows down columns (the vLLM connector's
    ``worker.int8_tiles`` finds its engine's)."""
    if _codec is None or h.encoding is not None:
        return None
    k = blockfile.DTYPE_SIZES[h.dtype]
    if name == "int8":
        dt = _INT8_DTYPE.get(h.dtype)
        if dt is None or not h.shape:
            return None
        group = h.shape[-1]
        got = _codec.quantize(payload, dt, group, tiles)
        if got is None:
            return None
        stored, digest = got
        enc = Encoding(blockfile.CODEC_INT8, k, group, len(stored),
                       xxhash.xxh3_64_intdigest(stored), tiles)
        return replace(h, checksum=digest, sums=None, encoding=enc), stored
    if name != "planes":
        raise ValueError(f"unknown codec {name!r} (one of: planes, {', '.join(LOSSY)})")
    stored = encode_payload(payload, k, level=level, keep=keep)
    # What counts is the file: stored bytes are padded to a page as a payload is.
    if stored is None or (blockfile.padded_size(len(stored))
                          >= keep * blockfile.padded_size(h.payload_len)):
        return None
    enc = Encoding(blockfile.CODEC_PLANES, k, CHUNK, len(stored),
                   xxhash.xxh3_64_intdigest(stored))
    return replace(h, encoding=enc), stored


def file_parts(h: BlockHeader, stored: Any) -> tuple[bytes, Any, bytes]:
    """A version 3 block's file: header, stored bytes, zero padding."""
    return (blockfile.encode_header(h), stored,
            bytes(blockfile.padded_size(len(stored)) - len(stored)))


def encode_file(data: Any, *, level: int = LEVEL, keep: float = KEEP) -> bytes | None:
    """A whole block file (version 1 or 2, checked first) as a version 3 file (planes), or
    None where it stays as is: the encoder is not built, the block does not shrink below
    ``keep``, or it is encoded already. Raises BlockFormatError for a file that is not a
    sound block."""
    h, payload = blockfile.decode(data)
    got = encode_block(h, payload, level=level, keep=keep)
    return None if got is None else b"".join(file_parts(*got))


def is_lossy(h: BlockHeader) -> bool:
    """Whether block ``h`` is stored with a lossy codec (decoding does not give back the
    payload it was saved from, so it is never decoded into a raw file)."""
    return h.encoding is not None and h.encoding.codec == blockfile.CODEC_INT8


def decode_file(data: Any) -> bytes:
    """A whole version 3 file decoded back into the block file it was made from (version 1
    or 2), both checksums checked; any other sound block file is returned as it is."""
    h, payload = blockfile.decode(data)
    return bytes(data) if h.encoding is None else raw_file(h, payload)


def raw_file(h: BlockHeader, payload: Any) -> bytes:
    """The block file an encoded block ``h`` was made from, given its decoded payload."""
    pad = bytes(blockfile.padded_size(h.payload_len) - h.payload_len)
    return b"".join((blockfile.encode_header(replace(h, encoding=None)), payload, pad))


def gather(views: Any, n: int) -> bytearray:
    """The first ``n`` bytes that landed across ``views``, in order, copied into one buffer
    (a stored payload read into its block's destination, to be decoded back into it)."""
    out = bytearray(n)
    at = 0
    for v in views:
        take = min(v.nbytes, n - at)
        out[at:at + take] = v[:take]
        at += take
        if at == n:
            break
    return out


def decode_payload(h: BlockHeader, stored: Any, dest: Any = None, *,
                   stored_checked: bool = False) -> Any:
    """Decode a version 3 block's stored bytes (after checking their length and checksum)
    into ``dest`` (a writable buffer, or a list of them filled in order, the payload's size
    in all; None: new memory, returned), checking the decoded payload's checksum. Raises
    BlockFormatError ("checksum", "length", "codec"); ``dest`` is then not to be used.
    ``stored_checked``: the stored bytes were checked already (hashed as a seal was opened)."""
    e = h.encoding
    assert e is not None
    if e.seal is not None:
        raise BlockFormatError("sealed", "an encrypted block: opened first (kvfs.format.seal)")
    if not stored_checked:
        blockfile.verify_stored(h, stored)
    out = bytearray(h.payload_len) if dest is None else dest
    if e.codec == blockfile.CODEC_INT8:
        if _codec is not None:
            verdict, digest = _codec.dequantize(stored, _INT8_DTYPE[h.dtype], e.chunk, out,
                                                e.tiles)
            if verdict:
                raise BlockFormatError("codec", f"bad int8 codes in a {e.stored_len}-byte "
                                       "stored block")
        else:
            digest = _py_dequantize(stored, h, out)
    elif _codec is not None:
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


def plane_table(stored: Any, k: int, n: int) -> list[tuple[bool, int, int]]:
    """A planes block's plane table (docs/format.md, codec 1) for a payload of ``n`` bytes of
    ``k``-byte elements: (zstd frames?, offset, length) per plane, checked to fill
    ``stored`` exactly. Raises BlockFormatError ("codec")."""
    mv = memoryview(stored).cast("B")
    if n % k or mv.nbytes < 8 * k:
        raise BlockFormatError("codec", "bad plane table")
    planes, at = [], 8 * k
    for w in struct.unpack_from(f"<{k}Q", mv):
        length = w & _LEN_MASK
        if w & ~(_ZSTD_BIT | _LEN_MASK) or at + length > mv.nbytes:
            raise BlockFormatError("codec", "bad plane table")
        planes.append((bool(w & _ZSTD_BIT), at, length))
        at += length
    if at != mv.nbytes:
        raise BlockFormatError("codec", "bad plane table")
    return planes


def _py_decode(stored: Any, e: Encoding, dest: Any, n: int) -> int:
    """The decoder without kvfs.format._codec: python-zstandard and slice assignment (a copy
    more)."""
    try:
        import zstandard
    except ImportError:
        raise BlockFormatError("codec", "an encoded block, and neither kvfs.format._codec nor "
                               "zstandard is installed to decode it") from None
    k, mv = e.element_size, memoryview(stored).cast("B")
    out, elems = bytearray(n), n // k
    for p, (zstd, at, length) in enumerate(plane_table(mv, k, n)):
        plane = mv[at:at + length]
        if zstd:
            try:
                got = zstandard.ZstdDecompressor().decompressobj(
                    read_across_frames=True).decompress(plane)
            except zstandard.ZstdError as exc:
                raise BlockFormatError("codec", f"bad zstd frame: {exc}") from None
            plane = memoryview(got)
        if plane.nbytes != elems:
            raise BlockFormatError("codec", "bad decoded length")
        out[p::k] = plane
    parts = dest if isinstance(dest, list | tuple) else [dest]
    off = 0
    for part in parts:
        v = memoryview(part).cast("B")
        v[:] = out[off:off + v.nbytes]
        off += v.nbytes
    return xxhash.xxh3_64_intdigest(out)


def _py_dequantize(stored: Any, h: BlockHeader, dest: Any) -> int:
    """The int8 decoder without kvfs.format._codec: torch (the client has it), the same rounding."""
    try:
        import torch
    except ImportError:
        raise BlockFormatError("codec", "an int8 block, and neither kvfs.format._codec nor torch "
                               "is installed to decode it") from None
    e = h.encoding
    assert e is not None
    n = h.payload_len // e.element_size
    mv = bytearray(stored)  # writable: torch takes no read-only buffer without a warning
    codes = torch.frombuffer(mv, dtype=torch.int8, count=n).float()
    scales = torch.frombuffer(mv, dtype=torch.float32, offset=n)
    w, kinds, mask = blockfile.tiles_of(e.tiles)
    if not w:
        vals = codes * scales.repeat_interleave(e.chunk)
    else:  # tile t: codes [t, i] of chunk * w; its scales [t, 0 .. w)
        codes, scales = codes.view(-1, e.chunk * w), scales.view(-1, w)
        rows = (codes.view(-1, w, e.chunk) * scales[:, :, None]).view(codes.shape)
        cols = (codes.view(-1, e.chunk, w) * scales[:, None, :]).view(codes.shape)
        kind = torch.arange(codes.shape[0]) % kinds
        is_col = ((mask >> kind) & 1).bool()[:, None]
        vals = torch.where(is_col, cols, rows).view(-1)
    out = memoryview(vals.to(getattr(torch, h.dtype)).view(torch.uint8).numpy())
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
