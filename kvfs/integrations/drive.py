"""Drive the engines' own classes against a storage backend, in a process of the engines' venv.

Used by the tests (tests/test_sglang.py, tests/test_lmcache.py) and by ``kvfs bench backends``,
which run ``<venv>/bin/python -m kvfs.integrations.drive <engine> '<json plan>'`` and read one
JSON object from the last line of its output. A plan says which backend (``kvfs``, the
engine's own file backend on a directory, or ``raw``: :class:`RawFiles`), which pages or
chunks (a seed, a count, a page size) and what to do with them (``put``, ``exists``,
``get``, ``bench``, and ``clean``: remove what the backend wrote); a list of plans runs one
after the other in the same process, each answering its error if it raises.
Data are pseudo-random bytes from the seed; the answer carries the sha256 of each page or
chunk written or read, so a test compares what one process wrote with what another read.

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

import gc
import hashlib
import importlib
import json
import os
import random
import resource
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import xxhash

from kvfs.client.transport import preadv_all, pwritev_all
from kvfs.integrations._common import key_hash, runs

STORAGE_BATCH = 128  # pages per call, as SGLang's controller batches them


def _seeded(seed: str, nbytes: int) -> torch.Tensor:
    return torch.frombuffer(bytearray(random.Random(seed).randbytes(nbytes)),
                            dtype=torch.uint8)


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _page_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(t.view(torch.uint8).reshape(-1).numpy())


def _drop_caches() -> None:
    """``sync; echo 3 > /proc/sys/vm/drop_caches`` (root): the next read comes from the disk."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")
    time.sleep(0.5)  # let the mount's daemon take the kernel's forgets first


class RawFiles:
    """The physical floor of a file backend (``backend: raw``): each page or chunk one file
    of a directory, written with one ``pwritev`` and read with one ``preadv`` of its bytes
    where the engine holds them, by a pool of 4 threads (LocalDiskBackend's I/O pool), and
    nothing else: no index, no header, no hash, no engine code."""

    def __init__(self, directory: str, threads: int = 4) -> None:
        self.dir = directory
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="raw-io")

    def _path(self, rep: int, i: int) -> str:
        return os.path.join(self.dir, f"{rep}-{i}")

    def put(self, rep: int, items: list[list[memoryview]]) -> None:
        def one(i: int) -> None:
            fd = os.open(self._path(rep, i), os.O_WRONLY | os.O_CREAT | os.O_TRUNC
                         | os.O_CLOEXEC, 0o644)
            try:
                pwritev_all(fd, items[i], 0)
            finally:
                os.close(fd)
        list(self.pool.map(one, range(len(items))))

    def get(self, items: list[list[memoryview]]) -> None:
        def one(i: int) -> None:
            fd = os.open(self._path(0, i), os.O_RDONLY | os.O_CLOEXEC)
            try:
                want = sum(v.nbytes for v in items[i])
                if preadv_all(fd, items[i], 0) != want:
                    raise RuntimeError(f"{self._path(0, i)}: short")
            finally:
                os.close(fd)
        list(self.pool.map(one, range(len(items))))

    def close(self) -> None:
        self.pool.shutdown()


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


def page_keys(seed: str, n: int, start: int = 0) -> list[str]:
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
    raw = plan["backend"] == "raw"
    backend = RawFiles(plan["dir"]) if raw else _sglang_backend(plan, pool)
    ps, n, seed = plan["page_size"], plan["count"], plan["seed"]
    keys = page_keys(seed, n)
    zero_copy = plan.get("zero_copy", plan["backend"] == "kvfs")
    indices = pool.alloc(n * ps)
    firsts = [int(i) for i in indices[::ps]]
    page_bytes = pool.get_dummy_flat_data_page().numel() * pool.dtype.itemsize
    out: dict[str, Any] = {"page_bytes": page_bytes}

    def page(i: int) -> torch.Tensor:
        return pool.get_data_page(firsts[i], flat=True)

    def put_each(lo: int, hi: int) -> list[bool]:
        info = HiCacheStorageExtraInfo(prefix_keys=keys[:lo] or None)
        if zero_copy:
            return list(backend.batch_set_v1(keys[lo:hi], indices[lo * ps:hi * ps], info))
        values = [pool.get_data_page(f, flat=True) for f in firsts[lo:hi]]
        return [bool(backend.batch_set(keys[lo:hi], values))] * (hi - lo)

    def put(lo: int, hi: int) -> bool:
        return all(put_each(lo, hi))

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

    def fill() -> None:
        for i in range(n):  # fill the pool's pages with this plan's bytes
            src = _seeded(f"{seed}/{i}", page_bytes)
            pool.set_from_flat_data_page(firsts[i], src.view(pool.dtype))

    for op in plan["ops"]:
        if op == "put":
            fill()
            out["put_sha"] = [_sha(page(i)) for i in range(n)]
            out["put_each"] = [ok for lo, hi in batches() for ok in put_each(lo, hi)]
            out["put_ok"] = all(out["put_each"])
            out["blocks"] = [key_hash(k).hex() for k in keys]
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
            def put_all(rep: int = 0, first: tuple[str, ...] = tuple(keys)) -> None:
                keys[:] = page_keys(f"{seed}/set{rep}", n) if rep else first
                if not all(put(lo, hi) for lo, hi in batches()):
                    raise RuntimeError("a set failed")

            def get_all() -> None:
                if sum(get(lo, hi) for lo, hi in batches()) != n:
                    raise RuntimeError("a get missed")

            # The pages hold bytes before the clock starts, as a serving pool's do (and as
            # LMCache's chunks are made first): a set from memory never touched reads zero
            # pages through page faults, which the first backend of a process paid for.
            fill()
            if raw:  # the physical floor: the pages' bytes where they are, to files
                items = [[_page_bytes(r) for r in runs(pool.get_data_page(f, flat=False))]
                         for f in firsts]
                out["bench"] = _bench(plan, lambda rep, items=items: backend.put(rep, items),
                                      lambda items=items: backend.get(items), n * page_bytes)
            elif plan.get("hash"):
                # The verified-store floor: the file backend's own set and get plus one
                # xxh3_64 pass over every page's bytes in the calling thread (a set
                # checksums its pages before it hands them over; a get hashes what it read).
                def page_hash(i: int) -> int:  # over the page's runs in the pool, no copy
                    x = xxhash.xxh3_64()
                    for r in runs(pool.get_data_page(firsts[i], flat=False)):
                        x.update(_page_bytes(r))
                    return x.intdigest()

                def put_hashed(rep: int = 0) -> None:
                    for i in range(n):
                        page_hash(i)
                    put_all(rep)

                def get_hashed() -> None:
                    get_all()
                    for i in range(n):
                        page_hash(i)

                out["bench"] = _bench(plan, put_hashed, get_hashed, n * page_bytes)
            else:
                out["bench"] = _bench(plan, put_all, get_all, n * page_bytes)
        elif op == "stats":
            out["stats"] = backend.get_stats()
        elif op == "clean":
            _clean(plan, backend)
        elif op == "clear":
            out["clear"] = backend.clear()
    if hasattr(backend, "close"):
        backend.close()
    return out


def _clean(plan: dict[str, Any], backend: Any) -> None:
    """Remove what the plan's backend wrote (a benchmark's passes would fill the disk): the
    file backend's directory's entries, or the kvfs namespace's fan-out directories, through
    the mount (kvfs accounts for them)."""
    file = plan["backend"] in ("file", "raw")
    with os.scandir(plan["dir"] if file else backend.cache.ns_dir) as it:
        for entry in it:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            elif file:
                os.unlink(entry.path)


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _bench(plan: dict[str, Any], put_all: Any, get_all: Any, total: int
           ) -> dict[str, float]:
    """Seconds to set every page (``put_all(rep)``: the pages under key set ``rep``, 0 the
    keys the gets read), then to get them all warm and cold (median of repeats each), and
    the CPU seconds this process (all its threads) spent on each (``*_cpu_s``; a kvfs
    mount's daemon is another process, not counted)."""
    def timed(fn: Any) -> tuple[float, float]:
        # As timeit does: no garbage collection inside the clock (a full one over an
        # engine's heap took 0.3 s of CPU in a 10 ms set), the heap collected before it.
        gc.collect()
        gc.disable()
        try:
            c, t = _cpu(), time.perf_counter()
            fn()
            return time.perf_counter() - t, _cpu() - c
        finally:
            gc.enable()

    out: dict[str, float] = {"bytes": total}
    reps = plan.get("repeats", 3)
    # Each timed set writes new keys (a set of keys already stored is skipped), the last
    # set's keys are the ones read back; the disk is synced before each, so no write-back
    # of what came before runs during it.
    sets = []
    for rep in reversed(range(reps)):
        os.sync()
        sets.append(timed(lambda rep=rep: put_all(rep)))
    warm, cold = [], []
    get_all()
    for _ in range(reps):
        warm.append(timed(get_all))
    for _ in range(reps if plan.get("drop_caches") else 0):
        _drop_caches()
        cold.append(timed(get_all))
    for name, runs_ in (("set", sets), ("get_warm", warm), ("get_cold", cold)):
        if runs_:
            out[f"{name}_s"] = sorted(w for w, _ in runs_)[len(runs_) // 2]
            out[f"{name}_cpu_s"] = sorted(c for _, c in runs_)[len(runs_) // 2]
    return out


# -- LMCache -------------------------------------------------------------------------------


def _hash_in_io_threads(backend: Any) -> None:
    """LocalDiskBackend as the best verifying store on its design would be: each chunk
    hashed (xxh3_64) by the I/O thread that writes it, right before the write, or reads it,
    right after the read, so the hashing runs on its thread pools, in parallel."""
    read, write = backend.read_file, backend.write_file

    def read_file(key: Any, buffer: Any, path: str) -> None:
        read(key, buffer, path)
        xxhash.xxh3_64_intdigest(buffer)

    def write_file(buffer: Any, path: str) -> None:
        xxhash.xxh3_64_intdigest(buffer)
        write(buffer, path)

    backend.read_file, backend.write_file = read_file, write_file


def _lmcache(plan: dict[str, Any]) -> dict[str, Any]:
    from lmcache.utils import CacheEngineKey  # noqa: PLC0415
    from lmcache.v1.config import LMCacheEngineConfig  # noqa: PLC0415
    from lmcache.v1.event_manager import EventManager  # noqa: PLC0415
    from lmcache.v1.memory_management import MemoryFormat  # noqa: PLC0415
    from lmcache.v1.metadata import LMCacheMetadata  # noqa: PLC0415
    from lmcache.v1.storage_backend.storage_manager import StorageManager  # noqa: PLC0415

    n, seed, chunk = plan["count"], plan["seed"], plan["chunk_size"]
    layers, heads, hd = plan["layers"], plan["heads"], plan["head_dim"]
    dtype = getattr(torch, plan["dtype"])
    chunk_bytes = 2 * layers * chunk * heads * hd * dtype.itemsize
    cfg: dict[str, Any] = {"chunk_size": chunk, "local_cpu": True,
                           "max_local_cpu_size": plan.get("cpu_gb", 0.5)}
    if plan["backend"] == "kvfs":
        name = "kvfs"
        cfg |= {"storage_plugins": ["kvfs"], "extra_config": {
            "storage_plugin.kvfs.module_path": "kvfs.integrations.lmcache",
            "storage_plugin.kvfs.class_name": "KVFSBackend",
            "kvfs.mount": plan["mount"], "kvfs.tenant": plan["tenant"],
            **plan.get("extra", {})}}
    elif plan["backend"] == "raw":  # LMCache's CPU backend only, as the allocator
        name = "LocalCPUBackend"
    else:
        name = "LocalDiskBackend"
        cfg |= {"local_disk": plan["dir"], "max_local_disk_size": plan.get("disk_gb", 4.0)}
    metadata = LMCacheMetadata(
        model_name=plan["model"], world_size=plan.get("world_size", 1), local_world_size=1,
        worker_id=plan.get("worker_id", 0), local_worker_id=0, kv_dtype=dtype,
        kv_shape=(layers, 2, chunk, heads, hd), chunk_size=chunk)
    manager = StorageManager(LMCacheEngineConfig.from_dict(cfg), metadata, EventManager())
    out: dict[str, Any] = {"backends": list(manager.storage_backends)}
    backend = manager.storage_backends.get(name)
    if backend is None:
        manager.close()
        out["error"] = f"no {name} backend (see the log)"
        return out

    def keys_of(rep: int) -> list[Any]:
        tag = f"{seed}/set{rep}" if rep else seed
        return [CacheEngineKey(plan["model"], metadata.world_size, metadata.worker_id,
                               int(hashlib.sha256(f"{tag}/{i}".encode()).hexdigest()[:15], 16),
                               dtype) for i in range(n)]

    keys = keys_of(0)
    shapes, dtypes = metadata.get_shapes(chunk), metadata.get_dtypes()

    def filled() -> list[Any]:
        objs = [manager.allocate(shapes, dtypes, MemoryFormat.KV_2LTD) for _ in keys]
        for i, o in enumerate(objs):
            o.tensor.view(torch.uint8).reshape(-1).copy_(_seeded(f"{seed}/{i}", chunk_bytes))
        return objs

    def put_keys(these: list[Any], objs: list[Any]) -> None:
        """The backend's own asynchronous put, waited for through its completion callback
        (each key's, once written: the same moment for every backend)."""
        left, done = set(these), threading.Event()

        def one_done(key: Any) -> None:
            left.discard(key)
            if not left:
                done.set()

        for o in objs:
            o.ref_count_up()  # the bench keeps the chunks for the next set
        backend.batched_submit_put_task(these, objs, on_complete_callback=one_done)
        for o in objs:
            o.ref_count_down()
        if not done.wait(120):
            raise TimeoutError(f"puts not done after 120 s ({len(left)} left)")

    def wait_put() -> None:
        if hasattr(backend, "flush"):
            backend.flush()
            return
        deadline = time.monotonic() + 120
        while any(backend.exists_in_put_tasks(k) or not backend.contains(k) for k in keys):
            if time.monotonic() > deadline:
                raise TimeoutError("puts not done after 120 s")
            time.sleep(0.01)

    def get_all(keep: bool = False) -> list[Any]:
        got = backend.batched_get_blocking(keys)
        if not keep:
            for o in got:
                if o is not None:
                    o.ref_count_down()
        return got

    for op in plan["ops"]:
        if op == "put":
            manager.batched_put(keys, filled())
            wait_put()
            out["put_sha"] = [_sha(_seeded(f"{seed}/{i}", chunk_bytes)) for i in range(n)]
            out["blocks"] = [key_hash(k.to_string()).hex() for k in keys]
        elif op == "exists":
            out["exists"] = manager.batched_contains(keys)[0]
            out["exists_each"] = [bool(backend.contains(k)) for k in keys]
        elif op == "get":
            # As LMCache's cache engine retrieves: a prefix lookup across its backends, then
            # a get from the backend that holds each part of it.
            _hits, mapping = manager.batched_contains(keys)
            got = []
            for location, part in mapping.items():
                got += manager.batched_get(part, location=location)
            got += [None] * (n - len(got))
            m = next((i for i, o in enumerate(got) if o is None), len(got))
            out["got"] = m
            out["got_none"] = [o is None for o in got]
            out["get_sha"] = [_sha(o.tensor) for o in got[:m]]
            for o in got:
                if o is not None:
                    o.ref_count_down()
        elif op == "bget":  # this backend alone, as LMCache asks each backend in turn
            got = get_all(keep=True)
            m = next((i for i, o in enumerate(got) if o is None), len(got))
            out["got"] = m
            out["get_sha"] = [_sha(o.tensor) for o in got[:m]]
            for o in got[:m]:
                o.ref_count_down()
        elif op == "sleep":
            time.sleep(plan.get("sleep", 1.0))
        elif op == "bench":
            objs = filled()  # made before the clock starts, as the pages are for SGLang
            if name == "LocalCPUBackend":
                # The physical floor: the chunks' bytes to files, and read back into
                # memory objects of LMCache's allocator (allocated in the clock, as every
                # backend's get allocates them).
                raw = RawFiles(plan["dir"])

                def raw_get(raw: RawFiles = raw) -> None:
                    got = [manager.allocate(shapes, dtypes, MemoryFormat.KV_2LTD)
                           for _ in keys]
                    raw.get([[memoryview(o.byte_array)] for o in got])
                    for o in got:
                        o.ref_count_down()

                items = [[memoryview(o.byte_array)] for o in objs]
                out["bench"] = _bench(plan, lambda rep, raw=raw, items=items: raw.put(
                    rep, items), raw_get, n * chunk_bytes)
                raw.close()
            else:
                if plan.get("hash"):
                    # The verified-store floor: the file backend's own set and get, with one
                    # xxh3_64 pass over every chunk's bytes in the thread doing its I/O.
                    _hash_in_io_threads(backend)
                out["bench"] = _bench(plan, lambda rep, objs=objs: put_keys(keys_of(rep),
                                                                            objs),
                                      get_all, n * chunk_bytes)
            for o in objs:
                o.ref_count_down()
        elif op == "stats":
            out["stats"] = getattr(getattr(backend, "cache", None), "stats", None)
        elif op == "clean":
            _clean(plan, backend)
    manager.close()
    return out


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


def _guarded(run: Any, plan: dict[str, Any]) -> dict[str, Any]:
    """One plan of several: its error is its answer (a test may expect one)."""
    try:
        return run(plan)
    except Exception as exc:  # noqa: BLE001 - reported to the caller
        return {"error": f"{type(exc).__name__}: {exc}"}


def main(argv: list[str]) -> int:
    what = argv[0] if argv else ""
    plan = json.loads(argv[1]) if len(argv) > 1 else {}
    run = {"sglang": _sglang, "lmcache": _lmcache}.get(what)
    if what == "check":
        result: Any = _check()
    elif run is not None:
        result = [_guarded(run, p) for p in plan] if isinstance(plan, list) else run(plan)
    else:
        print("usage: python -m kvfs.integrations.drive check|sglang|lmcache '<plan json>'",
              file=sys.stderr)
        return 2
    sys.stdout.flush()
    print("\n" + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
