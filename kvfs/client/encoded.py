"""Loading encoded blocks (format version 3, kvfs.format.codec): decoded once, into the destination.

The cold and shared tiers store blocks encoded. A load that reads one (a directory tier's
file the daemon handed out, a granted GET of a shared tier's object) reads it as it reads
any block, into the block's destination; an encoded file is never longer than the block
it encodes, so all of it lands there. :func:`decode_landed` then takes the stored bytes out
(one copy of the smaller, stored bytes) and decodes them into the same memory, checking the
stored bytes' checksum first and the decoded payload's as it is written. A layer-wise or
device load reads the file whole first (:func:`decode_fd`); into GPU memory, a planes block's
zstd frames are decoded there, with nvCOMP where it is installed (:mod:`.gpudecode`).
A sealed block (encrypted under its tenant's key, kvfs.format.seal) is opened first, with its
namespace's key (:mod:`.keys`): decrypted in place where it landed, authenticated, then
decoded where a codec stored it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..format import blockfile, codec, seal
from ..format.blockfile import HEADER_SIZE, BlockFormatError, BlockHeader
from . import gpudecode
from .keys import NamespaceKeys
from .transport import host_view, preadv_all


def is_encoded(header: bytearray | bytes) -> bool:
    """Whether a block header read from a file is a version 3 (encoded) one (the version's
    low byte: the full check is :func:`kvfs.format.blockfile.decode_header`'s)."""
    return len(header) > 8 and header[8] == blockfile.ENCODED_VERSION


def _key(hdr: BlockHeader, keys: NamespaceKeys | None) -> bytes:
    kid = seal.key_id_of(hdr)
    assert kid is not None
    if keys is None:
        raise BlockFormatError("sealed", "an encrypted block, and no keys to open it")
    return keys.get(kid)


def decode_landed(hdr: BlockHeader, views: Sequence[memoryview], total: int,
                  keys: NamespaceKeys | None = None) -> None:
    """Decode encoded block ``hdr`` (its header checked, its spec's) whose file was read,
    ``total`` bytes in all, header first and then into ``views`` (the payload's memory),
    into ``views`` (a sealed one opened with ``keys`` first). Raises BlockFormatError."""
    if total != hdr.file_size:
        raise BlockFormatError("short" if total < hdr.file_size else "length",
                               f"encoded file is {total} bytes, header says {hdr.file_size}")
    if seal.is_sealed(hdr):
        seal.open_landed(hdr, views, _key(hdr, keys), *_names(keys))
        return
    stored = codec.gather(views, hdr.stored_len)
    codec.decode_payload(hdr, stored, list(views))


def _names(keys: NamespaceKeys | None) -> tuple[str, str]:
    assert keys is not None
    return keys.tenant, keys.namespace


def decode_fd(fd: int, hdr: BlockHeader, dests: Sequence[Any],
              keys: NamespaceKeys | None = None) -> int:
    """Read encoded block ``hdr``'s whole file from ``fd`` and decode it into ``dests``
    (byte views, or tensors on any device; a sealed one opened with ``keys`` first): the
    bytes read. Raises BlockFormatError."""
    data = bytearray(hdr.file_size)
    n = preadv_all(fd, [memoryview(data)], 0)
    if n != hdr.file_size:
        raise BlockFormatError("short", f"encoded file is {n} bytes, header says "
                               f"{hdr.file_size}")
    stored = memoryview(data)[HEADER_SIZE:HEADER_SIZE + hdr.stored_len]
    if seal.is_sealed(hdr):
        hdr = seal.open_in_place(hdr, stored, _key(hdr, keys), *_names(keys))
        if hdr.encoding is None:  # sealed as is: the payload itself, checked; copied out
            _copy_out(stored, dests)
            return n
    if all(isinstance(d, memoryview) for d in dests):
        codec.decode_payload(hdr, stored, list(dests))
    elif all(d.device.type == "cpu" and d.is_contiguous() for d in dests):
        codec.decode_payload(hdr, stored, [host_view(d) for d in dests])
    elif (hdr.encoding is not None and hdr.encoding.codec == blockfile.CODEC_PLANES
          and (frames := gpudecode.nvcomp_frames(dests[0].device)) is not None):
        gpudecode.decode_into(hdr, stored, dests, frames)  # the frames decoded on the GPU
    else:  # device memory: decoded on the host, then copied (one transfer a part)
        _copy_out(codec.decode_payload(hdr, stored), dests)
    return n


def _copy_out(host: Any, dests: Sequence[Any]) -> None:
    """A decoded payload in host memory into ``dests`` (byte views or tensors), in order."""
    at = 0
    mv = memoryview(host).cast("B")
    for d in dests:
        if isinstance(d, memoryview):
            d.cast("B")[:] = mv[at:at + d.nbytes]
            at += d.nbytes
            continue
        nb = d.numel() * d.element_size()
        d.view(-1).view(torch.uint8).copy_(torch.frombuffer(mv, dtype=torch.uint8,
                                                             count=nb, offset=at))
        at += nb
