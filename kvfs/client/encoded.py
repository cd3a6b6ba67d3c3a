"""Loading encoded blocks (format version 3, kvfs.format.codec): decoded once, into the destination.

The cold and shared tiers store blocks encoded. A load that reads one (a directory tier's
file the daemon handed out, a granted GET of a shared tier's object) reads it as it reads
any block, into the block's destination; an encoded file is never longer than the block
it encodes, so all of it lands there. :func:`decode_landed` then takes the stored bytes out
(one copy of the smaller, stored bytes) and decodes them into the same memory, checking the
stored bytes' checksum first and the decoded payload's as it is written. A layer-wise or
device load reads the file whole first (:func:`decode_fd`); into GPU memory, a planes block's
zstd frames are decoded there, with nvCOMP where it is installed (:mod:`.gpudecode`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..format import blockfile, codec
from ..format.blockfile import HEADER_SIZE, BlockFormatError, BlockHeader
from . import gpudecode
from .transport import host_view, preadv_all


def is_encoded(header: bytearray | bytes) -> bool:
    """Whether a block header read from a file is a version 3 (encoded) one (the version's
    low byte: the full check is :func:`kvfs.format.blockfile.decode_header`'s)."""
    return len(header) > 8 and header[8] == blockfile.ENCODED_VERSION


def decode_landed(hdr: BlockHeader, views: Sequence[memoryview], total: int) -> None:
    """Decode encoded block ``hdr`` (its header checked, its spec's) whose file was read,
    ``total`` bytes in all, header first and then into ``views`` (the payload's memory),
    into ``views``. Raises BlockFormatError."""
    if total != hdr.file_size:
        raise BlockFormatError("short" if total < hdr.file_size else "length",
                               f"encoded file is {total} bytes, header says {hdr.file_size}")
    stored = bytearray(hdr.stored_len)
    at = 0
    for v in views:
        take = min(v.nbytes, hdr.stored_len - at)
        stored[at:at + take] = v[:take]
        at += take
        if at == hdr.stored_len:
            break
    codec.decode_payload(hdr, stored, list(views))


def decode_fd(fd: int, hdr: BlockHeader, dests: Sequence[Any]) -> int:
    """Read encoded block ``hdr``'s whole file from ``fd`` and decode it into ``dests``
    (byte views, or tensors on any device): the bytes read. Raises BlockFormatError."""
    data = bytearray(hdr.file_size)
    n = preadv_all(fd, [memoryview(data)], 0)
    if n != hdr.file_size:
        raise BlockFormatError("short", f"encoded file is {n} bytes, header says "
                               f"{hdr.file_size}")
    stored = memoryview(data)[HEADER_SIZE:HEADER_SIZE + hdr.stored_len]
    if all(isinstance(d, memoryview) for d in dests):
        codec.decode_payload(hdr, stored, list(dests))
    elif all(d.device.type == "cpu" and d.is_contiguous() for d in dests):
        codec.decode_payload(hdr, stored, [host_view(d) for d in dests])
    elif (hdr.encoding is not None and hdr.encoding.codec == blockfile.CODEC_PLANES
          and (frames := gpudecode.nvcomp_frames(dests[0].device)) is not None):
        gpudecode.decode_into(hdr, stored, dests, frames)  # the frames decoded on the GPU
    else:  # device memory: decoded on the host, then copied (one transfer a part)
        host = codec.decode_payload(hdr, stored)
        at = 0
        for d in dests:
            nb = d.numel() * d.element_size()
            d.view(-1).view(torch.uint8).copy_(torch.frombuffer(host, dtype=torch.uint8,
                                                                 count=nb, offset=at))
            at += nb
    return n
