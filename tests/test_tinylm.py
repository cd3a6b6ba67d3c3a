"""The tiny transformer: a KV cache restored through kvfs gives exactly a recompute's tokens."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap

import pytest
import torch

from kvfs.client import KVCache
from kvfs.models.tinylm import (
    TinyLM,
    TinyLMConfig,
    blocks_to_kv,
    kv_to_blocks,
    restore_prefix,
    save_prefix,
)

from .conftest import kvfs as kvfs_cli

BS = 16
SEED = 7


@pytest.fixture(scope="module")
def model() -> TinyLM:
    return TinyLM(seed=SEED)


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(TinyLMConfig().vocab_size) for _ in range(n)]


def test_kv_does_not_depend_on_how_the_context_was_split(model):
    ctx = tokens(300, 1)
    logits, kv = model.prefill(ctx)
    assert kv.shape == (4, 2, 300, 2, 64) and kv.dtype == torch.float32
    assert logits.shape == (300, 512)
    parts, past = [], None
    for a, b in ((0, 37), (37, 38), (38, 200), (200, 201), (201, 300)):  # odd cuts, 1-token steps
        lg, past = model.prefill(ctx[a:b], past=past)
        parts.append(lg)
    assert torch.equal(torch.cat(parts), logits)
    assert torch.equal(past, kv)


def test_continuation_from_a_restored_prefix_equals_a_recompute(model):
    ctx = tokens(250, 2)
    want, kv_full = model.generate(ctx, 20)
    # The prefix's KV as a cache holds it: full blocks only, through the block layout, and
    # computed by another call than the one it is compared with.
    _, kv_prefix = model.prefill(ctx[:200])
    blocks = kv_to_blocks(kv_prefix, BS)
    assert blocks.shape == (12, 4, 2, BS, 2, 64) and blocks.is_contiguous()
    restored = blocks_to_kv(blocks.clone())
    assert restored.shape[2] == 12 * BS and torch.equal(restored, kv_prefix[:, :, :12 * BS])
    got, kv = model.generate(ctx[12 * BS:], 20, past=restored)
    assert got == want
    assert torch.equal(kv, kv_full)
    assert kv.shape[2] == 250 + 20  # the context and every generated token
    # The logits, too, are bit for bit a recompute's.
    lg_restored, _ = model.prefill(ctx[12 * BS:], past=restored)
    lg_full, _ = model.prefill(ctx)
    assert torch.equal(lg_restored, lg_full[12 * BS:])


def test_spec_names_the_weights():
    a, b = TinyLM(seed=1), TinyLM(seed=2)
    small = TinyLM(TinyLMConfig(num_layers=2), seed=1)
    assert a.spec(BS).model == "kvfs/models/tinylm" and a.spec(BS).kv_dtype == "float32"
    assert a.spec(BS).block_shape == (4, 2, BS, 2, 64)
    assert a.spec(BS).fingerprint == TinyLM(seed=1).spec(BS).fingerprint
    namespaces = {m.spec(BS).namespace for m in (a, b, small)} | {a.spec(32).namespace}
    assert len(namespaces) == 4
    assert small.spec(BS).num_layers == 2


def test_bad_inputs_are_refused(model):
    with pytest.raises(ValueError, match="token ids"):
        model.prefill([512])
    with pytest.raises(ValueError, match="past has shape"):
        model.prefill([1], past=torch.zeros(4, 2, 3, 4, 64))
    with pytest.raises(ValueError, match="dtype"):
        model.prefill([1], past=torch.zeros(4, 2, 3, 2, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match="multiple"):
        TinyLMConfig(num_heads=3, num_kv_heads=2)


RESTORE = textwrap.dedent("""
    import json, sys, time
    from kvfs.client import KVCache
    from kvfs.models.tinylm import TinyLM, restore_prefix
    args = json.loads(sys.argv[1])
    model = TinyLM(seed=args["seed"])
    with KVCache.open(args["mount"], tenant="acme", spec=model.spec(args["bs"])) as cache:
        n, kv = restore_prefix(cache, args["context"])
        stats = cache.stats
    out, _ = model.generate(args["context"][n:], args["n"], past=kv)
    print(json.dumps({"restored": n, "tokens": out, "direct": cache.direct,
                      "amp": stats["fetch_amplification"], "lookups": stats["lookups"]}))
""")


def test_conversation_restored_in_another_process(mount, model):
    kvfs_cli("tenant", "add", str(mount.mnt), "acme", "--uid", "0", "--gid", "0")
    conv: list[int] = tokens(200, 10)  # a system prompt
    kv = None
    saved = []
    with KVCache.open(mount.mnt, tenant="acme", spec=model.spec(BS)) as cache:
        for turn in range(3):
            user = tokens(50 + 7 * turn, 20 + turn)
            reply, kv = model.generate(user if kv is not None else conv + user, 12, past=kv)
            conv += user + reply
            assert kv.shape[2] == len(conv)
            full, new = save_prefix(cache, conv, kv)
            assert full == len(conv) // BS
            saved.append(new)
    assert all(new > 0 for new in saved)
    assert sum(saved) == len(conv) // BS  # each turn wrote only the blocks it added
    follow_up = tokens(40, 99)
    context = conv + follow_up
    want, _ = model.generate(context, 16)  # process 1: a full recompute
    args = {"mount": str(mount.mnt), "seed": SEED, "bs": BS, "context": context, "n": 16}
    res = subprocess.run([sys.executable, "-c", RESTORE, json.dumps(args)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["restored"] == len(conv) // BS * BS
    assert got["direct"] is True and got["amp"] == 1.0 and got["lookups"] == 1
    assert got["tokens"] == want
    ns = mount.stats()["tenants"]["acme"][model.spec(BS).namespace]
    assert ns["hit_blocks"] >= len(conv) // BS


def test_restore_prefix_on_a_miss(mount, model):
    kvfs_cli("tenant", "add", str(mount.mnt), "acme", "--uid", "0", "--gid", "0")
    with KVCache.open(mount.mnt, tenant="acme", spec=model.spec(BS)) as cache:
        assert restore_prefix(cache, tokens(64, 5)) == (0, None)
        _, kv = model.prefill(tokens(40, 5))
        assert save_prefix(cache, tokens(40, 5), kv) == (2, 2)
        n, restored = restore_prefix(cache, tokens(64, 5))
        assert n == 32 and torch.equal(restored, kv[:, :, :32])
        # A context whose every block is cached: the last block is recomputed, for its logits.
        n, restored = restore_prefix(cache, tokens(32, 5))
        assert n == 16 and torch.equal(restored, kv[:, :, :16])
        got, _ = model.generate(tokens(32, 5)[n:], 4, past=restored)
        assert got == model.generate(tokens(32, 5), 4)[0]
    with pytest.raises(ValueError, match="at least one new token"):
        model.generate([], 4, past=kv)


def test_a_corrupt_block_costs_a_recompute_never_a_wrong_token(mount, model):
    """Blocks of 2 MiB (read and checksummed piece by piece): a flipped byte deep inside one
    makes it, and every block after it, a miss; the continuation is still a recompute's."""
    kvfs_cli("tenant", "add", str(mount.mnt), "acme", "--uid", "0", "--gid", "0")
    bs = 512  # 512 tokens x 4 KiB of KV
    ctx = tokens(3 * bs + 40, 8)
    want, kv = model.generate(ctx, 8)
    with KVCache.open(mount.mnt, tenant="acme", spec=model.spec(bs)) as cache:
        assert cache.spec.block_payload_bytes == 2 << 20
        assert save_prefix(cache, ctx, kv) == (3, 3)
        with open(cache.path(cache.block_hashes(ctx)[1]), "r+b") as f:
            f.seek(4096 + (3 << 19) + 12345)  # in its second MiB
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 1]))
        n, restored = restore_prefix(cache, ctx)
        assert n == bs and cache.stats["corrupt_blocks"] == 1
    got, _ = model.generate(ctx[n:], 8, past=restored)
    assert got == want
