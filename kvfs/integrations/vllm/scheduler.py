"""The KVFSConnector's scheduler side: one kvfs lookup per request, and each step's metadata
(:class:`KVFSMetadata`): exactly the blocks to load and the full prompt blocks to save."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvfs.format.hashing import block_hashes

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from kvfs.client import KVCache

    from .events import KVEvents
    from .mountwatch import MountWatch

log = logging.getLogger(__name__)

#: Seconds a new request's lookup may keep the scheduler waiting where the mount has lower
#: tiers (the lookup itself may take up to lookup_budget_s: past this, the request waits
#: alone).
LOOKUP_WAIT_S = 0.005


@dataclass
class _Transfer:
    """Blocks to move between kvfs and vLLM's pages: ``hashes[i]`` <-> page ``block_ids[i]``."""

    req_id: str
    hashes: list[bytes]
    block_ids: list[int]
    parent: bytes | None = None


@dataclass
class KVFSMetadata(KVConnectorMetadata):
    """One step's work for the worker side: loads before the forward pass, saves after."""

    loads: list[_Transfer] = field(default_factory=list)
    saves: list[_Transfer] = field(default_factory=list)


@dataclass
class _Request:
    """What the scheduler side knows of one request."""

    hashes: list[bytes]  # kvfs hashes of the prompt's full blocks
    hit: int  # leading blocks kvfs holds (the lookup's answer)
    block_ids: list[int] = field(default_factory=list)
    saved: int = 0  # blocks [0, saved) are in kvfs or handed to the worker to save
    load: tuple[int, int] | None = None  # (first block, count) to load in the next step
    tokens: list[int] = field(default_factory=list)  # the prompt (for KV events)
    asked: int = 0  # blocks the lookup asked kvfs about (0: no lookup)


class SchedulerSide:
    """The scheduler-side methods of :class:`~kvfs.integrations.vllm.KVFSConnector`."""

    cache: KVCache
    watch: MountWatch
    _block_size: int
    _extra: dict[str, Any]
    _requests: dict[str, _Request]
    _lookups: dict[str, Future[_Request]]  # lookups running in _lookup_pool
    _lookup_pool: ThreadPoolExecutor
    events: KVEvents

    _count: Callable[..., None]

    def _extra_key(self, request: Request) -> str | None:
        """What besides the tokens changes the KV: LoRA adapter and cache salt."""
        parts = []
        lora = getattr(request, "lora_request", None)
        if lora is not None:
            parts.append(f"lora={lora.lora_name}")
        salt = getattr(request, "cache_salt", None)
        if salt:
            parts.append(f"salt={salt}")
        return ";".join(parts) or None

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        rid = request.request_id
        state = self._requests.get(rid)
        local = num_computed_tokens // self._block_size
        if state is None:
            state = self._looked_up(request, local)
            if state is None:
                self._count(deferred=1)
                return None, False  # vLLM asks again at its next step
            self._requests[rid] = state
        if state.hit <= local:
            return 0, False
        return (state.hit - local) * self._block_size, False

    def _looked_up(self, request: Request, local: int) -> _Request | None:
        """The lookup's answer for a new request, or None while it is still running.

        Where the mount has lower tiers, the lookup (which promotes what they hold, within
        ``lookup_budget_s``) runs in a thread of its own: the request waits, unscheduled,
        while the scheduler goes on with the others; an answer within
        :data:`LOOKUP_WAIT_S` (all hot, or nothing anywhere) comes in this very step."""
        rid = request.request_id
        fut = self._lookups.get(rid)
        if fut is None:
            if not self.cache.tiers:
                state = self._lookup(request, local)
                self._offer_lookup(state)
                return state
            fut = self._lookups[rid] = self._lookup_pool.submit(self._lookup, request, local)
            with contextlib.suppress(TimeoutError):
                fut.result(timeout=LOOKUP_WAIT_S)
        if not fut.done():
            return None
        del self._lookups[rid]
        state = fut.result()  # _lookup catches what a lookup raises
        self._offer_lookup(state)
        return state

    def _offer_lookup(self, state: _Request) -> None:
        try:
            if state.asked:
                self.events.looked_up(state.hashes[:state.asked], state.hit, state.tokens)
        except Exception:  # noqa: BLE001 - an event lost, never a request
            log.exception("kvfs KV events after a lookup")

    def _lookup(self, request: Request, local: int) -> _Request:
        """One kvfs lookup of the prompt's blocks (none if vLLM's own prefix cache holds
        every block a hit could give)."""
        prompt = list(request.prompt_token_ids or [])
        if getattr(request, "mm_features", None) or not prompt:
            return _Request(hashes=[], hit=0)  # multimodal inputs: not cached by kvfs
        hashes = block_hashes(prompt, self._block_size, extra=self._extra_key(request))
        # At least one prompt token must be computed, to sample the next one.
        usable = (len(prompt) - 1) // self._block_size
        if local >= usable:
            return _Request(hashes=hashes, hit=local, saved=local, tokens=prompt)
        if not self.watch.alive():  # logged there
            self._count(lookups=1, hit_blocks=0, miss_blocks=usable, unavailable=1)
            return _Request(hashes=hashes, hit=0, tokens=prompt)
        start = time.perf_counter()
        try:
            hit = self.cache.lookup(hashes[:usable], budget=self._extra["lookup_budget_s"])
        except Exception:  # noqa: BLE001 - a broken mount is a miss, never a dead engine
            log.exception("kvfs lookup in %s failed: treated as a miss", self.cache.ns_dir)
            hit = 0
        self._count(lookups=1, hit_blocks=hit, miss_blocks=usable - hit,
                    lookup_s=time.perf_counter() - start)
        return _Request(hashes=hashes, hit=hit, saved=hit, tokens=prompt, asked=usable)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        state = self._requests.get(request.request_id)
        if state is None or num_external_tokens <= 0:
            return
        n = num_external_tokens // self._block_size
        state.load = (state.hit - n, n)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVFSMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is not None:
                state.block_ids = list(new.block_ids[0])
                self._plan(meta, new.req_id, state,
                           new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                state.block_ids.extend(new_ids[0])
            self._plan(meta, req_id, state,
                       cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        return meta

    def _plan(self, meta: KVFSMetadata, req_id: str, state: _Request, end_tokens: int) -> None:
        """The blocks this step loads (planned at allocation) and the full prompt blocks
        it completes, to save."""
        if state.load is not None:
            first, n = state.load
            state.load = None
            meta.loads.append(_Transfer(req_id, state.hashes[first:first + n],
                                        state.block_ids[first:first + n]))
        full = min(len(state.hashes), end_tokens // self._block_size, len(state.block_ids))
        if full > state.saved:
            s = state.saved
            meta.saves.append(_Transfer(req_id, state.hashes[s:full], state.block_ids[s:full],
                                        parent=state.hashes[s - 1] if s else None))
            bs = self._block_size
            self.events.planned(state.hashes[s - 1] if s else None, state.hashes[s:full],
                                state.tokens[s * bs:full * bs])
            state.saved = full

    def take_events(self) -> Any:
        try:
            events = self.events.take()
        except Exception:  # noqa: BLE001 - events lost, never the scheduler
            log.exception("kvfs KV events")
            return []
        stored = sum(type(e).__name__ == "BlockStored" for e in events)
        if events:
            self._count(stored_events=stored, removed_events=len(events) - stored)
        return events

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # Saves copy their pages out during the step that completes them: the blocks may
        # be freed now.
        self._requests.pop(request.request_id, None)
        self._lookups.pop(request.request_id, None)
        return False, None
