"""Blocks saved encoded into the hot tier, against real mounts: a lossy (int8) namespace,
and the mount's lossless hot-tier codec (--hot-codec planes)."""

from __future__ import annotations

import contextlib
import dataclasses
import os

import pytest
import torch

import kvfs
from kvfs.client import KVCache
from kvfs.format import blockfile, codec, hashing

from .conftest import flip_byte
from .conftest import kvfs as kvfs_cli

pytestmark = pytest.mark.skipif(not codec.available(), reason="kvfs.format._codec is not built")

SPEC = kvfs.ModelSpec(model="org/tiny", revision="r1", kv_dtype="bfloat16", block_size=16,
                      num_layers=8, num_kv_heads=2, head_dim=64)
LOSSY = dataclasses.replace(SPEC, extras={codec.SPEC_KEY: "int8"})


def kv(n: int, seed: int = 0, spec: kvfs.ModelSpec = SPEC) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn((n, *spec.block_shape), generator=g) * 3).to(torch.bfloat16)


def int8_reference(x: torch.Tensor) -> torch.Tensor:
    """What int8 per (token, head) makes of ``x``: codes round(x / s), s = max |x| / 127 over
    each head_dim row, decoded as codes * s in float32, rounded to bfloat16."""
    f = x.float()
    s = f.abs().amax(-1, keepdim=True) / 127
    q = torch.where(s > 0, f / torch.where(s > 0, s, 1), 0).round().clamp(-127, 127)
    return (q * s).to(x.dtype)


def headers(c: KVCache, hashes: list[bytes]) -> list[blockfile.BlockHeader]:
    out = []
    for h in hashes:
        with open(c.path(h), "rb") as f:
            out.append(blockfile.decode_header(f.read(blockfile.HEADER_SIZE)))
    return out


@pytest.fixture
def tenant(mount) -> str:
    kvfs_cli("tenant", "add", str(mount.mnt), "acme", "--uid", "0", "--gid", "0")
    return "acme"


def test_an_int8_namespace_stores_and_serves_int8_kv(mount, tenant):
    """Saved blocks are int8 codes and scales (1.9x fewer bytes, counted so by the mount);
    loads give exactly the int8 reference of what was saved; the exact namespace of the
    same model is another one and serves none of it."""
    assert LOSSY.namespace != SPEC.namespace
    x = kv(4)
    with KVCache.open(mount.mnt, tenant=tenant, spec=LOSSY) as c:
        assert c.codec == "int8"
        hashes = c.block_hashes(list(range(4 * 16)))
        assert c.save(hashes, x) == 4
        for hdr in headers(c, hashes):
            assert hdr.encoding is not None and hdr.encoding.codec == blockfile.CODEC_INT8
            assert hdr.encoding.chunk == SPEC.head_dim
            assert hdr.stored_len * 1.85 < hdr.payload_len
            assert hdr.file_size < 0.6 * (blockfile.HEADER_SIZE + LOSSY.block_payload_bytes)
        out = torch.zeros_like(x)
        assert c.lookup(hashes) == 4 and c.load(hashes, out) == 4
        assert torch.equal(out, int8_reference(x))
        assert not torch.equal(out, x)
        # within half a step (max |x| / 254) and bfloat16's rounding (max |x| / 256)
        amax = x.float().abs().amax(-1)
        assert ((out.float() - x.float()).abs().amax(-1) <= amax / 120).all()
        parts = [[torch.zeros(LOSSY.block_payload_bytes // 2, dtype=torch.bfloat16)]
                 for _ in hashes]
        assert c.load_parts(hashes, parts) == 4
        assert torch.equal(torch.stack([p[0] for p in parts]).view(x.shape), out)
        used = sum(h.file_size for h in headers(c, hashes))
    ns = mount.stats()["tenants"]["acme"][LOSSY.namespace]
    assert used <= ns["bytes"] < used + 4096  # and the manifest
    with KVCache.open(mount.mnt, tenant=tenant, spec=SPEC) as exact:
        assert exact.codec is None
        assert exact.lookup(hashes) == 0


def test_a_damaged_int8_block_is_a_miss(mount, tenant):
    x = kv(3, seed=1)
    with KVCache.open(mount.mnt, tenant=tenant, spec=LOSSY) as c:
        hashes = c.block_hashes(list(range(3 * 16)))
        c.save(hashes, x)
        flip_byte(c.path(hashes[1]), blockfile.HEADER_SIZE + 100, 0x01)  # one code
        out = torch.zeros_like(x)
        assert c.load(hashes, out) == 1
        assert torch.equal(out[0], int8_reference(x)[0])
        assert c.stats["corrupt_blocks"] == 1


def test_a_lossy_codec_kvfs_lacks_is_refused(mount, tenant):
    for extras, why in (({codec.SPEC_KEY: "int4"}, "not a lossy codec"),):
        spec = dataclasses.replace(SPEC, extras=extras)
        with pytest.raises(ValueError, match=why):
            KVCache.open(mount.mnt, tenant=tenant, spec=spec)
    spec = dataclasses.replace(SPEC, kv_dtype="uint8", extras={codec.SPEC_KEY: "int8"})
    with pytest.raises(ValueError, match="takes bfloat16"):
        KVCache.open(mount.mnt, tenant=tenant, spec=spec)


@pytest.mark.parametrize("hot_codec", ["planes", "none"])
def test_the_hot_tier_codec(mount_factory, hot_codec):
    """--hot-codec planes: clients save blocks encoded losslessly (the mount says so in
    user.kvfs.codec), loads give back the very bytes saved, and the namespace holds fewer
    bytes; --hot-codec none (the default) keeps them as saved."""
    m = mount_factory(extra=["--hot-codec", hot_codec])
    kvfs_cli("tenant", "add", str(m.mnt), "acme", "--uid", "0", "--gid", "0")
    x = kv(6, seed=2)
    with KVCache.open(m.mnt, tenant="acme", spec=SPEC) as c:
        assert os.getxattr(c.ns_dir, "user.kvfs.codec").decode() == hot_codec
        assert c.codec == (None if hot_codec == "none" else "planes")
        hashes = c.block_hashes(list(range(6 * 16)))
        assert c.save(hashes, x) == 6
        hdrs = headers(c, hashes)
        out = torch.zeros_like(x)
        assert c.load(hashes, out) == 6
        assert torch.equal(out, x)
        assert c.stats["corrupt_blocks"] == 0
    raw = blockfile.HEADER_SIZE + SPEC.block_payload_bytes
    for hdr in hdrs:
        if hot_codec == "planes":
            assert hdr.encoding is not None and hdr.encoding.codec == blockfile.CODEC_PLANES
            assert hdr.file_size < 0.9 * raw
        else:
            assert hdr.encoding is None and hdr.file_size == raw
    ns = m.stats()["tenants"]["acme"][SPEC.namespace]
    used = sum(h.file_size for h in hdrs)
    assert used <= ns["bytes"] < used + 4096  # and the manifest
    # what any reader of the mount sees is the block file as stored, whole and sound
    rel = hashing.block_relpath(hashes[0])
    data = (m.mnt / "acme" / SPEC.namespace / rel).read_bytes()
    assert bytes(blockfile.decode(data)[1]) == bytes(x[0].view(torch.uint8).reshape(-1).numpy())


def test_int8_blocks_stay_int8_below_and_back(mount_factory, tmp_path):
    """A lossy namespace's blocks are demoted as they are (not encoded again) and come back
    from the cold tier still int8: loads after the round trip give the same KV."""
    cold = tmp_path / "cold"
    file_bytes = blockfile.HEADER_SIZE + blockfile.padded_size(
        SPEC.block_payload_bytes // 2 + 4 * SPEC.block_payload_bytes // 2 // SPEC.head_dim)
    m = mount_factory(extra=["--capacity", str(4 * file_bytes + 8192), "--cold",
                             f"dir://{cold}"])
    kvfs_cli("tenant", "add", str(m.mnt), "acme", "--uid", "0", "--gid", "0")
    x = kv(12, seed=3)
    with KVCache.open(m.mnt, tenant="acme", spec=LOSSY) as c:
        hashes = c.block_hashes(list(range(12 * 16)))
        for i in range(0, 12, 3):  # three at a time: the earlier ones go below
            c.save(hashes[i:i + 3], x[i:i + 3], parent=hashes[i - 1] if i else None)
        below = [cold / "acme" / LOSSY.namespace / hashing.block_relpath(h) for h in hashes]
        stored = [p for p in below if p.exists()]
        assert len(stored) >= 6
        for p in stored:
            hdr = blockfile.decode_header(p.read_bytes()[:blockfile.HEADER_SIZE])
            assert hdr.encoding is not None and hdr.encoding.codec == blockfile.CODEC_INT8
        out = torch.zeros_like(x)
        assert c.lookup(hashes) == 12
        for i in range(0, 12, 3):  # as much as the hot tier holds at a time, each looked up
            # again (the promotions of the loads before move blocks between the tiers)
            assert c.lookup(hashes[i:i + 3]) == 3
            assert c.load(hashes[i:i + 3], out[i:i + 3]) == 3
        assert torch.equal(out, int8_reference(x))
        c.flush()
        hot = []  # the hot copies still there (eviction may take one between two calls)
        for h in hashes:
            with contextlib.suppress(FileNotFoundError):
                hot += headers(c, [h])
        assert hot and all(hdr.encoding.codec == blockfile.CODEC_INT8
                           for hdr in hot)  # promoted copies as saved: int8
    st = m.stats()
    assert st["tiers"][0]["hits"] >= 1
