"""The KVFSConnector's scheduler side: one kvfs lookup per request, and each step's metadata
(:class:`KVFSMetadata`): exactly the blocks to load and the full prompt blocks to save."""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
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
#: Once the request computing a block has handed it to its worker to save and a step has
#: gone by (the step that computes it), seconds the requests waiting for that block keep
#: looking for it (the save lands asynchronously), and at most how often each looks.
SAVE_GRACE_S = 2.0
RELOOK_S = 0.02
#: Seconds a block handed to save stays known as computed here (then a lookup finds it).
FORGET_PLANNED_S = 60.0


@dataclass
class _Owner:
    """The request of this engine that computes (and will save) a block no lookup found."""

    rid: str
    planned_at: float | None = None  # when its save was handed to the worker
    looked_at: float | None = None  # when a waiting request first looked for it since


@dataclass
class _Parked:
    """A request waiting for a block of its prefix that another request is computing."""

    block: bytes
    since: float  # time.monotonic() when it was parked
    looked: float  # when its last lookup answered


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
    _step: int  # the scheduler's steps so far (build_connector_meta calls)
    _idle: bool  # whether the last step scheduled nothing
    _waited: int  # the step in which the scheduler side last waited (_idle_wait)
    _computing: dict[bytes, _Owner]  # blocks this engine's requests compute and will save
    _planned: deque[tuple[float, bytes]]  # (when, block) of _computing's planned entries
    _parked: dict[str, _Parked]  # requests waiting for a block another one computes
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
            parked = self._parked.get(rid)
            if parked is not None and not self._look_again(parked):
                self._idle_wait(sleep=True)
                return None, False
            state = self._looked_up(request, local)
            if state is None:
                self._count(deferred=1)
                return None, False  # vLLM asks again at its next step
            if self._park(rid, state, local):
                return None, False
            self._requests[rid] = state
            self._claim(rid, state, local)
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
            self._idle_wait()
        if not fut.done():
            return None
        del self._lookups[rid]
        state = fut.result()  # _lookup catches what a lookup raises
        self._offer_lookup(state)
        return state

    def _idle_wait(self, *, sleep: bool = False) -> None:
        """Where the last step scheduled nothing, wait briefly, once a step (until any lookup
        ends, at most LOOKUP_WAIT_S; ``sleep``: that long): vLLM's engine loop would
        otherwise ask again at once, thousands of times a second, holding the GIL and a core
        that the lookups' threads and the saves (in this process) need. A step that
        computes anything is never delayed."""
        if not self._idle or self._waited == self._step:
            return
        self._waited = self._step
        if self._lookups:
            wait_futures(list(self._lookups.values()), timeout=LOOKUP_WAIT_S,
                         return_when=FIRST_COMPLETED)
        elif sleep:
            time.sleep(LOOKUP_WAIT_S)

    # -- prefixes being computed ----------------------------------------------------------
    #
    # Requests that arrive together often share a prefix that no lookup finds yet: the first
    # of them computes it, and each of the others would compute it again beside it. A
    # request whose first missing block another request of this engine is computing waits
    # (unscheduled, as for a lookup) until that block has been handed to the worker to save,
    # then looks again, and loads what the other computed (up to ``inflight_wait_s``).

    def _park(self, rid: str, state: _Request, local: int) -> bool:
        """Whether ``rid`` waits for a block of its prefix another request computes."""
        first = max(state.hit, local)
        if first >= state.asked or self._extra["inflight_wait_s"] <= 0:
            self._unpark(rid)
            return False
        block = state.hashes[first]
        owner = self._computing.get(block)
        now = time.monotonic()
        parked = self._parked.get(rid)
        if owner is not None and owner.planned_at is not None and owner.looked_at is None:
            owner.looked_at = now  # the step that computes it is over: its save is on its way
        if (owner is None or owner.rid == rid
                or (parked is not None and self._waited_out(parked, now))
                or (owner.looked_at is not None and now > owner.looked_at + SAVE_GRACE_S)):
            self._unpark(rid)
            return False
        if parked is None:
            self._parked[rid] = _Parked(block, now, now)
            self._count(parked=1)
        else:
            parked.block, parked.looked = block, now
        return True

    def _look_again(self, parked: _Parked) -> bool:
        """Whether a parked request looks again now: the block it waits for has been handed
        to a worker to save (looked for every RELOOK_S until it is found), or its computing
        request is gone, or the wait is over."""
        now = time.monotonic()
        owner = self._computing.get(parked.block)
        if owner is None or self._waited_out(parked, now):
            return True
        return owner.planned_at is not None and now - parked.looked >= RELOOK_S

    def _waited_out(self, parked: _Parked, now: float) -> bool:
        return now - parked.since >= self._extra["inflight_wait_s"]

    def _unpark(self, rid: str) -> None:
        parked = self._parked.pop(rid, None)
        if parked is not None:
            self._count(parked_s=time.monotonic() - parked.since)

    def _claim(self, rid: str, state: _Request, local: int) -> None:
        """The blocks ``rid`` will compute and save: its prompt's full blocks past its hit
        (a block another request computed and handed to save, that this one's lookup did
        not find, is this one's now: the waiting requests wait for it)."""
        for block in state.hashes[max(state.hit, local):]:
            owner = self._computing.get(block)
            if owner is None or owner.planned_at is not None:
                self._computing[block] = _Owner(rid)

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
        self._step += 1
        self._idle = not scheduler_output.total_num_scheduled_tokens
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
            self._planning(req_id, state.hashes[s:full])
            bs = self._block_size
            self.events.planned(state.hashes[s - 1] if s else None, state.hashes[s:full],
                                state.tokens[s * bs:full * bs])
            state.saved = full

    def _planning(self, rid: str, blocks: list[bytes]) -> None:
        """``rid``'s saves of ``blocks`` go into this step: the blocks it claimed are marked
        planned (requests waiting for them look again after this step), and those planned
        more than FORGET_PLANNED_S ago are forgotten (a lookup finds them by now)."""
        now = time.monotonic()
        for block in blocks:
            owner = self._computing.get(block)
            if owner is not None and owner.rid == rid and owner.planned_at is None:
                owner.planned_at = now
                self._planned.append((now, block))
        while self._planned and now - self._planned[0][0] > FORGET_PLANNED_S:
            _, old = self._planned.popleft()
            done = self._computing.get(old)  # (claimed again since: planned later, or not)
            if (done is not None and done.planned_at is not None
                    and now - done.planned_at > FORGET_PLANNED_S):
                del self._computing[old]

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
        state = self._requests.pop(request.request_id, None)
        rid = request.request_id
        self._lookups.pop(rid, None)
        self._unpark(rid)
        # What it claimed and did not compute, nobody waits for now (what it handed to save
        # stays known: the waiting requests look for it).
        for block in (state.hashes if state is not None else ()):
            owner = self._computing.get(block)
            if owner is not None and owner.rid == rid and owner.planned_at is None:
                del self._computing[block]
        return False, None
