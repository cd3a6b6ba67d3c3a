"""The KVFSConnector's worker side: vLLM's paged KV tensors as kvfs's paged layout, loads
into them before the forward pass and saves out of them after it, off the forward path."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from .config import ConfigError
from .layerload import LayerLoad
from .scheduler import KVFSMetadata, _Transfer

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from kvfs.client import KVCache
    from kvfs.format.hashing import ModelSpec

    from .mountwatch import MountWatch

log = logging.getLogger(__name__)


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


def gather_blocks(layers: list[torch.Tensor], block_ids: list[int]) -> torch.Tensor:
    """The pages ``block_ids`` of every layer, as one contiguous (blocks, layers, *page)
    tensor: each layer's pages selected straight into their place (one copy, where stacking
    the selections would make two)."""
    first = layers[0]
    idx = torch.tensor(block_ids, dtype=torch.long, device=first.device)
    kv = torch.empty((len(block_ids), len(layers), *first.shape[1:]), dtype=first.dtype,
                     device=first.device)
    for i, t in enumerate(layers):
        torch.index_select(t, 0, idx, out=kv[:, i])
    return kv


def int8_tiles(layer: torch.Tensor, block_size: int, heads: int, dim: int) -> int:
    """How this engine's pages lay out a (token, head) row of keys and of values, as
    kvfs.format.blockfile.int8_tiles says it (int8 takes one scale per row): 0 where the page is
    (2, block_size, heads, head_dim) as its view names it (vLLM's GPU backends). vLLM's CPU
    attention keeps each head's keys transposed (head_dim rows of block_size tokens), then its
    values as rows: found here by writing marked rows through its own cache op. Raises
    ConfigError for a layout the codec cannot follow."""
    from kvfs.format import blockfile  # noqa: PLC0415

    if layer.is_cuda:
        return 0
    try:
        from vllm import _custom_ops as ops  # noqa: PLC0415
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # noqa: PLC0415

        isa = _get_attn_isa(layer.dtype, block_size, dim)
        tokens = torch.arange(block_size, dtype=torch.float32)[:, None, None]
        chans = torch.arange(dim, dtype=torch.float32)[None, None, :]
        found = []
        for mark in (tokens + 1 + 0 * chans, chans + 1 + 0 * tokens):
            key = mark.expand(block_size, heads, dim).to(layer.dtype).contiguous()
            cache = torch.zeros(1, heads, block_size, 2 * dim, dtype=layer.dtype)
            kc, vc = cache.view(1, heads, 2 * block_size, dim).chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(key, -key, kc, vc,
                                           torch.arange(block_size, dtype=torch.int64), isa)
            found.append(cache[0, 0].reshape(2, -1).float())
    except Exception as exc:  # noqa: BLE001 - an engine build without the op: say so
        raise ConfigError(f"KVFSConnector: kv_codec int8: could not learn how this CPU "
                          f"attention lays out its KV ({exc!r}); use kv_codec exact") from None
    tok, chan = (f - 1 for f in found)
    runs_t = torch.arange(block_size).repeat_interleave(dim).float()  # row t: dim values
    runs_c = torch.arange(dim).repeat(block_size).float()
    down_t = torch.arange(block_size).repeat(dim).float()  # column t: dim rows
    down_c = torch.arange(dim).repeat_interleave(block_size).float()
    values_in_runs = torch.equal(-tok[1] - 2, runs_t) and torch.equal(-chan[1] - 2, runs_c)
    if values_in_runs and torch.equal(tok[0], runs_t) and torch.equal(chan[0], runs_c):
        return 0
    if values_in_runs and torch.equal(tok[0], down_t) and torch.equal(chan[0], down_c):
        return blockfile.int8_tiles(block_size, (True, False))
    raise ConfigError(f"KVFSConnector: kv_codec int8: this CPU attention ({isa}) keeps keys "
                      "in a layout kvfs's int8 codec does not know; use kv_codec exact")


class WorkerSide:
    """The worker-side methods of :class:`~kvfs.integrations.vllm.KVFSConnector`."""

    cache: KVCache
    watch: MountWatch
    spec: ModelSpec
    _kv_cache_config: KVCacheConfig
    _connector_metadata: Any
    _lock: Any
    _stats: dict[str, int | float]
    _layers: list[torch.Tensor]
    _layer_index: dict[str, int]
    _layer_load: LayerLoad | None
    _extra: dict[str, Any]
    _load_errors: set[int]
    last_loads: list[_Transfer]

    _count: Callable[..., None]

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
        if self.cache.codec == "int8" and layers:
            self.cache.int8_tiles = int8_tiles(layers[0], s.block_size, s.num_kv_heads,
                                               s.head_dim)
        # Absent, `layerwise` follows the device: on a GPU the per-layer load overlaps the
        # forward pass; on a CPU host it competes with it for the cores and loads slower.
        self._layerwise = self._extra.get("layerwise")
        if self._layerwise is None:
            self._layerwise = bool(layers) and layers[0].is_cuda
        self._layer_index = {name: i for i, name in enumerate(names)}
        log.info("KVFSConnector: %d layers of %d pages registered", len(layers),
                 layers[0].shape[0] if layers else 0)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, KVFSMetadata) or not meta.loads:
            return
        self.last_loads = list(meta.loads)
        if not self.watch.alive():  # logged there; the backing files are not read either
            for ld in meta.loads:
                self._load_errors.update(ld.block_ids)
                self._count(loads=1, failed_blocks=len(ld.hashes))
            return
        if self._layerwise:
            # Layer by layer, in the background: wait_for_layer_load waits for each layer.
            self._layer_load = LayerLoad(self.cache, self.spec, self._layers, meta.loads)
            return
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
        load = self._layer_load
        if load is not None:
            load.wait_layer(self._layer_index[layer_name])

    def _finish_layer_load(self) -> None:
        """Wait for the step's layer-wise load to end, and account for it (before the
        step's load errors are reported)."""
        load, self._layer_load = self._layer_load, None
        if load is None:
            return
        load.join()
        self._load_errors.update(load.failed)
        n = sum(len(ld.hashes) for ld in load.loads)
        self._count(loads=len(load.loads), loaded_blocks=load.loaded,
                    failed_blocks=n - load.loaded, load_s=load.seconds,
                    loaded_bytes=load.loaded * self.spec.block_payload_bytes,
                    layer_waits=load.waits)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        return  # saved whole in wait_for_save, once every layer is written

    def wait_for_save(self) -> None:
        self._finish_layer_load()
        meta = self._connector_metadata
        if not isinstance(meta, KVFSMetadata) or not meta.saves or not self._layers:
            return
        if not self.watch.alive():  # logged there: a later miss
            self._count(saves=len(meta.saves),
                        dropped_blocks=sum(len(sv.hashes) for sv in meta.saves))
            return
        for sv in meta.saves:
            # A copy out of the pages (they may be reused once the step ends), made once,
            # layer by layer into its place; the client's writer thread writes it while the
            # engine goes on.
            kv = gather_blocks(self._layers, sv.block_ids)
            try:
                queued = self.cache.save_async(sv.hashes, kv, parent=sv.parent)
            except Exception:  # noqa: BLE001 - a lost save is a later miss
                log.exception("kvfs save of %d blocks failed", len(sv.hashes))
                queued = False
            self._count(saves=1, saved_blocks=len(sv.hashes) if queued else 0,
                        dropped_blocks=0 if queued else len(sv.hashes))

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._finish_layer_load()
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

