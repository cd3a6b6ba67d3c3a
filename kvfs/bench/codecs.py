"""``kvfs bench codec``: the lossless block codec on real model KV, against the bounds of this
machine and the codec a user would pick instead, in one run.

Sources of blocks:

- **smollm2 (vLLM)**: the blocks a real vLLM (the CPU build of ``tools/setup_vllm.sh``,
  SmolLM2-135M-Instruct, bfloat16) saved through the KVFSConnector into a kvfs mount while it
  prefilled a fixed English text (kvfs's own module docstrings, ``--tokens`` tokens): the
  block files exactly as the hot tier holds them;
- **llama-3-8b-shape (synthetic)**: Llama-3-8B-shaped blocks (32 layers, 8 KV heads of 128,
  16 tokens: 2 MiB) of bfloat16 values drawn from normal distributions, one scale per head
  (log-normal): the restore benchmark's shape with values instead of random bytes.

For each source, on its blocks, one thread unless said (figures per core):

- **ratio**: raw block files' bytes over the stored files' bytes (``kvfs.format.codec.encode_file``,
  blocks that do not pay stored as is), against zstd level 1 of each whole payload (the codec
  a user would reach for) and against the order-0 bound: each byte plane coded at its
  order-0 entropy (a plane whose entropy is 8 bits stored as is), which no coder of single
  bytes beats;
- **decode GB/s** (payload bytes per second): ``kvfs.format.codec.decode_payload`` into a
  destination buffer, both checksums checked, against the zstd library (libzstd, the one
  ``kvfs.format._codec`` links) decompressing the same frames alone, in the same loop with the merge
  and the checksums left out: the library's own speed on these frames; and against zstd
  level 1 of the whole payload, decoded by python-zstandard;
- **decode GB/s, all cores**: the same on ``--threads`` threads (one block each at a time),
  against copying and hashing (xxh3_64) raw payloads on as many threads: what a raw block's
  verified landing costs once its bytes are read;
- **encode MB/s**: ``encode_file`` (split, zstd, checksums), against zstd level 1 of the whole
  payload.

The lossy codec (``int8``, by a namespace's choice) on the same blocks: its ratio, and
decode and encode speed per core against a copy + xxh3 of the raw payloads.

**Quality gate** (smollm2 source): ``--gate-prompts`` fixed prompts of the same English text
(``--gate-tokens`` tokens each, vLLM block size 32), each served twice by a real vLLM with the
KVFSConnector, 32 greedy tokens with the top 20 logprobs of each: first in a saving engine
(the whole prompt computed: the **full recompute**, the reference), then in a fresh engine that
restores the prompt's blocks from the mount and computes only the last one. The exact
namespace and an int8 one (``kv_codec: int8``) are run so; each restore is compared with the
reference: the share of 32-token continuations identical to it, and, at every generated
position whose context is still the reference's (up to the first token that differs), top-1
agreement and KL(reference || restore) of the next-token distribution over the reference's
top 20 tokens (a token outside the restore's own top 20 taken at its 20th logprob). Then the
exact namespace's files are rewritten with the lowest bit of 1 % of their values flipped
(one bf16 ulp, seeded) and restored again: the **perturbed restore**, the floor of any KV
that is not bit-exact. On a CPU engine the exact restore is bit-identical to the full
recompute (the same kernels in the same order), so it shows no noise; the perturbed one
shows what the engine's bf16 arithmetic makes of the smallest change, and int8's figures
are compared with both it and the absolute targets. The int8 namespace's own saving engine
(a second full recompute) is compared with the first too.

Each figure is the median of ``--repeats`` passes over all the blocks.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import xxhash

from ..format import blockfile, codec
from .common import finish
from .harness import (
    LLAMA_HEAD_DIM,
    LLAMA_KV_HEADS,
    LLAMA_LAYERS,
    Mount,
    conditions,
    conditions_after,
    fuse_available,
)
from .records import Kind, figure_table

LLAMA = dict(layers=LLAMA_LAYERS, heads=LLAMA_KV_HEADS, dim=LLAMA_HEAD_DIM, tokens=16)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--python", default=os.path.join(".venv-vllm", "bin", "python"),
                   help="the vLLM venv's python (tools/setup_vllm.sh)")
    p.add_argument("--model", default=os.path.join(".cache", "models",
                                                   "smollm2-135m-instruct"))
    p.add_argument("--tokens", type=int, default=2048, help="tokens of text vLLM prefills (2048)")
    p.add_argument("--llama-blocks", type=int, default=16, dest="llama_blocks",
                   help="synthetic Llama-shaped blocks of 2 MiB (16)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="threads of the all-cores figures (default: the CPUs)")
    p.add_argument("--repeats", type=int, default=5, help="passes per figure; median (5)")
    p.add_argument("--no-engine", dest="engine", action="store_false",
                   help="skip the vLLM source (the synthetic blocks only)")
    p.add_argument("--dir", default=".", help="where the mount and its blocks go (here)")
    p.add_argument("--gate-prompts", type=int, default=18, dest="gate_prompts",
                   help="prompts of the int8 quality gate (18; 0: no gate)")
    p.add_argument("--gate-tokens", type=int, default=320, dest="gate_tokens",
                   help="tokens of each gate prompt (320)")


def check_args(args: argparse.Namespace) -> str | None:
    if not codec.available():
        return "kvfs.format._codec is not built (gcc, libzstd-dev; then reinstall kvfs)"
    if min(args.tokens, args.llama_blocks, args.threads, args.repeats) < 1:
        return "--tokens, --llama-blocks, --threads and --repeats must be at least 1"
    if not os.path.isdir(args.dir):
        return f"no directory {args.dir}"
    return None


def log(msg: str) -> None:
    print(f"bench codec: {msg}", file=sys.stderr, flush=True)


# -- sources -------------------------------------------------------------------------------------


def text(tokens: int) -> str:
    """A fixed English text of at least ``tokens`` tokens (about 4 characters a token): the
    module docstrings of kvfs as they stood on 2026-12-04 (``prompt_text.txt``, kept fixed so
    that every run, at any commit, prefills and gates on the same prompts), repeated as
    often as needed."""
    from importlib.resources import files  # noqa: PLC0415

    body = files(__package__).joinpath("prompt_text.txt").read_text()
    return "\n\n".join([body] * max(1, -(-6 * tokens // len(body))))


def vllm_blocks(args: argparse.Namespace, work: str) -> tuple[list[bytes], str]:
    """The block files a real vLLM saved through the connector, and what they are."""
    from .engine import _engine  # noqa: PLC0415

    prompt = os.path.join(work, "prompt.json")
    with open(prompt, "w") as f:
        json.dump({"parts": [[text(args.tokens), args.tokens]]}, f)
    m = Mount.under(os.path.join(work, "m"))
    m.start()
    try:
        m.add_tenant("bench")
        args.max_model_len = args.tokens + 64
        got = _engine(args, work, ["--connector", "kvfs", "--mount", str(m.mnt),
                                   "--tenant", "bench"], [prompt])
    finally:
        m.stop()
    files = sorted(glob.glob(os.path.join(m.backing, "bench", "*", "*", "*.kv")))
    blocks = [open(p, "rb").read() for p in files]
    saved = got.get("worker", {}).get("client", {}).get("saved_blocks")
    h = blockfile.decode_header(blocks[0]) if blocks else None
    what = (f"{len(blocks)} blocks vLLM saved ({saved} by its count) of {h.token_count} "
            f"tokens, {h.dtype} {list(h.shape)}, {h.payload_len / 2**20:.2f} MiB each"
            if h else "no blocks saved")
    return blocks, what


def llama_blocks(n: int, seed: int = 0) -> tuple[list[bytes], str]:
    import torch  # noqa: PLC0415

    g = torch.Generator().manual_seed(seed)
    shape = (LLAMA["layers"], 2, LLAMA["tokens"], LLAMA["heads"], LLAMA["dim"])
    out = []
    rng = random.Random(seed)
    for i in range(n):
        scale = torch.tensor([[math.exp(rng.gauss(0, 1)) for _ in range(LLAMA["heads"])]
                              for _ in range(LLAMA["layers"] * 2)]).reshape(
                                  LLAMA["layers"], 2, 1, LLAMA["heads"], 1)
        kv = (torch.randn(shape, generator=g) * scale).to(torch.bfloat16)
        payload = kv.view(torch.uint8).numpy().tobytes()
        out.append(blockfile.encode(block_hash=xxhash.xxh3_128_digest(b"%d" % i),
                                    parent_hash=bytes(16), fingerprint=bytes(16),
                                    token_count=LLAMA["tokens"], dtype="bfloat16",
                                    shape=shape, payload=payload))
    return out, (f"{n} blocks of {LLAMA['tokens']} tokens, bfloat16 {list(shape)}, "
                 f"2 MiB each; normal values, one log-normal scale per head")


# -- measurements --------------------------------------------------------------------------------


def int8_measure(blocks: list[bytes], args: argparse.Namespace, tiles: int = 0
                 ) -> dict[str, Any]:
    """The int8 codec on ``blocks`` (its groups laid out as ``tiles`` says): file ratio,
    decode and encode GB/s on one thread."""
    from dataclasses import replace  # noqa: PLC0415

    heads = [blockfile.decode_header(b) for b in blocks]
    payloads = [memoryview(b)[blockfile.HEADER_SIZE:blockfile.HEADER_SIZE + h.payload_len]
                for b, h in zip(blocks, heads, strict=True)]
    got = [codec.encode_block(replace(h, sums=None), p, "int8", tiles=tiles)
           for h, p in zip(heads, payloads, strict=True)]
    if any(g is None for g in got):
        return {}
    files = sum(len(b"".join(codec.file_parts(*g))) for g in got)  # type: ignore[misc]
    total = sum(h.payload_len for h in heads)
    dests = [bytearray(h.payload_len) for h in heads]
    dec = _median_s(lambda: [codec.decode_payload(g[0], g[1], d)  # type: ignore[index]
                             for g, d in zip(got, dests, strict=True)], args.repeats)
    enc = _median_s(lambda: [codec.encode_block(replace(h, sums=None), p, "int8", tiles=tiles)
                             for h, p in zip(heads, payloads, strict=True)],
                    args.repeats)

    def copy_hash() -> None:
        for p, d in zip(payloads, dests, strict=True):
            d[:] = p
            xxhash.xxh3_64_intdigest(d)

    raw = _median_s(copy_hash, args.repeats)
    return {"ratio": sum(map(len, blocks)) / files, "decode_gbps": total / dec / 1e9,
            "encode_gbps": total / enc / 1e9, "copy_hash_gbps": total / raw / 1e9}


def gate_prompts(args: argparse.Namespace, work: str) -> list[str]:
    """The gate's prompt files: consecutive pieces of the fixed text, ``--gate-tokens`` each."""
    body = text(args.gate_prompts * args.gate_tokens + 64)
    step = max(1, len(body) // args.gate_prompts)
    out = []
    for i in range(args.gate_prompts):
        path = os.path.join(work, f"gate-{i}.json")
        with open(path, "w") as f:
            json.dump({"parts": [[body[i * step:], args.gate_tokens]]}, f)
        out.append(path)
    return out


def compare(ref: list[dict[str, Any]], got: list[dict[str, Any]]) -> dict[str, Any]:
    """A restore's continuations and next-token distributions against the reference's."""
    same = kls = agree = positions = 0
    kl_max = 0.0
    for r, g in zip(ref, got, strict=True):
        same += r["token_ids"] == g["token_ids"]
        for j, (rl, gl) in enumerate(zip(r["logprobs"], g["logprobs"], strict=False)):
            if r["token_ids"][:j] != g["token_ids"][:j]:
                break  # the contexts differ from here on
            theirs = dict((t, lp) for t, lp in gl)
            floor = min(theirs.values())
            kl = sum(math.exp(lp) * (lp - theirs.get(t, floor)) for t, lp in rl)
            kls += max(kl, 0.0)
            kl_max = max(kl_max, kl)
            agree += rl[0][0] == gl[0][0]
            positions += 1
    n = len(ref)
    return {"prompts": n, "identical": same, "identical_share": same / n if n else None,
            "positions": positions, "top1": agree / positions if positions else None,
            "kl_mean": kls / positions if positions else None, "kl_max": kl_max}


def quality_gate(args: argparse.Namespace, work: str) -> dict[str, Any]:
    """The gate: exact and int8 namespaces, each saved by one engine and restored by the next."""
    from .engine import _engine  # noqa: PLC0415

    prompts = gate_prompts(args, work)
    m = Mount.under(os.path.join(work, "gate"))
    m.start()
    runs: dict[str, list[dict[str, Any]]] = {}
    restored: dict[str, int] = {}
    try:
        m.add_tenant("bench")
        args.max_model_len = args.gate_tokens + 64
        for name in ("exact", "int8"):
            kv = ["--connector", "kvfs", "--mount", str(m.mnt), "--tenant", "bench",
                  "--block-size", "32", "--max-tokens", "32", "--logprobs", "20",
                  "--extra", json.dumps({"kv_codec": name, "layerwise": False})]
            log(f"gate: {name}, saving engine (full recompute)")
            runs[f"{name} save"] = _engine(args, work, kv, prompts)["requests"]
            log(f"gate: {name}, restoring engine")
            runs[name] = _engine(args, work, kv, prompts)["requests"]
            restored[name] = sum(r["cached_tokens"] for r in runs[name])
            if name == "exact":  # the floor of any KV that is not bit-exact: one ulp off
                done = perturb_blocks(os.path.join(str(m.mnt), "bench"), PERTURB_SHARE)
                log(f"gate: exact KV with one bf16 ulp off in {PERTURB_SHARE:.0%} of its "
                    f"values ({done} blocks), restoring engine")
                runs["perturbed"] = _engine(args, work, kv, prompts)["requests"]
                restored["perturbed"] = sum(r["cached_tokens"] for r in runs["perturbed"])
    finally:
        m.stop()
    ref = runs["exact save"]
    tokens = sum(r["prompt_tokens"] for r in ref)
    out = {"reference": "the exact namespace's saving engine (full recompute)",
           "prompt_tokens": tokens}
    for name, label in (("exact", "exact restore"), ("int8", "int8 restore"),
                        ("perturbed", PERTURBED), ("int8 save", "second full recompute")):
        out[label] = {**{k: _r(v, 6) if isinstance(v, float) else v
                         for k, v in compare(ref, runs[name]).items()},
                      **({"restored_tokens": restored[name]} if name in restored else {})}
    return out


GATE = {"kl_mean": 1e-4, "top1": 0.995, "identical_share": 0.75}
#: The share of the exact KV's values the perturbed restore moves by one bf16 ulp.
PERTURB_SHARE = 0.01
PERTURBED = "perturbed restore"
#: "At the floor": KL within this factor of the perturbed restore's, and the shares within
#: these of its (18 prompts: one continuation is 0.056 of the share).
FLOOR_KL = 1.5
FLOOR_SLACK = {"top1": 0.02, "identical_share": 0.2}


def perturb_blocks(root: str, share: float, seed: int = 1) -> int:
    """Rewrite every block file under ``root`` (through the mount) with the lowest bit of
    ``share`` of its 16-bit values flipped (one ulp; seeded), its checksums made anew: the
    exact KV as a reader would get it from any lossy path that is almost exact."""
    import torch  # noqa: PLC0415

    g = torch.Generator().manual_seed(seed)
    n = 0
    for path in sorted(glob.glob(os.path.join(root, "**", "*.kv"), recursive=True)):
        with open(path, "rb") as f:
            h, payload = blockfile.decode(f.read())
        if h.encoding is not None or blockfile.DTYPE_SIZES[h.dtype] != 2:
            continue
        bits = torch.frombuffer(bytearray(payload), dtype=torch.int16)
        bits ^= (torch.rand(bits.shape, generator=g) < share).to(torch.int16)
        data = blockfile.encode(block_hash=h.block_hash, parent_hash=h.parent_hash,
                                fingerprint=h.fingerprint, token_count=h.token_count,
                                dtype=h.dtype, shape=h.shape, payload=bits.numpy().tobytes(),
                                sums=h.sums is not None)
        with open(path, "r+b") as f:
            f.write(data)
        n += 1
    return n


def gate_rows(g: dict[str, Any]) -> list[dict[str, Any]]:
    """The gate's figures: each restore against the exact restore, and int8's against the
    absolute targets and against the perturbed restore (one ulp off: the floor of any KV
    that is not bit-exact), whose figures are the baseline of int8's rows where present."""
    rows = []
    exact, pert = g["exact restore"], g.get(PERTURBED)
    for label in ("int8 restore", PERTURBED, "second full recompute"):
        x = g.get(label)
        if x is None:  # a record from before the perturbed restore
            continue
        floor, floor_name = ((pert, f"{PERTURBED} (one ulp off: the floor of inexact KV)")
                             if label == "int8 restore" and pert else
                             (exact, "exact restore"))
        for key, unit, name in (("identical_share", "share", "32-token continuations identical"),
                                ("top1", "share", "top-1 agreement"),
                                ("kl_mean", "1e-6 nats", "KL, mean over positions")):
            limit = GATE[key]
            ok = x[key] is not None and (x[key] <= limit if key == "kl_mean" else x[key] >= limit)
            scale = 1e6 if key == "kl_mean" else 1.0
            note = f"{x['identical']}/{x['prompts']} prompts, {x['positions']} positions"
            if label != "second full recompute":
                note += (f"; target {'<=' if key == 'kl_mean' else '>='} {limit * scale:g}: "
                         f"{'pass' if ok else 'FAIL'}")
            if label == "int8 restore" and pert and pert[key] is not None and x[key] is not None:
                at_floor = (x[key] <= pert[key] * FLOOR_KL if key == "kl_mean"
                            else x[key] >= pert[key] - FLOOR_SLACK[key])
                note += f"; {'at' if at_floor else 'WORSE than'} the one-ulp floor"
            rows.append({"source": "gate", "figure": f"gate: {label}: {name}",
                         "kvfs": _r(x[key] * scale, 4) if x[key] is not None else None,
                         "baseline": (_r(floor[key] * scale, 4)
                                      if floor[key] is not None else None),
                         "baseline_name": floor_name, "unit": unit, "ratio": None,
                         "note": note})
    return rows


def _median_s(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _entropy_bytes(plane: bytes) -> float:
    n = len(plane)
    bits = -sum(c / n * math.log2(c / n) for c in Counter(plane).values())
    return min(n, n * bits / 8)


def measure(blocks: list[bytes], args: argparse.Namespace) -> dict[str, Any]:
    import zstandard  # noqa: PLC0415

    heads = [blockfile.decode_header(b) for b in blocks]
    payloads = [memoryview(b)[blockfile.HEADER_SIZE:blockfile.HEADER_SIZE + h.payload_len]
                for b, h in zip(blocks, heads, strict=True)]
    total = sum(h.payload_len for h in heads)
    encoded = [codec.encode_file(b) or b for b in blocks]
    stored_heads = [blockfile.decode_header(e) for e in encoded]
    raw_bytes, stored_bytes = sum(map(len, blocks)), sum(map(len, encoded))
    # The order-0 bound of the byte planes (files: header and page padding as kvfs's).
    k = blockfile.DTYPE_SIZES[heads[0].dtype]
    bound = 0.0
    for p in payloads:
        bound += blockfile.HEADER_SIZE + sum(_entropy_bytes(bytes(p[j::k])) for j in range(k))
    # The peer: zstd level 1 of each whole payload.
    zc, zd = zstandard.ZstdCompressor(level=1), zstandard.ZstdDecompressor()
    peer = [zc.compress(p) for p in payloads]
    peer_bytes = sum(blockfile.HEADER_SIZE + blockfile.padded_size(len(z)) for z in peer)
    dests = [bytearray(h.payload_len) for h in heads]
    todo = [(h, memoryview(e)[blockfile.HEADER_SIZE:blockfile.HEADER_SIZE + h.stored_len], d)
            for h, e, d in zip(stored_heads, encoded, dests, strict=True) if h.encoding]

    def decode_all() -> None:
        for h, s, d in todo:
            codec.decode_payload(h, s, d)

    def library() -> None:  # the same frames, decompressed alone (no merge, no checksum)
        for h, st, d in todo:
            assert h.encoding is not None
            codec._codec.decode(st, h.encoding.element_size, h.encoding.chunk, d, False)

    def peer_decode() -> None:
        for z in peer:
            zd.decompress(z)

    enc_payload = sum(h.payload_len for h in stored_heads if h.encoding)
    one = _median_s(decode_all, args.repeats)
    lib = _median_s(library, args.repeats)
    peer_dec = _median_s(peer_decode, args.repeats)
    enc_s = _median_s(lambda: [codec.encode_file(b) for b in blocks], args.repeats)
    peer_enc_s = _median_s(lambda: [zc.compress(p) for p in payloads], args.repeats)
    # All cores: each thread decodes (copies) into its own destinations.
    own = [[bytearray(h.payload_len) for h in heads] for _ in range(args.threads)]
    work = [(t, i) for t in range(args.threads) for i in range(len(todo))]
    pool = ThreadPoolExecutor(args.threads)
    try:
        def decode_one(job: tuple[int, int]) -> None:
            t, i = job
            h, st, _ = todo[i]
            codec.decode_payload(h, st, own[t][i])

        def copy_hash(job: tuple[int, int]) -> None:
            t, i = job
            d = own[t][i]
            d[:] = payloads[i]
            xxhash.xxh3_64_intdigest(d)

        many = _median_s(lambda: list(pool.map(decode_one, work)), args.repeats)
        raws = [(t, i) for t in range(args.threads) for i in range(len(payloads))]
        raw_many = _median_s(lambda: list(pool.map(copy_hash, raws)), args.repeats)
    finally:
        pool.shutdown()
    return {
        "blocks": len(blocks), "encoded_blocks": len(todo), "payload_bytes": total,
        "raw_file_bytes": raw_bytes, "stored_file_bytes": stored_bytes,
        "ratio": raw_bytes / stored_bytes, "peer_ratio": raw_bytes / peer_bytes,
        "bound_ratio": raw_bytes / bound,
        "decode_gbps": enc_payload / one / 1e9,
        "library_gbps": enc_payload / lib / 1e9 if lib else None,
        "peer_decode_gbps": total / peer_dec / 1e9,
        "decode_all_gbps": enc_payload * args.threads / many / 1e9,
        "raw_copy_hash_all_gbps": total * args.threads / raw_many / 1e9,
        "encode_mbps": total / enc_s / 1e6, "peer_encode_mbps": total / peer_enc_s / 1e6,
    }


def rows_for(name: str, m: dict[str, Any], threads: int) -> list[dict[str, Any]]:
    def row(figure: str, kvfs: float | None, base: float | None, base_name: str, unit: str,
            note: str = "") -> dict[str, Any]:
        return {"source": name, "figure": f"{name}: {figure}", "kvfs": _r(kvfs),
                "baseline": _r(base), "baseline_name": base_name, "unit": unit,
                "ratio": _r(kvfs / base if kvfs and base else None, 3), "note": note}

    return [
        row("stored ratio", m["ratio"], m["peer_ratio"], "zstd -1 of the payload", "x",
            f"{m['encoded_blocks']} of {m['blocks']} blocks encoded"),
        row("stored ratio / order-0 bound", m["ratio"], m["bound_ratio"],
            "each byte plane at its order-0 entropy", "x"),
        row("decode, 1 thread", m["decode_gbps"], m["library_gbps"],
            "zstd library on the same frames alone", "GB/s",
            "payload bytes; both checksums checked"),
        row("decode vs the peer, 1 thread", m["decode_gbps"], m["peer_decode_gbps"],
            "zstd -1 of the payload, decoded", "GB/s"),
        row(f"decode, {threads} threads", m["decode_all_gbps"], m["raw_copy_hash_all_gbps"],
            f"copy + xxh3 of raw payloads, {threads} threads", "GB/s"),
        row("encode, 1 thread", m["encode_mbps"], m["peer_encode_mbps"],
            "zstd -1 of the payload", "MB/s"),
    ]


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x, nd)


def run(args: argparse.Namespace) -> int:
    work = tempfile.mkdtemp(prefix=".kvfs-bench-codec-", dir=args.dir)
    cond = conditions({"work": work}, modules=("zstandard", "xxhash", "torch"), gpu=False,
                      load=True)
    cond["libzstd"] = codec._codec.zstd_version
    sources: dict[str, Any] = {}
    skipped = []
    try:
        why = fuse_available()
        if args.engine and os.path.exists(args.python) and why is None:
            log("prefilling with vLLM through the KVFSConnector")
            blocks, what = vllm_blocks(args, work)
            if blocks:
                sources["smollm2-135m (vLLM)"] = (blocks, what)
            else:
                skipped.append("smollm2 (vLLM): the engine saved no blocks")
        elif args.engine:
            skipped.append(f"smollm2 (vLLM): needs {args.python} (tools/setup_vllm.sh) and "
                           f"a FUSE mount ({why or 'available'})")
        sources["llama-3-8b-shape (synthetic)"] = llama_blocks(args.llama_blocks)
        rows, details = [], {}
        for name, (blocks, what) in sources.items():
            log(f"measuring {name}: {what}")
            m = measure(blocks, args)
            details[name] = {"blocks": what, **{k: _r(v) if isinstance(v, float) else v
                                                for k, v in m.items()}}
            rows += rows_for(name, m, args.threads)
            # vLLM's CPU attention keeps a head's keys transposed (the connector finds it
            # through vLLM's own cache op: worker.int8_tiles); the synthetic blocks are rows.
            h0 = blockfile.decode_header(blocks[0])
            q = int8_measure(blocks, args, blockfile.int8_tiles(h0.token_count, (True, False))
                             if "vLLM" in name else 0)
            if q:
                details[name]["int8"] = {k: _r(v) for k, v in q.items()}
                rows += [
                    {"source": name, "figure": f"{name}: int8 stored ratio", "kvfs": _r(q["ratio"]),
                     "baseline": _r(m["ratio"]), "baseline_name": "planes (lossless)",
                     "unit": "x", "ratio": _r(q["ratio"] / m["ratio"]), "note": "lossy"},
                    {"source": name, "figure": f"{name}: int8 decode, 1 thread",
                     "kvfs": _r(q["decode_gbps"]), "baseline": _r(q["copy_hash_gbps"]),
                     "baseline_name": "copy + xxh3 of the raw payload", "unit": "GB/s",
                     "ratio": _r(q["decode_gbps"] / q["copy_hash_gbps"]),
                     "note": "payload bytes; both checksums checked"},
                    {"source": name, "figure": f"{name}: int8 encode, 1 thread",
                     "kvfs": _r(q["encode_gbps"]), "baseline": _r(q["copy_hash_gbps"]),
                     "baseline_name": "copy + xxh3 of the raw payload", "unit": "GB/s",
                     "ratio": _r(q["encode_gbps"] / q["copy_hash_gbps"]), "note": ""}]
        if args.engine and args.gate_prompts and "smollm2-135m (vLLM)" in sources:
            log("int8 quality gate through the connector")
            gate = quality_gate(args, work)
            details["gate"] = gate
            rows += gate_rows(gate)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    record = {"benchmark": "codec", "rows": rows, "sources": details, "skipped": skipped,
              "params": {"chunk_elements": codec.CHUNK, "zstd_level": codec.LEVEL,
                         "keep": codec.KEEP, "tokens": args.tokens, "threads": args.threads,
                         "repeats": args.repeats},
              "conditions": conditions_after(cond, load=True)}
    return finish(record, args, "\n".join(figure_table(record)), draw)


def draw(record: dict[str, Any], plt: Any) -> Any:
    """Three panels: the stored ratio and the decode speed per source (kvfs's codecs beside
    the peer and the bound), and the gate's shares per restore (exact, one ulp off, int8)."""
    from .plot import title  # noqa: PLC0415
    from .records import number, rows_of  # noqa: PLC0415

    rows = {r.get("figure"): r for r in rows_of(record)}
    sources = list(dict.fromkeys(f.split(": ")[0] for f in rows
                                 if f and f.endswith(": stored ratio")))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))

    def bars(ax: Any, groups: list[str], series: list[tuple[str, list[float | None]]],
             ylabel: str) -> None:
        width = 0.8 / max(1, len(series))
        for i, (name, values) in enumerate(series):
            xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
            vals = [v or 0.0 for v in values]
            ax.bar(xs, vals, width, label=name)
            for x, v in zip(xs, values, strict=True):
                if v:
                    ax.annotate(f"{v:.3g}", (x, v), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(groups)), [g.replace(" (", "\n(") for g in groups], fontsize=8)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)

    def val(figure: str, key: str = "kvfs") -> float | None:
        return number(rows.get(figure, {}).get(key))

    bars(axes[0], sources, [
        ("planes (lossless)", [val(f"{s}: stored ratio") for s in sources]),
        ("zstd -1 of the payload", [val(f"{s}: stored ratio", "baseline") for s in sources]),
        ("int8 (lossy)", [val(f"{s}: int8 stored ratio") for s in sources])],
        "raw bytes / stored bytes (whole files)")
    axes[0].set_title("stored ratio", fontsize=9)
    bars(axes[1], sources, [
        ("planes decode", [val(f"{s}: decode, 1 thread") for s in sources]),
        ("libzstd alone, same frames", [val(f"{s}: decode, 1 thread", "baseline")
                                        for s in sources]),
        ("int8 decode", [val(f"{s}: int8 decode, 1 thread") for s in sources]),
        ("copy + xxh3 of the raw payload", [val(f"{s}: int8 decode, 1 thread", "baseline")
                                            for s in sources])],
        "GB/s of payload, one core")
    axes[1].axhline(2.0, color="black", linewidth=0.8, linestyle="--")
    axes[1].annotate("target: 2 GB/s", (-0.45, 2.0), xytext=(0, 3), textcoords="offset points",
                     fontsize=7)
    axes[1].set_title("decode, one core", fontsize=9)
    restores = [("exact restore", PERTURBED, "baseline"), (PERTURBED, PERTURBED, "kvfs"),
                ("int8 restore", "int8 restore", "kvfs")]
    metrics = (("32-token continuations identical", "identical"), ("top-1 agreement", "top-1"))
    bars(axes[2], [name for name, _, _ in restores], [
        (label, [val(f"gate: {fig_of}: {m}", key) for _, fig_of, key in restores])
        for m, label in metrics], "share of the full recompute's")
    kl = [val(f"gate: {fig_of}: KL, mean over positions", key) for _, fig_of, key in restores]
    axes[2].set_title("int8 quality gate, through the engine (KL, 1e-6 nats: "
                      + ", ".join("-" if k is None else f"{k:.0f}" for k in kl) + ")",
                      fontsize=9)
    axes[2].set_ylim(0, 1.15)
    fig.suptitle(title(record, "kvfs bench codec"), fontsize=9)
    fig.tight_layout()
    return fig


KIND = Kind("codec", "Block codecs", "kvfs bench codec --out docs/bench", __doc__.split(
    "\n\n", 1)[1], figure_table, ("kvfs", "baseline", "ratio"), plot=draw)
