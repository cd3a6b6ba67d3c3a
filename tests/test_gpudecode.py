"""The device decoder of planes blocks (kvfs.client.gpudecode), run on CPU tensors with a
host zstd decoder in nvCOMP's place: the frame walk, the plane merge into the destination,
and every check that makes a bad block a miss. tools/gpu_check.py runs it with nvCOMP."""

from __future__ import annotations

import struct

import pytest
import xxhash

torch = pytest.importorskip("torch")
pytest.importorskip("zstandard")

from kvfs.client import gpudecode  # noqa: E402
from kvfs.format import blockfile as bf  # noqa: E402
from kvfs.format import codec  # noqa: E402

from .test_codec import kv_like, needs_codec, raw_block  # noqa: E402

pytestmark = needs_codec


def encoded(payload: bytes, *, sums: bool = True) -> tuple[bf.BlockHeader, bytearray]:
    enc = codec.encode_file(raw_block(payload, sums=sums))
    assert enc is not None
    h = bf.decode_header(enc)
    assert h.encoding is not None
    return h, bytearray(enc[4096:4096 + h.encoding.stored_len])


def resealed(h: bf.BlockHeader, stored: bytearray) -> bf.BlockHeader:
    """``h`` with its stored checksum made right for ``stored`` (a forger's, or a codec
    bug's, stored bytes: only the decode can tell)."""
    from dataclasses import replace

    assert h.encoding is not None
    return replace(h, encoding=replace(h.encoding,
                                       stored_checksum=xxhash.xxh3_64_intdigest(stored)))


@pytest.mark.parametrize("sums", [True, False])
def test_decodes_into_the_destination_bit_for_bit(sums: bool) -> None:
    payload = kv_like(300_000)  # 600 KB: 5 frames in the high plane, the last one short
    h, stored = encoded(payload, sums=sums)
    want = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    out = torch.zeros(len(payload), dtype=torch.uint8)
    calls = []

    def frames(batch: list[torch.Tensor]) -> list[torch.Tensor]:
        calls.append(len(batch))
        return gpudecode.host_frames(batch)

    gpudecode.decode_into(h, stored, [out], frames)
    assert torch.equal(out, want)
    assert calls == [-(-300_000 // codec.CHUNK)]  # one batch: every frame of the block
    # In parts, as a paged block's layers lie (bfloat16 tensors, as an engine holds them).
    parts = [torch.zeros(n, dtype=torch.bfloat16) for n in (4096, 100_000, 300_000 - 104_096)]
    gpudecode.decode_into(h, stored, parts, gpudecode.host_frames)
    assert torch.equal(torch.cat([p.view(torch.uint8) for p in parts]), want)


def test_frame_walk_finds_each_frame_and_refuses_what_is_not_one() -> None:
    payload = kv_like(200_000)
    h, stored = encoded(payload)
    (w0, w1) = struct.unpack_from("<2Q", stored)
    assert w1 >> 63 and not w0 >> 63  # the high plane compressed, the low one as is
    start, length = 16 + (w0 & ((1 << 48) - 1)), w1 & ((1 << 48) - 1)
    spans = gpudecode.frame_spans(stored, start, length)
    assert len(spans) == -(-200_000 // codec.CHUNK)
    assert spans[0][0] == start and sum(m for _, m in spans) == length
    assert all(o + m == o2 for (o, m), (o2, _) in zip(spans, spans[1:], strict=False))
    for bad in (bytes(8), stored[start:start + length - 1], stored[start:start + 3]):
        with pytest.raises(bf.BlockFormatError, match="zstd frame"):
            gpudecode.frame_spans(bad, 0, len(bad))


def test_every_bad_block_is_a_miss() -> None:
    payload = kv_like(150_000)
    h, stored = encoded(payload)
    out = torch.zeros(len(payload), dtype=torch.uint8)
    # A torn or corrupt stored byte: the stored checksum, before anything is decoded.
    torn = bytearray(stored)
    torn[-1] ^= 1
    with pytest.raises(bf.BlockFormatError, match="checksum"):
        gpudecode.decode_into(h, torn, [out], gpudecode.host_frames)
    # A raw plane's byte changed under a resealed stored checksum: the payload sums.
    forged = bytearray(stored)
    forged[20] ^= 0x40
    with pytest.raises(bf.BlockFormatError, match="sums"):
        gpudecode.decode_into(resealed(h, forged), forged, [out], gpudecode.host_frames)
    # A broken plane table.
    table = bytearray(stored)
    table[6] = 1  # bits 48..62 of plane 0's word
    with pytest.raises(bf.BlockFormatError, match="plane table"):
        gpudecode.decode_into(resealed(h, table), table, [out], gpudecode.host_frames)

    # A device decoder that fails, or gives back wrong or short bytes.
    def failing(batch: list[torch.Tensor]) -> list[torch.Tensor]:
        raise RuntimeError("nvCOMP: decompression failed")

    def wrong(batch: list[torch.Tensor]) -> list[torch.Tensor]:
        got = gpudecode.host_frames(batch)
        got[1][5] ^= 1
        return got

    def short(batch: list[torch.Tensor]) -> list[torch.Tensor]:
        return [t[:-1] for t in gpudecode.host_frames(batch)]

    with pytest.raises(bf.BlockFormatError, match="zstd frame"):
        gpudecode.decode_into(h, stored, [out], failing)
    with pytest.raises(bf.BlockFormatError, match="sums"):
        gpudecode.decode_into(h, stored, [out], wrong)
    with pytest.raises(bf.BlockFormatError, match="decoded length"):
        gpudecode.decode_into(h, stored, [out], short)
    # Without sums (a version 1 block), the decoded payload's xxh3 catches it.
    h1, stored1 = encoded(payload, sums=False)
    with pytest.raises(bf.BlockFormatError, match="payload checksum"):
        gpudecode.decode_into(h1, stored1, [out], wrong)
    with pytest.raises(ValueError, match="holds|hold"):
        gpudecode.decode_into(h, stored, [out[:-2]], gpudecode.host_frames)


def test_no_nvcomp_decoder_off_cuda() -> None:
    assert gpudecode.nvcomp_frames(torch.device("cpu")) is None
