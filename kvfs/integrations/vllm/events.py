"""KV events for a KV-aware router: which blocks kvfs holds for this engine's namespace.

Offered through the connector's ``take_events`` (the scheduler publishes them with its own,
when ``kv_events_config`` enables them), medium ``STORAGE`` (kvfs's hot tier of the
namespace), block hashes being kvfs's 16-byte chained hashes:

- ``BlockStored`` once a block is *in* kvfs, never on the promise of a save: a save this
  engine planned is offered when a sweep finds its block file (a save dropped on a full
  queue, refused for capacity or lost with the mount is never offered; one not found
  within :data:`STORED_WITHIN_S` is forgotten), and blocks a lookup found that were not
  offered (another engine saved them, or a lower tier supplied them) are offered then.
- ``BlockRemoved`` once a block offered is no longer there: kvfs evicted it (or demoted it to
  a lower tier, or quarantined it). The connector learns it two ways, both without the
  daemon's help: a lookup that stops short of a block offered (at once), and a sweep that
  checks up to :data:`SWEEP_BLOCKS` offered blocks every :data:`SWEEP_EVERY_S` seconds,
  oldest checked first (so a router hears of an eviction within
  ``offered / SWEEP_BLOCKS * SWEEP_EVERY_S`` seconds even if no request asks). kvfs's own
  counters say how many blocks were evicted, not which, so they cannot name them.

Nothing is reported while the mount is gone (its blocks are not removed, only unreachable),
and at most :data:`MAX_OFFERED` blocks are tracked: past that the oldest are forgotten
without an event (a router then holds a stale entry until its own expiry).
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored

if TYPE_CHECKING:
    from kvfs.client import KVCache

    from .mountwatch import MountWatch

MEDIUM = "STORAGE"
#: Seconds between two sweeps (pending saves, then offered blocks).
SWEEP_EVERY_S = 0.5
#: Offered blocks checked per sweep (one faccessat each).
SWEEP_BLOCKS = 256
#: Seconds a planned save may take to appear before it is forgotten (never offered).
STORED_WITHIN_S = 60.0
#: Blocks tracked as offered at most.
MAX_OFFERED = 1 << 18


class KVEvents:
    """The scheduler side's record of what it offered, and the events not yet taken."""

    def __init__(self, cache: KVCache, watch: MountWatch, block_size: int) -> None:
        self.cache, self.watch, self.block_size = cache, watch, block_size
        # planned saves: (parent, hashes, token ids of those blocks, give-up time)
        self._pending: list[tuple[bytes | None, list[bytes], list[int], float]] = []
        self._offered: OrderedDict[bytes, None] = OrderedDict()  # least recently checked first
        self._out: list[Any] = []
        self._next_sweep = 0.0
        self.counts = {"stored_events": 0, "removed_events": 0}

    # -- what the scheduler side tells it ---------------------------------------------------

    def planned(self, parent: bytes | None, hashes: list[bytes], tokens: list[int]) -> None:
        """A save of ``hashes`` (chained after ``parent``) went to the worker."""
        self._pending.append((parent, list(hashes), list(tokens),
                              time.monotonic() + STORED_WITHIN_S))

    def looked_up(self, hashes: list[bytes], hit: int, tokens: list[int]) -> None:
        """A lookup found ``hashes[:hit]`` in kvfs, and not ``hashes[hit]`` (if any)."""
        gone = [h for h in hashes[hit:] if h in self._offered]
        if gone:
            self._removed(gone)
        first = next((i for i, h in enumerate(hashes[:hit]) if h not in self._offered), hit)
        if first < hit:
            bs = self.block_size
            self._stored(hashes[first - 1] if first else None, hashes[first:hit],
                         tokens[first * bs:hit * bs])

    def take(self) -> list[Any]:
        self._sweep()
        out, self._out = self._out, []
        return out

    # -- the sweep ------------------------------------------------------------------------

    def _sweep(self) -> None:
        now = time.monotonic()
        if now < self._next_sweep or not (self._pending or self._offered):
            return
        self._next_sweep = now + SWEEP_EVERY_S
        if not self.watch.alive():
            return  # unreachable is not removed
        path, access, there = self.cache.path, os.access, os.F_OK

        def present(h: bytes) -> bool:
            return access(path(h), there, effective_ids=True)

        bs, keep = self.block_size, []
        for parent, hashes, tokens, give_up in self._pending:
            k = 0
            while k < len(hashes) and present(hashes[k]):
                k += 1
            if k:
                self._stored(parent, hashes[:k], tokens[:k * bs])
                parent, hashes, tokens = hashes[k - 1], hashes[k:], tokens[k * bs:]
            if hashes and now < give_up:
                keep.append((parent, hashes, tokens, give_up))
        self._pending = keep
        gone = []
        for h in list(self._offered)[:SWEEP_BLOCKS]:
            if present(h):
                self._offered.move_to_end(h)
            else:
                gone.append(h)
        if gone:
            self._removed(gone)

    # -- events -------------------------------------------------------------------------

    def _stored(self, parent: bytes | None, hashes: list[bytes], tokens: list[int]) -> None:
        for h in hashes:
            self._offered[h] = None
            self._offered.move_to_end(h)
        while len(self._offered) > MAX_OFFERED:
            self._offered.popitem(last=False)
        self.counts["stored_events"] += 1
        self._out.append(BlockStored(
            block_hashes=list(hashes), parent_block_hash=parent, token_ids=list(tokens),
            block_size=self.block_size, lora_id=None, medium=MEDIUM, lora_name=None))

    def _removed(self, hashes: list[bytes]) -> None:
        for h in hashes:
            self._offered.pop(h, None)
        self.counts["removed_events"] += 1
        self._out.append(BlockRemoved(block_hashes=list(hashes), medium=MEDIUM))
