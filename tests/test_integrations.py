"""What the engine backends stand on, without the engines: KVCache.load_parts / save_parts on a
real mount, and the adapters' shared helpers (names, page specs, runs, configuration checks)."""

from __future__ import annotations

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from kvfs.client import KVCache  # noqa: E402
from kvfs.integrations._common import (  # noqa: E402
    BadConfig,
    check_target,
    key_hash,
    page_spec,
    runs,
)

from .conftest import kvfs  # noqa: E402


def test_importing_the_package_imports_no_engine():
    code = ("import sys, kvfs.integrations, kvfs.integrations._common, kvfs.integrations.drive;"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('sglang', 'lmcache')];"
            "print(bad); sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_runs_are_the_flat_bytes_in_order():
    kv = torch.arange(2 * 4 * 40 * 3, dtype=torch.int32).reshape(2, 4, 40, 3)
    for page in (kv[:, :, 8:24], kv[:, 16:32], kv[1:, :, 5:6]):
        pieces = runs(page)
        assert all(p.is_contiguous() for p in pieces)
        assert torch.equal(torch.cat([p.reshape(-1) for p in pieces]), page.flatten())
    assert len(runs(kv[:, :, 8:24])) == 8 and len(runs(kv[:, 1:3])) == 2


def test_key_hash_and_page_spec():
    key = "ab" * 32
    assert key_hash(key) == bytes.fromhex(key[:32])
    assert len(key_hash("model@1@0@123@bfloat16")) == 16
    assert key_hash("a") != key_hash("b")
    mha = page_spec(model="m", dtype=torch.bfloat16, page_bytes=2 * 4 * 16 * 2 * 64 * 2,
                    num_layers=4, tokens=16, heads=2, head_dim=64, tp_size=2, tp_rank=1,
                    extras={"layout": "page_first"})
    assert (mha.num_kv_heads, mha.head_dim, mha.tp_rank) == (2, 64, 1)
    mla = page_spec(model="m", dtype=torch.bfloat16, page_bytes=4 * 16 * 576 * 2,
                    num_layers=4, tokens=16, heads=None, head_dim=None, tp_size=1, tp_rank=0,
                    extras={})
    assert mla.block_payload_bytes == 4 * 16 * 576 * 2 and mla.num_kv_heads == 1
    with pytest.raises(BadConfig, match="is not 4 layers"):
        page_spec(model="m", dtype=torch.bfloat16, page_bytes=1000, num_layers=4, tokens=16,
                  heads=None, head_dim=None, tp_size=1, tp_rank=0, extras={})


def test_check_target_says_what_is_wrong(mount, tmp_path):
    kvfs("tenant", "add", str(mount.mnt), "t", "--uid", "0", "--gid", "0")
    assert check_target(str(mount.mnt), "t", "e", "cfg") == (str(mount.mnt), "t")
    for mnt, tenant, msg in ((None, "t", "no kvfs mount"), (str(mount.mnt), "", "set 'tenant'"),
                             (str(tmp_path), "t", "is not a kvfs mount"),
                             (str(mount.mnt), "nobody", "no tenant 'nobody'"),
                             (str(mount.mnt), "../x", "set 'tenant'")):
        with pytest.raises(BadConfig, match=msg):
            check_target(mnt, tenant, "e", "cfg")


def test_parts_round_trip_and_bad_parts_change_nothing(mount):
    from kvfs.format.hashing import ModelSpec

    kvfs("tenant", "add", str(mount.mnt), "t", "--uid", "0", "--gid", "0")
    spec = ModelSpec(model="m", revision="", kv_dtype="bfloat16", block_size=16,
                     num_layers=4, num_kv_heads=2, head_dim=32)
    n, size = 5, spec.block_payload_bytes
    pool = torch.randint(0, 256, (2, n, size // 2), dtype=torch.uint8)  # K runs, V runs
    hashes = [bytes([i]) * 16 for i in range(1, n + 1)]
    with KVCache.open(mount.mnt, tenant="t", spec=spec) as c:
        with pytest.raises(ValueError, match="a block's payload is"):
            c.save_parts(hashes[:1], [[pool[0, 0]]])
        with pytest.raises(ValueError, match="not contiguous"):
            c.save_parts(hashes[:1], [[pool[:, 0].t(), pool[0, 0]]])
        assert c.lookup(hashes) == 0  # nothing was written
        assert c.save_parts(hashes, [[pool[0, i], pool[1, i]] for i in range(n)]) == n
        back = torch.zeros_like(pool)
        assert c.load_parts(hashes, [[back[0, i], back[1, i]] for i in range(n)]) == n
        assert torch.equal(back, pool)
        # The same bytes as one contiguous block: the payload is the parts in order.
        whole = torch.zeros(n, size, dtype=torch.uint8)
        assert c.load_parts(hashes, [[whole[i]] for i in range(n)]) == n
        assert torch.equal(whole, torch.cat([pool[0], pool[1]], dim=1))


def test_large_blocks_written_in_hashed_pieces_read_back_verified(mount):
    """Payloads over ONE_READ_BYTES are hashed piece by piece as they are written, the header
    last: the file is the same (header checksum = xxh3_64 of the payload, padding zero), in
    parts whose boundaries fall inside a piece, and a flipped byte is still caught."""
    import xxhash

    from kvfs.client.transport import HASH_PIECE, ONE_READ_BYTES
    from kvfs.format import blockfile
    from kvfs.format.hashing import ModelSpec

    kvfs("tenant", "add", str(mount.mnt), "t", "--uid", "0", "--gid", "0")
    spec = ModelSpec(model="m", revision="", kv_dtype="bfloat16", block_size=256,
                     num_layers=9, num_kv_heads=2, head_dim=66)  # not a multiple of a piece
    n, size = 3, spec.block_payload_bytes
    assert size > ONE_READ_BYTES and size % HASH_PIECE
    cut = HASH_PIECE + 1000  # a part boundary inside the second piece
    pool = torch.randint(0, 256, (n, size), dtype=torch.uint8)
    hashes = [bytes([i]) * 16 for i in range(1, n + 1)]
    with KVCache.open(mount.mnt, tenant="t", spec=spec) as c:
        assert c.save_parts(hashes, [[pool[i, :cut], pool[i, cut:]] for i in range(n)]) == n
        for i, h in enumerate(hashes):
            raw = open(c.path(h), "rb").read()
            hdr = blockfile.decode_header(raw[:blockfile.HEADER_SIZE])
            payload = raw[blockfile.HEADER_SIZE:blockfile.HEADER_SIZE + size]
            assert payload == pool[i].numpy().tobytes()
            assert hdr.checksum == xxhash.xxh3_64_intdigest(payload)
            assert len(raw) == blockfile.HEADER_SIZE + blockfile.padded_size(size)
            assert not any(raw[blockfile.HEADER_SIZE + size:])
        back = torch.zeros_like(pool)
        assert c.load_parts(hashes, [[back[i]] for i in range(n)]) == n
        assert torch.equal(back, pool)
        with open(c.path(hashes[1]), "r+b") as f:  # one byte of the last piece flipped
            f.seek(blockfile.HEADER_SIZE + size - 5)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0xFF]))
        back.zero_()
        assert c.load_parts(hashes, [[back[i]] for i in range(n)]) == 1
