"""LMCache storage plugin on kvfs's direct path: :class:`KVFSBackend`.

Loaded by LMCache's own storage-plugin launcher (LMCache 0.5.6)::

    storage_plugins: ["kvfs"]
    extra_config:
      storage_plugin.kvfs.module_path: kvfs.integrations.lmcache
      storage_plugin.kvfs.class_name: KVFSBackend
      kvfs.mount: /mnt/kvfs
      kvfs.tenant: acme

Optional ``extra_config`` keys: ``kvfs.verify`` ("full", the default, or "sampled"),
``kvfs.threads`` (the I/O pool), ``kvfs.io`` ("posix" / "kvikio").

Mapping:

- Namespace: one kvfs model namespace per LMCache worker: the model name, the world size and
  worker id (as TP size and rank), the KV dtype and the chunk's shape and memory format.
- Keys: each chunk key (``CacheEngineKey.to_string()``: model, world size, worker, chunk hash,
  dtype and any tags) names block xxh3-128(key). Chunks of one put are chained in order, so
  kvfs's chain-aware eviction sees the request's prefix order.
- Payload: the chunk's memory object bytes as LMCache holds them (what its local disk backend
  writes), read straight into a memory object of LMCache's CPU allocator and written from
  one, on kvfs's direct path, verified (header and checksum) on every read.
- Only full chunks are stored (LMCache's default, ``save_unfull_chunk: false``); with
  ``save_unfull_chunk: true`` a request's last, partial chunk is not stored and is recomputed.
- Misses: a chunk kvfs evicted, or whose block fails verification, is a miss: ``contains``
  is false, a get returns nothing; nothing is raised into LMCache. There is no index of this
  backend's own to go stale: a lookup asks the filesystem. Lookups, hits and misses are
  counted by kvfs per tenant and namespace.
- Memory: a get takes its chunks' memory from LMCache's CPU allocator; where that has no
  room for all of them (after evicting what LMCache's CPU cache may evict, and
  :data:`ALLOC_WAIT` for other requests to free some), it returns the prefix it has room
  for, never waiting without end.
- Space: a put larger than kvfs can hold (its capacity, or the tenant's quota) stores a
  prefix of its chunks that fits, not nothing (the rest are later misses; see
  :func:`~kvfs.integrations._common.save_prefix`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface

from ..client import KVCache
from ._common import check_target, key_hash, page_spec, save_prefix

log = logging.getLogger(__name__)

WHERE = "the LMCache configuration's extra_config (kvfs.mount, kvfs.tenant)"
#: Seconds a blocking get waits for room in LMCache's CPU memory (other requests' chunks
#: being freed) before it returns the chunks it has room for; the rest are misses.
ALLOC_WAIT = 0.2


class KVFSBackend(StoragePluginInterface):
    """LMCache chunks as kvfs blocks (see the module docstring)."""

    def __init__(self, dst_device: str = "cpu", config: Any = None, metadata: Any = None,
                 local_cpu_backend: Any = None,
                 loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(dst_device=dst_device, config=config, metadata=metadata,
                         local_cpu_backend=local_cpu_backend, loop=loop)
        extra = dict(getattr(config, "extra_config", None) or {})
        mount, tenant = check_target(extra.get("kvfs.mount"), extra.get("kvfs.tenant"),
                                     "kvfs LMCache backend", WHERE)
        if metadata is None:
            raise ValueError("kvfs LMCache backend: LMCache gave no metadata (model, shape)")
        if local_cpu_backend is None:
            raise ValueError("kvfs LMCache backend needs LMCache's CPU backend as its "
                             "allocator: set local_cpu: true / max_local_cpu_size > 0")
        dtypes = list(metadata.get_dtypes())
        if len(set(dtypes)) != 1:
            raise ValueError(f"kvfs LMCache backend: chunks of several dtypes {dtypes} are "
                             "not supported")
        self.shapes = list(metadata.get_shapes(metadata.chunk_size))
        self.dtypes = dtypes
        self.fmt = MemoryFormat.KV_MLA_FMT if metadata.use_mla else MemoryFormat.KV_2LTD
        self.chunk_bytes = sum(math.prod(s) for s in self.shapes) * dtypes[0].itemsize
        kv = metadata.kv_shape  # (num_layer, 2, chunk_size, num_kv_head, head_size)
        spec = page_spec(
            model=metadata.model_name, dtype=dtypes[0], page_bytes=self.chunk_bytes,
            num_layers=kv[0], tokens=metadata.chunk_size,
            heads=None if metadata.use_mla else kv[3],
            head_dim=None if metadata.use_mla else kv[4],
            tp_size=metadata.world_size, tp_rank=metadata.worker_id,
            extras={"engine": "lmcache", "fmt": self.fmt.name,
                    "shapes": ";".join("x".join(map(str, s)) for s in self.shapes)})
        options: dict[str, Any] = {}
        for k in ("verify", "io"):
            if f"kvfs.{k}" in extra:
                options[k] = extra[f"kvfs.{k}"]
        if "kvfs.threads" in extra:
            options["threads"] = int(extra["kvfs.threads"])
        self.cache = KVCache.open(mount, tenant=tenant, spec=spec, **options)
        self._putting: set[CacheEngineKey] = set()
        self._put_lock = threading.Lock()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kvfs-lmcache-put")
        self._reader = ThreadPoolExecutor(2, thread_name_prefix="kvfs-lmcache-get")
        self.skipped_puts = 0
        self._batched = True  # LMCache's allocator takes a get's chunks in one call
        log.info("kvfs LMCache backend: %s, chunks of %d bytes", self.cache, self.chunk_bytes)

    def __str__(self) -> str:
        return "KVFSBackend"

    # -- names ---------------------------------------------------------------------------

    @staticmethod
    def _hash(key: CacheEngineKey) -> bytes:
        return key_hash(key.to_string())

    def _bytes_of(self, obj: MemoryObj) -> torch.Tensor | None:
        """The chunk's bytes as a flat uint8 tensor over LMCache's memory (no copy), or None
        where it is not a full chunk of this backend's format."""
        buf = obj.byte_array
        if len(buf) != self.chunk_bytes:
            return None
        return torch.frombuffer(buf, dtype=torch.uint8)

    # -- lookups -------------------------------------------------------------------------

    def _lookup(self, keys: Sequence[CacheEngineKey]) -> int:
        if not keys:
            return 0
        try:
            return self.cache.lookup([self._hash(k) for k in keys])
        except OSError as exc:
            log.warning("kvfs lookup of %d chunks failed: %s (a miss)", len(keys), exc)
            return 0

    def contains(self, key: CacheEngineKey, pin: bool = False) -> bool:
        return self._lookup([key]) == 1

    def batched_contains(self, keys: list[CacheEngineKey], pin: bool = False) -> int:
        return self._lookup(keys)

    async def batched_async_contains(self, lookup_id: str, keys: list[CacheEngineKey],
                                     pin: bool = False) -> int:
        return self._lookup(keys)

    def exists_in_put_tasks(self, key: CacheEngineKey) -> bool:
        with self._put_lock:
            return key in self._putting

    # -- puts ----------------------------------------------------------------------------

    def batched_submit_put_task(self, keys: Sequence[CacheEngineKey], objs: list[MemoryObj],
                                transfer_spec: Any = None,
                                on_complete_callback: Callable[[CacheEngineKey], None]
                                | None = None) -> None:
        todo: list[tuple[CacheEngineKey, MemoryObj, torch.Tensor]] = []
        with self._put_lock:
            for key, obj in zip(keys, objs, strict=False):
                data = self._bytes_of(obj)
                if data is None:
                    self.skipped_puts += 1
                    log.debug("kvfs: not storing %s: %d bytes, a full chunk is %d", key,
                              len(obj.byte_array), self.chunk_bytes)
                    continue
                if key in self._putting:
                    continue
                self._putting.add(key)
                obj.ref_count_up()
                todo.append((key, obj, data))
        if todo:
            self._writer.submit(self._put, todo, on_complete_callback)

    def submit_put_task(self, key: CacheEngineKey, obj: MemoryObj,
                        on_complete_callback: Callable[[CacheEngineKey], None]
                        | None = None) -> None:
        self.batched_submit_put_task([key], [obj], None, on_complete_callback)

    def _put(self, todo: list[tuple[CacheEngineKey, MemoryObj, torch.Tensor]],
             on_complete: Callable[[CacheEngineKey], None] | None) -> None:
        try:
            save_prefix(self.cache, [self._hash(k) for k, _, _ in todo],
                        [[d] for _, _, d in todo])
        except Exception as exc:  # noqa: BLE001 - a lost put is a later miss, never fatal
            log.warning("kvfs save of %d chunks failed: %s", len(todo), exc)
        finally:
            with self._put_lock:
                for key, obj, _ in todo:
                    self._putting.discard(key)
                    obj.ref_count_down()
        for key, _, _ in todo if on_complete is not None else ():
            try:
                on_complete(key)  # type: ignore[misc]
            except Exception as exc:  # noqa: BLE001 - LMCache's own callback
                log.warning("on_complete_callback failed for %s: %s", key, exc)

    def flush(self) -> None:
        """Wait for the puts submitted so far (tests and benchmarks; LMCache never waits)."""
        self._writer.submit(lambda: None).result()
        self.cache.flush()

    # -- gets ----------------------------------------------------------------------------

    def _allocate(self, n: int, busy_loop: bool = True) -> list[MemoryObj]:
        """``n`` memory objects of LMCache's CPU allocator (fewer where it has no room): in
        one call where they fit as they are (64 chunks of 4 MiB: 0.67 ms against 1.76 ms in
        64 calls, LMCache 0.5.6, medians of 30 on a 2-core VM), else one by one through the
        CPU backend, which evicts from LMCache's CPU cache to make room (the CPU backend's
        batched form evicts as for layer-wise objects, which these are not)."""
        allocator = getattr(self.local_cpu_backend, "memory_allocator", None)
        batched = getattr(allocator, "batched_allocate", None) if self._batched else None
        if n > 1 and batched is not None:
            try:
                got = batched(self.shapes, self.dtypes, n, self.fmt)
            except Exception as exc:  # noqa: BLE001 - an allocator without this form
                log.info("kvfs: LMCache's allocator has no batched form here (%s): "
                         "allocating one chunk at a time", exc)
                self._batched = False
                got = None
            if got is not None:
                return list(got)
        objs: list[MemoryObj] = []
        deadline = time.monotonic() + (ALLOC_WAIT if busy_loop else 0.0)
        while len(objs) < n:
            # Not LMCache's own busy loop: it waits without end for room a get larger
            # than the whole CPU pool never gets.
            obj = self.local_cpu_backend.allocate(self.shapes, self.dtypes, self.fmt,
                                                  busy_loop=False)
            if obj is not None:
                objs.append(obj)
            elif time.monotonic() < deadline:
                time.sleep(0.01)
            else:
                break
        return objs

    def _get(self, keys: Sequence[CacheEngineKey], busy_loop: bool = True
             ) -> list[MemoryObj | None]:
        if not keys:
            return []
        objs = self._allocate(len(keys), busy_loop)
        if len(objs) < len(keys):
            log.warning("kvfs: LMCache's CPU allocator gave %d of %d chunks", len(objs),
                        len(keys))
        n = 0
        try:
            parts = [[self._bytes_of(o)] for o in objs]
            if any(p[0] is None for p in parts):
                raise ValueError("LMCache allocated a chunk of another size")
            n = self.cache.load_parts([self._hash(k) for k in keys[:len(objs)]], parts)
        except (OSError, ValueError) as exc:
            log.warning("kvfs load of %d chunks failed: %s (a miss)", len(keys), exc)
        for obj in objs[n:]:
            obj.ref_count_down()
        return [*objs[:n], *[None] * (len(keys) - n)]

    def get_blocking(self, key: CacheEngineKey) -> MemoryObj | None:
        return self._get([key])[0]

    def batched_get_blocking(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        return self._get(keys)

    def get_non_blocking(self, key: CacheEngineKey, location: str | None = None
                         ) -> Future | None:
        if not self.contains(key):
            return None
        return self._reader.submit(self.get_blocking, key)

    async def batched_get_non_blocking(self, lookup_id: str, keys: list[CacheEngineKey],
                                       transfer_spec: Any = None) -> list[MemoryObj]:
        loop = asyncio.get_running_loop()
        got = await loop.run_in_executor(self._reader, self._get, list(keys), False)
        return [o for o in got if o is not None]

    # -- the rest --------------------------------------------------------------------------

    def pin(self, key: CacheEngineKey) -> bool:
        return self.contains(key)

    def unpin(self, key: CacheEngineKey) -> bool:
        return True

    def remove(self, key: CacheEngineKey, force: bool = True) -> bool:
        """Unlink the chunk's block through the mount (kvfs accounts for it)."""
        x = self._hash(key).hex()
        try:
            os.unlink(os.path.join(self.cache.ns_dir, x[:2], f"{x}.kv"))
        except FileNotFoundError:
            return False
        return True

    def touch_cache(self) -> None:
        """kvfs sees every read: its own eviction order needs nothing from LMCache."""

    def get_allocator_backend(self) -> Any:
        return self.local_cpu_backend

    def close(self) -> None:
        self._writer.shutdown(wait=True)
        self._reader.shutdown(wait=True)
        self.cache.close()


__all__ = ["KVFSBackend"]
