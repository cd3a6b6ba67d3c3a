"""Drive the engines' own classes against a storage backend, in a process of the engines' venv.

Used by the tests (tests/test_sglang.py, tests/test_lmcache.py) and by ``kvfs bench engines``,
which run ``<venv>/bin/python -m kvfs.integrations.drive <engine> '<json plan>'`` and read one
JSON object from the last line of its output. A plan says which backend (``kvfs``, or the
engine's own file backend on a directory), which pages or chunks (a seed, a count, a page
size) and what to do with them (``put``, ``get``, ``bench``). Data are pseudo-random bytes
from the seed; the answer carries the sha256 of each page or chunk written or read, so a
test compares what one process wrote with what another read.

SGLang: a real host KV pool (``MHATokenToKVPoolHost`` or ``MLATokenToKVPoolHost`` on CPU, in
the layout the plan names) and the backend made by SGLang's ``StorageBackendFactory``
(``dynamic`` for kvfs, ``file`` for HiCacheFile), called as SGLang's cache controller calls
it: ``batch_exists`` on the page keys, then the zero-copy page forms (``batch_get_v1`` /
``batch_set_v1``, as with ``interface_v1``) or the generic ones with flat pages
(``batch_get`` / ``batch_set``, the file backend's path), 128 pages per call.

LMCache: LMCache's own ``StorageManager`` (its CPU backend, the storage plugin launcher
loading the kvfs plugin, or its ``LocalDiskBackend``), with ``batched_put``,
``batched_contains`` and ``batched_get``, as LMCache's cache engine calls them.

``python -m kvfs.integrations.drive check`` imports what the tests need and says so.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import random
import sys
import time
from typing import Any

import torch

STORAGE_BATCH = 128  # pages per call, as SGLang's controller batches them


def _seeded(seed: str, nbytes: int) -> torch.Tensor:
    return torch.frombuffer(bytearray(random.Random(seed).randbytes(nbytes)),
                            dtype=torch.uint8)


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _evict_page_cache(root: str) -> None:
    """Drop the page cache of every file under ``root`` (POSIX_FADV_DONTNEED after a sync):
    the next read comes from the disk, as on a host that has not read them since."""
    os.sync()
    for d, _dirs, files in os.walk(root):
        for name in files:
            try:
                fd = os.open(os.path.join(d, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


# -- SGLang --------------------------------------------------------------------------------


def _sglang_first() -> None:
    """Import the kvfs backend before any of SGLang: it makes torchvision importable where
    its kernels do not load (see :mod:`kvfs.integrations.sglang`)."""
    importlib.import_module("kvfs.integrations.sglang")


def _sglang_pool(plan: dict[str, Any]) -> Any:
    _sglang_first()
    from sglang.srt.mem_cache.device_pool_info import (  # noqa: PLC0415
        KVBufferLayout,
        KVBuffers,
        MHABufferInfo,
        MLABufferInfo,
    )
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: PLC0415
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: PLC0415

    layers, ps, dtype = plan["layers"], plan["page_size"], getattr(torch, plan["dtype"])
    pages = plan["count"] + 2
    dev_tokens = ps * 2
    cpu = torch.device("cpu")

    def ptrs(ts: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)

    common = dict(pin_memory=False, device="cpu", device_capacity_tokens=dev_tokens,
                  start_layer=0, end_layer=layers, host_token_capacity=pages * ps)
    if plan.get("mla"):
        dim = plan["kv_dim"]
        bufs = tuple(torch.zeros(dev_tokens, 1, dim, dtype=dtype) for _ in range(layers))
        info = MLABufferInfo(buffers=bufs, data_ptrs=ptrs(bufs),
                             layer_indices=tuple(range(layers)), device_layer_num=layers,
                             page_size=ps, kv_lora_rank=dim - 64, qk_rope_head_dim=64,
                             kv_cache_dim=dim, dtype=dtype, device=cpu)
        return MLATokenToKVPoolHost(info, 1.0, 0, ps, plan["layout"], target_layer_num=layers,
                                    **common)
    heads, hd = plan["heads"], plan["head_dim"]
    k = tuple(torch.zeros(dev_tokens, heads, hd, dtype=dtype) for _ in range(layers))
    v = tuple(torch.zeros(dev_tokens, heads, hd, dtype=dtype) for _ in range(layers))
    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v),
                          layout=KVBufferLayout.NHD),
        page_size=ps, head_num=heads, head_dim=hd, v_head_dim=hd, dtype=dtype, device=cpu)
    return MHATokenToKVPoolHost(info, 1.0, 0, ps, plan["layout"], **common)


def _sglang_backend(plan: dict[str, Any], pool: Any) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: PLC0415
    from sglang.srt.mem_cache.storage.backend_factory import (  # noqa: PLC0415
        StorageBackendFactory,
    )

    mla = bool(plan.get("mla"))
    if plan["backend"] == "kvfs":
        name = "dynamic"
        extra = {"backend_name": "kvfs", "module_path": "kvfs.integrations.sglang",
                 "class_name": "KVFSHiCacheStorage", "mount": plan["mount"],
                 "tenant": plan["tenant"], "interface_v1": 1}
        extra |= plan.get("extra", {})
    else:
        name = "file"
        extra = {"file_storage_path": plan["dir"]}
    config = HiCacheStorageConfig(
        tp_rank=plan.get("tp_rank", 0), tp_size=plan.get("tp_size", 1), pp_rank=0, pp_size=1,
        attn_cp_rank=0, attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=False,
        is_page_first_layout=plan["layout"] != "layer_first", model_name=plan["model"],
        extra_config=extra)
    backend = StorageBackendFactory.create_backend(name, config, pool)
    backend.register_mem_pool_host(pool)
    return backend


def _page_keys(seed: str, n: int, start: int = 0) -> list[str]:
    """SGLang-style page keys: a sha256 hex chain (one link per page)."""
    keys, prev = [], ""
    for i in range(start + n):
        prev = hashlib.sha256(f"{prev}:{seed}:{i}".encode()).hexdigest()
        keys.append(prev)
    return keys[start:]


def _sglang(plan: dict[str, Any]) -> dict[str, Any]:
    _sglang_first()
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo  # noqa: PLC0415

    pool = _sglang_pool(plan)
    backend = _sglang_backend(plan, pool)
    ps, n, seed = plan["page_size"], plan["count"], plan["seed"]
    keys = _page_keys(seed, n)
    zero_copy = plan.get("zero_copy", plan["backend"] == "kvfs")
    indices = pool.alloc(n * ps)
    firsts = [int(i) for i in indices[::ps]]
    page_bytes = pool.get_dummy_flat_data_page().numel() * pool.dtype.itemsize
    out: dict[str, Any] = {"page_bytes": page_bytes}

    def page(i: int) -> torch.Tensor:
        return pool.get_data_page(firsts[i], flat=True)

    def put(lo: int, hi: int) -> bool:
        info = HiCacheStorageExtraInfo(prefix_keys=keys[:lo] or None)
        if zero_copy:
            return all(backend.batch_set_v1(keys[lo:hi], indices[lo * ps:hi * ps], info))
        values = [pool.get_data_page(f, flat=True) for f in firsts[lo:hi]]
        return bool(backend.batch_set(keys[lo:hi], values))

    def get(lo: int, hi: int) -> int:
        info = HiCacheStorageExtraInfo(prefix_keys=keys[:lo] or None)
        if zero_copy:
            ok = backend.batch_get_v1(keys[lo:hi], indices[lo * ps:hi * ps], info)
            return ok.index(False) if False in ok else len(ok)
        dst = [pool.get_dummy_flat_data_page() for _ in range(hi - lo)]
        got = backend.batch_get(keys[lo:hi], dst)
        m = next((i for i, g in enumerate(got) if g is None), len(got))
        for i in range(m):
            pool.set_from_flat_data_page(firsts[lo + i], got[i])
        return m

    def batches() -> list[tuple[int, int]]:
        return [(lo, min(n, lo + STORAGE_BATCH)) for lo in range(0, n, STORAGE_BATCH)]

    for op in plan["ops"]:
        if op == "put":
            for i in range(n):  # fill the pool's pages with this plan's bytes
                src = _seeded(f"{seed}/{i}", page_bytes)
                pool.set_from_flat_data_page(firsts[i], src.view(pool.dtype))
            out["put_sha"] = [_sha(page(i)) for i in range(n)]
            out["put_ok"] = all(put(lo, hi) for lo, hi in batches())
        elif op == "exists":
            out["exists"] = sum(backend.batch_exists(keys[lo:hi]) for lo, hi in batches())
            out["exists_each"] = [bool(backend.exists(k)) for k in keys]
        elif op == "get":
            pool.kv_buffer.zero_()
            got = 0
            for lo, hi in batches():
                m = get(lo, hi)
                got += m
                if lo + m < hi:
                    break
            out["got"] = got
            out["get_sha"] = [_sha(page(i)) for i in range(got)]
        elif op == "bench":
            out["bench"] = _bench(plan, put, get, batches, n * page_bytes)
        elif op == "stats":
            out["stats"] = backend.get_stats()
        elif op == "clear":
            out["clear"] = backend.clear()
    if hasattr(backend, "close"):
        backend.close()
    return out


def _bench(plan: dict[str, Any], put: Any, get: Any, batches: Any, total: int
           ) -> dict[str, float]:
    """Seconds to set every page, then to get them all warm and cold (median of repeats)."""
    def timed(fn: Any) -> float:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    def put_all() -> None:
        if not all(put(lo, hi) for lo, hi in batches()):
            raise RuntimeError("a set failed")

    def get_all() -> None:
        for lo, hi in batches():
            get(lo, hi)

    out = {"bytes": total, "set_s": timed(put_all)}
    root = plan.get("cold_root")
    reps = plan.get("repeats", 3)
    warm, cold = [], []
    get_all()
    for _ in range(reps):
        warm.append(timed(get_all))
    for _ in range(reps if root else 0):
        _evict_page_cache(root)
        cold.append(timed(get_all))
    out["get_warm_s"] = sorted(warm)[len(warm) // 2]
    if cold:
        out["get_cold_s"] = sorted(cold)[len(cold) // 2]
    return out


# -- LMCache -------------------------------------------------------------------------------


def _lmcache(plan: dict[str, Any]) -> dict[str, Any]:
    raise NotImplementedError


# -- entry ---------------------------------------------------------------------------------


def _check() -> dict[str, Any]:
    _sglang_first()
    import lmcache  # noqa: PLC0415
    import sglang  # noqa: PLC0415
    from lmcache.v1.storage_backend.storage_manager import StorageManager  # noqa: F401, PLC0415
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: F401, PLC0415
    from sglang.srt.mem_cache.storage.backend_factory import (  # noqa: F401, PLC0415
        StorageBackendFactory,
    )

    import kvfs.integrations.lmcache  # noqa: F401, PLC0415

    return {"sglang": sglang.__version__, "lmcache": lmcache.__version__,
            "torch": torch.__version__}


def main(argv: list[str]) -> int:
    what = argv[0] if argv else ""
    plan = json.loads(argv[1]) if len(argv) > 1 else {}
    if what == "check":
        result = _check()
    elif what == "sglang":
        result = _sglang(plan)
    elif what == "lmcache":
        result = _lmcache(plan)
    else:
        print("usage: python -m kvfs.integrations.drive check|sglang|lmcache '<plan json>'",
              file=sys.stderr)
        return 2
    sys.stdout.flush()
    print("\n" + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
