"""The lossless block codec (kvfs.format.codec, kvfs.format._codec) and format version 3."""

from __future__ import annotations

import os
import random
import struct
import threading
from array import array

import pytest
import xxhash

from kvfs.format import blockfile as bf
from kvfs.format import codec

needs_codec = pytest.mark.skipif(not codec.available(), reason="kvfs.format._codec not built")


def kv_like(n: int, seed: int = 0) -> bytes:
    """``n`` bfloat16 values drawn like KV (normal, a few scales): the high byte of each
    takes a few dozen values, the low byte is near random."""
    rng = random.Random(seed)
    f32 = array("f", [rng.gauss(0, rng.choice((0.5, 1.0, 4.0))) for _ in range(n)])
    return array("H", f32.tobytes())[1::2].tobytes()  # the top half of each float32


ARGS = dict(block_hash=bytes(range(16)), parent_hash=bytes(16), fingerprint=b"f" * 16,
            token_count=16)


def raw_block(payload: bytes, *, sums: bool = False, dtype: str = "bfloat16") -> bytes:
    k = bf.DTYPE_SIZES[dtype]
    return bf.encode(**ARGS, dtype=dtype, shape=(len(payload) // k,), payload=payload,
                     sums=sums)


def reseal(data: bytearray) -> bytes:
    """``data`` with its header checksum made right again (a forger's file)."""
    data[168:176] = bytes(8)
    data[168:176] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(data[:4096])))
    return bytes(data)


@needs_codec
@pytest.mark.parametrize("sums", [False, True])
def test_round_trip_is_the_same_file(sums: bool) -> None:
    payload = kv_like(200_000)  # 400 KB: several frames a plane, a partial last one
    raw = raw_block(payload, sums=sums)
    enc = codec.encode_file(raw)
    assert enc is not None and len(enc) < 0.8 * len(raw)
    h = bf.decode_header(enc)
    assert h.version == bf.ENCODED_VERSION and h.encoding is not None
    assert h.checksum == bf.payload_checksum(payload)  # the decoded payload's
    assert h.encoding.stored_checksum == xxhash.xxh3_64_intdigest(
        enc[4096:4096 + h.encoding.stored_len])  # the stored bytes'
    assert (h.sums is not None) == sums
    assert len(enc) == h.file_size and len(enc) % 4096 == 0
    assert codec.decode_file(enc) == raw  # byte for byte, header and all
    _, got = bf.decode(enc)
    assert bytes(got) == payload
    # Decoded into a destination in parts (a block's pages), as a load does.
    parts = [bytearray(1000), bytearray(len(payload) - 1007), bytearray(7)]
    codec.decode_payload(h, memoryview(enc)[4096:4096 + h.encoding.stored_len], parts)
    assert b"".join(parts) == payload


@needs_codec
def test_what_does_not_shrink_stays_as_saved() -> None:
    assert codec.encode_file(raw_block(os.urandom(64 << 10))) is None
    assert codec.encode_file(raw_block(os.urandom(64 << 10), dtype="uint8")) is None
    enc = codec.encode_file(raw_block(kv_like(30_000)))
    assert enc is not None and codec.encode_file(enc) is None  # encoded already
    with pytest.raises(bf.BlockFormatError):  # not a sound block: refused, not encoded
        codec.encode_file(raw_block(kv_like(30_000))[:-1])
    assert codec.decode_file(raw_block(b"ab" * 100)) == raw_block(b"ab" * 100)


@needs_codec
def test_a_plane_whose_first_chunk_does_not_shrink_is_stored_as_is() -> None:
    """The encoder probes each plane with its first chunk (codec.CHUNK elements): a plane
    whose probe does not shrink is stored as is, uncompressed, even where the rest of it
    would have; the other planes are compressed as ever, and the block decodes to itself."""
    n = 3 * codec.CHUNK
    lo = bytearray(os.urandom(n))  # a bfloat16 payload's low plane: random throughout
    hi = bytearray(n)  # its high plane: random in the first chunk, then constant
    hi[:codec.CHUNK] = os.urandom(codec.CHUNK)
    payload = bytearray(2 * n)
    payload[0::2], payload[1::2] = lo, hi
    assert codec.encode_payload(bytes(payload), 2) is None  # neither plane is compressed
    hi[:codec.CHUNK] = bytes(codec.CHUNK)  # the probe shrinks: the whole plane is compressed
    payload[1::2] = hi
    stored = codec.encode_payload(bytes(payload), 2)
    assert stored is not None
    words = struct.unpack_from("<QQ", stored)
    assert words[0] == n  # the low plane as is
    assert words[1] >> 63 and (words[1] & ((1 << 48) - 1)) < n // 100  # the high one zstd
    raw = raw_block(bytes(payload))
    enc = codec.encode_file(raw)
    assert enc is not None and codec.decode_file(enc) == raw


@needs_codec
def test_every_bit_flip_of_an_encoded_block_is_refused() -> None:
    """A corrupt stored byte fails the stored checksum; a forger who fixes that checksum and
    the header's still meets the decoder's checks and the decoded payload's checksum: never
    wrong bytes."""
    payload = kv_like(40_000, seed=3)
    enc = codec.encode_file(raw_block(payload))
    assert enc is not None
    h = bf.decode_header(enc)
    assert h.encoding is not None
    end = 4096 + h.encoding.stored_len
    rng = random.Random(7)
    for _ in range(60):
        at = rng.randrange(4096, end)
        bad = bytearray(enc)
        bad[at] ^= 1 << rng.randrange(8)
        with pytest.raises(bf.BlockFormatError, match="checksum"):
            bf.decode(bad)
        # The forger's version: the stored checksum recomputed, the header resealed.
        struct.pack_into("<Q", bad, 216, xxhash.xxh3_64_intdigest(bytes(bad[4096:end])))
        with pytest.raises(bf.BlockFormatError) as ei:
            bf.decode(reseal(bad))
        assert ei.value.reason in ("codec", "checksum")


@needs_codec
def test_encoding_fields_are_checked() -> None:
    enc = bytearray(codec.encode_file(raw_block(kv_like(30_000))) or b"")
    for off, value, match in [
        (192, struct.pack("<H", 9), "unknown codec"),
        (194, struct.pack("<H", 4), "flags"),  # 1: sums, 2: sealed
        (196, struct.pack("<I", 4), "element size"),
        (200, struct.pack("<I", 0), "chunk"),
        (204, struct.pack("<I", 1), "tiles"),  # planes has none
        (208, struct.pack("<Q", 60_001), "stored length"),  # longer than the payload
        (224, b"\x01", "reserved"),
    ]:
        bad = bytearray(enc)
        bad[off:off + len(value)] = value
        with pytest.raises(bf.BlockFormatError, match=match):
            bf.decode_header(reseal(bad))
    # A header that says the file is shorter or longer than it is.
    with pytest.raises(bf.BlockFormatError, match="length"):
        bf.decode(bytes(enc) + bytes(4096))


@needs_codec
def test_the_python_decoder_agrees(monkeypatch) -> None:
    """Where kvfs.format._codec is not built, python-zstandard decodes the same frames."""
    pytest.importorskip("zstandard")
    payload = kv_like(100_000, seed=5)
    raw = raw_block(payload, sums=True)
    enc = codec.encode_file(raw)
    assert enc is not None
    monkeypatch.setattr(codec, "_codec", None)
    assert not codec.available() and codec.encode_file(raw) is None
    assert codec.decode_file(enc) == raw
    h = bf.decode_header(enc)
    parts = [bytearray(333), bytearray(len(payload) - 333)]
    codec.decode_payload(h, memoryview(enc)[4096:4096 + h.stored_len], parts)
    assert b"".join(parts) == payload
    bad = bytearray(enc)
    bad[5000] ^= 0xFF
    with pytest.raises(bf.BlockFormatError):
        codec.decode_file(bad)


@needs_codec
def test_threads_decode_side_by_side() -> None:
    """Decoding releases the GIL: blocks decoded on several threads all come out right."""
    blocks = [raw_block(kv_like(60_000, seed=s)) for s in range(6)]
    encs = [codec.encode_file(b) for b in blocks]
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            for _ in range(5):
                assert codec.decode_file(encs[k]) == blocks[k]
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_format_vector() -> None:
    """The version 3 header of docs/format.md, field by field (no codec needed to parse)."""
    stored = bytes(range(16)) + bytes(20)  # any bytes: the header only names them
    payload = bytes(64)
    h = bf.make_header(**ARGS, dtype="bfloat16", shape=(32,), payload=payload)
    e = bf.Encoding(bf.CODEC_PLANES, 2, 65536, len(stored), xxhash.xxh3_64_intdigest(stored))
    from dataclasses import replace
    head = bf.encode_header(replace(h, encoding=e))
    assert struct.unpack_from("<I", head, 8)[0] == 3
    assert struct.unpack_from("<HHIIIQQ", head, 192) == (1, 0, 2, 65536, 0, 36,
                                                           e.stored_checksum)
    assert head[224:] == bytes(4096 - 224)
    got = bf.decode_header(head)
    assert got.encoding == e and got.file_size == 8192 and got.stored_len == 36
    assert bf.HeaderCheck(fingerprint=b"f" * 16, token_count=16, dtype="bfloat16",
                          shape=(32,)).payload_checksum(bytearray(head), ARGS["block_hash"]) \
        is None  # the readers' shortcut never takes an encoded header for a raw one


VECTOR_STORED = bytes.fromhex(
    "4000000000000000" "1100000000000080"
    "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f"
    "202122232425262728292a2b2c2d2e2f303132333435363738393a3b3c3d3e3f"
    "28b52ffd2040450000103f3f0100930016")
VECTOR_HEAD_160_224 = bytes.fromhex(
    "8c38d171b63489032c2f1e382ffcf06700000000000000000000000000000000"
    "010000000200000000000100000000006100000000000000edf5feee2910f993")


@pytest.mark.parametrize("native", [True, False])
def test_the_format_vector_decodes(monkeypatch, native: bool) -> None:
    """docs/format.md, section 5: the version 3 file made of the documented bytes decodes
    (with kvfs.format._codec, and with python-zstandard) into the documented block, whose own
    version 1 file comes back."""
    from kvfs.format import hashing

    if native and not codec.available():
        pytest.skip("kvfs.format._codec not built")
    if not native:
        pytest.importorskip("zstandard")
        monkeypatch.setattr(codec, "_codec", None)
    payload = b"".join(bytes([i, 0x3F]) for i in range(64))
    raw = bf.encode(block_hash=bytes(range(16)), parent_hash=hashing.ROOT_PARENT,
                    fingerprint=bytes.fromhex("d63a9e59af86df24757cd7b66c825fbc"),
                    token_count=4, dtype="bfloat16", shape=(64,), payload=payload)
    head = bytearray(raw[:4096])
    head[8:12] = struct.pack("<I", 3)
    head[160:224] = VECTOR_HEAD_160_224
    assert xxhash.xxh3_64_intdigest(VECTOR_STORED) == 0x93F91029EEFEF5ED
    f = bytes(head) + VECTOR_STORED + bytes(4096 - len(VECTOR_STORED))
    h, got = bf.decode(f)
    assert h.encoding == bf.Encoding(1, 2, 65536, 97, 0x93F91029EEFEF5ED)
    assert bytes(got) == payload and codec.decode_file(f) == raw


# -- int8 (lossy, by a namespace's choice) ---------------------------------------------------


def int8_block(payload: bytes, group: int = 64, dtype: str = "bfloat16"
               ) -> tuple[bf.BlockHeader, bytes]:
    k = bf.DTYPE_SIZES[dtype]
    h = bf.make_header(**ARGS, dtype=dtype, shape=(len(payload) // k // group, group),
                       payload=payload)
    got = codec.encode_block(h, payload, "int8")
    assert got is not None
    return got


@needs_codec
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_int8_decodes_as_torch_computes_it(monkeypatch, dtype: str) -> None:
    """The C decoder and the torch one give the same bytes and checksum; the codes and
    scales are max |x| / 127 per group; a block file of them decodes in blockfile.decode."""
    torch = pytest.importorskip("torch")
    x = (torch.randn(64, 64, generator=torch.Generator().manual_seed(5)) * 2).to(
        getattr(torch, dtype))
    x[3] = 0  # an all-zero group: scale 0, codes 0
    payload = x.view(torch.uint8).numpy().tobytes()
    h, stored = int8_block(payload, dtype=dtype)
    assert h.version == bf.ENCODED_VERSION and h.sums is None
    assert len(stored) == 64 * 64 + 4 * 64
    native = bytearray(h.payload_len)
    codec.decode_payload(h, stored, native)
    monkeypatch.setattr(codec, "_codec", None)
    fallback = bytearray(h.payload_len)
    codec.decode_payload(h, stored, fallback)
    assert native == fallback
    y = torch.frombuffer(native, dtype=x.dtype).view(x.shape)
    f = x.float()
    s = f.abs().amax(-1, keepdim=True) / 127
    q = torch.where(s > 0, f / torch.where(s > 0, s, 1), 0).round().clamp(-127, 127)
    assert torch.equal(y, (q * s).to(x.dtype)) and not y[3].any()
    monkeypatch.undo()
    data = b"".join(codec.file_parts(h, stored))
    assert bytes(bf.decode(data)[1]) == bytes(native)
    parts = [bytearray(1000), bytearray(h.payload_len - 1000)]  # into parts, in order
    codec.decode_payload(h, stored, parts)
    assert parts[0] + parts[1] == native


@needs_codec
def test_int8_refuses_what_it_cannot_hold_and_what_is_forged() -> None:
    torch = pytest.importorskip("torch")
    x = torch.randn(8, 64).to(torch.bfloat16)
    x[2, 5] = float("inf")
    payload = x.view(torch.uint8).numpy().tobytes()
    h = bf.make_header(**ARGS, dtype="bfloat16", shape=(8, 64), payload=payload)
    assert codec.encode_block(h, payload, "int8") is None  # stored as is, exact
    h8 = bf.make_header(**ARGS, dtype="uint8", shape=(8, 64), payload=bytes(512))
    assert codec.encode_block(h8, bytes(512), "int8") is None  # not a float dtype
    x[2, 5] = 1
    payload = x.view(torch.uint8).numpy().tobytes()
    h3, stored = int8_block(payload)
    data = b"".join(codec.file_parts(h3, stored))
    flipped = bytearray(data)
    flipped[bf.HEADER_SIZE + 7] ^= 0x10  # one code: the stored checksum
    with pytest.raises(bf.BlockFormatError, match="checksum"):
        bf.decode(flipped)
    from dataclasses import replace
    for field, value, why in ((8, 48, "groups of 48"), (16, len(stored) - 4, "stored length")):
        forged = bytearray(bf.encode_header(h3))  # a forger's header, checksum made right
        off = bf._ENC_OFF + field
        forged[off:off + (4 if field == 8 else 8)] = value.to_bytes(4 if field == 8 else 8,
                                                                    "little")
        with pytest.raises(bf.BlockFormatError, match=why):
            bf.decode_header(reseal(forged))
    wrong = replace(h3, checksum=h3.checksum ^ 1)  # a decoder that computes other values
    with pytest.raises(bf.BlockFormatError, match="checksum"):
        bf.decode(b"".join(codec.file_parts(wrong, stored)))



@needs_codec
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_int8_tiles_give_each_row_its_scale_where_keys_lie_down_columns(
        monkeypatch, dtype: str) -> None:
    """A head's keys transposed (head_dim rows of tokens: vLLM's CPU layout), its values as
    rows: with the tiles word each token's keys get their own scale, so a token of large keys
    (an attention sink) does not flatten the others; the C and torch decoders agree; forged
    tiles are refused."""
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(9)
    layers, heads, tokens, dim = 2, 3, 16, 64
    keys = torch.randn(layers, heads, tokens, dim, generator=g)
    keys[:, :, 0] *= 100  # the sink
    values = torch.randn(layers, heads, tokens, dim, generator=g)
    page = torch.cat([keys.transpose(2, 3).reshape(layers, heads, -1),
                      values.reshape(layers, heads, -1)], dim=2).to(getattr(torch, dtype))
    payload = page.contiguous().view(torch.uint8).numpy().tobytes()
    h = bf.make_header(**ARGS, dtype=dtype, shape=(layers, heads, 2 * tokens, dim),
                       payload=payload)
    tiles = bf.int8_tiles(tokens, (True, False))
    h8, stored = codec.encode_block(h, payload, "int8", tiles=tiles)
    assert h8.encoding.tiles == tiles and bf.decode_header(bf.encode_header(h8)) == h8
    native = bytearray(h.payload_len)
    codec.decode_payload(h8, stored, native)
    monkeypatch.setattr(codec, "_codec", None)
    fallback = bytearray(h.payload_len)
    codec.decode_payload(h8, stored, fallback)
    monkeypatch.undo()
    assert native == fallback

    def rows(buf: bytes) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.frombuffer(bytearray(buf), dtype=page.dtype).view(layers, heads, -1).float()
        return (y[..., :tokens * dim].view(layers, heads, dim, tokens).transpose(2, 3),
                y[..., tokens * dim:].view(layers, heads, tokens, dim))

    def per_row(x: torch.Tensor) -> torch.Tensor:
        s = x.abs().amax(-1, keepdim=True) / 127
        return ((x / s).round().clamp(-127, 127) * s).to(page.dtype).float()

    k, v = rows(native)
    k0, v0 = rows(payload)
    assert torch.equal(k, per_row(k0)) and torch.equal(v, per_row(v0))
    # Runs of 64 (no tiles) would share a scale across the sink's column: far worse keys.
    h_runs, s_runs = codec.encode_block(h, payload, "int8")
    runs = bytearray(h.payload_len)
    codec.decode_payload(h_runs, s_runs, runs)
    err = ((k - k0).abs() / k0.abs().amax(-1, keepdim=True))[:, :, 1:].max()
    err_runs = ((rows(runs)[0] - k0).abs() / k0.abs().amax(-1, keepdim=True))[:, :, 1:].max()
    assert err <= 1 / 254 + 1 / 128 < err_runs
    for bad, why in ((bf.int8_tiles(tokens, (True, False)) | 1 << 31, "tiles"),
                     (bf.int8_tiles(7, (True,)), "tiles")):
        forged = bytearray(bf.encode_header(h8))
        forged[bf._ENC_OFF + 12:bf._ENC_OFF + 16] = bad.to_bytes(4, "little")
        with pytest.raises(bf.BlockFormatError, match=why):
            bf.decode_header(reseal(forged))
    hp = codec.encode_block(h, payload, "planes")
    if hp is not None:  # planes has no tiles
        forged = bytearray(bf.encode_header(hp[0]))
        forged[bf._ENC_OFF + 12:bf._ENC_OFF + 16] = tiles.to_bytes(4, "little")
        with pytest.raises(bf.BlockFormatError, match="tiles"):
            bf.decode_header(reseal(forged))
