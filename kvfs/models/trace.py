"""Request traces in the Mooncake format, and generators of synthetic ones.

A trace is a JSON-lines file, one request a line, as Moonshot AI published it with the Mooncake
paper: ``timestamp`` (ms since the first request), ``input_length`` and ``output_length``
(tokens), ``hash_ids`` (the prompt's KV blocks, ``block_tokens`` each, the last one possibly
partial). Ids are chained: an id stands for its block *and* every block before it, so two
requests share a prefix exactly as long as their leading runs of equal ids.

Two generators write the same format, so that policies can be compared on workloads they were
not tuned on (``python -m kvfs.models.trace agentic out.jsonl --set sessions=500`` writes one):

- :func:`agentic_trace`: many concurrent agent sessions. Each turn re-sends a large shared
  prefix (system prompt and tools, one of a few agents) plus the session's whole history, and
  appends new tokens (user message, tool results) and the previous answer; between turns a
  short think time, sometimes a long idle gap; a session over the context limit compacts its
  history into a summary and goes on from there.
- :func:`mixed_trace`: documents read by many requests with random (Zipf or uniform)
  popularity, each request asking its own question, mixed with one-off long prompts (scans).
"""

from __future__ import annotations

import argparse
import heapq
import inspect
import itertools
import json
import math
import random
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

BLOCK_TOKENS = 512


@dataclass(slots=True)
class Request:
    timestamp: int  # ms since the first request
    input_length: int  # prompt tokens
    output_length: int  # generated tokens
    hash_ids: list[int]  # chained block ids of the prompt

    def to_json(self) -> str:
        return json.dumps(
            {
                "timestamp": self.timestamp,
                "input_length": self.input_length,
                "output_length": self.output_length,
                "hash_ids": self.hash_ids,
            }
        )


def iter_trace(path: str | Path) -> Iterator[Request]:
    """Requests of a Mooncake-format trace, in file order (blank lines skipped)."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                yield Request(
                    int(d["timestamp"]),
                    int(d["input_length"]),
                    int(d.get("output_length", 0)),
                    [int(h) for h in d["hash_ids"]],
                )
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: not a trace record: {e}") from None


def read_trace(path: str | Path) -> list[Request]:
    return list(iter_trace(path))


def write_trace(path: str | Path, requests: Iterable[Request]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            f.write(r.to_json() + "\n")


class BlockIds:
    """Chained integer block ids: one id per (parent id, block content), numbered from 0."""

    def __init__(self) -> None:
        self._ids: dict[tuple, int] = {}

    def extend(self, ids: list[int], contents: Iterable[tuple]) -> list[int]:
        """Append the ids of blocks with these contents after the chain ``ids`` (in place)."""
        parent = ids[-1] if ids else -1
        for content in contents:
            parent = self._ids.setdefault((parent, content), len(self._ids))
            ids.append(parent)
        return ids


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return min(hi, max(lo, round(median * math.exp(sigma * rng.gauss(0.0, 1.0)))))


def _finish(requests: list[tuple[float, int, int, list[int]]]) -> list[Request]:
    requests.sort(key=lambda r: r[0])
    t0 = requests[0][0] if requests else 0.0
    return [Request(round((t - t0) * 1000), n, out, ids) for t, n, out, ids in requests]


def agentic_trace(
    *,
    sessions: int = 300,
    turns: float = 15.0,
    prefix_tokens: int = 18_000,
    agents: int = 3,
    block_tokens: int = BLOCK_TOKENS,
    first_tokens: int = 1_500,
    turn_tokens: int = 600,
    output_tokens: int = 250,
    max_context: int = 131_072,
    arrival_s: float = 4.0,
    think_s: float = 6.0,
    idle_prob: float = 0.1,
    idle_s: float = 900.0,
    concurrency: int = 0,
    seed: int = 0,
) -> list[Request]:
    """A trace of concurrent multi-turn agent sessions (see the module docstring).

    ``sessions`` start as a Poisson process, one every ``arrival_s`` seconds on average, and
    last a geometric number of turns (mean ``turns``). With ``concurrency`` N > 0 they run
    closed-loop instead: N users, each starting a new session (after an exponential pause of
    mean ``arrival_s``) when its last one ends, so that N sessions are interleaved at any
    time; the sessions themselves are the same whatever N. Agent ``a`` of ``agents`` (Zipf
    popularity) has its own ``prefix_tokens``-token prefix. New tokens per turn are lognormal
    around ``turn_tokens`` (``first_tokens`` for the first turn), answers around
    ``output_tokens``. Between turns: a lognormal think time around ``think_s``, or with
    probability ``idle_prob`` an exponential idle gap of mean ``idle_s``.
    """
    rng = random.Random(seed)
    blocks = BlockIds()
    weights = [1.0 / (a + 1) for a in range(agents)]
    shared = prefix_tokens // block_tokens  # blocks made of prefix tokens only
    out: list[tuple[float, int, int, list[int]]] = []
    if concurrency < 0:
        raise ValueError(f"concurrency must be >= 0, got {concurrency}")
    start = 0.0
    users = [0.0] * concurrency  # closed loop: when each user is free again (a heap)
    for s in range(sessions):
        if concurrency:
            start = heapq.heappop(users) + rng.expovariate(1.0 / arrival_s)
        else:
            start += rng.expovariate(1.0 / arrival_s)
        agent = rng.choices(range(agents), weights)[0]
        n_turns = 1 + int(math.log(1.0 - rng.random()) / math.log(1.0 - 1.0 / turns))
        t, epoch, history = start, 0, 0  # history: session tokens after the shared prefix
        full: list[int] = []  # ids of the prompt's full blocks, stable from turn to turn
        new = _lognormal(rng, first_tokens, 0.8, 16, max_context // 4)
        for _ in range(n_turns):
            if prefix_tokens + history + new > max_context:  # compact: summary replaces history
                epoch, history, full = epoch + 1, 0, full[:shared]
                new = _lognormal(rng, 2_000, 0.5, 256, max_context // 4)
            length = prefix_tokens + history + new
            n_full, rest = divmod(length, block_tokens)
            owner = ("session", s, epoch)
            blocks.extend(
                full,
                (
                    ("agent", agent, k) if k < shared else (*owner, k, block_tokens)
                    for k in range(len(full), n_full)
                ),
            )
            ids = blocks.extend(list(full), [(*owner, n_full, rest)]) if rest else list(full)
            answer = _lognormal(rng, output_tokens, 0.7, 1, 8_192)
            out.append((t, length, answer, ids))
            history += new + answer
            new = _lognormal(rng, turn_tokens, 1.0, 8, max_context // 4)
            gap = rng.expovariate(1.0 / idle_s) if rng.random() < idle_prob else 0.0
            t += gap + _lognormal(rng, think_s, 0.8, 0, 600) + length / 20_000  # + prefill
        if concurrency:
            heapq.heappush(users, t)
    return _finish(out)


def mixed_trace(
    *,
    requests: int = 4_000,
    documents: int = 1_500,
    zipf: float = 0.8,
    doc_blocks: int = 24,
    scan_prob: float = 0.3,
    scan_blocks: int = 48,
    block_tokens: int = BLOCK_TOKENS,
    rate_s: float = 4.0,
    seed: int = 0,
) -> list[Request]:
    """Documents with Zipf(``zipf``) popularity (0: uniform) mixed with one-off scans.

    Each request reads one of ``documents`` documents (lognormal length around ``doc_blocks``
    blocks), whole or cut short, and adds a question of its own; with probability
    ``scan_prob`` it is instead a one-off prompt of about ``scan_blocks`` blocks that no other
    request shares. Requests arrive as a Poisson process of ``rate_s`` per second.
    """
    rng = random.Random(seed)
    blocks = BlockIds()
    lengths = [_lognormal(rng, doc_blocks, 0.7, 1, 512) for _ in range(documents)]
    weights = [1.0 / (d + 1) ** zipf for d in range(documents)]
    order = list(range(documents))
    rng.shuffle(order)  # popularity unrelated to document number
    out: list[tuple[float, int, int, list[int]]] = []
    t = 0.0
    for r in range(requests):
        t += rng.expovariate(rate_s)
        if rng.random() < scan_prob:
            n = _lognormal(rng, scan_blocks, 0.7, 1, 1024)
            ids = blocks.extend([], (("scan", r, k) for k in range(n)))
        else:
            d = order[rng.choices(range(documents), weights)[0]]
            n = lengths[d] if rng.random() < 0.7 else rng.randint(1, lengths[d])
            ids = blocks.extend([], (("doc", d, k) for k in range(n)))
            blocks.extend(ids, [("question", r)])
        tokens = (len(ids) - 1) * block_tokens + rng.randint(1, block_tokens)
        out.append((t, tokens, _lognormal(rng, 200, 0.7, 1, 4096), ids))
    return _finish(out)


def _quantiles(values: Sequence[float], qs: Sequence[float] = (0.05, 0.1, 0.5, 0.9, 0.95)
               ) -> dict[str, float]:
    """Nearest-rank quantiles (``p5``, ``p50``...) plus min, max and mean; {} when empty."""
    if not values:
        return {}
    v = sorted(values)
    out = {"min": v[0]}
    for q in qs:
        out[f"p{q * 100:g}"] = v[min(len(v) - 1, max(0, math.ceil(q * len(v)) - 1))]
    out.update(max=v[-1], mean=sum(v) / len(v))
    return out


def describe(requests: Sequence[Request], *, block_tokens: int = BLOCK_TOKENS,
             long_gap_s: float = 300.0) -> dict:
    """What a trace is like, measured from its records alone (so any Mooncake-format trace):

    - ``reuse``: per request, the share of its input tokens in the leading run of blocks that
      an earlier request already sent (what a cache of unbounded size would hit), in %.
    - ``shared_prefix_tokens``: per request, the depth of the deepest block of its chain at
      which conversations branch (two or more chains go on below it), in tokens: the prefix
      it shares with other conversations (a system prompt and tools). A block only some
      request's partial last block follows is no branch: that is one conversation's turn.
    - Conversations, inferred from the branching: a request belongs to the chain below its
      deepest branch point (a session after a history compaction counts as a new one).
      ``concurrency``: at each request's arrival, the conversations whose first request has
      arrived and whose last has not yet. ``gaps_s``: the pauses between a conversation's
      consecutive requests; ``long_gaps``: those over ``long_gap_s`` seconds.
    """
    children: dict[int, set[int]] = {}
    for r in requests:
        parent = -1
        for h in r.hash_ids:
            children.setdefault(parent, set()).add(h)
            parent = h
    inner = set(children)  # blocks that some request goes on after
    branch = {p for p, kids in children.items() if p != -1 and len(kids & inner) >= 2}
    seen: set[int] = set()
    reuse, shared, tokens, hit = [], [], 0, 0
    spans: dict[int, list[float]] = {}  # conversation -> its request times (s)
    for i, r in enumerate(requests):
        n = 0
        for h in r.hash_ids:
            if h not in seen:
                break
            n += 1
        seen.update(r.hash_ids)
        got = min(n * block_tokens, r.input_length)
        tokens += r.input_length
        hit += got
        reuse.append(100.0 * got / r.input_length if r.input_length else 0.0)
        depth = max((k + 1 for k, h in enumerate(r.hash_ids) if h in branch), default=0)
        shared.append(min(depth * block_tokens, r.input_length))
        below = r.hash_ids[depth:]
        conv = next((h for h in below if h in inner), below[0] if below else -2 - i)
        spans.setdefault(conv, []).append(r.timestamp / 1000)
    gaps = [b - a for times in spans.values() for a, b in itertools.pairwise(times)]
    ends = sorted((t[0], t[-1]) for t in spans.values())
    active = []
    if requests:
        import bisect  # noqa: PLC0415

        starts, last = [a for a, _ in ends], sorted(b for _, b in ends)
        for r in requests:
            t = r.timestamp / 1000
            active.append(bisect.bisect_right(starts, t) - bisect.bisect_left(last, t))
    span_s = (requests[-1].timestamp - requests[0].timestamp) / 1000 if requests else 0.0
    return {
        "requests": len(requests),
        "distinct_blocks": len({h for r in requests for h in r.hash_ids}),
        "input_tokens": tokens,
        "duration_s": round(span_s, 1),
        "reuse_percent": {k: round(v, 2) for k, v in _quantiles(reuse).items()},
        "reused_tokens_percent": round(100.0 * hit / tokens, 2) if tokens else 0.0,
        "requests_85_to_99_percent": (round(100.0 * sum(85 <= x <= 99 for x in reuse)
                                            / len(reuse), 1) if reuse else 0.0),
        "shared_prefix_tokens": {k: round(v) for k, v in _quantiles(shared).items()},
        "conversations": len(spans),
        "concurrency": {k: round(v, 1) for k, v in _quantiles(active, (0.1, 0.5, 0.9)).items()},
        "gaps_s": {k: round(v, 1) for k, v in _quantiles(gaps, (0.5, 0.9, 0.99)).items()},
        "long_gaps": sum(g > long_gap_s for g in gaps),
        "long_gap_s": long_gap_s,
    }


GENERATORS: dict[str, Callable[..., list[Request]]] = {
    "agentic": agentic_trace,
    "mixed": mixed_trace,
}


def generator_options(kind: str, items: Iterable[str]) -> dict:
    """``NAME=VALUE`` strings as keyword arguments of generator ``kind``, typed like their
    defaults; ValueError naming what is wrong."""
    if kind not in GENERATORS:
        raise ValueError(f"no trace generator {kind!r} (known: {', '.join(GENERATORS)})")
    defaults = {n: p.default for n, p in inspect.signature(GENERATORS[kind]).parameters.items()}
    options = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not eq or name not in defaults:
            raise ValueError(f"{kind} has no option {name!r}; options: {', '.join(defaults)}")
        try:
            options[name] = type(defaults[name])(value)
        except ValueError:
            raise ValueError(f"{name}: not a {type(defaults[name]).__name__}: {value!r}"
                             ) from None
    return options


def format_description(d: dict) -> str:
    """`describe`'s figures as a short table."""
    def dist(q: dict, unit: str = "") -> str:
        return ", ".join(f"{k} {v:g}{unit}" for k, v in q.items()) or "-"

    return "\n".join([
        f"{d['requests']} requests, {d['distinct_blocks']} distinct blocks, "
        f"{d['input_tokens']} input tokens over {d['duration_s']:g} s",
        f"{'shared prefix (tokens)':<26} {dist(d['shared_prefix_tokens'])}",
        f"{'input reused per request':<26} {dist(d['reuse_percent'], ' %')}",
        f"{'':<26} {d['reused_tokens_percent']:g} % of all input tokens; "
        f"{d['requests_85_to_99_percent']:g} % of requests reuse 85-99 %",
        f"{'conversations':<26} {d['conversations']}",
        f"{'active at once':<26} {dist(d['concurrency'])}",
        f"{'gaps within one (s)':<26} {dist(d['gaps_s'])}",
        f"{'':<26} {d['long_gaps']} gaps over {d['long_gap_s']:g} s",
    ])


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m kvfs.models.trace",
        description="Write a synthetic trace in the Mooncake format."
    )
    ap.add_argument("kind", choices=sorted(GENERATORS))
    ap.add_argument("out", help="the JSONL file to write")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a generator option (see its docstring), e.g. sessions=500; repeatable",
    )
    args = ap.parse_args(argv)
    try:
        options = generator_options(args.kind, args.set)
    except ValueError as exc:
        ap.error(str(exc))
    requests = GENERATORS[args.kind](**options)
    write_trace(args.out, requests)
    blocks = len({key for r in requests for key in r.hash_ids})
    print(f"{args.out}: {len(requests)} requests, {blocks} distinct blocks", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
