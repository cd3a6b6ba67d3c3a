"""Benchmark restoring KV blocks with the kvfs client, against the physical limit, in one run.

The same block files (written once through :class:`kvfs.KVCache` into a kvfs mount over a
directory of the filesystem measured) are read, for each block size (1, 4, 16, 64 MiB), with 1
to 4 threads, with a warm page cache and a cold one (``sync; echo 3 > drop_caches``, as root):

- ``raw``: threaded ``os.preadv`` of each whole block file into a preallocated host buffer:
  the limit of this machine for this job, and the baseline of every ratio;
- ``fio``: buffered sequential reads of the same files (psync, 1 MiB requests, one job per
  thread, each job its share of the files; page cache not invalidated), where fio is
  installed;
- ``direct``: ``KVCache.load`` on the direct path (POSIX transport), ``verify="full"`` and
  ``verify="sampled"``;
- ``mount``: the same load through the mount (``direct=False``);
- ``torch.load``: the naive alternative, one ``torch.save`` file per block (written
  beforehand, same bytes), loaded and copied into the same preallocated tensor.

Then the control plane: a 64-block request (``lookup`` + ``load``) of a namespace whose blocks
carry 8 bytes of KV each, so that what is left is the control cost (the number of control
calls, each a setxattr through the mount, and the client's own work); and, as a cross-check,
the same request for 64 real 1 MiB blocks minus raw ``preadv`` of those files. Fetch
amplification (bytes read / bytes of the blocks loaded) comes from ``cache.stats``.

GB/s is KV payload delivered per second of wall time (the 4 KiB block header is read but not
counted), the median of ``--repeats`` runs; ``x raw`` is the median over those runs of raw
preadv's time divided by the method's. The methods' runs are interleaved (round r runs each
once), so that the load of other processes weighs on all of them alike. A warm figure
follows one untimed pass of each method; a cold one drops the caches before every run.

Usage (as root, for cold-cache figures and for FUSE):

    python tools/bench_restore.py                  # full run: 1 GiB of blocks per block size
    python tools/bench_restore.py --quick          # a smoke run
    python tools/bench_restore.py --json out.json  # every figure, and the conditions
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

#: The checkout this tool belongs to: its kvfs is the one measured, here and in the daemon.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isdir(os.path.join(REPO, "kvfs")):
    sys.path.insert(0, REPO)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [REPO, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])

import torch  # noqa: E402

import kvfs  # noqa: E402
from kvfs import control  # noqa: E402
from kvfs.bench.common import cpu_model, filesystem_of, memory_gib  # noqa: E402
from kvfs.bench.common import read_text as _read  # noqa: E402
from kvfs.client import KVCache  # noqa: E402
from kvfs.hashing import ModelSpec  # noqa: E402
from kvfs.transport import host_view, preadv_all  # noqa: E402

MiB = 1 << 20
TENANT = "bench"
KVFS = [sys.executable, "-m", "kvfs.cli"]
#: KV of a Llama-3-8B-shaped model: 32 layers, 8 KV heads of 128, bfloat16: 128 KiB per token.
LAYERS, KV_HEADS, HEAD_DIM = 32, 8, 128
TOKEN_BYTES = LAYERS * 2 * KV_HEADS * HEAD_DIM * 2
METHODS = ("raw", "fio", "direct", "direct-sampled", "mount", "torch.load")
TARGET_DIRECT = 0.9  # direct load at least this fraction of raw preadv
TARGET_CONTROL_MS = 1.0  # per 64-block request
CONTROL_BLOCKS = 64
_DROP = "/proc/sys/vm/drop_caches"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


# -- conditions ------------------------------------------------------------------------------


def busy_cpus(seconds: float = 1.0) -> float:
    """CPUs kept busy by other processes over ``seconds`` (this one sleeps meanwhile)."""
    def sample() -> tuple[int, int]:
        f = [int(x) for x in _read("/proc/stat").splitlines()[0].split()[1:]]
        return sum(f) - f[3] - f[4], sum(f)

    b0, t0 = sample()
    time.sleep(seconds)
    b1, t1 = sample()
    return round((b1 - b0) / max(1, t1 - t0) * (os.cpu_count() or 1), 2)


def _version(argv: list[str]) -> str | None:
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (res.stdout or res.stderr).strip().splitlines()[0] if res.returncode == 0 else None


def conditions(work: str) -> dict[str, Any]:
    import xxhash  # noqa: PLC0415

    try:
        import pyfuse3  # noqa: PLC0415

        pyfuse3_version = pyfuse3.__version__
    except ImportError:
        pyfuse3_version = None
    commit = _version(["git", "-C", REPO, "rev-parse", "--short", "HEAD"])
    dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--", "kvfs"],
                           capture_output=True, text=True).stdout.split("\n")
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "memory_gib": memory_gib(),
        "kernel": platform.release(),
        "filesystem": filesystem_of(work),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "xxhash": xxhash.VERSION,
        "kvfs": kvfs.__version__,
        "kvfs_commit": commit,
        "kvfs_local_changes": [line[3:] for line in dirty if line.strip()],
        "pyfuse3": pyfuse3_version,
        "fio": _version(["fio", "--version"]) if shutil.which("fio") else None,
        "root": os.getuid() == 0,
        "cold_cache": can_drop_caches(),
        "other_busy_cpus_before": busy_cpus(),
        "loadavg_before": [round(x, 2) for x in os.getloadavg()],
        "time": time.strftime("%Y-%m-%d %H:%M:%S %z"),
    }


def conditions_text(c: dict[str, Any]) -> str:
    fs = c["filesystem"]
    return (f"{c['cpu']}, {c['cores']} cores, {c['memory_gib']} GiB; Linux {c['kernel']}; "
            f"{fs.get('type')} on {fs.get('source')} ({fs.get('kind', '?')}, read-ahead "
            f"{fs.get('read_ahead_kb', '?')} KiB); Python {c['python']}, torch {c['torch']}, "
            f"xxhash {c['xxhash']}, kvfs {c['kvfs']} ({c['kvfs_commit']}"
            f"{' + local changes' if c['kvfs_local_changes'] else ''}), pyfuse3 {c['pyfuse3']}, "
            f"{c['fio'] or 'no fio'}; other processes kept {c['other_busy_cpus_before']} CPUs "
            f"busy (load average {c['loadavg_before'][0]})")


# -- the page cache and the mount ---------------------------------------------------------------


def can_drop_caches() -> bool:
    if os.getuid() != 0:
        return False
    try:
        with open(_DROP, "w") as f:
            f.write("1")
    except OSError:
        return False
    return True


def _cpu_ticks(pid: int) -> int:
    fields = _read(f"/proc/{pid}/stat").rsplit(")", 1)[-1].split()
    return int(fields[11]) + int(fields[12]) if len(fields) > 12 else 0


def drop_caches(daemon_pid: int) -> None:
    """``sync; echo 3 > drop_caches``, then wait until the daemon has handled the FORGETs that
    dropping the kernel's inodes sends it."""
    os.sync()
    with open(_DROP, "w") as f:
        f.write("3")
    last, t = _cpu_ticks(daemon_pid), time.monotonic()
    while time.monotonic() - t < 30:
        time.sleep(0.1)
        now = _cpu_ticks(daemon_pid)
        if now - last == 0:
            break
        last = now


class Mount:
    """A kvfs mount over ``work/backing``, as a user runs it."""

    def __init__(self, work: str) -> None:
        self.backing = os.path.join(work, "backing")
        self.mnt = os.path.join(work, "mnt")
        self.log = os.path.join(work, "daemon.log")
        os.makedirs(self.backing)
        os.makedirs(self.mnt)

    def start(self) -> None:
        subprocess.run([*KVFS, "mount", self.backing, self.mnt, "--log", self.log],
                       check=True, capture_output=True)
        subprocess.run([*KVFS, "tenant", "add", self.mnt, TENANT, "--uid", str(os.getuid()),
                        "--gid", str(os.getgid())], check=True, capture_output=True)

    @property
    def pid(self) -> int:
        with open(os.path.join(self.mnt, ".kvfs", "stats.json"), "rb") as f:
            return int(json.loads(f.read())["pid"])

    def stop(self) -> None:
        if os.path.ismount(self.mnt):
            res = subprocess.run([*KVFS, "umount", self.mnt], capture_output=True, text=True)
            if res.returncode != 0 and os.path.ismount(self.mnt):
                subprocess.run(["fusermount3", "-uz", self.mnt], capture_output=True)

    def tracebacks(self) -> bool:
        return "Traceback" in _read(self.log)


# -- one block size ----------------------------------------------------------------------------


def spec_for(block_mib: int) -> ModelSpec:
    return ModelSpec(model="bench/llama-3-8b-shape", revision="r1", kv_dtype="bfloat16",
                     block_size=block_mib * MiB // TOKEN_BYTES, num_layers=LAYERS,
                     num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)


class Blocks:
    """The blocks of one block size: written once, read by every method."""

    def __init__(self, mount: Mount, work: str, block_mib: int, total_mib: int) -> None:
        self.spec = spec_for(block_mib)
        self.n = max(1, total_mib // block_mib)
        self.payload = self.spec.block_payload_bytes
        self.mount = mount
        tokens = list(range(block_mib * 10**7, block_mib * 10**7 + self.n * self.spec.block_size))
        self.torch_dir = os.path.join(work, f"torch-{block_mib}")
        os.makedirs(self.torch_dir)
        with KVCache.open(mount.mnt, tenant=TENANT, spec=self.spec, direct=True) as cache:
            self.hashes = cache.block_hashes(tokens)
            self.paths = [cache.path(h) for h in self.hashes]
            step = max(1, 256 * MiB // self.payload)
            for i in range(0, self.n, step):
                j = min(self.n, i + step)
                kv = torch.randint(0, 256, (j - i, self.payload), dtype=torch.uint8)
                kv = kv.view(torch.bfloat16).view(j - i, *self.spec.block_shape)
                cache.save(self.hashes[i:j], kv, parent=self.hashes[i - 1] if i else None)
                for k in range(j - i):  # clone: torch.save writes a view's whole storage
                    torch.save(kv[k].clone(), self.torch_path(i + k))
        self.file_bytes = os.path.getsize(self.paths[0])
        self.out = torch.zeros((self.n, *self.spec.block_shape), dtype=torch.bfloat16)
        self.raw_buf = torch.zeros(self.n * self.file_bytes, dtype=torch.uint8)
        self.raw_views = [host_view(self.raw_buf[i * self.file_bytes:(i + 1) * self.file_bytes])
                          for i in range(self.n)]

    def torch_path(self, i: int) -> str:
        return os.path.join(self.torch_dir, f"{i:05d}.pt")

    @property
    def total_payload(self) -> int:
        return self.n * self.payload

    def remove(self) -> None:
        shutil.rmtree(self.torch_dir, ignore_errors=True)
        self.out = self.raw_buf = torch.empty(0)
        self.raw_views = []


def raw_read(blocks: Blocks, pool: ThreadPoolExecutor) -> Callable[[], dict[str, Any]]:
    def one(i: int) -> None:
        fd = os.open(blocks.paths[i], os.O_RDONLY | os.O_CLOEXEC)
        try:
            if preadv_all(fd, [blocks.raw_views[i]], 0) != blocks.file_bytes:
                raise OSError(f"{blocks.paths[i]}: short read")
        finally:
            os.close(fd)

    def run() -> dict[str, Any]:
        list(pool.map(one, range(blocks.n)))
        return {}
    return run


def torch_read(blocks: Blocks, pool: ThreadPoolExecutor) -> Callable[[], dict[str, Any]]:
    def one(i: int) -> None:
        blocks.out[i].copy_(torch.load(blocks.torch_path(i), weights_only=True))

    def run() -> dict[str, Any]:
        list(pool.map(one, range(blocks.n)))
        return {}
    return run


def cache_read(blocks: Blocks, cache: KVCache) -> Callable[[], dict[str, Any]]:
    def run() -> dict[str, Any]:
        before = cache.stats
        got = cache.load(blocks.hashes, blocks.out)
        if got != blocks.n:
            raise RuntimeError(f"loaded {got} of {blocks.n} blocks")
        after = cache.stats
        read = after["read_bytes"] - before["read_bytes"]
        needed = after["needed_bytes"] - before["needed_bytes"]
        return {"amplification": read / needed,
                "control_calls": after["control_calls"] - before["control_calls"]}
    return run


def fio_read(blocks: Blocks, threads: int, work: str) -> Callable[[], dict[str, Any]]:
    """One fio job per thread, each reading its share of the block files (hard links to them
    in a directory of its own: fio's file list is limited to 4096 characters)."""
    base = os.path.join(work, f"fio-{blocks.payload // MiB}-{threads}")
    lines = ["[global]", "rw=read", "bs=1M", "ioengine=psync", "direct=0", "invalidate=0",
             "group_reporting=1", "file_service_type=sequential", ""]
    for t in range(threads):
        share = blocks.paths[t::threads]
        if not share:
            continue
        d = os.path.join(base, str(t))
        os.makedirs(d)
        for i, p in enumerate(share):
            os.link(p, os.path.join(d, f"{i:05d}.kv"))
        lines += [f"[j{t}]", f"opendir={d}", ""]
    jobfile = base + ".ini"
    with open(jobfile, "w") as f:
        f.write("\n".join(lines))

    def run() -> dict[str, Any]:
        res = subprocess.run(["fio", "--output-format=json", jobfile], capture_output=True,
                             text=True)
        if res.returncode != 0:
            raise RuntimeError(f"fio failed: {res.stderr.strip()[:300]}")
        data = json.loads(res.stdout[res.stdout.index("{"):])
        rd = data["jobs"][0]["read"]
        return {"seconds": rd["io_bytes"] / rd["bw_bytes"], "io_bytes": rd["io_bytes"]}
    return run


def measure_row(runs: dict[str, Callable[[], dict[str, Any]]], repeats: int, cold: bool,
                daemon_pid: int) -> dict[str, dict[str, Any]]:
    """Every method ``repeats`` times, interleaved: round r runs each method once (in an order
    rotated by r), so that a change in the machine's load hits them all alike. Cold: caches
    dropped before each run; warm: after one untimed run of each method. A method's ``x_raw``
    is the median over rounds of raw's time / its time in the same round."""
    names = list(runs)
    if not cold:
        for name in names:
            runs[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    extra: dict[str, dict[str, Any]] = {}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            if cold:
                drop_caches(daemon_pid)
            t = time.perf_counter()
            extra[name] = runs[name]()
            dt = time.perf_counter() - t
            times[name].append(extra[name].pop("seconds", dt))
    return {name: {"seconds": median(ts), "runs": ts,
                   "x_raw": median([a / b for a, b in zip(times["raw"], ts, strict=True)]),
                   **extra[name]} for name, ts in times.items()}


def bench_size(args: argparse.Namespace, mount: Mount, work: str, block_mib: int
               ) -> dict[str, Any]:
    t = time.perf_counter()
    blocks = Blocks(mount, work, block_mib, args.total_mib)
    log(f"{block_mib} MiB blocks: {blocks.n} blocks ({blocks.total_payload / 2**30:.2f} GiB of "
        f"KV, {blocks.spec.block_size} tokens each), and as many torch.save files, written in "
        f"{time.perf_counter() - t:.1f} s")
    results: list[dict[str, Any]] = []
    fio = shutil.which("fio") is not None and not args.no_fio
    states = (["cold"] if args.cold else []) + ["warm"]
    try:
        for state in states:
            for threads in args.threads:
                pool = ThreadPoolExecutor(threads)
                caches = {
                    "direct": KVCache.open(mount.mnt, tenant=TENANT, spec=blocks.spec,
                                           direct=True, io="posix", threads=threads),
                    "direct-sampled": KVCache.open(mount.mnt, tenant=TENANT, spec=blocks.spec,
                                                   direct=True, io="posix", threads=threads,
                                                   verify="sampled"),
                    "mount": KVCache.open(mount.mnt, tenant=TENANT, spec=blocks.spec,
                                          direct=False, io="posix", threads=threads),
                }
                runs: dict[str, Callable[[], dict[str, Any]]] = {
                    "raw": raw_read(blocks, pool),
                    **{k: cache_read(blocks, c) for k, c in caches.items()},
                    "torch.load": torch_read(blocks, pool),
                }
                if fio:
                    runs["fio"] = fio_read(blocks, threads, work)
                try:
                    row = measure_row({m: runs[m] for m in METHODS if m in runs}, args.repeats,
                                      state == "cold", mount.pid)
                finally:
                    pool.shutdown()
                    for c in caches.values():
                        c.close()
                    shutil.rmtree(os.path.join(work, f"fio-{block_mib}-{threads}"),
                                  ignore_errors=True)
                    if os.path.exists(os.path.join(work, f"fio-{block_mib}-{threads}.ini")):
                        os.unlink(os.path.join(work, f"fio-{block_mib}-{threads}.ini"))
                load = round(os.getloadavg()[0], 2)
                for method, r in row.items():
                    r["gbps"] = blocks.total_payload / r["seconds"] / 1e9
                    results.append({"block_mib": block_mib, "threads": threads, "cache": state,
                                    "method": method, "blocks": blocks.n, "loadavg": load, **r})
                log(f"  {block_mib:>2} MiB  {threads} thr  {state}: " + "  ".join(
                    f"{m} {r['gbps']:.2f}" for m, r in row.items()) + f" GB/s (load {load})")
    finally:
        blocks.remove()
    return {"block_mib": block_mib, "blocks": blocks.n, "block_tokens": blocks.spec.block_size,
            "file_bytes": blocks.file_bytes, "results": results}


# -- the control plane ---------------------------------------------------------------------------


def timed(fn: Callable[[], Any], n: int) -> list[float]:
    """Milliseconds of each of ``n`` calls, after min(20, n) untimed ones."""
    for _ in range(min(20, n)):
        fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1000)
    return ts


def bench_control(args: argparse.Namespace, mount: Mount, work: str) -> dict[str, Any]:
    """A 64-block request with ~0 payload: what it costs beyond moving bytes."""
    spec = ModelSpec(model="bench/control", revision="r1", kv_dtype="float32", block_size=1,
                     num_layers=1, num_kv_heads=1, head_dim=1)  # 8 bytes of KV per block
    out: dict[str, Any] = {"blocks": CONTROL_BLOCKS, "payload_bytes": spec.block_payload_bytes}
    n_req = args.control_requests
    with KVCache.open(mount.mnt, tenant=TENANT, spec=spec, direct=True, io="posix") as cache:
        hashes = cache.block_hashes(list(range(CONTROL_BLOCKS)))
        cache.save(hashes, torch.zeros((CONTROL_BLOCKS, *spec.block_shape)))
        dest = torch.zeros((CONTROL_BLOCKS, *spec.block_shape))
        paths = [cache.path(h) for h in hashes]
        size = os.path.getsize(paths[0])
        buf = torch.zeros(CONTROL_BLOCKS * size, dtype=torch.uint8)
        views = [host_view(buf[i * size:(i + 1) * size]) for i in range(CONTROL_BLOCKS)]

        def request() -> None:
            n = cache.lookup(hashes)
            if cache.load(hashes[:n], dest) != CONTROL_BLOCKS:
                raise RuntimeError("control request missed")

        def raw() -> None:
            for p, v in zip(paths, views, strict=True):
                fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    preadv_all(fd, [v], 0)
                finally:
                    os.close(fd)

        empty = control.Access(lookups=0, hashes=()).pack()
        full = control.Access(lookups=0, hashes=tuple(hashes)).pack()

        def setxattr() -> None:
            os.setxattr(cache.ns_dir, control.ACCESS, empty)

        def setxattr64() -> None:
            os.setxattr(cache.ns_dir, control.ACCESS, full)

        before = cache.stats["control_calls"]
        req = timed(request, n_req)
        calls = (cache.stats["control_calls"] - before) / (n_req + min(20, n_req))
        lookup = timed(lambda: cache.lookup(hashes), n_req)
        load = timed(lambda: cache.load(hashes, dest), n_req)
        raw_ms = timed(raw, n_req)
        sx = timed(setxattr, n_req)
        sx64 = timed(setxattr64, n_req)
        amp = cache.stats["fetch_amplification"]
    p90 = sorted(req)[int(0.9 * len(req))]
    out["loadavg"] = round(os.getloadavg()[0], 2)
    out.update(request_ms=median(req), request_p90_ms=p90, lookup_ms=median(lookup),
               load_ms=median(load), raw_preadv_ms=median(raw_ms), setxattr_ms=median(sx),
               setxattr_64_ms=median(sx64),
               control_calls_per_request=calls, amplification=amp,
               overhead_ms=median(req) - median(raw_ms), requests=n_req)
    # Cross-check with real blocks: 64 x 1 MiB, warm, minus raw preadv of the same files.
    blocks1 = Blocks(mount, work, 1, CONTROL_BLOCKS)
    threads = max(args.threads)
    pool = ThreadPoolExecutor(threads)
    try:
        with KVCache.open(mount.mnt, tenant=TENANT, spec=blocks1.spec, direct=True, io="posix",
                          threads=threads) as cache:
            def request1() -> None:
                n = cache.lookup(blocks1.hashes)
                if cache.load(blocks1.hashes[:n], blocks1.out) != CONTROL_BLOCKS:
                    raise RuntimeError("1 MiB request missed")

            r1 = timed(request1, 15)
            r0 = timed(raw_read(blocks1, pool), 15)
        out["real_1mib"] = {"threads": threads, "request_ms": median(r1),
                            "raw_preadv_ms": median(r0), "overhead_ms": median(r1) - median(r0)}
    finally:
        pool.shutdown()
        blocks1.remove()
    return out


# -- report ----------------------------------------------------------------------------------------


def table(sizes: list[dict[str, Any]]) -> str:
    methods = [m for m in METHODS if any(r["method"] == m for s in sizes for r in s["results"])]
    head = f"{'block':>6} {'cache':<5} {'thr':>3} " + " ".join(f"{m:>16}" for m in methods)
    lines = [head, "-" * len(head)]
    for s in sizes:
        by = {(r["cache"], r["threads"], r["method"]): r for r in s["results"]}
        for state in ("cold", "warm"):
            for threads in sorted({r["threads"] for r in s["results"]}):
                cells = []
                for m in methods:
                    r = by.get((state, threads, m))
                    cells.append(f"{r['gbps']:6.2f} ({r['x_raw']:4.2f}x)" if r else f"{'-':>16}")
                if any(c.strip() != "-" for c in cells):
                    lines.append(f"{s['block_mib']:>4}Mi {state:<5} {threads:>3} "
                                 + " ".join(f"{c:>16}" for c in cells))
    return "\n".join(lines)


def verdicts(sizes: list[dict[str, Any]], ctl: dict[str, Any] | None) -> list[dict[str, Any]]:
    rows = [r for s in sizes for r in s["results"]]
    out = []
    direct = [r for r in rows if r["method"] == "direct"]
    if direct:
        worst = min(direct, key=lambda r: r["x_raw"])
        misses = [r for r in direct if r["x_raw"] < TARGET_DIRECT]
        out.append({"target": f"direct load >= {TARGET_DIRECT}x raw preadv (verify=full)",
                    "met": not misses, "worst": round(worst["x_raw"], 3),
                    "worst_at": f"{worst['block_mib']} MiB, {worst['threads']} threads, "
                                f"{worst['cache']}",
                    "median": round(median([r["x_raw"] for r in direct]), 3),
                    "missed": [f"{r['block_mib']} MiB/{r['threads']}thr/{r['cache']}: "
                               f"{r['x_raw']:.2f}x" for r in misses]})
    sampled = [r for r in rows if r["method"] == "direct-sampled"]
    if sampled:
        worst = min(sampled, key=lambda r: r["x_raw"])
        out.append({"target": f"direct load >= {TARGET_DIRECT}x raw preadv (verify=sampled)",
                    "met": worst["x_raw"] >= TARGET_DIRECT, "worst": round(worst["x_raw"], 3),
                    "worst_at": f"{worst['block_mib']} MiB, {worst['threads']} threads, "
                                f"{worst['cache']}",
                    "median": round(median([r["x_raw"] for r in sampled]), 3)})
    if ctl:
        out.append({"target": f"control overhead < {TARGET_CONTROL_MS} ms per "
                              f"{CONTROL_BLOCKS}-block request",
                    "met": ctl["overhead_ms"] < TARGET_CONTROL_MS,
                    "measured": round(ctl["overhead_ms"], 3),
                    "control_calls": ctl["control_calls_per_request"]})
    amps = [r["amplification"] for r in rows if "amplification" in r]
    if ctl:
        amps.append(ctl["amplification"])
    if amps:
        out.append({"target": "fetch amplification 1.00x", "met": max(amps) == 1.0,
                    "measured": round(max(amps), 4)})
    return out


def report(res: dict[str, Any]) -> str:
    lines = [f"conditions: {conditions_text(res['conditions'])}",
             f"command: {res['command']}"]
    if res["sizes"]:
        lines += ["", "GB/s of KV delivered (x raw preadv of the same files, same threads, "
                  "same run):", table(res["sizes"])]
    ctl = res.get("control")
    if ctl:
        lines += ["", f"control plane, {ctl['blocks']}-block request of {ctl['payload_bytes']}-"
                  f"byte blocks (median of {ctl['requests']}): lookup+load "
                  f"{ctl['request_ms']:.3f} ms (p90 {ctl['request_p90_ms']:.3f}); raw preadv "
                  f"of the same 64 files {ctl['raw_preadv_ms']:.3f} ms; overhead "
                  f"{ctl['overhead_ms']:.3f} ms; {ctl['control_calls_per_request']:g} control "
                  f"calls per request; one access setxattr: {ctl['setxattr_ms']:.3f} ms "
                  f"empty, {ctl['setxattr_64_ms']:.3f} ms with the 64 hashes; lookup "
                  f"{ctl['lookup_ms']:.3f} ms, load {ctl['load_ms']:.3f} ms; load average "
                  f"{ctl['loadavg']}"]
        r1 = ctl.get("real_1mib")
        if r1:
            lines.append(f"  cross-check, 64 x 1 MiB warm, {r1['threads']} threads: request "
                         f"{r1['request_ms']:.2f} ms - raw preadv {r1['raw_preadv_ms']:.2f} ms "
                         f"= {r1['overhead_ms']:.2f} ms")
    lines += ["", "targets:"]
    for v in res["verdicts"]:
        fig = v.get("measured", v.get("worst"))
        extra = f" (worst at {v['worst_at']}; median {v['median']}x)" if "worst_at" in v else ""
        lines.append(f"  [{'met' if v['met'] else 'MISSED'}] {v['target']}: {fig}{extra}")
    return "\n".join(lines)


# -- main ----------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", help="where the temporary work directory goes; its filesystem is "
                   "the one measured (default: the current working directory's)")
    p.add_argument("--sizes", default="1,4,16,64", help="block sizes in MiB (1,4,16,64)")
    p.add_argument("--threads", default="1,2,3,4", help="thread counts (1,2,3,4)")
    p.add_argument("--total-mib", type=int, default=1024,
                   help="KV bytes per block size, the same for all sizes (1024)")
    p.add_argument("--repeats", type=int, default=5, help="runs per figure; median (5)")
    p.add_argument("--control-requests", type=int, default=300,
                   help="64-block requests timed for the control overhead (300)")
    p.add_argument("--no-cold", dest="cold", action="store_false",
                   help="skip the cold-cache figures")
    p.add_argument("--no-fio", action="store_true", help="skip fio")
    p.add_argument("--control-only", action="store_true",
                   help="only the control-plane figures (no block sizes)")
    p.add_argument("--quick", action="store_true", help="a smoke run: small, few repeats")
    p.add_argument("--json", metavar="OUT", help="write every figure and the conditions here")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    return p


def _stop(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally blocks: unmount, clean up


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.getLogger("kvfs").setLevel(logging.ERROR)  # "through the mount (slower)" is known
    signal.signal(signal.SIGTERM, _stop)
    if args.quick:
        args.sizes, args.threads = "1,16", "1,4"
        args.total_mib = min(args.total_mib, 64)
        args.repeats = 1
        args.control_requests = min(args.control_requests, 50)
    args.sizes = [int(x) for x in str(args.sizes).split(",") if x]
    args.threads = [int(x) for x in str(args.threads).split(",") if x]
    if not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None:
        print("bench_restore: needs /dev/fuse and fusermount3", file=sys.stderr)
        return 2
    if args.cold and not can_drop_caches():
        log("not root: no cold-cache figures (dropping the page cache needs root)")
        args.cold = False
    base = os.path.abspath(args.dir or os.getcwd())
    work = tempfile.mkdtemp(prefix=".kvfs-bench-restore-", dir=base)
    os.chmod(work, 0o755)
    mount = Mount(work)
    command = "python tools/bench_restore.py " + " ".join(argv if argv is not None
                                                          else sys.argv[1:])
    res: dict[str, Any] = {"command": command.strip(), "conditions": conditions(work),
                           "params": {k: v for k, v in vars(args).items()
                                      if k not in ("json", "keep", "dir")},
                           "sizes": []}
    log(f"conditions: {conditions_text(res['conditions'])}")
    try:
        mount.start()
        for size in [] if args.control_only else args.sizes:
            res["sizes"].append(bench_size(args, mount, work, size))
        log("control plane")
        res["control"] = bench_control(args, mount, work)
    finally:
        mount.stop()
        if mount.tracebacks():
            log(f"WARNING: the daemon logged a traceback: see {mount.log}")
            args.keep = True
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    res["conditions"]["other_busy_cpus_after"] = busy_cpus()
    res["conditions"]["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    res["verdicts"] = verdicts(res["sizes"], res.get("control"))
    print()
    print(report(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
