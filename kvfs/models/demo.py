"""`kvfs demo`: a mount over a default backing directory, and a model's KV cache living in it.

It mounts ``DIR/mnt`` over ``DIR/backing`` (capacity 1 GiB) and adds a tenant owned by the
invoking user. Then a small transformer (:mod:`kvfs.models.tinylm`, random weights, CPU) serves a
conversation: a shared system prompt and three turns, each turn's context saved as KV blocks
through :class:`kvfs.KVCache` (the direct path). A second process (``python -m kvfs.models.demo
restore``) then takes the next turn the way a serving engine picks up a returning
conversation: it looks up the longest cached prefix, restores it, recomputes only the tail,
decodes, and checks its tokens against a full recompute done by the first process. It prints
what it restored, restore time against recompute time for that prefix, and ``identical:
yes`` (exit status 1 if not). Last, what an operator sees: ``ls -l``, ``du -sh``, ``df -h``,
``getfattr`` and ``kvfs status``. The mount stays up for exploring; ``kvfs umount DIR/mnt``
ends it. Without torch, the demo writes synthetic blocks instead, as an engine's file
backend would.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
import warnings
from typing import Any

from ..format import blockfile, hashing
from ..format.layout import MANIFEST

KVFS = [sys.executable, "-m", "kvfs.cli"]
TENANT = "demo"
BLOCK_SIZE = 16
SEED = 0
REPLY_TOKENS = 32

SPEC = hashing.ModelSpec(model="demo/tiny-llama", revision="r1", kv_dtype="float16",
                         block_size=16, num_layers=4, num_kv_heads=2, head_dim=64)

SYSTEM = """\
You are the on-call assistant of a storage team. You answer questions about a fleet of GPU
hosts that serve large language models, and about kvfs, the filesystem that holds their KV
caches on local NVMe and in a shared object store. Be brief, cite the metric you used, and
never guess a number you can read. When you need data, call one of the tools below and wait
for its answer before you go on.

Tools:
  hosts(pool)             -> the hosts of a pool, with their GPU model and free memory
  kvfs_status(host)       -> capacity, usage, hit rate and evictions of a host's kvfs mount
  kvfs_top(host, tenant)  -> the busiest model namespaces of a tenant, by bytes served
  logs(host, since, grep) -> lines of the serving engine's log
  page(team, text)        -> page a team; only for an outage that is still going on

House rules: a hit rate under 80 % on a warm host is worth a look; a checksum failure always
is; capacity over the high watermark for more than ten minutes means eviction cannot keep up.
"""
TURNS = [
    "Hit rate on gpu-17 dropped from 94 % to 61 % since noon. The tenant is acme, model "
    "llama-70b. Nothing was deployed. Where do I start?",
    "kvfs_status says usage is at 99 % of 500G with evictions climbing. kvfs_top shows a new "
    "namespace llama-70b@9c1e with 300G in it. Same model name, new fingerprint. Why?",
    "The revision changed: someone pushed new weights at 11:58. So the old namespace is dead "
    "weight. Can I drop it without a restart, and will the engine notice?",
]
FOLLOW_UP = ("Done, rm -r of the old namespace freed 290G and the hit rate is climbing again. "
             "What should I watch for the next hour?")


def _show(title: str, argv: list[str]) -> None:
    print(f"\n$ {title}")
    sys.stdout.flush()
    subprocess.run(argv, check=False)


def _owner() -> tuple[int, int]:
    uid = int(os.environ.get("SUDO_UID", os.getuid()))
    gid = int(os.environ.get("SUDO_GID", os.getgid()))
    return uid, gid


def _import_torch() -> bool:
    try:
        with warnings.catch_warnings():  # a CPU torch without numpy warns about it at import
            warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
            import torch  # noqa: F401, PLC0415
    except ImportError:
        return False
    return True


def encode(text: str) -> list[int]:
    """The demo's tokenizer: one token per UTF-8 byte (the model's vocabulary has 512)."""
    return list(text.encode())


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


# -- the synthetic demo (no torch) ------------------------------------------------------------


def write_blocks(ns_dir: str, token_ids: list[int], seed: int = 0) -> list[bytes]:
    """Write the blocks of `token_ids` the way an engine's file backend does."""
    rng = random.Random(seed)
    hashes = hashing.block_hashes(token_ids, SPEC.block_size)
    parent = hashing.ROOT_PARENT
    for h in hashes:
        path = os.path.join(ns_dir, hashing.block_relpath(h))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        payload = rng.randbytes(SPEC.block_payload_bytes)
        data = blockfile.encode(block_hash=h, parent_hash=parent, fingerprint=SPEC.fingerprint,
                                token_count=SPEC.block_size, dtype=SPEC.kv_dtype,
                                shape=SPEC.block_shape, payload=payload)
        tmp = os.path.join(os.path.dirname(path), f".tmp.{os.getpid()}")
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        parent = h
    return hashes


def synthetic(tenant: str) -> str:
    """Synthetic blocks written through the mount; returns a block's path."""
    ns_dir = os.path.join(tenant, SPEC.namespace)
    os.makedirs(ns_dir, exist_ok=True)
    with open(os.path.join(ns_dir, os.fsdecode(MANIFEST)), "wb") as f:
        f.write(SPEC.manifest_json())
    # A system prompt shared by two conversations: their first blocks are the same files.
    system = list(range(1000, 1000 + 64))
    conv_a = write_blocks(ns_dir, system + list(range(5000, 5000 + 96)), seed=1)
    conv_b = write_blocks(ns_dir, system + list(range(9000, 9000 + 48)), seed=2)
    shared = len(set(conv_a) & set(conv_b))
    print(f"kvfs demo: wrote {len(conv_a)} + {len(conv_b)} blocks of {SPEC.block_size} tokens "
          f"({shared} shared by both conversations) into {ns_dir}")
    return os.path.join(ns_dir, hashing.block_relpath(conv_a[-1]))


# -- the model demo -------------------------------------------------------------------------


def serve(base: str, mnt: str) -> tuple[int, str]:
    """Process 1: serve three turns, saving each turn's KV; then hand the fourth turn to a
    second process. Returns its exit status and the path of a block in the mount."""
    from ..client import KVCache  # noqa: PLC0415 - torch only here
    from .tinylm import TinyLM, save_prefix  # noqa: PLC0415

    model = TinyLM(seed=SEED)
    spec = model.spec(BLOCK_SIZE)
    c = model.config
    print(f"model: {spec.model} (random weights, seed {SEED}): {c.num_layers} layers, "
          f"d_model {c.d_model}, {c.num_heads} heads / {c.num_kv_heads} KV heads of "
          f"{c.head_dim}, float32 KV: {c.kv_bytes_per_token // 1024} KiB per token, "
          f"{spec.block_payload_bytes // 1024} KiB per block of {BLOCK_SIZE} tokens")
    conv = encode(SYSTEM)
    kv = None
    print(f"process 1 (pid {os.getpid()}): system prompt of {len(conv)} tokens, "
          f"then {len(TURNS)} turns")
    with KVCache.open(mnt, tenant=TENANT, spec=spec, direct=True) as cache:
        for i, text in enumerate(TURNS, 1):
            user = encode(f"\nuser: {text}\nassistant: ")
            t0 = time.perf_counter()
            reply, kv = model.generate(user if kv is not None else conv + user, REPLY_TOKENS,
                                       past=kv)
            t1 = time.perf_counter()
            conv += user + reply
            full, new = save_prefix(cache, conv, kv)
            t2 = time.perf_counter()
            print(f"  turn {i}: +{len(user)} user tokens, {len(reply)} reply tokens in "
                  f"{_ms(t1 - t0)}; context {len(conv)} tokens: saved {full} blocks "
                  f"({new} new) in {_ms(t2 - t1)}")
        block = os.path.join(cache.ns_dir, hashing.block_relpath(cache.block_hashes(conv)[-1]))
    context = conv + encode(f"\nuser: {FOLLOW_UP}\nassistant: ")
    t0 = time.perf_counter()
    want, _ = model.generate(context, REPLY_TOKENS)
    print(f"  reference for turn {len(TURNS) + 1}: full recompute of its {len(context)} "
          f"tokens + {REPLY_TOKENS} decoded in {_ms(time.perf_counter() - t0)}")
    request = os.path.join(base, "turn4.json")
    with open(request, "w") as f:
        json.dump({"seed": SEED, "block_size": BLOCK_SIZE, "context": context,
                   "n": REPLY_TOKENS, "expected": want}, f)
    argv = [sys.executable, "-m", "kvfs.models.demo", "restore", mnt, TENANT, request]
    print(f"\n$ python -m kvfs.models.demo restore {mnt} {TENANT} {request}")
    sys.stdout.flush()
    return subprocess.run(argv, check=False).returncode, block


def restore(mnt: str, tenant: str, request: str) -> int:
    """Process 2: restore the longest cached prefix, recompute the tail, decode, compare."""
    _import_torch()
    import torch  # noqa: PLC0415

    from ..client import KVCache  # noqa: PLC0415
    from .tinylm import TinyLM, blocks_to_kv  # noqa: PLC0415

    with open(request) as f:
        req: dict[str, Any] = json.load(f)
    context: list[int] = req["context"]
    model = TinyLM(seed=req["seed"])
    spec = model.spec(req["block_size"])
    model.prefill(context[:64])  # warm up the kernels before anything is timed
    print(f"process 2 (pid {os.getpid()}): a request of {len(context)} tokens")
    with KVCache.open(mnt, tenant=tenant, spec=spec, direct=True) as cache:
        t0 = time.perf_counter()
        # Every full block but, always, the last token: its logits start the decoding.
        hashes = cache.block_hashes(context)[:(len(context) - 1) // spec.block_size]
        found = cache.lookup(hashes)
        out = torch.empty((found, *spec.block_shape), dtype=torch.float32)
        loaded = cache.load(hashes[:found], out)
        kv = blocks_to_kv(out[:loaded]) if loaded else None
        t_restore = time.perf_counter() - t0
        stats = cache.stats
    n = loaded * spec.block_size
    print(f"  {cache!r}")
    print(f"  lookup: {found} of {len(hashes)} full blocks cached; loaded {loaded} blocks "
          f"({loaded * spec.block_payload_bytes / 2**20:.1f} MiB): {n} tokens restored, "
          f"fetch amplification {stats['fetch_amplification'] or 0:.2f}x, "
          f"{stats['control_calls']} control calls")
    t0 = time.perf_counter()
    _, kv_recomputed = model.prefill(context[:n])
    t_recompute = time.perf_counter() - t0
    exact = kv is not None and torch.equal(kv, kv_recomputed)
    print(f"  restore of those {n} tokens: {_ms(t_restore)} (lookup + load, page cache warm); "
          f"recompute: {_ms(t_recompute)}; restore is {t_recompute / t_restore:.0f}x faster"
          if n else "  nothing restored: the whole context is recomputed")
    if n:
        print(f"  restored KV equals the recomputed KV bit for bit: {'yes' if exact else 'NO'}")
    t0 = time.perf_counter()
    got, _ = model.generate(context[n:], req["n"], past=kv)
    print(f"  recomputed the {len(context) - n}-token tail and decoded {len(got)} tokens in "
          f"{_ms(time.perf_counter() - t0)}: {' '.join(map(str, got[:12]))} ...")
    same = got == req["expected"]
    print(f"  identical: {'yes' if same else 'NO'} (against the full recompute in process 1)")
    return 0 if same and n > 0 else 1


def _kvfs(*args: str) -> bool:
    """``kvfs ARGS`` (its messages go to the terminal); False, said, if it failed."""
    if subprocess.run([*KVFS, *args], check=False).returncode == 0:
        return True
    print(f"kvfs demo: `kvfs {' '.join(args)}` failed (see above)", file=sys.stderr)
    return False


def run_demo(base: str) -> int:
    base = os.path.abspath(base)
    backing, mnt = os.path.join(base, "backing"), os.path.join(base, "mnt")
    try:
        os.makedirs(backing, exist_ok=True)
        os.makedirs(mnt, exist_ok=True)
    except OSError as exc:
        print(f"kvfs demo: cannot make {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 1
    if os.path.ismount(mnt) and not _kvfs("umount", mnt):
        return 1
    if not _kvfs("mount", backing, mnt, "--capacity", "1G"):
        return 1
    uid, gid = _owner()
    tenant = os.path.join(mnt, TENANT)
    if not os.path.isdir(tenant) and not _kvfs("tenant", "add", mnt, TENANT, "--uid", str(uid),
                                                "--gid", str(gid)):
        return 1
    status = 0
    if _import_torch():
        status, block = serve(base, mnt)
    else:
        print("kvfs demo: torch is not installed, so no model runs here; writing synthetic "
              "KV blocks instead (pip install torch, or tools/setup.sh, for the full demo)")
        block = synthetic(tenant)
    _show(f"ls -l {os.path.dirname(block)}", ["ls", "-l", os.path.dirname(block)])
    _show(f"du -sh {tenant}", ["du", "-sh", tenant])
    _show(f"df -h {mnt}", ["df", "-h", mnt])
    _show(f"getfattr -d {block}", ["getfattr", "-d", block])
    _show(f"kvfs status {mnt}", [*KVFS, "status", mnt])
    print(f"\nThe mount stays up: explore {mnt}, then `kvfs umount {mnt}`.")
    if status:
        print("kvfs demo: the restored conversation did NOT match the recompute", file=sys.stderr)
    return status


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvfs.models.demo",
                                description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("run", help="the whole demo (what `kvfs demo` runs)")
    d.add_argument("dir", nargs="?", default="demo")
    r = sub.add_parser("restore", help="process 2: restore a conversation's prefix, continue")
    r.add_argument("mount")
    r.add_argument("tenant")
    r.add_argument("request", help="JSON written by the demo: context, expected tokens")
    args = p.parse_args(argv)
    if args.cmd == "run":
        return run_demo(args.dir)
    return restore(args.mount, args.tenant, args.request)


if __name__ == "__main__":
    sys.exit(main())
