"""SGLang HiCache storage backend on kvfs's direct path: :class:`KVFSHiCacheStorage`.

Loaded by SGLang's own dynamic backend loader (SGLang 0.5.23)::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvfs",
        "module_path": "kvfs.integrations.sglang", "class_name": "KVFSHiCacheStorage",
        "mount": "/mnt/kvfs", "tenant": "acme", "interface_v1": 1}'

``interface_v1: 1`` makes SGLang's cache controller use the zero-copy page forms
(``batch_get_v1`` / ``batch_set_v1``): each page is read from its block file straight into the
registered host KV pool, and written from it, with no staging page. Without it the controller
uses ``batch_get`` / ``batch_set`` with flat page tensors, which work too.

Mapping:

- Namespace: one kvfs model namespace per SGLang storage identity and page format: the model
  name, the TP rank and size (MLA pages are the same on every TP rank, so MLA ranks share one
  namespace, written by SGLang's storage writer rank only), pipeline / context / decode-context
  parallel ranks, and the host pool's layout, dtype and geometry (``extras``). It is opened
  when SGLang registers its host pool, which is what gives the page geometry.
- Keys: SGLang's page key (a sha256 hex chain over the page's tokens) names block
  ``key[:32]`` (the first 16 bytes); any other key is hashed (xxh3-128). A page's parent is
  the key before it (``extra_info.prefix_keys``), so kvfs's chain-aware eviction sees SGLang's
  chains.
- Payload: the page's bytes in SGLang's own flat-page order for the pool's layout (the bytes
  of ``get_data_page(i).flatten()``, which is what SGLang's file backend writes), read and
  written as the page's contiguous runs of the host pool (2 for page-first layouts, 2 per
  layer for layer-first). The header carries kvfs's ``[layers, 2, page, heads, dim]`` shape of
  the same size; the layout name in the namespace's spec says what order the bytes are in.
- Misses: a page kvfs evicted, or whose file fails verification (checksum, header, length),
  is a miss: ``batch_exists`` stops before it, ``batch_get_v1`` reports False from it on, and
  nothing is raised into SGLang. Lookups, hits and misses are counted by kvfs per tenant and
  namespace, as for any kvfs client.
- Space: a batch larger than kvfs can hold (its capacity, or the tenant's quota) stores a
  prefix of its pages that fits (``batch_set_v1`` answers True for those, False after), not
  nothing: a prefix of a chain is a prefix hit (:func:`~kvfs.integrations._common.save_prefix`).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import torch

from ..client import KVCache
from ..format.hashing import ROOT_PARENT
from ._common import BadConfig, check_target, key_hash, page_spec, runs, save_prefix

log = logging.getLogger(__name__)

_TV_LIB: Any = None


def _importable_torchvision() -> None:
    """SGLang imports torchvision (for multimodal configurations) whenever it is imported.
    The torchvision wheels on PyPI are CUDA builds; on a host without CUDA their kernels do
    not load, and torchvision's import then fails while registering fake kernels for two
    operators that do not exist. Define those two (schemas only: never called here), so
    that torchvision's Python part imports. A no-op wherever torchvision imports."""
    global _TV_LIB
    try:
        import torchvision  # noqa: F401, PLC0415
    except ModuleNotFoundError:
        return
    except RuntimeError as exc:
        if "torchvision::" not in str(exc):
            raise
        for name in [m for m in sys.modules if m.split(".")[0] == "torchvision"]:
            del sys.modules[name]
        _TV_LIB = torch.library.Library("torchvision", "DEF")
        for op in ("nms", "qnms"):
            _TV_LIB.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        log.info("torchvision's kernels do not load here (%s): defined placeholders", exc)


_importable_torchvision()

from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

WHERE = "--hicache-storage-backend-extra-config"


class KVFSHiCacheStorage(HiCacheStorage):
    """SGLang HiCache storage on a kvfs mount (see the module docstring)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        extra = dict(storage_config.extra_config or {})
        self.mount, self.tenant = check_target(extra.get("mount"), extra.get("tenant"),
                                               "kvfs HiCache backend", WHERE)
        self.config = storage_config
        self.options = {k: extra[k] for k in ("io", "threads", "verify") if k in extra}
        self.cache: KVCache | None = None
        self.mem_pool_host: Any = None
        self._page_size = 0

    # -- opening -------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        if self.cache is None:
            self.cache = self._open(mem_pool_host)

    def _open(self, pool: Any) -> KVCache:
        c = self.config
        page = pool.get_dummy_flat_data_page()
        extras = {"engine": "sglang", "layout": str(pool.layout),
                  "pool": type(pool).__name__, "page_elements": str(page.numel())}
        for name, rank, size in (("pp", c.pp_rank, c.pp_size),
                                 ("cp", c.attn_cp_rank, c.attn_cp_size),
                                 ("dcp", c.dcp_rank, c.dcp_size)):
            if size > 1:
                extras[name] = f"{rank}/{size}"
        if c.dcp_size > 1:
            extras["logical_page_size"] = str(c.logical_page_size)
        mla = bool(c.is_mla_model)
        same_kv = getattr(pool, "head_dim", None) == getattr(pool, "v_head_dim", -1)
        spec = page_spec(
            model=c.model_name or "", dtype=pool.dtype,
            page_bytes=page.numel() * page.element_size(), num_layers=pool.layer_num,
            tokens=pool.page_size, heads=getattr(pool, "head_num", None) if same_kv else None,
            head_dim=getattr(pool, "head_dim", None), tp_size=1 if mla else c.tp_size,
            tp_rank=0 if mla else c.tp_rank, extras=extras | ({"mla": "1"} if mla else {}))
        self._page_size = pool.page_size
        cache = KVCache.open(self.mount, tenant=self.tenant, spec=spec, **self.options)
        log.info("kvfs HiCache backend: %s, %s pages of %d tokens", cache, pool.layout,
                 pool.page_size)
        return cache

    def _ready(self) -> KVCache:
        if self.cache is None:
            raise RuntimeError("kvfs HiCache backend used before SGLang registered its host "
                               "KV pool (register_mem_pool_host)")
        return self.cache

    # -- lookups -------------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        if not keys:
            return 0
        try:
            return self._ready().lookup([key_hash(k) for k in keys])
        except OSError as exc:
            log.warning("kvfs lookup of %d pages failed: %s (a miss)", len(keys), exc)
            return 0

    # -- zero-copy page forms ------------------------------------------------------------

    def _page_parts(self, host_indices: torch.Tensor, n: int) -> list[list[torch.Tensor]]:
        ps, pool = self._page_size, self.mem_pool_host
        if host_indices.numel() < n * ps:
            raise ValueError(f"{host_indices.numel()} host indices for {n} pages of {ps}")
        firsts = host_indices[:n * ps:ps].tolist()
        return [runs(pool.get_data_page(int(i), flat=False)) for i in firsts]

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        if not keys:
            return []
        try:
            n = self._ready().load_parts([key_hash(k) for k in keys],
                                         self._page_parts(host_indices, len(keys)))
        except (OSError, ValueError) as exc:
            log.warning("kvfs load of %d pages failed: %s (a miss)", len(keys), exc)
            n = 0
        return [i < n for i in range(len(keys))]

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        if not keys:
            return []
        if not self.config.is_storage_writer:
            return [True] * len(keys)  # MLA: another rank writes the same pages
        return self._save(keys, self._page_parts(host_indices, len(keys)), extra_info)

    def _save(self, keys: list[str], parts: list[list[torch.Tensor]],
              extra_info: HiCacheStorageExtraInfo | None) -> list[bool]:
        prefix = extra_info.prefix_keys if extra_info is not None else None
        parent = key_hash(prefix[-1]) if prefix else ROOT_PARENT
        try:
            n = save_prefix(self._ready(), [key_hash(k) for k in keys], parts, parent=parent)
        except (OSError, ValueError) as exc:
            log.warning("kvfs save of %d pages failed: %s", len(keys), exc)
            return [False] * len(keys)
        return [i < n for i in range(len(keys))]

    # -- page tensors (the controller's generic path) ------------------------------------

    def get(self, key: str, target_location: Any = None,
            target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        if not keys:
            return []
        if target_locations is None or any(t is None for t in target_locations):
            raise ValueError("kvfs HiCache backend: batch_get needs target tensors")
        try:
            n = self._ready().load_parts([key_hash(k) for k in keys],
                                         [[t] for t in target_locations])
        except (OSError, ValueError) as exc:
            log.warning("kvfs load of %d pages failed: %s (a miss)", len(keys), exc)
            n = 0
        return [t if i < n else None for i, t in enumerate(target_locations[:len(keys)])]

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        if not keys:
            return True
        if not self.config.is_storage_writer:
            return True
        return all(self._save(keys, [[v.contiguous()] for v in values], None))

    # -- the rest --------------------------------------------------------------------------

    def clear(self) -> bool:
        """Remove this namespace's blocks (through the mount: kvfs accounts for it)."""
        cache = self.cache
        if cache is None:
            return True
        removed = 0
        for root, _dirs, files in os.walk(cache.ns_dir):
            for name in files:
                if name.endswith(".kv"):
                    try:
                        os.unlink(os.path.join(root, name))
                        removed += 1
                    except FileNotFoundError:
                        pass
        log.info("kvfs HiCache backend: cleared %d blocks of %s", removed, cache.ns_dir)
        return True

    def get_stats(self) -> dict[str, Any] | None:
        return None if self.cache is None else self.cache.stats

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()


__all__ = ["BadConfig", "KVFSHiCacheStorage"]
