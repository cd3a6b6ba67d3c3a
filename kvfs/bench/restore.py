"""`kvfs bench restore`: restoring KV blocks with the kvfs client, against this machine's limit.

The same block files, written once through :class:`kvfs.KVCache` into a kvfs mount over a
directory of the filesystem measured (``--dir``), are read for each block size (``--sizes``,
MiB), thread count (``--threads``) and page-cache state (cold: ``sync; echo 3 >
/proc/sys/vm/drop_caches`` before every run, as root; warm: after one untimed run), by:

- ``raw``: threaded ``os.preadv`` of each whole block file into its own slice of one
  preallocated buffer (each thread, the caller included, takes the next file): the limit of
  this machine for this job, and the baseline of every ratio;
- ``raw+xxh3``: the same, and each thread hashes each file's bytes with one ``xxh3_64`` pass
  over the buffer right after reading them: the honest baseline of a verified read, which
  the direct paths are also compared with (``x_raw_xxh3``);
- ``fio``: buffered sequential reads of the same files (psync, 1 MiB requests, one job per
  thread, each its share of the files), where fio is installed; throughput only;
- ``direct``: ``KVCache.load`` on the direct path (POSIX transport), ``verify="full"`` (the
  default: every payload checksummed) and ``direct-sampled`` (``verify="sampled"``);
- ``mount``: the same load through the mount (``direct=False``);
- ``torch.load``: the naive alternative, one ``torch.save`` file per block (same KV),
  loaded and copied into the same preallocated tensor.

A run reads every block once, as requests of ``--request-mib`` of KV each (one engine
request restoring that much prefix), one after the other; latency is per request (p50, p99
over every request of every run). GB/s is KV payload (the 4 KiB header is read but not
counted) per second of wall time, the median run (``--repeats`` runs cold, each after a
cache drop; ``--warm-repeats`` warm, which are short); ``x_raw`` is the median over runs of
raw's time divided by the path's. A ``KVCache`` path's time is its loads' (reading its
counters after the last one waits for the access records to reach the daemon, which an engine
does not). Runs are interleaved (round r runs each path once, in an order rotated by r), so
the load of other processes weighs on all paths alike; warm, each run of a path is paired with
a raw run right beside it (so raw runs once per other path and round), and the ratio is that
pair's (``x_raw_runs``: every pair's).

The targets (the record's verdicts, every cell): ``verify="full"`` warm >= 0.9x
``raw+xxh3``, cold >= 0.95x raw; ``verify="sampled"`` warm >= 0.95x raw; the control overhead
below; fetch amplification 1.00x. Beside each wall-time ratio, the same pairs give one in CPU
time (``cpu_x_raw``, ``cpu_x_raw_xxh3``: this process's CPU seconds, all threads, kernel
time included; not for fio and the mount, whose work other processes do), which the load of
other processes on a shared machine moves far less than wall time.

Warm, checksumming is CPU that raw ``preadv`` does not spend: the record states what it
allows. After each round, xxh3_64 is timed over cached bytes (as many threads as the cell,
each hashing one :data:`kvfs.transport.HASH_PIECE` buffer over and over; the median over
rounds), and each direct row gets ``checksummed_fraction`` f (1 for ``verify="full"``; for
"sampled", the share of these very blocks that the sample picks), ``copy_gbps`` (raw's GB/s),
``hash_gbps`` and ``bound_x_raw`` = 1 / (1 + f * copy / hash): the ratio a load would reach if
hashing were the only thing it did beyond raw's copy, on cores the copy already keeps busy.
The verdicts give the median bound and the median fraction of it reached; the record's notes
(rendered by `kvfs bench report`) list them per cell.

Then the control plane: ``--control-requests`` requests (``lookup`` + ``load``) of 64 blocks
that carry 8 bytes of KV each, against raw ``preadv`` of the same 64 files: what a request
costs beyond moving its bytes; the control calls (setxattrs through the mount) per request;
one access setxattr alone. Fetch amplification (bytes read / bytes of the blocks loaded) is
the client's own count (``cache.stats``) over each path's loads.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

from .common import (
    DROP_CACHES,
    busy_cpus,
    can_drop_caches,
    conditions,
    first_line,
    read_text,
)

MiB = 1 << 20
TENANT = "bench"
KVFS = [sys.executable, "-m", "kvfs.cli"]
#: KV of a Llama-3-8B-shaped model: 32 layers, 8 KV heads of 128, bfloat16: 128 KiB per token.
LAYERS, KV_HEADS, HEAD_DIM = 32, 8, 128
TOKEN_BYTES = LAYERS * 2 * KV_HEADS * HEAD_DIM * 2
PATHS = ("raw", "raw+xxh3", "fio", "direct", "direct-sampled", "mount", "torch.load")
#: The honest baseline of a verified read: raw preadv, then one xxh3_64 pass over the bytes.
VERIFIED = "raw+xxh3"
#: Targets: full verification, warm, against VERIFIED; full, cold, and sampled, warm, against
#: raw preadv (cold, the disk is the limit; sampled hashes one block in 8).
TARGET_X_VERIFIED = 0.9
TARGET_X_RAW_COLD = 0.95
TARGET_X_RAW_SAMPLED = 0.95
TARGET_CONTROL_MS = 1.0  # per 64-block lookup + load
CONTROL_BLOCKS = 64


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def percentile(xs: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` percentile."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


# -- conditions and the page cache -------------------------------------------------------------


def _cpu_ticks(pid: int) -> int:
    fields = read_text(f"/proc/{pid}/stat").rsplit(")", 1)[-1].split()
    return int(fields[11]) + int(fields[12]) if len(fields) > 12 else 0


def drop_caches(daemon_pid: int) -> None:
    """``sync; echo 3 > drop_caches``, then wait until the daemon has handled the FORGETs
    that dropping the kernel's inodes sends it."""
    os.sync()
    with open(DROP_CACHES, "w") as f:
        f.write("3")
    last, t = _cpu_ticks(daemon_pid), time.monotonic()
    while time.monotonic() - t < 30:
        time.sleep(0.1)
        now = _cpu_ticks(daemon_pid)
        if now == last:
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
        return "Traceback" in read_text(self.log)


# -- one block size ----------------------------------------------------------------------------


def spec_for(block_mib: int) -> Any:
    from ..hashing import ModelSpec  # noqa: PLC0415

    return ModelSpec(model="bench/llama-3-8b-shape", revision="r1", kv_dtype="bfloat16",
                     block_size=max(1, block_mib * MiB // TOKEN_BYTES), num_layers=LAYERS,
                     num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)


class Blocks:
    """The blocks of one block size: written once, read by every path."""

    def __init__(self, mount: Mount, work: str, block_mib: int, total_mib: int,
                 request_mib: int) -> None:
        import torch  # noqa: PLC0415 - the client side

        from ..client import KVCache  # noqa: PLC0415
        from ..transport import host_view  # noqa: PLC0415

        self.spec = spec_for(block_mib)
        self.block_mib = block_mib
        self.n = max(1, total_mib // block_mib)
        self.per_request = max(1, request_mib // block_mib)
        self.payload = self.spec.block_payload_bytes
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
        view = host_view(self.raw_buf)
        self.raw_views = [view[i * self.file_bytes:(i + 1) * self.file_bytes]
                          for i in range(self.n)]

    def torch_path(self, i: int) -> str:
        return os.path.join(self.torch_dir, f"{i:05d}.pt")

    def requests(self) -> list[range]:
        k = self.per_request
        return [range(a, min(self.n, a + k)) for a in range(0, self.n, k)]

    @property
    def total_payload(self) -> int:
        return self.n * self.payload

    def remove(self) -> None:
        import torch  # noqa: PLC0415

        shutil.rmtree(self.torch_dir, ignore_errors=True)
        self.raw_views = []
        self.out = self.raw_buf = torch.empty(0)


#: A path's run: the latency of each request, and what else it measured.
Run = Callable[[], tuple[list[float], dict[str, Any]]]


def _by_request(blocks: Blocks, one: Callable[[range], None]) -> Run:
    def run() -> tuple[list[float], dict[str, Any]]:
        lat = []
        t0 = time.perf_counter()
        for req in blocks.requests():
            t = time.perf_counter()
            one(req)
            lat.append(time.perf_counter() - t)
        return lat, {"seconds": time.perf_counter() - t0}
    return run


def raw_read(blocks: Blocks, pool: ThreadPoolExecutor, threads: int) -> Run:
    """Each of ``threads`` threads (the caller and ``threads - 1`` of the pool) takes the next
    file of the request: open, one preadv of the whole file, close."""
    return _threaded_read(blocks, pool, threads, hashed=False)


def verified_read(blocks: Blocks, pool: ThreadPoolExecutor, threads: int) -> Run:
    """The honest baseline of a verified read: as :func:`raw_read`, and each thread hashes
    each file's bytes with one xxh3_64 pass over the buffer it read them into, right after
    the read (while they may still be in its core's cache)."""
    return _threaded_read(blocks, pool, threads, hashed=True)


def _threaded_read(blocks: Blocks, pool: ThreadPoolExecutor, threads: int, *, hashed: bool
                   ) -> Run:
    import xxhash  # noqa: PLC0415

    from ..transport import preadv_all  # noqa: PLC0415

    def read(i: int) -> None:
        fd = os.open(blocks.paths[i], os.O_RDONLY | os.O_CLOEXEC)
        try:
            if preadv_all(fd, [blocks.raw_views[i]], 0) != blocks.file_bytes:
                raise OSError(f"{blocks.paths[i]}: short read")
        finally:
            os.close(fd)
        if hashed:
            xxhash.xxh3_64_intdigest(blocks.raw_views[i])

    def one(req: range) -> None:
        todo = iter(req)

        def work() -> None:
            for i in todo:
                read(i)

        futures = [pool.submit(work) for _ in range(min(threads, len(req)) - 1)]
        try:
            work()
        finally:
            wait(futures)
        for f in futures:
            f.result()
    return _by_request(blocks, one)


#: Paths whose work is partly done by other processes (fio's jobs, the daemon serving the mount):
#: this process's CPU time does not say what they cost, so they get no CPU ratio.
NO_CPU = ("fio", "mount")


def ratio_key(path: str) -> str:
    """The row key of a path's ratio to baseline ``path``: x_raw, x_raw_xxh3."""
    return "x_" + path.replace("+", "_")


def torch_read(blocks: Blocks, pool: ThreadPoolExecutor) -> Run:
    import torch  # noqa: PLC0415

    def read(i: int) -> None:
        blocks.out[i].copy_(torch.load(blocks.torch_path(i), weights_only=True))

    return _by_request(blocks, lambda req: list(pool.map(read, req)))


def cache_read(blocks: Blocks, cache: Any) -> Run:
    """The run's time is its loads' only: reading the counters (before the first load and
    after the last) waits until the control thread has sent the access records queued so
    far, a wait that an engine does not have (the records leave the request's path; see
    :mod:`kvfs.client`). The daemon's work on the records sent during the run still weighs
    on it, as it would on an engine's."""
    def run() -> tuple[list[float], dict[str, Any]]:
        before = cache.stats
        lat = []
        t0 = time.perf_counter()
        for req in blocks.requests():
            t = time.perf_counter()
            got = cache.load(blocks.hashes[req.start:req.stop], blocks.out[req.start:req.stop])
            lat.append(time.perf_counter() - t)
            if got != len(req):
                raise RuntimeError(f"loaded {got} of {len(req)} blocks")
        seconds = time.perf_counter() - t0
        after = cache.stats
        read = after["read_bytes"] - before["read_bytes"]
        needed = after["needed_bytes"] - before["needed_bytes"]
        return lat, {"seconds": seconds, "amplification": read / needed,
                     "control_calls_per_request":
                         (after["control_calls"] - before["control_calls"]) / len(lat)}
    return run


def fio_read(blocks: Blocks, threads: int, work: str) -> Run:
    """One fio job per thread, each reading its share of the block files (hard links to them
    in a directory of its own: fio's file list is limited to 4096 characters)."""
    base = os.path.join(work, f"fio-{blocks.block_mib}-{threads}")
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
    with open(base + ".ini", "w") as f:
        f.write("\n".join(lines))

    def run() -> tuple[list[float], dict[str, Any]]:
        res = subprocess.run(["fio", "--output-format=json", base + ".ini"],
                             capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"fio failed: {res.stderr.strip()[:300]}")
        rd = json.loads(res.stdout[res.stdout.index("{"):])["jobs"][0]["read"]
        return [], {"seconds": rd["io_bytes"] / rd["bw_bytes"]}
    return run


def measure(runs: dict[str, Run], repeats: int, cold: bool, daemon_pid: int,
            between: Callable[[], None] | None = None,
            pairs: dict[str, Sequence[str]] | None = None) -> dict[str, dict[str, Any]]:
    """Every path ``repeats`` times, interleaved (round r runs each once, in an order rotated
    by r). Cold: caches dropped before each run, and a path's ratio to raw pairs the runs of
    one round. Warm (after one untimed run of each): each run of a path other than raw is
    paired with a raw run right beside it (before it in one round, after it in the next), so
    a ratio compares two runs a few milliseconds apart, never runs that the other paths'
    runs (and whatever else the machine did meanwhile) separate. ``pairs`` names, for some
    paths, other paths they are also compared with (row key ``x_<other>``): cold, the runs
    of one round; warm, one more run of the other right beside each run (raw on one side,
    the other on the other side, swapped from one round to the next). ``between`` (if given)
    is called after each round: a measurement taken in the same conditions as the runs."""
    names = list(runs)
    pairs = {k: [b for b in v if b in runs] for k, v in (pairs or {}).items() if k in runs}
    if not cold:
        for name in names:
            runs[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    # The baselines' times beside each run of a path: raw's, and the others' it is paired with.
    paired: dict[str, dict[str, list[float]]] = {
        name: {b: [] for b in ["raw", *pairs.get(name, ())]} for name in names}
    lat: dict[str, list[float]] = {name: [] for name in names}
    extra: dict[str, dict[str, Any]] = {}
    # CPU seconds of this process (all its threads, kernel time included) per run, and the
    # baselines' beside each run: what a run costs, which other processes move far less
    # than its wall time on a shared machine.
    cpu: dict[str, list[float]] = {name: [] for name in names}
    cpu_paired: dict[str, dict[str, list[float]]] = {
        name: {b: [] for b in paired[name]} for name in names}
    last_cpu: dict[str, float] = {}

    def once(name: str, own: bool = True) -> float:
        """Run ``name``; ``own``: as itself (its row counts the run), not as another path's
        baseline (raw's row counts every run of raw)."""
        if cold:
            drop_caches(daemon_pid)
        t, c = time.perf_counter(), time.process_time()
        got, more = runs[name]()
        dt = time.perf_counter() - t
        last_cpu[name] = time.process_time() - c
        dt = more.pop("seconds", dt)
        if own or name == "raw":
            extra[name] = more
            times[name].append(dt)
            cpu[name].append(last_cpu[name])
            lat[name] += got
        return float(dt)

    for r in range(repeats):
        order = names[r % len(names):] + names[:r % len(names)]
        if cold:
            for name in order:
                once(name)
            for name in names:
                for b, ts in paired[name].items():
                    ts.append(times[b][-1])
                    cpu_paired[name][b].append(cpu[b][-1])
        else:
            for k, name in enumerate(o for o in order if o != "raw"):
                base = list(paired[name])  # raw first
                even = (r + k) % 2 == 0
                seq = base if even else base[::-1]
                cut = (len(seq) + 1) // 2 if even else len(seq) // 2
                for b in seq[:cut]:
                    paired[name][b].append(once(b, own=False))
                    cpu_paired[name][b].append(last_cpu[b])
                once(name)
                for b in seq[cut:]:
                    paired[name][b].append(once(b, own=False))
                    cpu_paired[name][b].append(last_cpu[b])
            if len(names) == 1:  # raw alone
                once("raw")
        if between is not None:
            between()
    out = {}
    for name, ts in times.items():
        row: dict[str, Any] = {}
        for b, bts in paired[name].items():
            ratios = [1.0] if name == b else [a / t for a, t in zip(bts, ts, strict=True)]
            key = ratio_key(b)
            row[key] = median(ratios)
            row[f"{key}_runs"] = [round(x, 3) for x in ratios]  # how much the pairs disagree
            if name != b and name not in NO_CPU:
                row[f"cpu_{key}"] = median([a / t for a, t in zip(
                    cpu_paired[name][b], cpu[name], strict=True) if t > 0] or [0.0])
        row.update({
            "p50_ms": percentile(lat[name], 50) * 1e3 if lat[name] else None,
            "p99_ms": percentile(lat[name], 99) * 1e3 if lat[name] else None,
            "requests": len(lat[name]), "runs": len(ts), "seconds": median(ts), **extra[name]})
        out[name] = row
    return out


def hash_rate(threads: int, trials: int = 5, per_thread: int = 64 * MiB) -> float:
    """GB/s of xxh3_64 over bytes in the CPU's cache, as the full verification hashes them:
    ``threads`` threads at once, each updating one streaming digest with its own buffer of
    :data:`kvfs.transport.HASH_PIECE` bytes, ``per_thread`` bytes in all; the median of
    ``trials`` trials."""
    import xxhash  # noqa: PLC0415

    from ..transport import HASH_PIECE  # noqa: PLC0415

    bufs = [bytearray(os.urandom(HASH_PIECE)) for _ in range(threads)]
    count = max(1, per_thread // HASH_PIECE)

    def work(buf: bytearray) -> int:
        x = xxhash.xxh3_64()
        for _ in range(count):
            x.update(buf)
        return x.intdigest()

    rates = []
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(trials):
            t = time.perf_counter()
            list(pool.map(work, bufs))
            rates.append(threads * count * HASH_PIECE / (time.perf_counter() - t) / 1e9)
    return median(rates)


def verify_bound(copy_gbps: float, hash_gbps: float, fraction: float = 1.0) -> float:
    """The best ratio to an unverified copy that a load can reach when it hashes ``fraction``
    of the bytes it copies, on CPUs that both the copy and the hash keep busy (a warm page
    cache): each byte costs 1/copy + fraction/hash seconds per GB instead of 1/copy."""
    return 1.0 / (1.0 + fraction * copy_gbps / hash_gbps)


def bench_size(args: Any, mount: Mount, work: str, block_mib: int) -> list[dict[str, Any]]:
    from ..client import KVCache  # noqa: PLC0415

    t = time.perf_counter()
    blocks = Blocks(mount, work, block_mib, args.total_mib, args.request_mib)
    _log(f"{block_mib} MiB blocks: {blocks.n} ({blocks.total_payload / 2**30:.2f} GiB of KV, "
         f"{blocks.spec.block_size} tokens each, {blocks.per_request} per request), and as "
         f"many torch.save files, written in {time.perf_counter() - t:.1f} s")
    rows: list[dict[str, Any]] = []
    chosen = {"raw", *(getattr(args, "paths", None) or PATHS)}
    if chosen & {"direct", "direct-sampled"}:
        chosen.add(VERIFIED)  # their baseline
    fio = shutil.which("fio") is not None and args.fio and "fio" in chosen
    try:
        for state in (["cold"] if args.cold else []) + ["warm"]:
            for threads in args.threads:
                pool = ThreadPoolExecutor(max(1, threads))
                opts = {"tenant": TENANT, "spec": blocks.spec, "io": "posix",
                        "threads": threads}
                caches = {
                    "direct": KVCache.open(mount.mnt, direct=True, **opts),
                    "direct-sampled": KVCache.open(mount.mnt, direct=True, verify="sampled",
                                                   **opts),
                    "mount": KVCache.open(mount.mnt, direct=False, **opts),
                }
                runs: dict[str, Run] = {
                    "raw": raw_read(blocks, pool, threads),
                    VERIFIED: verified_read(blocks, pool, threads),
                    **{k: cache_read(blocks, c) for k, c in caches.items()},
                    "torch.load": torch_read(blocks, pool),
                }
                if fio:
                    runs["fio"] = fio_read(blocks, threads, work)
                # Warm, xxh3's rate is measured after each round, as loaded as the runs.
                hash_rates: list[float] = []
                try:
                    got = measure({p: runs[p] for p in PATHS if p in runs and p in chosen},
                                  args.repeats if state == "cold" else args.warm_repeats,
                                  state == "cold", mount.pid,
                                  None if state == "cold" else
                                  lambda rates=hash_rates, t=threads: rates.append(
                                      hash_rate(t, trials=3)),
                                  pairs={p: [VERIFIED] for p in ("direct", "direct-sampled")})
                finally:
                    pool.shutdown()
                    for c in caches.values():
                        c.close()
                    shutil.rmtree(os.path.join(work, f"fio-{block_mib}-{threads}"),
                                  ignore_errors=True)
                    with_ini = os.path.join(work, f"fio-{block_mib}-{threads}.ini")
                    if os.path.exists(with_ini):
                        os.unlink(with_ini)
                load = round(os.getloadavg()[0], 2)
                vkey = ratio_key(VERIFIED)
                for r in got.values():
                    r["gbps"] = blocks.total_payload / r.pop("seconds") / 1e9
                if state == "warm":
                    # What checksumming may cost at best, measured now on the same threads.
                    hashed = {p: sum(map(c._checksummed, blocks.hashes)) / blocks.n
                              for p, c in caches.items() if p.startswith("direct")}
                    xxh3 = median(hash_rates)
                    copy = got["raw"]["gbps"]
                    for p, f in hashed.items():
                        if p in got:
                            got[p].update(checksummed_fraction=f, copy_gbps=copy,
                                          hash_gbps=xxh3,
                                          bound_x_raw=verify_bound(copy, xxh3, f))
                for path, r in got.items():
                    rows.append({"path": path, "block_mib": block_mib, "threads": threads,
                                 "cache": state, "blocks": blocks.n,
                                 "request_blocks": blocks.per_request, "loadavg": load, **r})
                _log(f"  {block_mib:>2} MiB {threads} thr {state}: " + "  ".join(
                    f"{p} {r['gbps']:.2f}" for p, r in got.items()) + f" GB/s (load {load})"
                    + "".join(f"; {p} {r['x_raw']:.2f}x raw, {r[vkey]:.2f}x {VERIFIED}"
                              for p, r in got.items() if vkey in r and p != VERIFIED))
    finally:
        blocks.remove()
    return rows


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


def _loop_cpu(pid: int | None) -> int | None:
    """CPU nanoseconds of a process's main thread (the daemon's event loop, where control
    calls are handled), or None where the kernel does not say."""
    fields = read_text(f"/proc/{pid}/schedstat").split() if pid else []
    return int(fields[0]) if fields else None


def bench_control(args: Any, mount: Mount) -> dict[str, Any]:
    """A 64-block request whose blocks carry 8 bytes of KV: what it costs beyond its bytes."""
    import torch  # noqa: PLC0415

    from .. import control  # noqa: PLC0415
    from ..client import KVCache  # noqa: PLC0415
    from ..hashing import ModelSpec  # noqa: PLC0415
    from ..transport import host_view, preadv_all  # noqa: PLC0415

    spec = ModelSpec(model="bench/control", revision="r1", kv_dtype="float32", block_size=1,
                     num_layers=1, num_kv_heads=1, head_dim=1)
    n_req = args.control_requests
    daemon_pid = mount.pid
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

        empty = control.Access(lookups=0).pack()
        full = control.Access(lookups=0, hashes=tuple(hashes)).pack()
        # Interleaved in rounds, so the machine's load weighs on both alike.
        req: list[float] = []
        raw_ms: list[float] = []
        calls0 = cache.stats["control_calls"]
        rounds = max(1, n_req // 50)
        for r in range(rounds):
            k = n_req // rounds + (r < n_req % rounds)
            req += timed(request, k)
            raw_ms += timed(raw, k)
        warmups = sum(min(20, n_req // rounds + (r < n_req % rounds)) for r in range(rounds))
        calls = (cache.stats["control_calls"] - calls0) / (n_req + warmups)
        # CPU time per request, which the load of other processes inflates less than wall
        # time: the client's (all its threads: the control thread's sends too), the
        # daemon's event loop's, and raw preadv's of the same files.
        cache.flush()
        cpu0, d0 = time.process_time(), _loop_cpu(daemon_pid)
        for _ in range(n_req):
            request()
        cache.flush()
        cpu_ms = (time.process_time() - cpu0) / n_req * 1e3
        daemon_ms = (_loop_cpu(daemon_pid) - d0) / n_req / 1e6 if d0 is not None else None
        cpu0 = time.process_time()
        for _ in range(n_req):
            raw()
        raw_cpu_ms = (time.process_time() - cpu0) / n_req * 1e3
        lookup = timed(lambda: cache.lookup(hashes), n_req)
        load = timed(lambda: cache.load(hashes, dest), n_req)
        sx = timed(lambda: os.setxattr(cache.ns_dir, control.ACCESS, empty), n_req)
        sx64 = timed(lambda: os.setxattr(cache.ns_dir, control.ACCESS, full), n_req)
        amp = cache.stats["fetch_amplification"]
    return {"blocks": CONTROL_BLOCKS, "payload_bytes": spec.block_payload_bytes,
            "requests": n_req, "loadavg": round(os.getloadavg()[0], 2),
            "request_ms": median(req), "request_p90_ms": percentile(req, 90),
            "request_p99_ms": percentile(req, 99),
            "raw_preadv_ms": median(raw_ms), "overhead_ms": median(req) - median(raw_ms),
            "client_cpu_ms": cpu_ms, "daemon_cpu_ms": daemon_ms, "raw_cpu_ms": raw_cpu_ms,
            "cpu_overhead_ms": (cpu_ms + (daemon_ms or 0.0) - raw_cpu_ms),
            "control_calls_per_request": calls,
            "lookup_ms": median(lookup), "load_ms": median(load),
            "setxattr_ms": median(sx), "setxattr_64_ms": median(sx64),
            "amplification": amp}


# -- record and table ----------------------------------------------------------------------------


#: The issue's targets: (path, cache state, baseline, least ratio in every cell).
TARGETS = (
    ("direct", "warm", VERIFIED, TARGET_X_VERIFIED),
    ("direct", "cold", "raw", TARGET_X_RAW_COLD),
    ("direct-sampled", "warm", "raw", TARGET_X_RAW_SAMPLED),
)


def verdicts(rows: list[dict[str, Any]], ctl: dict[str, Any] | None) -> list[dict[str, Any]]:
    out = []
    for path, cache, base, target in TARGETS:
        key = ratio_key(base)
        sel = [r for r in rows if r["path"] == path and r["cache"] == cache and key in r]
        if not sel:
            continue
        verify = "full" if path == "direct" else "sampled"
        what = "raw preadv + one xxh3_64 pass" if base == VERIFIED else "raw preadv"
        worst = min(sel, key=lambda r: r[key])
        v = {"target": f"direct load >= {target}x {what} (verify={verify}, {cache})",
             "met": worst[key] >= target, "worst": round(worst[key], 3),
             "worst_at": f"{worst['block_mib']} MiB, {worst['threads']} threads",
             "median": round(median([r[key] for r in sel]), 3)}
        cpus = [r[f"cpu_{key}"] for r in sel if f"cpu_{key}" in r]
        if cpus:  # the same ratio in CPU time, which other processes move less
            v["cpu_worst"], v["cpu_median"] = round(min(cpus), 3), round(median(cpus), 3)
        bounded = [r for r in sel if r.get("bound_x_raw")]
        if bounded and base == "raw":  # warm: the most that checksumming these bytes allows
            v["bound_median"] = round(median([r["bound_x_raw"] for r in bounded]), 3)
            v["of_bound_median"] = round(median(
                [r["x_raw"] / r["bound_x_raw"] for r in bounded]), 3)
        out.append(v)
    if ctl:
        out.append({"target": f"control overhead < {TARGET_CONTROL_MS} ms per "
                              f"{CONTROL_BLOCKS}-block lookup + load",
                    "met": ctl["overhead_ms"] < TARGET_CONTROL_MS,
                    "measured": round(ctl["overhead_ms"], 3)})
    amps = [r["amplification"] for r in rows if r.get("amplification") is not None]
    if ctl and ctl["amplification"] is not None:
        amps.append(ctl["amplification"])
    if amps:
        out.append({"target": "fetch amplification 1.00x", "met": max(amps) == 1.0,
                    "measured": round(max(amps), 4)})
    return out


def table(record: dict[str, Any]) -> str:
    rows = record["rows"]
    paths = [p for p in PATHS if any(r["path"] == p for r in rows)]
    lines = []
    if rows:
        head = f"{'block':>6} {'cache':<5} {'thr':>3} " + " ".join(f"{p:>16}" for p in paths)
        lines += ["GB/s of KV delivered (x raw preadv of the same files, same threads, "
                  "same run); then p50 / p99 ms per request:", head, "-" * len(head)]
        by = {(r["block_mib"], r["cache"], r["threads"], r["path"]): r for r in rows}
        keys = sorted({(r["block_mib"], r["cache"] != "cold", r["threads"]) for r in rows})
        for mib, warm, thr in keys:
            state = "warm" if warm else "cold"
            cells, lats = [], []
            for p in paths:
                r = by.get((mib, state, thr, p))
                cells.append(f"{r['gbps']:6.2f} ({r['x_raw']:4.2f}x)" if r else "-")
                lats.append(f"{r['p50_ms']:7.1f}/{r['p99_ms']:<7.1f}"
                            if r and r["p50_ms"] is not None else "-")
            lines.append(f"{mib:>4}Mi {state:<5} {thr:>3} " + " ".join(f"{c:>16}" for c in cells))
            lines.append(f"{'':>16}" + " ".join(f"{c:>16}" for c in lats))
    key = ratio_key(VERIFIED)
    against = sorted((r for r in rows if key in r and r["path"] != VERIFIED),
                     key=lambda r: (r["block_mib"], r["cache"] != "cold", r["threads"], r["path"]))
    if against:
        lines += ["", f"against the verified-read baseline ({VERIFIED}: raw preadv, then one "
                  "xxh3_64 pass over each file's bytes in the same thread), same run:"]
        for r in against:
            cpu = (f"; CPU time {r['cpu_' + key]:.2f}x {VERIFIED}, {r['cpu_x_raw']:.2f}x raw"
                   if "cpu_" + key in r else "")
            lines.append(f"  {r['block_mib']:>4}Mi {r['cache']:<5} {r['threads']:>3} thr "
                         f"{r['path']:<15} {r[key]:.2f}x {VERIFIED}, {r['x_raw']:.2f}x raw{cpu}")
    bounded = sorted((r for r in rows if r.get("bound_x_raw")),
                     key=lambda r: (r["block_mib"], r["threads"], r["path"]))
    if bounded:
        lines += ["", "what checksumming allows (warm): bound = 1 / (1 + f * copy / hash), f the "
                  "fraction of bytes checksummed, copy raw preadv's GB/s, hash xxh3_64's GB/s "
                  "over cached bytes on as many threads, both measured in this run:"]
        for r in bounded:
            lines.append(
                f"  {r['block_mib']:>4}Mi {r['threads']:>3} thr {r['path']:<15} f "
                f"{r['checksummed_fraction']:.3f}  copy {r['copy_gbps']:5.2f}  hash "
                f"{r['hash_gbps']:5.2f}  bound {r['bound_x_raw']:.2f}x  measured "
                f"{r['x_raw']:.2f}x ({r['x_raw'] / r['bound_x_raw']:.2f} of the bound)")
    ctl = record.get("control")
    if ctl:
        lines += ["", f"control plane, {ctl['blocks']}-block lookup + load of "
                  f"{ctl['payload_bytes']}-byte blocks (median of {ctl['requests']}): "
                  f"{ctl['request_ms']:.3f} ms (p99 {ctl['request_p99_ms']:.3f}) against "
                  f"{ctl['raw_preadv_ms']:.3f} ms of raw preadv of the same files: overhead "
                  f"{ctl['overhead_ms']:.3f} ms; CPU per request: client "
                  f"{ctl['client_cpu_ms']:.3f} ms + daemon {ctl['daemon_cpu_ms'] or 0:.3f} ms "
                  f"- raw preadv {ctl['raw_cpu_ms']:.3f} ms = {ctl['cpu_overhead_ms']:.3f} ms; "
                  f"{ctl['control_calls_per_request']:g} control calls per request; one access "
                  f"setxattr {ctl['setxattr_ms']:.3f} ms empty, "
                  f"{ctl['setxattr_64_ms']:.3f} ms with 64 hashes; load average "
                  f"{ctl['loadavg']}"]
    lines += ["", "targets:"]
    for v in record["verdicts"]:
        fig = v.get("measured", v.get("worst"))
        extra = f" (worst at {v['worst_at']}; median {v['median']}x" if "worst_at" in v else ""
        if "cpu_median" in v:
            extra += f"; in CPU time worst {v['cpu_worst']}x, median {v['cpu_median']}x"
        if "bound_median" in v:
            extra += (f"; bound for this verification {v['bound_median']}x, reached "
                      f"{v['of_bound_median']} of it")
        extra += ")" if extra else ""
        lines.append(f"  [{'met' if v['met'] else 'MISSED'}] {v['target']}: {fig}{extra}")
    c = record["conditions"]
    lines += ["", f"conditions: {c['cpu']}, {c['cores']} cores, {c['memory_gib']} GiB, load "
              f"average {c['load_average'][0]:.2f} before, {c['load_average_after'][0]:.2f} "
              f"after; other processes kept {c['other_busy_cpus_before']} CPUs busy before"]
    return "\n".join(lines)


def _commit() -> str | None:
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if not os.path.isdir(os.path.join(here, ".git")):
        return None
    return first_line(["git", "-C", here, "rev-parse", "--short", "HEAD"])


def run(args: Any) -> dict[str, Any]:
    """The whole benchmark; returns the record."""
    if args.cold and not can_drop_caches():
        _log("not root: no cold-cache figures (dropping the page cache needs root)")
        args.cold = False
    work = tempfile.mkdtemp(prefix=".kvfs-bench-restore-", dir=os.path.abspath(args.dir))
    os.chmod(work, 0o755)
    cond = conditions([work])
    # The work directory is temporary: name its filesystem, not its path.
    cond["filesystems"] = {"work": cond["filesystems"][work]}
    cond.update(root=os.getuid() == 0, cold_cache=args.cold, kvfs_commit=_commit(),
                fio=first_line(["fio", "--version"]) if shutil.which("fio") else None,
                other_busy_cpus_before=busy_cpus())
    params = {k: getattr(args, k, None) for k in (
        "sizes", "threads", "total_mib", "request_mib", "repeats", "warm_repeats",
        "control_requests", "cold", "fio", "paths")}
    record: dict[str, Any] = {"benchmark": "restore", "params": params, "conditions": cond,
                              "rows": [], "control": None}
    mount = Mount(work)
    keep = args.keep
    try:
        mount.start()
        if not args.control_only:
            for size in args.sizes:
                record["rows"] += bench_size(args, mount, work, size)
        if args.control_requests:
            _log("control plane")
            record["control"] = bench_control(args, mount)
    finally:
        mount.stop()
        if mount.tracebacks():
            _log(f"WARNING: the daemon logged a traceback: see {mount.log}")
            keep = True
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    cond["other_busy_cpus_after"] = busy_cpus()
    cond["load_average_after"] = os.getloadavg()
    record["verdicts"] = verdicts(record["rows"], record["control"])
    bound = bound_notes(record["rows"])
    if bound:
        record["notes"] = bound
    return record


def bound_notes(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown lines (the record's ``notes``, which `kvfs bench report` renders): each warm
    direct cell's ratio to raw beside the most that its checksumming allows."""
    bounded = sorted((r for r in rows if r.get("bound_x_raw")),
                     key=lambda r: (r["block_mib"], r["threads"], r["path"]))
    if not bounded:
        return []
    lines = ["What checksumming allows, warm: bound = 1 / (1 + f x copy / hash), where f is the "
             "fraction of the bytes checksummed, copy raw `preadv`'s GB/s and hash xxh3_64's "
             "GB/s over bytes in the CPU's cache on as many threads, both measured in this run; "
             "the ratio that a load would reach if hashing were all it did beyond raw's copy.",
             "", "| block | threads | verify | f | copy GB/s | hash GB/s | bound | measured "
             "| of the bound |", "|---|---|---|---|---|---|---|---|---|"]
    for r in bounded:
        verify = "full" if r["path"] == "direct" else "sampled"
        lines.append(f"| {r['block_mib']} MiB | {r['threads']} | {verify} | "
                     f"{r['checksummed_fraction']:.3f} | {r['copy_gbps']:.2f} | "
                     f"{r['hash_gbps']:.2f} | {r['bound_x_raw']:.2f}x | {r['x_raw']:.2f}x | "
                     f"{r['x_raw'] / r['bound_x_raw']:.2f} |")
    return lines


def command(argv: list[str]) -> list[str]:
    """How the record was made, as a reader would type it: the options after `restore`, with
    absolute paths (this machine's directories) replaced by their role."""
    rest = argv[argv.index("restore") + 1:] if "restore" in argv else argv[1:]
    out, role = ["kvfs", "bench", "restore"], {"--dir": "DIR", "--out": "OUT", "--json": "OUT"}
    for i, a in enumerate(rest):
        key, eq, value = a.partition("=")
        if key in role and eq and os.path.isabs(value):
            a = f"{key}={role[key]}"
        elif i and rest[i - 1] in role and os.path.isabs(a):
            a = role[rest[i - 1]]
        out.append(a)
    return out


def main(args: Any) -> int:
    import logging  # noqa: PLC0415

    from .common import finish  # noqa: PLC0415

    # The mount path is measured on purpose: its "through the mount (slower)" warning is known.
    logging.getLogger("kvfs.client").setLevel(logging.ERROR)
    if args.quick:
        args.sizes, args.threads = [1, 16], [1, 2]
        args.total_mib = min(args.total_mib, 64)
        args.repeats = args.warm_repeats = 1
        args.control_requests = min(args.control_requests, 50)
    record = run(args)
    record["command"] = command(list(sys.argv))
    return finish(record, args, table(record))
