"""`kvfs bench crossover`: time to first token, restoring the prefix from kvfs or recomputing it.

For each context length, one request whose whole prefix was saved earlier: the time to its
first token when the prefix KV is restored through a real mount (lookup + load on the direct
path, then prefill of the tail that is not a whole block) against a full recompute (prefill of
every token), with the demo transformer (`kvfs.models.tinylm`; a larger configuration from the
command line). At every length the first token (and the logits it comes from) must be identical both
ways, or the run fails. The crossover is the shortest context from which restoring wins. The
page cache is warm (the blocks were just written); `--cold` drops it before each restore.
"""

from __future__ import annotations

import random
import shutil
import sys
import tempfile
import time
from typing import Any

from .common import finish
from .harness import Mount, conditions, drop_caches, median, mounted
from .plot import ttft
from .records import Kind, md_table, num_text, number, ratio_text, rows_of


def run(lengths: list[int], *, workdir: str, block_size: int = 16, repeats: int = 3,
        cold: bool = False, config: dict[str, int] | None = None) -> dict[str, Any]:
    import torch  # noqa: PLC0415 - the client side

    from ..client import KVCache  # noqa: PLC0415
    from ..models.tinylm import TinyLM, TinyLMConfig, restore_prefix, save_prefix  # noqa: PLC0415

    model = TinyLM(TinyLMConfig(**(config or {})), seed=0)
    spec = model.spec(block_size)
    base = tempfile.mkdtemp(prefix="kvfs-crossover-", dir=workdir)
    m = Mount.under(base)
    m.start()
    rows = []
    try:
        m.add_tenant("bench")
        rng = random.Random(0)
        with KVCache.open(m.mnt, tenant="bench", spec=spec) as cache:
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
                        drop_caches(3)
                    t0 = time.perf_counter()
                    restored, past = restore_prefix(cache, tokens)
                    tail, _ = model.prefill(tokens[restored:], past)
                    restore.append(time.perf_counter() - t0)
                    if not torch.equal(tail[-1], full[-1]):
                        raise AssertionError(f"{length} tokens: the restored prefix gives other "
                                             "logits than the recompute")
                rec, res = median(recompute), median(restore)
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
        m.stop(check=False)
        if not mounted(m.mnt):  # a mount left behind keeps its tree
            shutil.rmtree(base, ignore_errors=True)
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

    from ..models.tinylm import TinyLMConfig  # noqa: PLC0415

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
    return finish(record, args, table(record), draw)


# -- the record, as `kvfs bench report` shows it --------------------------------------------


def report_table(record: dict[str, Any]) -> list[str]:
    head = ["context tokens", "recompute (ms)", "restore + tail (ms)",
            "speedup (recompute / restore)", "first token identical"]
    out = []
    for r in rows_of(record):
        rec, res = number(r.get("recompute_ms")), number(r.get("restore_ms"))
        speed = r.get("speedup") if number(r.get("speedup")) else (rec / res if rec and res
                                                                     else None)
        ident = r.get("identical")
        out.append([num_text(r.get("tokens"), "g"), num_text(rec, ".1f"), num_text(res, ".1f"),
                    ratio_text(speed), "-" if ident is None else "yes" if ident else "**NO**"])
    cross = number(record.get("crossover_tokens"))
    tail = [f"Restoring beats recomputing from **{cross:g} tokens** on." if cross else
            "Restoring never beat recomputing at these lengths." if out else ""]
    return md_table(head, out) + ["", *tail]


def draw(record: dict[str, Any], plt: Any) -> Any:
    return ttft(record, plt, (
        ("recompute_ms", "recompute (prefill of every token)", "o-"),
        ("restore_ms", "restore from kvfs + prefill of the tail", "s-")), "restore",
        "kvfs bench crossover: time to first token, page cache "
        f"{record.get('page_cache', '?')}")


KIND = Kind("crossover", "Crossover", "kvfs bench crossover --lengths 16 32 64 128 256 512 1024 "
            "2048 4096 --out docs/bench", """\
`kvfs bench crossover` (`kvfs/bench/crossover.py`): for each context length, one request whose
whole prefix was saved just before, through a real mount. Time to its first token when the
prefix KV is restored (`lookup` + `load` on the direct path, then prefill of the tail that is
not a whole block, at least the last token) against a full recompute (prefill of every token),
with the demo transformer (`kvfs.models.tinylm`: 4 layers, d_model 256, 4 heads / 2 KV heads of 64,
float32 KV, 4 KiB per token, blocks of 16 tokens, one CPU thread; a larger configuration from
the command line). At every length the logits of the last token must be identical both ways,
or the run fails. Median of the repeats; page cache warm (`--cold` drops it before each
restore). The crossover is the shortest context from which restoring wins. For a tiny model
the fixed cost of a lookup and a load weighs more than for a real one, which computes far more
per token: its crossover comes earlier and its gain is larger. The run pins the method and the
exactness; the milliseconds are this machine's.""", report_table,
            ("tokens", "recompute_ms", "restore_ms", "speedup"), shown=("crossover_tokens",),
            plot=draw)
