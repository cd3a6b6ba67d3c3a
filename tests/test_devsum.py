"""Payload sums (block format version 2) and the loads that verify them where bytes land.

kvikio reads into GPU memory, which the host never sees: there the client checks a block's
payload sums with torch ops (kvfs.client.devsum). There is no GPU here, so these tests run the same
torch code on CPU tensors, fed by a fake device transport (a POSIX transport that, like
kvikio with CUDA tensors, never hashes the bytes on the host and says that they land on a
device). tools/gpu_check.py runs the same checks on CUDA where a GPU is lent.
"""

from __future__ import annotations

import os
import struct

import pytest
import torch
import xxhash

import kvfs
from kvfs.client import KVCache, devsum, transport
from kvfs.format import blockfile as bf

from .conftest import flip_byte
from .conftest import kvfs as kvfs_cli

SPEC = kvfs.ModelSpec(model="org/tiny", revision="r1", kv_dtype="bfloat16", block_size=4,
                      num_layers=3, num_kv_heads=2, head_dim=8)  # 768-byte payloads
#: Layers of exactly one 4 KiB row each: a paged block's sums are combined piece by piece.
PAGED = kvfs.ModelSpec(model="org/paged", revision="r1", kv_dtype="bfloat16", block_size=16,
                       num_layers=2, num_kv_heads=2, head_dim=32)

# Pinned: the version 2 form of docs/format.md's test vector (same fields and payload).
ARGS = dict(block_hash=bytes(range(16)), parent_hash=bytes(16),
            fingerprint=bytes.fromhex("d63a9e59af86df24757cd7b66c825fbc"), token_count=4,
            dtype="float16", shape=(2, 3))
V2_HEADER = (
    "4b564653424c4b000200000000100000000102030405060708090a0b0c0d0e0f"
    "00000000000000000000000000000000d63a9e59af86df24757cd7b66c825fbc"
    "0400000002000000666c6f617431360000000000000000000200000000000000"
    "0300000000000000000000000000000000000000000000000000000000000000"
    "0000000000000000000000000000000000000000000000000c00000000000000"
    "4b89101c516ace5a{hcsum}"
    "0c0f1215000000000c0f121520262c32"
)


class FakeDeviceTransport(transport.PosixTransport):
    """The POSIX transport, acting for CPU tensors as kvikio does for CUDA ones: the client
    reads into them through the transport (not host views), never hashes what landed there,
    and verifies it by its payload sums; saves from them carry sums."""

    name = "fake-device"

    def reads_to_host(self, t: torch.Tensor) -> bool:
        return False

    def device_verifies(self, t: torch.Tensor) -> bool:
        return True


def device_cache(mount, tenant: str, spec: kvfs.ModelSpec = SPEC, **kw) -> KVCache:
    c = KVCache.open(mount.mnt, tenant=tenant, spec=spec, io="posix", **kw)
    c.transport = FakeDeviceTransport(spec.block_payload_bytes, 4)
    return c


def kv_for(n: int, spec: kvfs.ModelSpec = SPEC, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, *spec.block_shape), generator=g).to(torch.bfloat16)


@pytest.fixture
def tenant(mount) -> str:
    kvfs_cli("tenant", "add", str(mount.mnt), "acme", "--uid", "0", "--gid", "0")
    return "acme"


# -- the sums themselves ---------------------------------------------------------------------


def test_version_2_vector():
    data = bf.encode(**ARGS, payload=bytes(range(12)), sums=True)
    # Words 0x03020100, 0x07060504, 0x0b0a0908 in one row: word sum 353505036, row sum
    # the same (row weight 1), column sum 1*w0 + 2*w1 + 3*w2 mod (2**31 - 1) = 841754144.
    w = [0x03020100, 0x07060504, 0x0B0A0908]
    p = bf.SUMS_PRIME
    assert bf.payload_sums(bytes(range(12))) == (sum(w), sum(w), (w[0] + 2 * w[1] + 3 * w[2]) % p)
    hcsum = data[168:176].hex()
    assert data[:192].hex() == V2_HEADER.format(hcsum=hcsum)
    assert hcsum == "72e484e93bef8e44" and bf.payload_sums(bytes(range(12)))[2] == 841754144
    assert struct.unpack_from("<Q", data, 168)[0] == xxhash.xxh3_64_intdigest(
        data[:168] + bytes(8) + data[176:4096])
    assert data[192:4096] == bytes(4096 - 192) and len(data) == 8192
    h, payload = bf.decode(data, sums=True)
    assert h.version == 2 and h.sums == bf.payload_sums(payload)


@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 12, 4095, 4096, 4097, 3 * 4096 + 10, 1 << 17])
def test_torch_sums_equal_the_reference(n):
    data = os.urandom(n)
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if n else torch.zeros(
        0, dtype=torch.uint8)
    want = bf.payload_sums(data)
    assert devsum.payload_sums([t]) == want
    cut = 4096 * (n // 8192)  # whole rows, then the rest: combined piece by piece
    assert devsum.payload_sums([t[:cut], t[cut:]]) == want
    assert devsum.payload_sums([t[:n // 3], t[n // 3:n // 2], t[n // 2:]]) == want  # any cut


def test_torch_sums_in_a_batch_and_at_odd_addresses(monkeypatch):
    g = torch.Generator().manual_seed(1)
    rows = torch.randint(0, 256, (4, 2 * 4096 + 6), dtype=torch.uint8, generator=g)
    want = [bf.payload_sums(bytes(rows[i].tolist())) for i in range(4)]
    assert devsum.as_tuples(devsum.block_sums(rows)) == want
    odd = torch.randint(0, 256, (4 * 8192 + 1,), dtype=torch.uint8, generator=g)[1:]
    odd = odd.view(4, 8192)  # not 4-byte aligned: summed from an aligned copy
    assert devsum.as_tuples(devsum.block_sums(odd)) == [
        bf.payload_sums(bytes(odd[i].tolist())) for i in range(4)]
    monkeypatch.setattr(devsum, "_STEP_ROWS", 1)  # step by step: the same sums
    assert devsum.as_tuples(devsum.block_sums(rows)) == want
    with pytest.raises(ValueError):
        devsum.block_sums(rows.view(torch.int16))


def test_every_byte_flip_gives_the_hosts_verdict():
    """The verdict of the sums (the device path) equals xxh3's (the host path) for the same
    file: sound passes both; any byte changed anywhere in the payload fails both."""
    payload = bytearray(os.urandom(2 * 4096 + 12))
    data = bytearray(bf.encode(**{**ARGS, "shape": (len(payload) // 2,)}, payload=payload,
                               sums=True))
    h = bf.decode_header(data)
    for off in range(4096, 4096 + len(payload)):
        for mask in (0x01, 0x80, 0xFF):
            data[off] ^= mask
            body = torch.frombuffer(data, dtype=torch.uint8)[4096:4096 + len(payload)]
            device_ok = devsum.payload_sums([body]) == h.sums
            host_ok = xxhash.xxh3_64_intdigest(bytes(body.tolist())) == h.checksum
            assert not device_ok and not host_ok, off
            data[off] ^= mask
    body = torch.frombuffer(data, dtype=torch.uint8)[4096:4096 + len(payload)]
    assert devsum.payload_sums([body]) == h.sums


def test_sums_catch_moved_pages_and_words():
    """What a plain sum misses: pages swapped, words swapped in a page, a word moved to
    another page (the row and column sums weigh each word by where it is)."""
    base = bytearray(os.urandom(3 * 4096))
    want = bf.payload_sums(base)
    pages = bytes(base[4096:8192] + base[:4096] + base[8192:])
    words = bytearray(base)
    words[0:4], words[8:12] = base[8:12], base[0:4]
    moved = bytearray(base)
    moved[0:4], moved[4096:4100] = base[4096:4100], base[0:4]
    for bad in (pages, words, moved):
        assert bad != base and bf.payload_sums(bad) != want


def test_version_2_headers_are_checked_as_strictly():
    data = bf.encode(**ARGS, payload=bytes(range(12)), sums=True)
    for off in range(0, 4096):
        bad = bytearray(data)
        bad[off] ^= 0x04
        with pytest.raises(bf.BlockFormatError):
            bf.decode(bad)
    # Sums out of range, with a right header checksum: refused by the decode and the fast
    # check alike; the sums themselves wrong: refused by decode(sums=True) only.
    check = bf.HeaderCheck(fingerprint=ARGS["fingerprint"], token_count=4, dtype="float16",
                           shape=(2, 3))
    head = bytearray(data[:4096])
    assert check.payload_checksum(head, ARGS["block_hash"]) == xxhash.xxh3_64_intdigest(
        bytes(range(12)))
    assert check.sums(head) == bf.payload_sums(bytes(range(12)))

    def resealed(buf: bytearray) -> bytearray:
        buf[168:176] = bytes(8)
        buf[168:176] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(buf[:4096])))
        return buf

    big = resealed(bytearray(data[:184]) + struct.pack("<I", bf.SUMS_PRIME) + data[188:])
    with pytest.raises(bf.BlockFormatError, match="header"):
        bf.decode(big)
    assert check.payload_checksum(bytearray(big[:4096]), ARGS["block_hash"]) is None
    wrong = resealed(bytearray(data[:176]) + struct.pack("<Q", 5) + data[184:])
    bf.decode(wrong)  # xxh3 right: the host's verdict
    with pytest.raises(bf.BlockFormatError, match="checksum"):
        bf.decode(wrong, sums=True)
    reserved = resealed(bytearray(data[:3000]) + b"\x01" + data[3001:])
    with pytest.raises(bf.BlockFormatError, match="reserved"):
        bf.decode(reserved)
    assert check.payload_checksum(bytearray(reserved[:4096]), ARGS["block_hash"]) is None
    v4 = resealed(bytearray(data[:8]) + struct.pack("<I", 4) + data[12:])
    with pytest.raises(bf.BlockFormatError, match="version"):
        bf.decode(v4)
    # Version 3 (encoded) needs its encoding fields, and sums it does not flag are refused.
    v3 = resealed(bytearray(data[:8]) + struct.pack("<I", 3) + data[12:])
    with pytest.raises(bf.BlockFormatError, match="not flagged"):
        bf.decode(v3)


# -- loads through a device transport -----------------------------------------------------------


def test_device_saves_write_version_2_and_loads_verify_the_sums(mount, tenant):
    with device_cache(mount, tenant) as dev, KVCache.open(mount.mnt, tenant=tenant,
                                                          spec=SPEC) as host:
        hashes = dev.block_hashes(list(range(6 * SPEC.block_size)))
        kv = kv_for(6)
        assert dev.save(hashes, kv) == 6
        for h in hashes:
            with open(dev.path(h), "rb") as f:
                hdr, payload = bf.decode(f.read(), sums=True)
            assert hdr.version == 2
        out = torch.zeros_like(kv)
        calls, hashed = [], []
        real, real_xxh3 = devsum.block_sums, xxhash.xxh3_64_intdigest
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(devsum, "block_sums", lambda t: calls.append(t.shape) or real(t))
            mp.setattr(xxhash, "xxh3_64_intdigest", lambda b: hashed.append(
                memoryview(b).nbytes) or real_xxh3(b))
            mp.setattr(xxhash, "xxh3_64", None)
            mp.setattr(transport, "checksum", None)
            assert dev.load(hashes, out) == 6
        assert torch.equal(out, kv)
        assert set(hashed) <= {bf.HEADER_SIZE}  # headers only: the payload is never hashed
        assert calls == [(6, SPEC.block_payload_bytes)]  # one batch for the whole load
        host_out = torch.zeros_like(kv)
        assert host.load(hashes, host_out) == 6 and torch.equal(host_out, kv)  # v2 on the host


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_corrupt_byte_is_a_miss_on_the_device_as_on_the_host(mount, tenant, where):
    """The same corrupted file: the device path (sums) and the host path (xxh3) load the same
    prefix; the device path zeroes the block, reports it, and the daemon quarantines it."""
    with device_cache(mount, tenant) as dev, KVCache.open(mount.mnt, tenant=tenant,
                                                          spec=SPEC) as host:
        hashes = dev.block_hashes(list(range(4 * SPEC.block_size)), extra=where)
        kv = kv_for(4, seed=3)
        dev.save(hashes, kv)
        off = {"first": 4096, "middle": 4096 + 300,
               "last": 4096 + SPEC.block_payload_bytes - 1}[where]
        flip_byte(dev.path(hashes[2]), off, 0x20)
        # The host's verdict first (without letting it report: read the file as it does).
        with open(host.path(hashes[2]), "rb") as f:
            with pytest.raises(bf.BlockFormatError, match="checksum"):
                bf.decode(f.read())
        out = torch.full_like(kv, 7.0)
        assert dev.load(hashes, out) == 2
        assert torch.equal(out[:2], kv[:2]) and torch.count_nonzero(out[2]) == 0
        assert dev.stats["corrupt_blocks"] == 1
        assert not os.path.exists(dev.path(hashes[2]))  # the daemon agreed: quarantined
        assert host.load(hashes, torch.zeros_like(kv)) == 2


def test_version_1_blocks_load_through_the_device_path(mount, tenant):
    """Blocks written by a host (version 1, no sums) still load on a device: checked by xxh3
    over a copy of their bytes; a corrupt one is a miss there too."""
    with KVCache.open(mount.mnt, tenant=tenant, spec=SPEC) as host, \
            device_cache(mount, tenant) as dev:
        hashes = host.block_hashes(list(range(3 * SPEC.block_size)), extra="v1")
        kv = kv_for(3, seed=5)
        host.save(hashes, kv)
        with open(host.path(hashes[0]), "rb") as f:
            assert bf.decode_header(f.read(4096)).version == 1
        out = torch.zeros_like(kv)
        assert dev.load(hashes, out) == 3 and torch.equal(out, kv)
        flip_byte(dev.path(hashes[1]), 4096 + 17, 0x20)
        out = torch.full_like(kv, 7.0)
        assert dev.load(hashes, out) == 1 and torch.count_nonzero(out[1]) == 0


def test_paged_and_layerwise_loads_verify_on_the_device(mount, tenant):
    with device_cache(mount, tenant, spec=PAGED) as dev:
        assert PAGED.block_payload_bytes // PAGED.num_layers == 4096  # whole rows per layer
        hashes = dev.block_hashes(list(range(4 * PAGED.block_size)))
        kv = kv_for(4, PAGED, seed=7)
        pages = [torch.zeros((6, *PAGED.block_shape[1:]), dtype=torch.bfloat16)
                 for _ in range(PAGED.num_layers)]
        ids = [4, 0, 5, 2]
        for i, p in enumerate(ids):
            for layer in range(PAGED.num_layers):
                pages[layer][p] = kv[i, layer]
        dev.save_paged(hashes, pages, ids)  # sums combined from the layers' pages
        for h in hashes:
            with open(dev.path(h), "rb") as f:
                bf.decode(f.read(), sums=True)
        dst = [torch.zeros_like(t) for t in pages]
        assert dev.load_paged(hashes, dst, [1, 2, 3, 0]) == 4
        for i, p in enumerate([1, 2, 3, 0]):
            for layer in range(PAGED.num_layers):
                assert torch.equal(dst[layer][p], kv[i, layer])
        out = torch.zeros_like(kv)
        assert dev.load_async(hashes, out).wait() == 4 and torch.equal(out, kv)
        flip_byte(dev.path(hashes[3]), 4096 + 4096 + 5, 0x20)  # layer 1 of block 3
        dst = [torch.full_like(t, 7.0) for t in pages]
        assert dev.load_paged(hashes, dst, [1, 2, 3, 0]) == 3
        assert all(torch.count_nonzero(d[0]) == 0 for d in dst)
        out = torch.full_like(kv, 7.0)
        assert dev.load_async(hashes, out).wait() == 3  # now quarantined: absent


def test_layerwise_device_check_catches_corruption(mount, tenant):
    with device_cache(mount, tenant) as dev:
        hashes = dev.block_hashes(list(range(5 * SPEC.block_size)), extra="lw")
        kv = kv_for(5, seed=9)
        dev.save(hashes, kv)
        flip_byte(dev.path(hashes[3]), 4096 + SPEC.block_payload_bytes - 2, 0x20)
        out = torch.full_like(kv, 7.0)
        h = dev.load_async(hashes, out)
        assert h.wait() == 3
        assert torch.equal(out[:3], kv[:3]) and torch.count_nonzero(out[3]) == 0
        assert dev.stats["corrupt_blocks"] == 1


# -- tools/gpu_check.py's verdicts, emulated ------------------------------------------------------


def _gpu_check(monkeypatch):
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "tools" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", mod)  # its dataclasses look it up
    spec.loader.exec_module(mod)
    return mod


def test_gpu_check_verdicts_pass_emulated_and_fail_on_a_wrong_verdict(mount, tenant, tmp_path,
                                                                       monkeypatch, capsys):
    """The verdict checks that tools/gpu_check.py runs on CUDA, run here through the emulated
    device: exit 0 as things are, 1 where the device path accepts a corrupted block."""
    gpu_check = _gpu_check(monkeypatch)
    out = tmp_path / "v.json"
    assert gpu_check.main([str(mount.mnt), "--tenant", tenant, "--emulate",
                           "--json", str(out)]) == 0
    assert "OK (emulated)" in capsys.readouterr().out
    monkeypatch.setattr(devsum, "as_tuples", lambda sums: [(0, 0, 0)] * len(sums))
    assert gpu_check.main([str(mount.mnt), "--tenant", tenant, "--emulate"]) == 1
    text = capsys.readouterr().out
    assert "FAILED" in text and "payload sums" in text and "WRONG" in text
