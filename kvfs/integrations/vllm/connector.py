"""``KVFSConnector``: the vLLM v1 KV connector backed by kvfs, its two sides joined (see the
package's docstring)."""

from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from .config import ConfigError, extra_config, model_spec, open_cache
from .events import KVEvents
from .layerload import LayerLoad
from .mountwatch import MountWatch
from .scheduler import SchedulerSide, _Owner, _Parked, _Request, _Transfer
from .worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger(__name__)

_INSTANCES: list[KVFSConnector] = []  # this process's connectors (the driver reads them)


class KVFSConnector(SchedulerSide, WorkerSide, KVConnectorBase_V1):
    """vLLM v1 KV connector whose store is a kvfs namespace (see the package docstring)."""

    _cache_hit_source = CacheHitSource.DISK

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = extra_config(vllm_config)
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
        # The scheduler's lookups serve loads in this process only with vLLM's uniprocess
        # executor; `vllm serve` (the multiprocess executor) loads in a worker process.
        here = (role == KVConnectorRole.WORKER
                or vllm_config.parallel_config.distributed_executor_backend == "uni")
        self.cache = open_cache(extra["mount"], extra["tenant"], self.spec, extra,
                                loads_here=here)
        self.watch = MountWatch(extra["mount"], self.cache.ns_dir)
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
        self._lookups: dict[str, Future[_Request]] = {}
        self._lookup_pool = ThreadPoolExecutor(1, thread_name_prefix="kvfs-lookup")
        self._step, self._idle, self._waited = 0, False, -1
        self._computing: dict[bytes, _Owner] = {}
        self._planned: deque[tuple[float, bytes]] = deque()
        self._parked: dict[str, _Parked] = {}
        self.events = KVEvents(self.cache, self.watch, self._block_size)
        # worker side
        self._layers: list[torch.Tensor] = []
        self._load_errors: set[int] = set()
        self._layer_load: LayerLoad | None = None  # this step's, while it runs
        self._layer_index: dict[str, int] = {}
        self.last_loads: list[_Transfer] = []  # for tests: what the last loads were
        _INSTANCES.append(self)

    def _count(self, **deltas: int | float) -> None:
        with self._lock:
            for k, v in deltas.items():
                self._stats[k] = self._stats.get(k, 0) + v
                self._totals[k] = self._totals.get(k, 0) + v

    def shutdown(self) -> None:
        if self._layer_load is not None:
            self._layer_load.join()
        self._lookup_pool.shutdown(wait=True, cancel_futures=True)
        try:
            self.cache.close()
        except Exception:  # noqa: BLE001
            log.exception("closing the kvfs client failed")

    def counters(self) -> dict[str, Any]:
        """Everything counted since the start (the driver's record)."""
        with self._lock:
            totals = dict(self._totals)
        return {"connector": totals, "client": self.cache.stats}

