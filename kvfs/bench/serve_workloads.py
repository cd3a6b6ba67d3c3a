"""The workloads of `kvfs bench serve`, as Mooncake-format traces vLLM's own load generator
replays (`vllm bench serve --dataset-name timed_trace`), and what a trace alone says about
them: the share of prompt tokens an unbounded cache would serve (the ceiling), and which
requests no cache could serve (the misses).

vLLM's ``timed_trace`` dataset turns each hash id into ``chunk`` tokens drawn from a seed
made of the id (Python's ``hash`` of a string: the load generator runs with a fixed
``PYTHONHASHSEED``, so that two runs of one trace send the same tokens), so two requests
share exactly the prefix their leading equal ids say. The chunk here is vLLM's block size,
so a hash id is one block of the engine's own prefix cache and of kvfs's.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

from kvfs.models.trace import Request, agentic_trace, read_trace, write_trace

#: Added to every hash id of a run's trace times the run's number: each run sends prompts no
#: earlier run sent, so no run finds what an earlier one left in any cache.
RUN_OFFSET = 10_000_000
#: Mooncake's published traces count 512 tokens per hash id.
MOONCAKE_BLOCK = 512


def agentic(concurrency: int, *, sessions: int, turns: float, block: int, max_len: int,
            output: int, prefix_blocks: int = 2, seed: int = 0) -> list[Request]:
    """Agent sessions as kvfs's generator makes them (kvfs.models.trace.agentic_trace),
    scaled to a small model's context: three agents' shared prefixes (system prompt and
    tools) of ``prefix_blocks`` blocks (2 of a 16-block context: about the share a coding
    agent's ~20k tokens of prompt and tools take of its 160-200k context), a first message
    of ~3 blocks, ~1.5 blocks more per turn, compacted at the context limit;
    ``concurrency`` sessions interleaved (closed loop), answers of ``output`` tokens."""
    reqs = agentic_trace(sessions=sessions, turns=turns, prefix_tokens=prefix_blocks * block,
                         agents=3, block_tokens=block, first_tokens=3 * block,
                         turn_tokens=block * 3 // 2, output_tokens=output,
                         max_context=max_len - output - 1, concurrency=concurrency,
                         idle_prob=0.0, seed=seed)
    for r in reqs:
        r.output_length = output
    return reqs


def mooncake(path: str, *, requests: int, block: int, max_len: int, output: int
             ) -> list[Request]:
    """The first ``requests`` requests of a Mooncake-format trace, scaled to the model:
    each 512-token hash id becomes one ``block``-token block (lengths scaled alike), prompts
    cut to the context (a cut keeps a prefix, so the sharing between requests is kept),
    answers of ``output`` tokens."""
    scale = MOONCAKE_BLOCK / block
    out = []
    for r in read_trace(path)[:requests]:
        n = min(max(1, round(r.input_length / scale)), max_len - output - 1)
        ids = r.hash_ids[:math.ceil(n / block)]
        if len(ids) * block < n:  # a trace whose ids do not cover its length
            n = len(ids) * block
        if n > 0:
            out.append(Request(r.timestamp, n, output, list(ids)))
    return out


def offset(reqs: Sequence[Request], run: int) -> list[Request]:
    """The requests with every hash id moved to run ``run``'s own range."""
    return [Request(r.timestamp, r.input_length, r.output_length,
                    [h + run * RUN_OFFSET for h in r.hash_ids]) for r in reqs]


def write(path: str, reqs: Sequence[Request]) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_trace(path, reqs)
    return path


def cacheable(r: Request, block: int) -> int:
    """Tokens of ``r`` a prefix cache can serve at most: its full blocks, the last token
    always computed (vLLM's rule)."""
    return (r.input_length - 1) // block * block


def ceiling(reqs: Sequence[Request], block: int) -> dict[str, Any]:
    """What an unbounded cache would serve of the requests in this order: per request the
    tokens of its leading blocks some earlier request had (ids are chained), at block
    granularity; the share of all prompt tokens; and which requests are misses (nothing of
    theirs seen before)."""
    seen: set[int] = set()
    hit_tokens, prompt_tokens, misses = 0, 0, []
    per_request = []
    for i, r in enumerate(reqs):
        k = 0
        for h in r.hash_ids:
            if h not in seen:
                break
            k += 1
        hit = min(k * block, cacheable(r, block))
        per_request.append(hit)
        hit_tokens += hit
        prompt_tokens += r.input_length
        if hit == 0:
            misses.append(i)
        seen.update(r.hash_ids[:r.input_length // block])  # full blocks only
    return {"hit_tokens": hit_tokens, "prompt_tokens": prompt_tokens,
            "share": hit_tokens / prompt_tokens if prompt_tokens else 0.0,
            "per_request": per_request, "misses": misses,
            "saved_share": (sum(cacheable(r, block) for r in reqs) / prompt_tokens
                            if prompt_tokens else 0.0)}


def percentile(values: Sequence[float], p: float) -> float | None:
    """The ``p``-th percentile (linear between ranks, as numpy's default), None if empty."""
    xs = sorted(values)
    if not xs:
        return None
    at = (len(xs) - 1) * p / 100
    lo = math.floor(at)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (at - lo)


def by_length(lengths: Sequence[int], ttfts_ms: Sequence[float], bins: int = 4
              ) -> list[dict[str, Any]]:
    """TTFT p50/p99 per context-length bin (bins of equal request counts, by length)."""
    pairs = sorted(zip(lengths, ttfts_ms, strict=True))
    if not pairs:
        return []
    size = max(1, math.ceil(len(pairs) / bins))
    out = []
    for i in range(0, len(pairs), size):
        part = pairs[i:i + size]
        t = [x for _, x in part]
        out.append({"tokens_lo": part[0][0], "tokens_hi": part[-1][0],
                    "tokens": round(sum(n for n, _ in part) / len(part)),
                    "requests": len(part), "p50_ms": round(percentile(t, 50) or 0, 1),
                    "p99_ms": round(percentile(t, 99) or 0, 1)})
    return out


def metrics(text: str) -> dict[str, float]:
    """Prometheus text: each sample's value summed over its labels, by name."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name = head.split("{", 1)[0]
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


#: vLLM's counters a run reads (their increase over the run), by the record's name.
COUNTERS = {"prompt_tokens": "vllm:prompt_tokens_total",
            "queried_tokens": "vllm:prefix_cache_queries_total",
            "own_hit_tokens": "vllm:prefix_cache_hits_total",
            "external_queried_tokens": "vllm:external_prefix_cache_queries_total",
            "external_hit_tokens": "vllm:external_prefix_cache_hits_total",
            "preemptions": "vllm:num_preemptions_total"}


def counter_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    return {k: round(after.get(v, 0.0) - before.get(v, 0.0)) for k, v in COUNTERS.items()}
