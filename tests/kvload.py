"""The kvfs client under load, for the crash tests (test_crash, test_kill).

Block contents derive from their hashes, so any loaded block can be checked on its own, not
only against its checksum. Run as a script, it saves and loads from several threads until
killed, and exits 3 (printing WRONG KV) if a load ever returns KV that is not the block's:

    python kvload.py MNT SEED TENANT MODEL THREADS [ENGINE_DIR]

With ENGINE_DIR it also writes files there the way an engine's file backend does (temporary,
then rename into place). It prints "ready" once its threads run.
"""

from __future__ import annotations

import os
import random
import sys
import threading

import torch

import kvfs as kv
from kvfs.format import hashing


def spec(model: str) -> kv.ModelSpec:
    return kv.ModelSpec(model=model, revision="1", kv_dtype="float16", block_size=16,
                        num_layers=2, num_kv_heads=2, head_dim=64)


def content(spec: kv.ModelSpec, hashes: list[bytes]) -> torch.Tensor:
    """The KV of each block: random values seeded by its hash."""
    out = torch.empty(len(hashes), *spec.block_shape, dtype=torch.float16)
    for i, h in enumerate(hashes):
        g = torch.Generator().manual_seed(int.from_bytes(h[:8], "little"))
        out[i] = torch.randn(spec.block_shape, generator=g).to(torch.float16)
    return out


def all_blocks(ns_dir: str | os.PathLike) -> list[bytes]:
    """The hashes of the block files below a namespace's backing directory."""
    found = []
    for _, _, files in os.walk(ns_dir):
        for f in files:
            h = hashing.parse_block_filename(f)
            if h is not None:
                found.append(h)
    return found


def _work(cache: kv.KVCache, sp: kv.ModelSpec, rng: random.Random) -> None:
    while True:
        tokens = [rng.randrange(50) for _ in range(16 * rng.randrange(1, 12))]
        hashes = cache.block_hashes(tokens)
        if rng.random() < 0.6:
            try:
                cache.save(hashes, content(sp, hashes))
            except OSError:  # CacheFull among them
                pass
        else:
            n = cache.lookup(hashes)
            out = torch.zeros(len(hashes), *sp.block_shape, dtype=torch.float16)
            got = cache.load(hashes[:n], out)
            if got and not torch.equal(out[:got], content(sp, hashes[:got])):
                print("WRONG KV", flush=True)
                os._exit(3)


def _engine(ns: str, rng: random.Random) -> None:
    os.makedirs(ns, exist_ok=True)
    while True:
        name = os.path.join(ns, f"f{rng.randrange(40)}")
        with open(name + ".tmp", "wb") as f:
            f.write(os.urandom(rng.randrange(1, 60000)))
        os.replace(name + ".tmp", name)


def main(argv: list[str]) -> None:
    mnt, seed, tenant, model, threads = argv[:5]
    sp = spec(model)
    cache = kv.KVCache.open(mnt, tenant=tenant, spec=sp)
    for k in range(int(threads)):
        rng = random.Random(int(seed) * 100 + k)
        threading.Thread(target=_work, args=(cache, sp, rng), daemon=True).start()
    print("ready", flush=True)
    if len(argv) > 5:
        _engine(argv[5], random.Random(int(seed)))
    threading.Event().wait()


if __name__ == "__main__":
    main(sys.argv[1:])
