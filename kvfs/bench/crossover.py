"""`kvfs bench crossover`: time to first token, restoring the prefix from kvfs or recomputing it.

For each context length, one request whose whole prefix was saved earlier: the time to its
first token when the prefix KV is restored through a real mount (lookup + load on the direct
path, then prefill of the tail that is not a whole block) against a full recompute (prefill of
every token), with the demo transformer (`kvfs.tinylm`; a larger configuration from the command
line). At every length the first token (and the logits it comes from) must be identical both
ways, or the run fails. The crossover is the shortest context from which restoring wins. The
page cache is warm (the blocks were just written); `--cold` drops it before each restore.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from .common import conditions, finish

KVFS = [sys.executable, "-m", "kvfs.cli"]


def _drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return True
    except OSError:
        return False


def run(lengths: list[int], *, workdir: str, block_size: int = 16, repeats: int = 3,
        cold: bool = False, config: dict[str, int] | None = None) -> dict[str, Any]:
    import torch  # noqa: PLC0415 - the client side

    from ..client import KVCache  # noqa: PLC0415
    from ..tinylm import TinyLM, TinyLMConfig, restore_prefix, save_prefix  # noqa: PLC0415

    model = TinyLM(TinyLMConfig(**(config or {})), seed=0)
    spec = model.spec(block_size)
    base = tempfile.mkdtemp(prefix="kvfs-crossover-", dir=workdir)
    backing, mnt = os.path.join(base, "backing"), os.path.join(base, "mnt")
    os.makedirs(backing)
    os.makedirs(mnt)
    subprocess.run([*KVFS, "mount", backing, mnt, "--log", os.path.join(base, "daemon.log")],
                   check=True, capture_output=True)
    rows = []
    try:
        subprocess.run([*KVFS, "tenant", "add", mnt, "bench", "--uid", str(os.getuid()),
                        "--gid", str(os.getgid())], check=True, capture_output=True)
        rng = random.Random(0)
        with KVCache.open(mnt, tenant="bench", spec=spec) as cache:
            for length in lengths:
                tokens = [rng.randrange(model.config.vocab_size) for _ in range(length)]
                logits, kv = model.prefill(tokens)
                save_prefix(cache, tokens, kv)
                recompute, restore, restored = [], [], 0
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    full, _ = model.prefill(tokens)
                    recompute.append(time.perf_counter() - t0)
                    if cold:
                        _drop_caches()
                    t0 = time.perf_counter()
                    restored, past = restore_prefix(cache, tokens)
                    tail, _ = model.prefill(tokens[restored:], past)
                    restore.append(time.perf_counter() - t0)
                    if not torch.equal(tail[-1], full[-1]):
                        raise AssertionError(f"{length} tokens: the restored prefix gives other "
                                             "logits than the recompute")
                rec, res = sorted(recompute)[repeats // 2], sorted(restore)[repeats // 2]
                rows.append({"tokens": length, "restored_tokens": restored,
                             "recompute_ms": round(rec * 1e3, 2),
                             "restore_ms": round(res * 1e3, 2),
                             "speedup": round(rec / res, 2) if res else None,
                             "first_token": int(full[-1].argmax()), "identical": True,
                             "kv_bytes": restored * model.config.kv_bytes_per_token})
                print(f"  {length:>6} tokens: recompute {rec * 1e3:8.1f} ms, restore "
                      f"{res * 1e3:8.1f} ms ({restored} tokens from kvfs), identical",
                      file=sys.stderr, flush=True)
    finally:
        if subprocess.run([*KVFS, "umount", mnt], capture_output=True).returncode == 0:
            shutil.rmtree(base, ignore_errors=True)  # a mount left behind keeps its tree
    cross = next((r["tokens"] for r in rows if r["restore_ms"] < r["recompute_ms"]), None)
    from dataclasses import asdict  # noqa: PLC0415

    return {"benchmark": "crossover", "model": spec.manifest(),
            "model_config": asdict(model.config), "block_size": block_size,
            "page_cache": "cold" if cold else "warm", "repeats": repeats, "rows": rows,
            "crossover_tokens": cross, "conditions": conditions([workdir])}


def table(record: dict[str, Any]) -> str:
    lines = [f"{'tokens':>8} {'recompute ms':>13} {'restore ms':>11} {'speedup':>8} identical"]
    for r in record["rows"]:
        lines.append(f"{r['tokens']:>8} {r['recompute_ms']:>13.1f} {r['restore_ms']:>11.1f} "
                     f"{r['speedup']:>7.1f}x {'yes' if r['identical'] else 'NO'}")
    cross = record["crossover_tokens"]
    lines.append(f"restoring beats recomputing from {cross} tokens" if cross is not None
                 else "restoring never beat recomputing at these lengths")
    return "\n".join(lines)


def model_config(items: list[str]) -> dict[str, int]:
    """`FIELD=VALUE` items as TinyLMConfig fields (ints), checked; ValueError says what is
    wrong."""
    from dataclasses import fields  # noqa: PLC0415

    from ..tinylm import TinyLMConfig  # noqa: PLC0415

    known = {f.name: f.type for f in fields(TinyLMConfig)}
    config: dict[str, Any] = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not eq or name not in known:
            raise ValueError(f"--model {item!r}: expected FIELD=VALUE with FIELD one of "
                             f"{', '.join(known)}")
        try:
            config[name] = float(value) if known[name] in (float, "float") else int(value)
        except ValueError:
            raise ValueError(f"--model {item!r}: {value!r} is not a number") from None
    TinyLMConfig(**config)  # the model's own checks
    return config


def main(args: Any) -> int:
    config = getattr(args, "config", None) or {}
    record = run(args.lengths, workdir=args.dir, repeats=args.repeats, cold=args.cold,
                 block_size=getattr(args, "block_size", 16), config=config)
    return finish(record, args, table(record))
