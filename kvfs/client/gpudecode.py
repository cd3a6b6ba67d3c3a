"""Encoded blocks decoded where they land: planes-zstd frames on the GPU, with nvCOMP.

A planes block's stored bytes are a plane table and, per byte plane, the plane as is or a
run of standard zstd frames, one per chunk of elements (docs/format.md, "Encodings"). nvCOMP
decodes standard zstd frames on the GPU, so a load into GPU memory need not decode on the
host and copy the whole payload across: the stored bytes (fewer than the payload's) are
checked on the host by their checksum, as every decode checks them, and copied to the device
once, each frame at an aligned offset (found from the frames' own headers,
:func:`frame_spans`: a few bytes a frame), and the frames are decoded there in one batch;
each plane is written into its byte column of the destination. The decoded payload is then
checked on the device by its payload sums (:mod:`kvfs.client.devsum`: a version 3 block keeps its
raw header's sums) or, for a block saved without them (version 1), by ``xxh3_64`` of a copy
on the host. A block that fails any check is a miss, never served.

Lossy (int8) blocks, and hosts without nvCOMP (``nvidia-nvcomp-cu12``, the ``gpu`` extra),
keep the host decoder (:func:`kvfs.client.encoded.decode_fd`). The frame decoder is a
parameter: the tests run :func:`decode_into` on CPU tensors with a host zstd decoder in
nvCOMP's place; ``tools/gpu_check.py`` runs it with nvCOMP on a GPU.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import xxhash

from ..format import blockfile, codec
from ..format.blockfile import BlockFormatError, BlockHeader
from . import devsum

#: Decodes standard zstd frames (uint8 tensors on one device) into their contents there.
FrameDecoder = Callable[[list[torch.Tensor]], list[torch.Tensor]]

_MAGIC = 0xFD2FB528
_tls = threading.local()
#: Where each piece starts in the device copy of a block's stored bytes.
_ALIGN = 16


def frame_spans(stored: Any, start: int, length: int) -> list[tuple[int, int]]:
    """The (offset, length) of each zstd frame in ``stored[start:start + length]`` (RFC 8878:
    the frame header, then blocks of 3-byte headers, then an optional checksum), checking
    that they fill it exactly. Raises BlockFormatError ("codec")."""
    mv = memoryview(stored).cast("B")
    spans, at, end = [], start, start + length

    def need(n: int) -> None:
        if at + n > end:
            raise BlockFormatError("codec", f"bad zstd frame: truncated at byte {at}")

    while at < end:
        first = at
        need(5)
        if struct.unpack_from("<I", mv, at)[0] != _MAGIC:
            raise BlockFormatError("codec", f"bad zstd frame: no magic number at byte {at}")
        fhd = mv[at + 4]
        if fhd & 0x08:
            raise BlockFormatError("codec", "bad zstd frame: reserved bit set")
        single = fhd & 0x20
        fcs = (0, 2, 4, 8)[fhd >> 6] or (1 if single else 0)
        at += 5 + (0 if single else 1) + (0, 1, 2, 4)[fhd & 3] + fcs
        while True:
            need(3)
            word = mv[at] | mv[at + 1] << 8 | mv[at + 2] << 16
            kind, size = (word >> 1) & 3, word >> 3
            if kind == 3:
                raise BlockFormatError("codec", "bad zstd frame: reserved block type")
            at += 3 + (1 if kind == 1 else size)
            if word & 1:
                break
        at += 4 if fhd & 0x04 else 0
        need(0)
        spans.append((first, at - first))
    return spans


def decode_into(hdr: BlockHeader, stored: Any, dests: Sequence[torch.Tensor],
                frames: FrameDecoder) -> None:
    """Decode planes block ``hdr`` (its header checked, its spec's) from ``stored`` (its
    stored bytes, host memory) into ``dests`` (uint8-viewable tensors on one device, back to
    back, the payload's size in all), the zstd frames by ``frames`` on that device; check
    both checksums. Raises BlockFormatError; ``dests`` are then not to be used."""
    e = hdr.encoding
    if e is None or e.codec != blockfile.CODEC_PLANES:
        raise ValueError("decode_into takes a planes-zstd block")
    blockfile.verify_stored(hdr, stored)
    k, n = e.element_size, hdr.payload_len
    elems = n // k
    mv = memoryview(stored).cast("B")
    planes = codec.plane_table(mv, k, n)
    if any(not z and length != elems for z, _, length in planes):
        raise BlockFormatError("codec", "bad plane table")
    dev = dests[0].device
    flat = [d.reshape(-1).view(torch.uint8) for d in dests]
    if sum(f.numel() for f in flat) != n:
        raise ValueError(f"destinations hold {sum(f.numel() for f in flat)} bytes, the "
                         f"block's payload {n}")
    # The pieces (raw planes, frames) packed at aligned offsets (nvCOMP's decoders want
    # their inputs aligned; 16 bytes serves every one) and copied to the device at once.
    pieces = []  # per plane: [(offset in `packed`, length), ...]; one entry for a raw plane
    spans = [frame_spans(mv, off, length) if z else [(off, length)] for z, off, length in planes]
    packed_len = sum(-(-m // _ALIGN) * _ALIGN for sp in spans for _, m in sp)
    packed = bytearray(packed_len)
    at = 0
    for sp in spans:
        placed = []
        for o, m in sp:
            packed[at:at + m] = mv[o:o + m]
            placed.append((at, m))
            at += -(-m // _ALIGN) * _ALIGN
        pieces.append(placed)
    on_dev = torch.frombuffer(packed, dtype=torch.uint8).to(dev) if packed_len else \
        torch.empty(0, dtype=torch.uint8, device=dev)
    payload = flat[0] if len(flat) == 1 else torch.empty(n, dtype=torch.uint8, device=dev)
    cols = payload.view(elems, k)
    batch = [on_dev[o:o + m] for p, (z, _, _) in enumerate(planes) if z for o, m in pieces[p]]
    try:
        out = frames(batch) if batch else []
    except BlockFormatError:
        raise
    except Exception as exc:  # the device decoder's own error: a corrupt frame is a miss
        raise BlockFormatError("codec", f"bad zstd frame: {exc}") from None
    if len(out) != len(batch):
        raise BlockFormatError("codec", f"{len(out)} frames decoded of {len(batch)}")
    i = 0
    for p, (z, _, _) in enumerate(planes):
        if not z:
            o, m = pieces[p][0]
            cols[:, p].copy_(on_dev[o:o + m])
            continue
        parts = out[i:i + len(pieces[p])]
        i += len(pieces[p])
        lengths = [t.numel() for t in parts]
        want = [min(e.chunk, elems - j * e.chunk) for j in range(len(parts))]
        if lengths != want or sum(want) != elems:
            raise BlockFormatError("codec", "bad decoded length")
        cols[:, p].copy_(torch.cat(parts) if len(parts) > 1 else parts[0])
    if len(flat) > 1:
        at = 0
        for f in flat:
            f.copy_(payload[at:at + f.numel()])
            at += f.numel()
    if hdr.sums is not None:
        got = devsum.payload_sums(flat)
        if got != hdr.sums:
            raise BlockFormatError("checksum", f"decoded payload sums {got}, header says "
                                   f"{hdr.sums}")
        return
    digest = xxhash.xxh3_64_intdigest(memoryview(payload.cpu().numpy()))
    if digest != hdr.checksum:
        raise BlockFormatError("checksum", f"decoded payload checksum {digest:#018x}, "
                               f"header says {hdr.checksum:#018x}")


def host_frames(frames: list[torch.Tensor]) -> list[torch.Tensor]:
    """A :data:`FrameDecoder` for CPU tensors (python-zstandard, one frame at a time): what
    the tests run in nvCOMP's place, and the reference its output is held to."""
    import zstandard

    d = zstandard.ZstdDecompressor()
    out = []
    for f in frames:
        try:
            got = d.decompressobj().decompress(f.numpy().tobytes())
        except zstandard.ZstdError as exc:
            raise BlockFormatError("codec", f"bad zstd frame: {exc}") from None
        out.append(torch.frombuffer(bytearray(got), dtype=torch.uint8))
    return out


def nvcomp_frames(device: torch.device) -> FrameDecoder | None:
    """This thread's nvCOMP zstd decoder for CUDA ``device`` (one per thread, as nvCOMP's
    codecs are not shared between threads; on the thread's current stream), or None where
    nvCOMP is not installed or the device is not a CUDA one."""
    if device.type != "cuda":
        return None
    cached = getattr(_tls, "decoders", None)
    if cached is None:
        cached = _tls.decoders = {}
    key = device.index
    if key not in cached:
        cached[key] = _make_nvcomp(device)
    return cached[key]  # type: ignore[no-any-return]


def _make_nvcomp(device: torch.device) -> FrameDecoder | None:
    try:
        from nvidia import nvcomp  # type: ignore[import-not-found]
    except ImportError:
        return None
    stream = torch.cuda.current_stream(device)
    try:
        codec = nvcomp.Codec(algorithm="Zstd", bitstream_kind=nvcomp.BitstreamKind.RAW,
                             device_id=device.index or 0, cuda_stream=stream.cuda_stream)
    except Exception:  # noqa: BLE001 (its CUDA runtime refused: the host decoder serves)
        return None

    def run(frames: list[torch.Tensor]) -> list[torch.Tensor]:
        outs = codec.decode(nvcomp.as_arrays(frames, stream.cuda_stream))
        return [torch.as_tensor(outs[i], device=device).view(torch.uint8).reshape(-1)
                for i in range(len(frames))]

    return run
