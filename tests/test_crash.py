"""Crash safety: SIGKILL the daemon at random points of concurrent saves, loads and evictions.

After every kill and remount: a full fsck finds nothing left to fix, capacity holds, and every
block that loads verifies (against content derived from its hash, not only its checksum).
Also: random byte flips anywhere in block files are all detected and become misses.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest

from .conftest import force_unmount, kvfs

torch = pytest.importorskip("torch")

import kvfs as kv  # noqa: E402

from . import kvload  # noqa: E402

SPEC = kvload.spec("crash/test")
LOAD = [sys.executable, kvload.__file__]



def all_blocks(m) -> list[bytes]:
    return kvload.all_blocks(m.backing / "t" / SPEC.namespace)


def test_sigkill_at_random_points(mount_factory, tmp_path):
    cap = 3 << 20
    m = mount_factory(extra=["--capacity", str(cap), "--high-watermark", "0.9",
                             "--low-watermark", "0.7"])
    kvfs("tenant", "add", str(m.mnt), "t", "--uid", "0", "--gid", "0")
    rng = random.Random(7)
    for round_ in range(6):
        worker = subprocess.Popen([*LOAD, str(m.mnt), str(round_), "t", SPEC.model, "4",
                                   str(m.mnt / "t" / "engine")],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert worker.stdout.readline().strip() == "ready", worker.stderr.read()
        time.sleep(rng.uniform(0.2, 1.5))
        os.kill(m.pid(), signal.SIGKILL)
        force_unmount(m.mnt)  # before waiting on the worker: see conftest.abort_connection
        worker.kill()
        out, err = worker.communicate()
        assert "WRONG KV" not in out, "a load returned KV that is not the block's"
        m.start()  # the mount reconciles the index itself after an unclean stop
        assert m.stats()["used_bytes"] <= cap
        m.stop()
        res = kvfs("fsck", str(m.backing), "--verify")
        assert " 0 added, 0 dropped, 0 updated, 0 partial files removed, 0 temporaries " \
               "removed, 0 quarantined, 0 orphans" in res.stdout, res.stdout
        m.start()
        hashes = all_blocks(m)
        with kv.KVCache.open(m.mnt, tenant="t", spec=SPEC) as cache:
            for h in hashes:
                out = torch.zeros(1, *SPEC.block_shape, dtype=torch.float16)
                if cache.load([h], out) == 1:
                    assert torch.equal(out, kvload.content(SPEC, [h]))
                else:  # only a block evicted meanwhile (above the high watermark) may miss
                    assert not os.path.exists(cache.path(h))
            assert cache.stats["corrupt_blocks"] == cache.stats["mismatched_blocks"] == 0
            assert cache.stats["loaded_blocks"] >= len(hashes) // 2


def test_every_byte_flip_is_a_miss(mount):
    """A flip anywhere in the header or the payload (every byte that could reach a model)
    is a miss on load; flips in the zero padding after the payload are found by
    `kvfs fsck --verify` (tests/test_posix.py)."""
    kvfs("tenant", "add", str(mount.mnt), "t", "--uid", "0", "--gid", "0")
    spec = kv.ModelSpec(model="flip/test", revision="1", kv_dtype="uint8", block_size=4,
                        num_layers=1, num_kv_heads=1, head_dim=8)
    rng = random.Random(1)
    with kv.KVCache.open(mount.mnt, tenant="t", spec=spec) as cache:
        size = 4096 + 4096  # header + one padded payload page
        for trial in range(40):
            tokens = [trial] * 4
            hashes = cache.block_hashes(tokens)
            data = torch.randint(0, 255, (1, *spec.block_shape), dtype=torch.uint8)
            cache.save(hashes, data)
            path = cache.path(hashes[0])
            raw = bytearray(open(path, "rb").read())
            assert len(raw) == size
            off = rng.randrange(4096 + 64)  # header + payload
            raw[off] ^= 1 << rng.randrange(8)
            with open(path, "r+b") as f:
                f.write(raw)
            out = torch.zeros_like(data)
            assert cache.load(hashes, out) == 0, f"flip at byte {off} went unnoticed"
            assert not out.any()
    assert mount.stats()["tenants"]["t"][spec.namespace]["checksum_failures"] == 40
