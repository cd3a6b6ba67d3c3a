"""The measured paths of `kvfs bench restore` (:mod:`kvfs.bench.restore`): the blocks of one
size, each path's run (raw, raw+xxh3, fio, the kvfs client direct and through the mount,
torch.load), the interleaved measurement of the runs, what checksumming allows, and the
control plane's requests.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

from .harness import Mount, drop_caches, llama_spec, median, quantile, read_text

MiB = 1 << 20
TENANT = "bench"
#: KV of a Llama-3-8B-shaped model: 32 layers, 8 KV heads of 128, bfloat16: 128 KiB per token.
PATHS = ("raw", "raw+xxh3", "fio", "direct", "direct-sampled", "mount", "torch.load")
#: The honest baseline of a verified read: raw preadv, then one xxh3_64 pass over the bytes.
VERIFIED = "raw+xxh3"
CONTROL_BLOCKS = 64


# -- one block size ----------------------------------------------------------------------------


class Blocks:
    """The blocks of one block size: written once, read by every path."""

    def __init__(self, mount: Mount, work: str, block_mib: int, total_mib: int,
                 request_mib: int) -> None:
        import torch  # noqa: PLC0415 - the client side

        from ..client import KVCache  # noqa: PLC0415
        from ..client.transport import host_view  # noqa: PLC0415

        self.spec = llama_spec(block_mib)
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

    from ..client.transport import preadv_all  # noqa: PLC0415

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
            drop_caches(3, daemon_pid)
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
            "p50_ms": quantile(lat[name], 0.5) * 1e3 if lat[name] else None,
            "p99_ms": quantile(lat[name], 0.99) * 1e3 if lat[name] else None,
            "requests": len(lat[name]), "runs": len(ts), "seconds": median(ts), **extra[name]})
        out[name] = row
    return out


def hash_rate(threads: int, trials: int = 5, per_thread: int = 64 * MiB) -> float:
    """GB/s of xxh3_64 over bytes in the CPU's cache, as the full verification hashes them:
    ``threads`` threads at once, each updating one streaming digest with its own buffer of
    :data:`kvfs.client.transport.HASH_PIECE` bytes, ``per_thread`` bytes in all; the median of
    ``trials`` trials."""
    import xxhash  # noqa: PLC0415

    from ..client.transport import HASH_PIECE  # noqa: PLC0415

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

    from ..client import KVCache  # noqa: PLC0415
    from ..client.transport import host_view, preadv_all  # noqa: PLC0415
    from ..format import control  # noqa: PLC0415
    from ..format.hashing import ModelSpec  # noqa: PLC0415

    spec = ModelSpec(model="bench/control", revision="r1", kv_dtype="float32", block_size=1,
                     num_layers=1, num_kv_heads=1, head_dim=1)
    n_req = args.control_requests
    daemon_pid = mount.pid()
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
            "request_ms": median(req), "request_p90_ms": quantile(req, 0.9),
            "request_p99_ms": quantile(req, 0.99),
            "raw_preadv_ms": median(raw_ms), "overhead_ms": median(req) - median(raw_ms),
            "client_cpu_ms": cpu_ms, "daemon_cpu_ms": daemon_ms, "raw_cpu_ms": raw_cpu_ms,
            "cpu_overhead_ms": (cpu_ms + (daemon_ms or 0.0) - raw_cpu_ms),
            "control_calls_per_request": calls,
            "lookup_ms": median(lookup), "load_ms": median(load),
            "setxattr_ms": median(sx), "setxattr_64_ms": median(sx64),
            "amplification": amp}
