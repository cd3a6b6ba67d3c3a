"""Restores from the lower tiers (:mod:`kvfs.bench.tiers`): the blocks, one request, the
baselines (threaded ``preadv`` of the same files, threaded boto3 GETs of the same objects, the
least a restore must move: a copy into a hot file read back), the restore rounds and the one
large restore from S3; and the daemon's tier counters read around them.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import xxhash

from ..client import KVCache
from ..format.hashing import ModelSpec, block_relpath
from .harness import REGION, Mount, host_buffer, log, median

MiB = 1 << 20
HEADER = 4096
TENANT = "t"
BUCKET = "kvfs-bench"
PREFIX = "kvfs"
#: KV of a Llama-3-8B-shaped model: 32 layers, 8 KV heads of 128, bfloat16: 128 KiB per token.
#: The daemon runs at most this many tier calls at once (its tier thread limiter).
TIER_THREADS = 32


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


def kv_like(spec: ModelSpec, n: int, seed: int) -> torch.Tensor:
    """bfloat16 values drawn like KV: normal, one log-normal scale per (layer, K/V, head)."""
    g = torch.Generator().manual_seed(seed)
    layers, _, _, heads, _ = spec.block_shape
    scale = torch.exp(torch.randn(n, layers, 2, 1, heads, 1, generator=g))
    return (torch.randn(n, *spec.block_shape, generator=g) * scale).to(torch.bfloat16)


def s3_key(spec: ModelSpec, h: bytes) -> str:
    return f"{PREFIX}/{TENANT}/{spec.namespace}/{block_relpath(h)}"


def wait_published(m: Mount, expected: int, timeout: float,
                   polls: list[int] | None = None) -> float:
    """Wait until write-through has handled ``expected`` blocks; returns when it had.
    ``polls``: the number of times the daemon's stats were read is appended to it (each costs
    the daemon some CPU)."""
    deadline = time.monotonic() + timeout
    n = 0
    while True:
        n += 1
        if polls is not None and n == 1:
            polls.append(0)
        if polls is not None:
            polls[-1] = n
        t = m.tier()
        handled = t["uploads"] + t["upload_failures"] + t["uploads_dropped"]
        if handled >= expected:
            if t["upload_failures"] or t["uploads_dropped"]:
                raise BenchError(f"{m.name}: write-through lost blocks: {t}")
            return time.monotonic()
        if time.monotonic() > deadline:
            raise BenchError(f"{m.name}: write-through handled {handled} of {expected} blocks "
                             f"in {timeout:.0f} s: {t}")
        time.sleep(0.02)  # a publish of 128 MiB takes about a second: poll finely


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
        self.buf = host_buffer(file_bytes * n)
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="raw-preadv")

    def read(self, paths: Sequence[str], hashed: bool = False,
             opener: Callable[[memoryview], None] | None = None) -> float:
        """Seconds to read ``paths`` (``hashed``: and xxh3 of each file's bytes, on the same
        threads without the GIL: the least a verified load does with them; ``opener``: and
        that done to each file's bytes, a sealed block's opening)."""
        def one(i: int) -> None:
            fd = os.open(paths[i], os.O_RDONLY | os.O_CLOEXEC)
            try:
                view = self.buf[i * self.file_bytes:(i + 1) * self.file_bytes]
                # A file's own size: an encoded block's (kvfs.format.codec) is smaller.
                size = min(os.fstat(fd).st_size, self.file_bytes)
                if _preadv_all(fd, view) != size:
                    raise OSError(f"{paths[i]}: short read")
                if hashed:
                    xxhash.xxh3_64_intdigest(view[:size])
                if opener is not None:
                    opener(view[:size])
            finally:
                os.close(fd)

        t0 = time.perf_counter()
        list(self.pool.map(one, range(len(paths))))
        return time.perf_counter() - t0


class RawS3:
    """Threaded boto3 GETs of whole objects into memory: the store's own limit."""

    def __init__(self, endpoint: str, threads: int, credentials: tuple[str, str] | None = None
                 ) -> None:
        """``credentials``: (access key, secret key); None: boto3's own (the environment)."""
        import boto3  # noqa: PLC0415
        from botocore.config import Config  # noqa: PLC0415

        keys = ({} if credentials is None else
                {"aws_access_key_id": credentials[0], "aws_secret_access_key": credentials[1]})
        self.client = boto3.session.Session(**keys).client(
            "s3", endpoint_url=endpoint, region_name=REGION,
            config=Config(s3={"addressing_style": "path"}, max_pool_connections=threads,
                          connect_timeout=2, read_timeout=10,
                          retries={"total_max_attempts": 1}))
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="raw-s3")

    def read(self, keys: Sequence[str], size: int) -> float:
        def one(key: str) -> None:
            got = self.client.get_object(Bucket=BUCKET, Key=key)
            body = got["Body"]
            try:  # the object's own size: an encoded block's (kvfs.format.codec) is smaller
                if len(body.read()) != min(size, got["ContentLength"]):
                    raise OSError(f"{key}: short object")
            finally:
                body.close()

        t0 = time.perf_counter()
        list(self.pool.map(one, keys))
        return time.perf_counter() - t0

    def close(self) -> None:
        self.pool.shutdown()
        self.client.close()


class RawURLs:
    """The fastest plain client measured on these objects (kvfs bench s3clients): presigned
    GETs (signed beforehand, untimed) read by urllib3, ``readinto`` straight into memory,
    on as many threads as the daemon's tier pool."""

    def __init__(self, raw_s3: RawS3, file_bytes: int, n: int) -> None:
        import urllib3  # noqa: PLC0415 - botocore's own dependency

        self.raw_s3 = raw_s3
        self.http = urllib3.PoolManager(maxsize=TIER_THREADS, retries=False,
                                        timeout=urllib3.Timeout(connect=2, read=10))
        self.file_bytes = file_bytes
        self.buf = host_buffer(file_bytes * n)
        self.pool = ThreadPoolExecutor(TIER_THREADS, thread_name_prefix="raw-url")

    def read(self, keys: Sequence[str]) -> float:
        urls = [self.raw_s3.client.generate_presigned_url(
            "get_object", Params={"Bucket": BUCKET, "Key": k}, ExpiresIn=300) for k in keys]

        def one(i: int) -> None:
            resp = self.http.request("GET", urls[i], preload_content=False)
            try:
                if resp.status != 200:
                    raise OSError(f"{keys[i]}: HTTP {resp.status}")
                view, got = self.buf[i * self.file_bytes:(i + 1) * self.file_bytes], 0
                while got < len(view) and (k := resp.readinto(view[got:])):
                    got += k
                if got != min(self.file_bytes, int(resp.headers.get("Content-Length", -1))):
                    raise OSError(f"{keys[i]}: short object")
            finally:
                resp.release_conn()

        t0 = time.perf_counter()
        list(self.pool.map(one, range(len(keys))))
        return time.perf_counter() - t0

    def write(self, keys: Sequence[str], objects: Sequence[bytes]) -> float:
        """Presigned PUTs (signed beforehand, untimed) of ``objects`` under ``keys``: the
        fastest client's PUT in kvfs bench s3clients; seconds."""
        from ..daemon.tiers.presign import presign_put  # noqa: PLC0415
        from .seaweed import ACCESS_KEY, SECRET_KEY  # noqa: PLC0415

        # kvfs's own presigner (the one its grants use): botocore's presigned PUT asks for a
        # checksum header that a plain client does not send
        endpoint, now = self.raw_s3.client.meta.endpoint_url, time.time()
        urls = [presign_put(endpoint, BUCKET, k, REGION, ACCESS_KEY, SECRET_KEY, 300, now)
                for k in keys]

        def one(i: int) -> None:
            resp = self.http.request("PUT", urls[i], body=objects[i],
                                     headers={"Content-Type": "application/octet-stream"})
            if resp.status != 200:
                raise OSError(f"{keys[i]}: HTTP {resp.status}: {resp.data[:200]!r}")

        t0 = time.perf_counter()
        list(self.pool.map(one, range(len(keys))))
        return time.perf_counter() - t0

    def close(self) -> None:
        self.pool.shutdown()
        self.http.clear()


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
        self.buf = host_buffer(file_bytes * n)
        self.pool = ThreadPoolExecutor(TIER_THREADS, thread_name_prefix="copy-back")

    def _run(self, count: int, fill: Callable[[int, int], None]) -> float:
        def one(i: int) -> None:
            dst = os.path.join(self.scratch, f"{i:05d}.kv")
            fd = os.open(dst, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                fill(i, fd)
                view = self.buf[i * self.file_bytes:(i + 1) * self.file_bytes]
                if _preadv_all(fd, view) != min(os.fstat(fd).st_size, self.file_bytes):
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


def sealed_opener(path: str, cache: KVCache, spec: ModelSpec
                  ) -> Callable[[memoryview], None] | None:
    """Where the block file at ``path`` is sealed: what opening a sealed file's bytes takes at
    least (AES-256-GCM in place and the checks of kvfs.format.seal.open_in_place, with the
    namespace key ``cache`` holds), for the read-and-open baseline; else None."""
    from ..format import blockfile, seal  # noqa: PLC0415

    with open(path, "rb") as f:
        h = blockfile.decode_header(f.read(HEADER))
    kid = seal.key_id_of(h)
    if kid is None:
        return None
    key = cache.keys.get(kid)

    def open_(view: memoryview) -> None:
        hdr = blockfile.decode_header(view[:HEADER])
        seal.open_in_place(hdr, view[HEADER:HEADER + hdr.stored_len], key, TENANT,
                           spec.namespace)

    return open_


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
    raw_urls = RawURLs(raw_s3, file_bytes, n)
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
                                  Callable[[], float] | None, list[str] | None]] = [
                    ("s3", c_s3, r_s3, lambda k=keys: raw_s3.read(k, file_bytes),
                     lambda k=keys: copier.from_s3(k), None),
                    ("cold", c_dir, r_dir, lambda p=cold_paths: raw_files.read(p),
                     lambda p=cold_paths: copier.from_files(p), cold_paths),
                    ("hot", c_s3, r_s3, lambda p=hot_paths: raw_files.read(p), None, hot_paths),
                ]
                done: list[str] = []
                for tier, cache, mount, baseline, copy, files in plans:
                    if tier == "hot" and rows["s3"][-1].get("short"):
                        continue  # the S3 restore did not place them all: nothing to read
                    done.append(tier)
                    baseline()  # untimed: the source into the page cache
                    t_before = mount.tier()
                    got: dict[str, Any] = {}
                    steps: dict[str, Callable[[], Any]] = {
                        "raw": baseline,
                        # The hot copies a restore writes behind are in before the next
                        # step (untimed), so that no baseline reads beside its writes.
                        "method": lambda c=cache, h=hashes: _flushed(
                            c, request(c, h, out, timeout))}
                    if copy is not None:
                        steps["copy"] = copy
                    if files is not None:
                        steps["raw+xxh3"] = lambda p=files: raw_files.read(p, hashed=True)
                        opener = (sealed_opener(files[0], cache, spec) if tier == "cold"
                                  else None)
                        if opener is not None:  # sealed: what opening them takes at least
                            steps["raw+open"] = (lambda p=files, o=opener:
                                                 raw_files.read(p, opener=o))
                    if tier == "s3":
                        steps["urls"] = lambda k=keys: raw_urls.read(k)
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
                    if "raw+xxh3" in got:
                        res.update(hashed_s=got["raw+xxh3"],
                                   hashed_gbps=payload / got["raw+xxh3"] / 1e9,
                                   hashed_ratio=got["raw+xxh3"] / res["seconds"])
                    if "raw+open" in got:
                        res.update(opened_s=got["raw+open"],
                                   opened_gbps=payload / got["raw+open"] / 1e9,
                                   opened_ratio=got["raw+open"] / res["seconds"])
                    if "urls" in got:
                        res.update(url_s=got["urls"], url_gbps=payload / got["urls"] / 1e9,
                                   url_ratio=got["urls"] / res["seconds"])
                    rows[tier].append(res)
                log(f"  round {r + 1}/{len(sets)}: " + ", ".join(
                    f"{t} {rows[t][-1]['gbps']:.2f} GB/s (x{rows[t][-1]['ratio']:.2f} of raw, "
                    f"{rows[t][-1]['seconds'] * 1e3:.0f} ms)" for t in done))
    finally:
        raw_s3.close()
        raw_files.pool.shutdown()
        copier.close()
        raw_urls.close()
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
            "latency_ms": ms(median([x["seconds"] for x in ok])),
            "baseline_ms": ms(median([x["baseline_s"] for x in rs])),
            "lookup_ms": ms(median([x["lookup_s"] for x in ok])),
            "load_ms": ms(median([x["load_s"] for x in ok])),
            "storage_share": median([x["storage_share"] for x in ok]),
        }
        if tier == "s3":
            result[tier].update(
                url_gbps=median([x["url_gbps"] for x in rs]),
                url_ratio=median([x["url_ratio"] for x in ok]))
        if any("hashed_s" in x for x in rs):
            result[tier].update(
                hashed_gbps=median([x["hashed_gbps"] for x in rs]),
                hashed_ratio=median([x["hashed_ratio"] for x in ok]))
        if any("opened_s" in x for x in rs):
            result[tier].update(
                opened_gbps=median([x["opened_gbps"] for x in rs if "opened_gbps" in x]),
                opened_ratio=median([x["opened_ratio"] for x in ok if "opened_ratio" in x]))
        if tier != "hot":
            result[tier].update(
                copy_gbps=median([x["copy_gbps"] for x in rs]),
                copy_ms=ms(median([x["copy_s"] for x in rs])),
                copy_ratio=median([x["copy_ratio"] for x in ok]))
        if tier in before:
            result[tier]["daemon"] = tier_delta(before[tier], after[tier])
    return result


def ms(x: float | None) -> float | None:
    """Seconds as milliseconds, rounded to the microsecond."""
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


def _flushed(cache: KVCache, res: dict[str, Any]) -> dict[str, Any]:
    cache.flush()
    return res
