"""Offline replay of request traces through eviction policies, against the offline optimum.

Model. Requests arrive in trace order. A request's hits are the leading run of its blocks that
are cached when it arrives (a prefix match stops at the first miss); hit tokens are hit blocks
times ``block_tokens``, at most the request's ``input_length`` (its last block may be partial).
The hits are read first: ``access`` on each hit block. Then the engine saves the blocks it
computed, as the kvfs client and daemon do it (so that ``kvfs bench hitrate`` through a real
mount gets the very same figures): the blocks that are not cached, in chain order, up to the
first one the policy does not ``admit`` (a block without its prefix is useless); the policy
then evicts its best victims until the cache has room for all of them, and they are inserted
in order. (A block cached beyond a miss, possible only with a chain-blind policy, is neither
written nor read again.) A save larger than the whole cache is refused, all of it.
Capacity counts blocks, or bytes with ``block_bytes`` (a block then weighs ``block_bytes``
times its share of ``block_tokens``).

The optimum (``belady``). After each request the cache may keep any of the blocks it held or
the request brought, up to the capacity. Keep those whose next use is soonest, evicting the
furthest first and, between blocks next used by the same request, the deeper first. Since ids
are chained, every request that uses a block uses its parent, so a block is never next used
before its parent: the rule keeps the cache prefix-closed, and every cached block a request
asks for is a prefix hit. And the rule (Belady's, with bypass) maximises the hits counted
anywhere in a request, an upper bound on any policy's prefix hits. So it is the optimum, in
blocks; with byte sizes it is the same greedy rule, no longer exactly optimal. (Breaking ties
parent first instead strands children: 50.1 % instead of 50.6 % at 10 % of the Mooncake
trace.) ``unbounded`` never evicts: the ceiling.

Bounds (``clairvoyant``). Between an online policy and the optimum, two reference policies
that know part of the future measure what an online policy could learn: ``knows-reuse`` is
chain-aware LRU that caches only the blocks that will be used again; ``knows-count`` also
evicts the tail with the fewest uses to come first (least recently used among equals). Neither
knows when; both are for comparison only.

``python -m kvfs.models.simulate TRACE`` prints a table; TRACE is a Mooncake-format file or the name
of a generator of ``kvfs.models.trace`` (``agentic``, ``mixed``).
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from kvfs.models.policy import POLICIES, ChainLRU, Key, Policy, policy_by_name
from kvfs.models.trace import BLOCK_TOKENS, Request, agentic_trace, mixed_trace, read_trace

OPTIMUM = "optimum"
UNBOUNDED = "unbounded"
KNOWS = ("knows-reuse", "knows-count")


@dataclass(slots=True)
class Result:
    policy: str
    capacity: int
    requests: int = 0
    blocks: int = 0  # block references
    hit_blocks: int = 0
    tokens: int = 0
    hit_tokens: int = 0
    inserted: int = 0  # blocks written into the cache
    evicted: int = 0

    @property
    def block_hit_rate(self) -> float:
        return self.hit_blocks / self.blocks if self.blocks else 0.0

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.tokens if self.tokens else 0.0

    def count(self, req: Request, hits: int, block_tokens: int) -> None:
        self.requests += 1
        self.blocks += len(req.hash_ids)
        self.hit_blocks += hits
        self.tokens += req.input_length
        self.hit_tokens += min(hits * block_tokens, req.input_length)


def _sizes(req: Request, block_tokens: int, block_bytes: int | None) -> list[int]:
    n = len(req.hash_ids)
    if block_bytes is None:
        return [1] * n
    last = min(max(req.input_length - (n - 1) * block_tokens, 1), block_tokens)
    sizes = [block_bytes] * n
    if n:
        sizes[-1] = -(-block_bytes * last // block_tokens)
    return sizes


def simulate(
    requests: Iterable[Request],
    policy: Policy | str,
    capacity: int,
    *,
    block_tokens: int = BLOCK_TOKENS,
    block_bytes: int | None = None,
) -> Result:
    """Replay ``requests`` through ``policy`` (an object or a name) at ``capacity``."""
    pol = policy_by_name(policy) if isinstance(policy, str) else policy
    res = Result(pol.name, capacity)
    cached: dict[int, int] = {}  # key -> size
    used = 0
    for req in requests:
        ids = req.hash_ids
        n, now = len(ids), req.timestamp / 1000.0
        k = 0
        while k < n and ids[k] in cached:
            k += 1
        res.count(req, k, block_tokens)
        for key in ids[:k]:
            pol.access(key, now)
        sizes = _sizes(req, block_tokens, block_bytes)
        # The save, as the client and the daemon do it: the client writes the blocks that
        # are not cached and publishes them in one call; the daemon asks the policy to admit
        # each, makes room for all of them, then caches them in chain order.
        batch: list[tuple[int, int, int | None]] = []
        growth = 0
        parent = ids[k - 1] if k else None
        for key, size in zip(ids[k:], sizes[k:], strict=True):
            if key in cached:  # beyond a miss (chain-blind policies only): not written again
                parent = key
                continue
            if not pol.admit(key, size, parent=parent, now=now):
                break  # what follows would lack its prefix
            batch.append((key, size, parent))
            growth += size
            parent = key
        if growth > capacity:
            batch = []  # the daemon refuses a save that cannot fit (ENOSPC): none of it stays
        if batch and used + growth > capacity:
            offered = pol.victims()
            for victim in offered:
                used -= cached.pop(victim)
                pol.remove(victim)
                res.evicted += 1
                if used + growth <= capacity:
                    break
            else:
                raise RuntimeError(f"{pol.name}: too few victims ({used + growth} > {capacity})")
            offered.close()
        for key, size, up in batch:
            pol.insert(key, size, parent=up, now=now)
            cached[key] = size
            used += size
            res.inserted += 1
    return res


def belady(
    requests: Sequence[Request],
    capacity: int,
    *,
    block_tokens: int = BLOCK_TOKENS,
    block_bytes: int | None = None,
) -> Result:
    """The offline optimum at ``capacity`` (see the module docstring)."""
    never = len(requests)
    next_use: list[list[int]] = [[]] * len(requests)
    seen: dict[int, int] = {}
    for i in range(len(requests) - 1, -1, -1):
        ids = requests[i].hash_ids
        next_use[i] = [seen.get(key, never) for key in ids]
        for key in ids:
            seen[key] = i
    res = Result(OPTIMUM, capacity)
    cached: dict[int, tuple[int, int, int]] = {}  # key -> (next use, depth, size)
    heap: list[tuple[int, int, int]] = []  # (-next use, -depth, key), stale entries skipped
    used = 0
    for i, req in enumerate(requests):
        ids = req.hash_ids
        k = 0
        while k < len(ids) and ids[k] in cached:
            k += 1
        res.count(req, k, block_tokens)
        sizes = _sizes(req, block_tokens, block_bytes)
        fresh = set()
        for depth, (key, nxt, size) in enumerate(zip(ids, next_use[i], sizes, strict=True)):
            if key not in cached:
                used += size
                fresh.add(key)
            cached[key] = (nxt, depth, size)
            heapq.heappush(heap, (-nxt, -depth, key))
        while used > capacity:
            nxt, depth, key = heapq.heappop(heap)
            entry = cached.get(key)
            if entry is not None and entry[0] == -nxt and entry[1] == -depth:
                del cached[key]
                used -= entry[2]
                res.evicted += key not in fresh  # else: never cached (bypassed)
        res.inserted += sum(1 for key in fresh if key in cached)
        if len(heap) > 4 * len(cached) + 1024:  # drop stale entries
            heap = [(-n, -d, key) for key, (n, d, _) in cached.items()]
            heapq.heapify(heap)
    return res


class _KnowsReuse(ChainLRU):
    """Chain-aware LRU that admits only blocks used again (``remaining``: uses to come)."""

    name = KNOWS[0]

    def __init__(self, remaining: dict[Key, int]) -> None:
        super().__init__()
        self.remaining = remaining

    def admit(self, key: Key, size: int, *, parent: Key | None = None, now: float) -> bool:
        return self.remaining.get(key, 0) > 0

    def changed(self, key: Key) -> None:
        pass


class _KnowsCount(Policy):
    """Chain-aware: admits only blocks used again, evicts the tail with the fewest uses to
    come, least recently used among equals. A heap of (uses, stamp, key), stale entries
    skipped; ``changed`` is told when a cached key's count drops."""

    name = KNOWS[1]

    def __init__(self, remaining: dict[Key, int]) -> None:
        self.remaining = remaining
        self.parent: dict[Key, Key | None] = {}
        self.kids: dict[Key, int] = {}
        self.stamp: dict[Key, int] = {}
        self.clock = 0
        self.heap: list[tuple[int, int, Key]] = []

    def _push(self, key: Key) -> None:
        if key in self.stamp and not self.kids[key]:
            heapq.heappush(self.heap, (self.remaining.get(key, 0), self.stamp[key], key))

    def changed(self, key: Key) -> None:
        self._push(key)

    def admit(self, key: Key, size: int, *, parent: Key | None = None, now: float) -> bool:
        return self.remaining.get(key, 0) > 0

    def insert(self, key: Key, size: int, *, parent: Key | None = None, now: float) -> None:
        if key in self.stamp:
            self.access(key, now)
            return
        self.clock += 1
        self.stamp[key], self.kids[key] = self.clock, 0
        self.parent[key] = parent if parent in self.stamp else None
        if self.parent[key] is not None:
            self.kids[parent] += 1  # type: ignore[index]
        self._push(key)

    def access(self, key: Key, now: float) -> None:
        if key in self.stamp:
            self.clock += 1
            self.stamp[key] = self.clock
            self._push(key)

    def remove(self, key: Key) -> None:
        if key not in self.stamp:
            return
        del self.stamp[key], self.kids[key]
        up = self.parent.pop(key)
        if up is not None and up in self.stamp:
            self.kids[up] -= 1
            self._push(up)

    def pin(self, key: Key, pinned: bool) -> None:
        raise NotImplementedError("a reference policy has no pins")

    def victims(self) -> Iterator[Key]:
        skipped = []
        try:
            while self.heap:
                uses, stamp, key = heapq.heappop(self.heap)
                if (self.stamp.get(key) != stamp or self.kids[key]
                        or self.remaining.get(key, 0) != uses):
                    continue  # stale
                yield key
                if key in self.stamp:
                    skipped.append(key)
        finally:
            for key in skipped:
                self._push(key)

    def __len__(self) -> int:
        return len(self.stamp)

    def __contains__(self, key: object) -> bool:
        return key in self.stamp


def clairvoyant(
    requests: Sequence[Request],
    capacity: int,
    knows: str,
    *,
    block_tokens: int = BLOCK_TOKENS,
    block_bytes: int | None = None,
) -> Result:
    """A reference policy that knows part of the future (``knows`` one of ``KNOWS``)."""
    remaining: dict[Key, int] = {}
    for r in requests:
        for key in r.hash_ids:
            remaining[key] = remaining.get(key, 0) + 1
    pol: _KnowsReuse | _KnowsCount
    pol = _KnowsReuse(remaining) if knows == KNOWS[0] else _KnowsCount(remaining)

    def feed() -> Iterator[Request]:
        for r in requests:
            for key in r.hash_ids:  # from now on: uses after this request
                remaining[key] -= 1
                if key in pol:
                    pol.changed(key)
            yield r

    return simulate(feed(), pol, capacity, block_tokens=block_tokens, block_bytes=block_bytes)


def unbounded(requests: Iterable[Request], *, block_tokens: int = BLOCK_TOKENS) -> Result:
    """Hits with no eviction at all: the ceiling of every policy."""
    res = Result(UNBOUNDED, 0)
    cached: set[int] = set()
    for req in requests:
        ids = req.hash_ids
        k = 0
        while k < len(ids) and ids[k] in cached:
            k += 1
        res.count(req, k, block_tokens)
        cached.update(ids[k:])
        res.inserted += len(ids) - k
    return res


def load(trace: str | Path | Sequence[Request], seed: int = 0) -> list[Request]:
    """A trace: requests, a file, or the name of a generator (``agentic``, ``mixed``)."""
    if not isinstance(trace, str | Path):
        return list(trace)
    if str(trace) == "agentic":
        return agentic_trace(seed=seed)
    if str(trace) == "mixed":
        return mixed_trace(seed=seed)
    return read_trace(trace)


def compare(
    trace: str | Path | Sequence[Request],
    fractions: Sequence[float] = (0.1, 0.25, 0.5),
    policies: Sequence[str] = POLICIES,
    *,
    block_tokens: int = BLOCK_TOKENS,
    seed: int = 0,
    bounds: bool = False,
) -> dict:
    """Every policy, the optimum and the unbounded cache at each capacity (and with
    ``bounds`` the reference policies of ``clairvoyant``).

    Capacities are ``fractions`` of the trace's distinct blocks. Each row has the block and
    token hit rates in %, and ``gap_closed``: the share of LRU's gap to the optimum that the
    policy closes, in % (negative: below LRU).
    """
    requests = load(trace, seed)
    distinct = len({key for r in requests for key in r.hash_ids})
    top = unbounded(requests, block_tokens=block_tokens)
    rows = []
    for fraction in fractions:
        cap = max(1, round(fraction * distinct))
        results = [simulate(requests, p, cap, block_tokens=block_tokens) for p in policies]
        if bounds:
            results += [clairvoyant(requests, cap, k, block_tokens=block_tokens) for k in KNOWS]
        opt = belady(requests, cap, block_tokens=block_tokens)
        by_name = {r.policy: r for r in results}
        lru = by_name.get("lru") or simulate(requests, "lru", cap, block_tokens=block_tokens)
        gap = opt.block_hit_rate - lru.block_hit_rate
        for r in [*results, opt, top]:
            closed = (r.block_hit_rate - lru.block_hit_rate) / gap if gap > 1e-12 else 0.0
            rows.append(
                {
                    "fraction": fraction,
                    "capacity": cap,
                    "policy": r.policy,
                    "block_hit": round(100 * r.block_hit_rate, 2),
                    "token_hit": round(100 * r.token_hit_rate, 2),
                    "gap_closed": round(100 * closed, 1),
                    **{k: v for k, v in asdict(r).items() if k in ("inserted", "evicted")},
                }
            )
    return {
        "requests": len(requests),
        "references": top.blocks,
        "blocks": distinct,
        "block_tokens": block_tokens,
        "rows": rows,
    }


def format_table(report: dict) -> str:
    lines = [
        f"{report['requests']} requests, {report['references']} block references, "
        f"{report['blocks']} distinct blocks of {report['block_tokens']} tokens",
        f"{'capacity':>16}  {'policy':<11} {'block hit %':>11} {'token hit %':>11} "
        f"{'gap closed %':>12}",
    ]
    last = None
    for row in report["rows"]:
        cap = f"{100 * row['fraction']:g} % = {row['capacity']}"
        if cap != last and last is not None:
            lines.append("")
        closed = "" if row["policy"] in ("lru", UNBOUNDED) else f"{row['gap_closed']:.1f}"
        lines.append(
            f"{cap if cap != last else '':>16}  {row['policy']:<11} {row['block_hit']:>11.1f} "
            f"{row['token_hit']:>11.1f} {closed:>12}"
        )
        last = cap
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvfs.models.simulate",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("trace", help="Mooncake-format JSONL file, or 'agentic' or 'mixed'")
    ap.add_argument("--fractions", default="0.1,0.25,0.5", help="capacities, of distinct blocks")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--block-tokens", type=int, default=BLOCK_TOKENS)
    ap.add_argument("--seed", type=int, default=0, help="for generated traces")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument("--bounds", action="store_true",
                    help="add the reference policies that know part of the future")
    args = ap.parse_args(argv)
    try:
        report = compare(
            args.trace,
            [float(f) for f in args.fractions.split(",")],
            args.policies.split(","),
            block_tokens=args.block_tokens,
            seed=args.seed,
            bounds=args.bounds,
        )
    except (OSError, ValueError) as e:
        print(f"kvfs.models.simulate: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=1) if args.json else format_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
