"""The vLLM v1 KV connector backed by kvfs (``KVFSConnector``), and a one-engine driver.

Loaded by vLLM with::

    --kv-transfer-config '{"kv_connector": "KVFSConnector",
        "kv_connector_module_path": "kvfs.integrations.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"mount": "/mnt/kvfs", "tenant": "acme"}}'

Extra config keys (``kv_connector_extra_config``):

- ``mount`` (required): the kvfs mount point.
- ``tenant`` (required): the tenant whose directory holds the blocks; the engine's uid
  must be allowed to use it.
- ``verify``: ``"full"`` (default: every loaded block's payload checksum is checked) or
  ``"sampled"`` (one block in 8; headers always).
- ``lookup_budget_s``: seconds a lookup may spend on blocks a lower tier (cold, S3) must
  supply (default 0.2); what has not arrived by then is a miss for that request and keeps
  arriving in the background for the next one.
- ``model_id``: the model name in the namespace (default: the model as vLLM names it; for
  a local directory, its last component).
- ``revision``: the model revision in the namespace (default: vLLM's ``revision``; for a
  local directory, a digest of its ``config.json`` and its weight files' names and sizes).
- ``direct``: ``true`` insists on the backing directory (the direct path), ``false``
  always goes through the mount, absent: the direct path where this uid may use it.
- ``max_pending_saves``: saves queued for the writer thread beyond which a save is dropped
  (a later miss, never a stalled forward pass); default 8.

How it works. The scheduler side hashes the request's prompt into kvfs block hashes
(``kvfs.hashing.block_hashes`` with vLLM's block size, so one kvfs block is one vLLM block),
asks kvfs once for the cached prefix (:meth:`kvfs.KVCache.lookup`) and answers
``get_num_new_matched_tokens`` with the part of it beyond vLLM's own prefix cache. The
metadata of each step carries exactly the blocks to load (hash, vLLM block id) and the full
prompt blocks that the step completes, to save. The worker side reads the block files
straight into vLLM's paged KV tensors (:meth:`kvfs.KVCache.load_paged`), before the
forward pass; after it, it copies the new full blocks out of the pages (a memory copy) and
hands them to the client's writer thread (:meth:`kvfs.KVCache.save_async`), so no forward
pass waits for the disk. A block that fails verification or vanished between lookup and
load is reported through ``get_block_ids_with_load_errors`` and vLLM recomputes it, which
vLLM 0.32 does only with ``"kv_load_failure_policy": "recompute"`` (its default, ``fail``,
fails the request): set it.

The namespace (:class:`kvfs.ModelSpec`) comes from vLLM's configuration: model, revision,
KV dtype, block size, layers, KV heads, head size, TP size and rank, plus (``extras``) the
model dtype, the KV-cache dtype setting, the device type and vLLM's KV-cache layout.

Run as a module (``python -m kvfs.integrations.vllm --help``), it runs one engine on one
prompt and prints a JSON record: the tests and ``kvfs bench engine`` use it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvfs.client import KVCache
from kvfs.hashing import ModelSpec, block_hashes

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

#: Extra config keys this connector reads (any other key is refused at start).
CONFIG_KEYS = ("mount", "tenant", "verify", "lookup_budget_s", "model_id", "revision",
               "direct", "max_pending_saves")
DEFAULT_LOOKUP_BUDGET_S = 0.2
_INSTANCES: list[KVFSConnector] = []  # this process's connectors (the driver reads them)


class ConfigError(ValueError):
    """A kv_connector_extra_config key is missing or wrong; the message names it."""


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


@dataclass
class KVFSStats(KVConnectorStats):
    """Counters of one interval, summed over workers: loads, blocks and payload bytes
    loaded, blocks that failed to load, load seconds, saves, blocks saved and dropped.
    (Fetch amplification is the client's: ``KVCache.stats``, and kvfs's own counters.)"""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _local_revision(path: str) -> str:
    """A digest naming a local model directory's contents: config.json's bytes and the
    weight files' names and sizes (the same on every host holding the same copy)."""
    h = hashlib.sha256()
    try:
        with open(os.path.join(path, "config.json"), "rb") as f:
            h.update(f.read())
    except OSError:
        pass
    for name in sorted(os.listdir(path)):
        if name.endswith((".safetensors", ".bin", ".gguf", ".pt")):
            h.update(f"{name}:{os.path.getsize(os.path.join(path, name))}\n".encode())
    return "local-" + h.hexdigest()[:16]


def model_spec(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, extra: dict[str, Any],
               tp_rank: int) -> ModelSpec:
    """The kvfs namespace of this engine's KV: every fact that changes its bytes."""
    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError(f"KVFSConnector supports models with one KV-cache group, this one "
                          f"has {len(groups)}")
    kspec = groups[0].kv_cache_spec
    name = str(mc.model)
    local = os.path.isdir(name)
    model = str(extra.get("model_id") or (os.path.basename(os.path.normpath(name)) if local
                                          else name))
    revision = extra.get("revision") or mc.revision or (_local_revision(name) if local else "")
    from vllm.platforms import current_platform

    return ModelSpec(
        model=model, revision=str(revision), kv_dtype=_dtype_name(kspec.dtype),
        block_size=int(kspec.block_size), num_layers=len(groups[0].layer_names),
        num_kv_heads=int(kspec.num_kv_heads), head_dim=int(kspec.head_size),
        tp_size=int(pc.tensor_parallel_size), tp_rank=tp_rank,
        extras={"engine": "vllm", "model_dtype": _dtype_name(mc.dtype),
                "cache_dtype": str(cc.cache_dtype), "device": str(current_platform.device_type),
                "kv_layout": str(kv_cache_config.kv_cache_layout or "")})


def _extra_config(vllm_config: VllmConfig) -> dict[str, Any]:
    extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    unknown = sorted(set(extra) - set(CONFIG_KEYS))
    if unknown:
        raise ConfigError(f"kv_connector_extra_config: unknown key(s) {unknown}; "
                          f"KVFSConnector reads {list(CONFIG_KEYS)}")
    for key in ("mount", "tenant"):
        if not extra.get(key) or not isinstance(extra[key], str):
            raise ConfigError(f"kv_connector_extra_config.{key} is required (a string)")
    if extra.get("verify", "full") not in ("full", "sampled"):
        raise ConfigError("kv_connector_extra_config.verify must be 'full' or 'sampled', "
                          f"got {extra['verify']!r}")
    try:
        budget = float(extra.get("lookup_budget_s", DEFAULT_LOOKUP_BUDGET_S))
        if budget < 0:
            raise ValueError
    except (TypeError, ValueError):
        raise ConfigError("kv_connector_extra_config.lookup_budget_s must be a number >= 0, "
                          f"got {extra.get('lookup_budget_s')!r}") from None
    extra["lookup_budget_s"] = budget
    if extra.get("direct") not in (None, True, False):
        raise ConfigError("kv_connector_extra_config.direct must be true, false or absent")
    mps = extra.get("max_pending_saves", 8)
    if isinstance(mps, bool) or not isinstance(mps, int) or mps < 1:
        raise ConfigError("kv_connector_extra_config.max_pending_saves must be an int >= 1")
    return extra


def open_cache(mount: str, tenant: str, spec: ModelSpec, extra: dict[str, Any]) -> KVCache:
    """Open the namespace, turning every way it can fail into an error naming the key."""
    if not os.path.isdir(mount):
        raise ConfigError(f"kv_connector_extra_config.mount: {mount!r} is not a directory")
    if not os.path.ismount(mount):
        raise ConfigError(f"kv_connector_extra_config.mount: {mount!r} is not a mount point "
                          "(is kvfs mounted there?)")
    try:
        return KVCache.open(mount, tenant=tenant, spec=spec, direct=extra.get("direct"),
                            verify=extra.get("verify", "full"),
                            max_pending_saves=extra.get("max_pending_saves", 8))
    except FileNotFoundError as exc:
        raise ConfigError(f"kv_connector_extra_config.tenant: no tenant {tenant!r} in "
                          f"{mount} ({exc.strerror})") from None
    except PermissionError as exc:
        raise ConfigError(f"kv_connector_extra_config.tenant: uid {os.getuid()} may not use "
                          f"tenant {tenant!r} of {mount} ({exc.strerror})") from None
    except ValueError as exc:  # not a kvfs mount (no backing xattr), or another spec
        raise ConfigError(f"kv_connector_extra_config.mount: {exc}") from None


class KVFSConnector(KVConnectorBase_V1):
    """vLLM v1 KV connector whose store is a kvfs namespace (see the module docstring)."""

    _cache_hit_source = CacheHitSource.DISK

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = _extra_config(vllm_config)
        self._extra = extra
        self._block_size = int(vllm_config.cache_config.block_size)
        rank = 0
        if role == KVConnectorRole.WORKER:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank()
        self.spec = model_spec(vllm_config, kv_cache_config, extra, rank)
        if self.spec.block_size != self._block_size:
            raise ConfigError(f"KV-cache block size {self.spec.block_size} differs from the "
                              f"scheduler's {self._block_size}")
        self.cache = open_cache(extra["mount"], extra["tenant"], self.spec, extra)
        policy = getattr(self._kv_transfer_config, "kv_load_failure_policy", "fail")
        if role == KVConnectorRole.SCHEDULER and policy != "recompute":
            log.warning("kv_load_failure_policy is %r: a kvfs block that fails verification "
                        "or vanishes before it is loaded fails its request; set "
                        "\"kv_load_failure_policy\": \"recompute\" to recompute it instead",
                        policy)
        log.info("KVFSConnector (%s): %r, namespace %s", role.name, self.cache,
                 self.spec.namespace)
        self._lock = threading.Lock()
        self._stats: dict[str, int | float] = {}  # since the last get_kv_connector_stats
        self._totals: dict[str, int | float] = {}  # since the start
        # scheduler side
        self._requests: dict[str, _Request] = {}
        self._events: list[Any] = []
        # worker side
        self._layers: list[torch.Tensor] = []
        self._load_errors: set[int] = set()
        self.last_loads: list[_Transfer] = []  # for tests: what the last loads were
        _INSTANCES.append(self)

    def _count(self, **deltas: int | float) -> None:
        with self._lock:
            for k, v in deltas.items():
                self._stats[k] = self._stats.get(k, 0) + v
                self._totals[k] = self._totals.get(k, 0) + v

    # -- scheduler side ------------------------------------------------------------------

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
        state = self._requests.get(request.request_id)
        local = num_computed_tokens // self._block_size
        if state is None:
            state = self._lookup(request, local)
            self._requests[request.request_id] = state
        if state.hit <= local:
            return 0, False
        return (state.hit - local) * self._block_size, False

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
            return _Request(hashes=hashes, hit=local, saved=local)
        start = time.perf_counter()
        try:
            hit = self.cache.lookup(hashes[:usable], budget=self._extra["lookup_budget_s"])
        except Exception:  # noqa: BLE001 - a broken mount is a miss, never a dead engine
            log.exception("kvfs lookup in %s failed: treated as a miss", self.cache.ns_dir)
            hit = 0
        self._count(lookups=1, hit_blocks=hit, miss_blocks=usable - hit,
                    lookup_s=time.perf_counter() - start)
        return _Request(hashes=hashes, hit=hit, saved=hit)

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
            self._offer_stored(state.hashes[s - 1] if s else None, state.hashes[s:full])
            state.saved = full

    def _offer_stored(self, parent: bytes | None, hashes: list[bytes]) -> None:
        """A KV event for blocks on their way into kvfs (medium STORAGE)."""
        try:
            from vllm.distributed.kv_events import BlockStored
        except ImportError:  # pragma: no cover - older vLLM
            return
        self._events.append(BlockStored(
            block_hashes=list(hashes), parent_block_hash=parent, token_ids=[],
            block_size=self._block_size, lora_id=None, medium="STORAGE", lora_name=None))

    def take_events(self) -> Any:
        events, self._events = self._events, []
        return events

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # Saves copy their pages out during the step that completes them: the blocks may
        # be freed now.
        self._requests.pop(request.request_id, None)
        return False, None

    # -- worker side ---------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = self._kv_cache_config.kv_cache_groups[0].layer_names
        s = self.spec
        page = (2, s.block_size, s.num_kv_heads, s.head_dim)
        layers = []
        for name in names:
            t = kv_caches[name]
            per_block = t.numel() // t.shape[0] if t.shape[0] else 0
            if (t.shape[0] != self._kv_cache_config.num_blocks or not t.is_contiguous()
                    or per_block * t.element_size() != s.block_payload_bytes // s.num_layers):
                raise ConfigError(
                    f"KVFSConnector: layer {name}'s KV cache {tuple(t.shape)} is not one "
                    f"contiguous page of {s.block_payload_bytes // s.num_layers} bytes per "
                    f"block (this layout is not supported yet)")
            # A page's bytes as kvfs's paged layout names them; the bytes are vLLM's own.
            layers.append(t.view(t.shape[0], *page))
        self._layers = layers
        log.info("KVFSConnector: %d layers of %d pages registered", len(layers),
                 layers[0].shape[0] if layers else 0)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, KVFSMetadata) or not meta.loads:
            return
        self.last_loads = list(meta.loads)
        for ld in meta.loads:
            start = time.perf_counter()
            try:
                n = self.cache.load_paged(ld.hashes, self._layers, ld.block_ids)
            except Exception:  # noqa: BLE001 - a failed load is a recompute, never a crash
                log.exception("kvfs load of %d blocks failed", len(ld.hashes))
                n = 0
            if n < len(ld.hashes):
                log.warning("kvfs: %d of %d blocks of request %s not loaded: vLLM recomputes "
                            "them", len(ld.hashes) - n, len(ld.hashes), ld.req_id)
                self._load_errors.update(ld.block_ids[n:])
            self._count(loads=1, loaded_blocks=n, failed_blocks=len(ld.hashes) - n,
                        load_s=time.perf_counter() - start,
                        loaded_bytes=n * self.spec.block_payload_bytes)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv, before the forward pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        return  # saved whole in wait_for_save, once every layer is written

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, KVFSMetadata) or not meta.saves or not self._layers:
            return
        for sv in meta.saves:
            idx = torch.tensor(sv.block_ids, dtype=torch.long, device=self._layers[0].device)
            # A copy out of the pages (they may be reused once the step ends); the
            # client's writer thread writes it while the engine goes on.
            kv = torch.stack([t.index_select(0, idx) for t in self._layers], dim=1)
            try:
                queued = self.cache.save_async(sv.hashes, kv.contiguous(), parent=sv.parent)
            except Exception:  # noqa: BLE001 - a lost save is a later miss
                log.exception("kvfs save of %d blocks failed", len(sv.hashes))
                queued = False
            self._count(saves=1, saved_blocks=len(sv.hashes) if queued else 0,
                        dropped_blocks=0 if queued else len(sv.hashes))

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        with self._lock:
            data, self._stats = self._stats, {}
        return KVFSStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVConnectorStats | None:
        return KVFSStats(data=dict(data or {}))

    def shutdown(self) -> None:
        try:
            self.cache.close()
        except Exception:  # noqa: BLE001
            log.exception("closing the kvfs client failed")

    def counters(self) -> dict[str, Any]:
        """Everything counted since the start (the driver's record)."""
        with self._lock:
            totals = dict(self._totals)
        return {"connector": totals, "client": self.cache.stats}


# -- the oracle: vLLM's own ExampleConnector, matching the longest stored prefix -------------

def _example_connector_class() -> type:
    from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
        ExampleConnector,
        ExampleConnectorMetadata,
    )

    class PrefixExampleConnector(ExampleConnector):
        """vLLM's ExampleConnector (its own save and inject code, bit for bit), except that
        a request restores the longest block-aligned prefix of its prompt that an earlier
        request stored, not only its whole prompt. The restore oracle of the tests."""

        def _stored_prefix(self, tokens: list[int]) -> int:
            bs = self._block_size
            k = (len(tokens) - 1) // bs * bs  # at least one token left to compute
            while k >= bs:
                if os.path.exists(self._generate_foldername_debug(
                        torch.tensor(tokens[:k]), [], create_folder=False)):
                    return k
                k -= bs
            return 0

        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                       ) -> tuple[int | None, bool]:
            k = self._stored_prefix(list(request.prompt_token_ids or []))
            self._matched = getattr(self, "_matched", {})
            self._matched[request.request_id] = k
            return max(0, k - num_computed_tokens), False

        def build_connector_meta(self, scheduler_output: Any) -> Any:
            meta = ExampleConnectorMetadata()
            matched = getattr(self, "_matched", {})
            for new in scheduler_output.scheduled_new_reqs:
                tokens = list(new.prompt_token_ids or [])
                if new.req_id in self._requests_need_load:
                    k = matched[new.req_id]
                    # make_meta keeps (len - 1) // bs * bs tokens: pass one more.
                    meta.add_request(tokens[:k + 1], new.block_ids[0], self._block_size,
                                     is_store=False, mm_hashes=[])
                elif not self._found_match_for_prompt(tokens, []):
                    meta.add_request(tokens, new.block_ids[0], self._block_size,
                                     is_store=True, mm_hashes=[])
            self._requests_need_load.clear()
            return meta

    return PrefixExampleConnector


def __getattr__(name: str) -> Any:
    if name == "PrefixExampleConnector":
        return _example_connector_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -- one engine, one prompt: the driver of the tests and of `kvfs bench engine` -------------

def _transfer_config(args: Any) -> dict[str, Any] | None:
    if args.connector == "none":
        return None
    if args.connector == "example":
        return {"kv_connector": "PrefixExampleConnector",
                "kv_connector_module_path": "kvfs.integrations.vllm", "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": args.storage}}
    extra = {"mount": args.mount, "tenant": args.tenant, **json.loads(args.extra or "{}")}
    return {"kv_connector": "KVFSConnector", "kv_connector_module_path": "kvfs.integrations.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": args.failure_policy,
            "kv_connector_extra_config": extra}


def _prompt_tokens(llm: Any, path: str) -> list[int]:
    """A prompt file: a JSON list of token ids, or ``{"parts": [[text, max_tokens], ...]}``:
    each text tokenized alone (no special tokens), cut to max_tokens (null: all) and the
    pieces concatenated, so that a prompt extended by a question starts with exactly the
    tokens of the prompt without it."""
    with open(path) as f:
        doc = json.load(f)
    if isinstance(doc, list):
        return [int(t) for t in doc]
    tok = llm.get_tokenizer()
    out: list[int] = []
    for text, limit in doc["parts"]:
        ids = tok.encode(text, add_special_tokens=False)
        out += ids if limit is None else ids[:limit]
    return out


def main(argv: list[str] | None = None) -> int:
    """Run one engine (vLLM, this process) on prompts and print a JSON record."""
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="python -m kvfs.integrations.vllm", description=main.__doc__)
    p.add_argument("--model", required=True, help="model directory (or id)")
    p.add_argument("--connector", choices=("kvfs", "example", "none"), default="kvfs")
    p.add_argument("--mount", help="kvfs mount (connector kvfs)")
    p.add_argument("--tenant", help="kvfs tenant (connector kvfs)")
    p.add_argument("--extra", help="more kv_connector_extra_config keys, as JSON")
    p.add_argument("--failure-policy", default="recompute", choices=("recompute", "fail"))
    p.add_argument("--storage", help="directory of the ExampleConnector (connector example)")
    p.add_argument("--prompt-file", action="append", required=True,
                   help="a prompt (JSON: token ids, or {\"parts\": [[text, max_tokens]]}); "
                        "repeat for several requests, run one after the other")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--warmup", type=int, default=0, metavar="TOKENS",
                   help="first serve one untimed prompt of this many tokens, unrelated to the "
                        "others (the first forward passes of a process are slow)")
    p.add_argument("--drop-caches", action="store_true",
                   help="drop the kernel's page cache before each prompt (root only)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="turn vLLM's own prefix cache off (every request asks the connector)")
    p.add_argument("--dump-loaded", help="write the pages the last load filled to this .pt")
    args = p.parse_args(argv)

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # connectors in this process
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = {}
    tc = _transfer_config(args)
    if tc is not None:
        from vllm.config import KVTransferConfig

        kwargs["kv_transfer_config"] = KVTransferConfig(**tc)
    if args.block_size:
        kwargs["block_size"] = args.block_size
    started = time.perf_counter()
    llm = LLM(model=args.model, dtype="bfloat16", max_model_len=args.max_model_len,
              max_num_batched_tokens=args.max_model_len, max_num_seqs=4, seed=0,
              enforce_eager=True, enable_prefix_caching=not args.no_prefix_cache, **kwargs)
    start_s = time.perf_counter() - started
    # Greedy; with --max-tokens 1 a request's time is its time to first token.
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    if args.warmup:
        vocab = llm.get_tokenizer().vocab_size
        warm = [(7919 * i + 13) % (vocab - 1000) + 500 for i in range(args.warmup)]
        llm.generate([TokensPrompt(prompt_token_ids=warm)], params, use_tqdm=False)
    from kvfs.integrations import vllm as mod  # the module vLLM loaded the connector from

    def snapshot() -> dict[str, Any]:
        out: dict[str, Any] = {}
        for c in mod._INSTANCES:
            out.update({f"{c.role.name.lower()}.{k}": v for k, v in c.counters()["connector"]
                        .items()})
            if c.role == KVConnectorRole.WORKER:
                out.update({f"client.{k}": v for k, v in c.cache.stats.items()
                            if isinstance(v, int | float)})
        return out

    results: list[dict[str, Any]] = []
    snapshot_0 = snapshot()
    for path in args.prompt_file:
        tokens = _prompt_tokens(llm, path)
        if args.drop_caches:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1")
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)[0]
        seconds = time.perf_counter() - t0
        before, after = (results[-1]["_after"] if results else snapshot_0), snapshot()
        delta = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
        results.append({"prompt_tokens": len(tokens), "seconds": seconds, "counters": delta,
                        "_after": after,
                        "cached_tokens": out.num_cached_tokens, "prompt_token_ids": tokens,
                        "text": out.outputs[0].text,
                        "token_ids": list(out.outputs[0].token_ids)})
    for r in results:
        del r["_after"]
    record: dict[str, Any] = {"connector": args.connector, "start_s": start_s,
                              "requests": results}
    workers = [c for c in mod._INSTANCES if c.role == KVConnectorRole.WORKER]
    scheds = [c for c in mod._INSTANCES if c.role == KVConnectorRole.SCHEDULER]
    if workers:
        w = workers[-1]
        w.cache.flush()
        record["worker"] = w.counters()
        record["namespace"] = w.spec.namespace
        record["direct"] = w.cache.direct
        record["spec"] = json.loads(w.spec.manifest_json())
        if args.dump_loaded and w.last_loads:
            pages = {}
            for ld in w.last_loads:
                idx = torch.tensor(ld.block_ids, dtype=torch.long)
                pages[ld.req_id] = {"hashes": [h.hex() for h in ld.hashes],
                                    "kv": torch.stack([t.index_select(0, idx)
                                                       for t in w._layers], dim=1).clone()}
            torch.save(pages, args.dump_loaded)
    if scheds:
        record["scheduler"] = scheds[-1].counters()["connector"]
    json.dump(record, sys.stdout)
    sys.stdout.write("\n")
    sys.stdout.flush()
    for c in mod._INSTANCES:
        c.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
