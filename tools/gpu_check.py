"""GPU check of the kvfs direct path: blocks written through a mount, loaded into CUDA tensors.

On a CUDA host this writes N blocks through a kvfs mount (the one given, or one it mounts
itself over a temporary directory with ``python -m kvfs.cli mount`` and unmounts at the end),
loads them through the kvikio transport (and the POSIX one) into CUDA tensors, verifies every
byte, and prints:

- whether kvikio read through cuFile (GDS) or in a compatibility mode, as kvikio reports it;
- the backing filesystem's type (cuFile does GDS on ext4/xfs on NVMe and a few others);
- GB/s of each load against the baseline on the same files in the same run: threaded host
  `preadv` into pinned memory, then a host-to-device copy of the same bytes.

Each timed load follows an untimed one (pinned buffers and CUDA streams are made on first
use) and starts after `posix_fadvise(DONTNEED)` of the block files (written with
fsync, so the kernel may drop them; kvikio's page-cache probe, where present, says whether it
did), or with the files left in the page cache (``--warm``: the path's own cost). Where FUSE cannot
be mounted, it says why and runs the same client over a plain directory (control calls
counted, not sent). Where there is no GPU it says so and exits 0.

Then the verdicts (:func:`verdicts`): payload sums (block format version 2) computed by torch
on the GPU equal the host's reference for every size and alignment tried; blocks saved from
CUDA are version 2; and a block with one corrupted payload byte is a miss (the load's prefix
ends there, its slice zeroed) for ``load``, ``load_async`` and ``load_paged``, in version 2
(checked on the GPU) and version 1 (checked on the host), exactly where the host's own
check (``blockfile.decode``) refuses the same file. Exit 1: a byte differed or a verdict was
wrong. ``--emulate`` runs the verdicts alone on the CPU, through a transport that acts for
CPU tensors as kvikio does for CUDA ones (the tests' fake), where no GPU is lent.

Then the codec (:func:`codec_check`): planes-zstd blocks decoded on the GPU by nvCOMP
(``nvidia-nvcomp-cu12``), bit for bit, against the host decoder plus a copy to the device.

    python tools/gpu_check.py [MOUNT] [--tenant T] [--blocks N] [--block-mib M] [--dir D]
                              [--warm] [--json PATH] [--emulate]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

KVFS = [sys.executable, "-m", "kvfs.cli"]
GiB = 1 << 30


def say(msg: str) -> None:
    print(f"gpu_check: {msg}", flush=True)


@dataclass
class Place:
    mount: str | None  # None: no kvfs mount could run here; `data` is a plain directory
    data: str
    note: str


def kvfs_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*KVFS, *args], capture_output=True, text=True)


@contextlib.contextmanager
def place(mount: str | None, tenant: str, base: str | None) -> Iterator[Place]:
    """A mount with `tenant` in it: the given one, or a temporary one (or a plain directory)."""
    if mount:
        if not os.path.isdir(os.path.join(mount, tenant)):
            res = kvfs_cli("tenant", "add", mount, tenant, "--uid", str(os.getuid()),
                           "--gid", str(os.getgid()))
            if res.returncode:
                raise SystemExit(f"gpu_check: cannot add tenant {tenant}: {res.stderr.strip()}")
        yield Place(mount, "", f"the kvfs mount {mount}")
        return
    from kvfs.bench.harness import KvfsError, Mount, mounted

    m = Mount.under(tempfile.mkdtemp(prefix="kvfs-gpu-check-", dir=base))
    try:
        m.start()
        why = None
    except KvfsError as exc:
        why = [line for line in str(exc).splitlines() if line.strip()]
    try:
        if why is None:
            m.add_tenant(tenant)
            yield Place(str(m.mnt), "", f"a kvfs mount made for this check over {m.backing}")
        else:
            data = os.path.join(m.backing, tenant, "check")
            os.makedirs(data)
            yield Place(None, data, "NO kvfs mount (it could not be mounted here: "
                        f"{why[-1] if why else 'no reason given'}); the same client over "
                        f"the plain directory {data}")
    finally:
        m.stop(check=False)
        if not mounted(m.mnt):
            shutil.rmtree(m.mnt.parent, ignore_errors=True)


def fs_type(path: str) -> str:
    """The filesystem type of `path`, from /proc/mounts (and `stat -f` where it differs)."""
    path = os.path.realpath(path)
    best, kind = "", "unknown"
    with contextlib.suppress(OSError), open("/proc/mounts") as f:
        for line in f:
            fields = line.split()
            if len(fields) < 3:
                continue
            mnt = fields[1].replace("\\040", " ")
            inside = path == mnt or path.startswith(mnt.rstrip("/") + "/")
            if inside and len(mnt) >= len(best):
                best, kind = mnt, fields[2]
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        res = subprocess.run(["stat", "-f", "-c", "%T", path], capture_output=True, text=True)
        st = res.stdout.strip()
        if res.returncode == 0 and st and st != kind:
            kind = f"{kind} (stat -f: {st})"
    return f"{kind} at {best or '?'}"


def gds_status(kvikio: Any, transport: Any, sample: str) -> str:
    """What kvikio says about how it reads: cuFile (GDS possible) or POSIX compatibility."""
    parts = [f"kvikio {getattr(kvikio, '__version__', '?')}",
             f"kvikio compat_mode={transport.kvikio_compat_mode(kvikio)}"]
    drv = transport.kvikio_module(kvikio, "cufile_driver")
    for key in ("is_gds_available", "allow_compat_mode"):
        with contextlib.suppress(Exception):
            if drv is not None and hasattr(drv, "get"):
                parts.append(f"cufile {key}={drv.get(key)}")
    with contextlib.suppress(Exception):
        f = kvikio.CuFile(sample, "r")
        try:
            if hasattr(f, "is_direct_io_supported"):
                parts.append(f"O_DIRECT on the block files={f.is_direct_io_supported()}")
        finally:
            f.close()
    compat = parts[1].split("=", 1)[1]
    if compat in ("on", "true", "1") or "inferred on" in compat:
        verdict = "COMPATIBILITY mode (kvikio reads with POSIX; cuFile not used)"
    elif "cufile is_gds_available=True" in parts:
        verdict = "GDS (cuFile, GPUDirect Storage available)"
    elif "cufile is_gds_available=False" in parts:
        verdict = "cuFile COMPATIBILITY mode (GDS not available: cuFile bounces through host)"
    else:
        verdict = "cuFile (GDS availability not reported by this kvikio)"
    return f"{verdict}; {', '.join(parts)}"


def drop_cache(paths: list[str], kvikio: Any = None) -> str:
    """Ask the kernel to drop the files' pages; what kvikio then sees cached, if it can."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    with contextlib.suppress(Exception):
        cached, pages = kvikio.get_page_cache_info(paths[0])
        return f"{cached}/{pages} pages of a block file still cached"
    return "page cache residency not measured"


def _corrupt_byte(path: str, offset: int) -> int:
    """Flip the bits of one byte of a file; returns the byte it had."""
    with open(path, "r+b") as f:
        f.seek(offset)
        old = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([old ^ 0x5A]))
    return old


def verdicts(open_cache: Any, dev: Any, io: str, make_transport: Any = None) -> list[str]:
    """The device path's verdicts on ``dev``: what went wrong (empty: all as the host says).

    ``open_cache(spec=, **options)`` opens a client; the device's uses transport ``io``, or
    ``make_transport(spec)`` where given (``--emulate``: a device transport for CPU
    tensors)."""
    import random

    import torch

    from kvfs.client import devsum
    from kvfs.client.transport import host_view
    from kvfs.format import blockfile
    from kvfs.format.hashing import ModelSpec

    failures: list[str] = []
    rng = random.Random(14)
    gen = torch.Generator().manual_seed(14)
    # 1. The sums on the device equal the host's reference, for every size and alignment.
    for size in (1, 12, 4095, 4096, 4097, 3 * 4096 + 7, 1 << 20):
        host = torch.randint(0, 256, (size + 1,), dtype=torch.uint8, generator=gen)
        for t in (host[:size], host[1:]):  # 4-byte aligned, and not
            want = blockfile.payload_sums(host_view(t.contiguous()))
            if devsum.payload_sums([t.to(dev)]) != want:
                failures.append(f"payload sums of {t.numel()} bytes on {dev}")
    rows = torch.randint(0, 256, (6, 2 * 4096 + 6), dtype=torch.uint8, generator=gen)
    if devsum.as_tuples(devsum.block_sums(rows.to(dev))) != [
            blockfile.payload_sums(host_view(rows[i].contiguous())) for i in range(6)]:
        failures.append(f"payload sums of a batch on {dev}")
    say(f"verdicts: payload sums on {dev}: "
        f"{'equal to the reference' if not failures else 'DIFFER'}")

    # 2. Loads of corrupted blocks, version 2 (saved from the device) and 1 (from the host).
    spec = ModelSpec(model="kvfs/gpu-check-verdicts", revision="1", kv_dtype="bfloat16",
                     block_size=16, num_layers=4, num_kv_heads=2, head_dim=32)  # 4 KiB layers
    n = 8
    kv = torch.randn((n, *spec.block_shape), generator=gen).to(torch.bfloat16)
    start = rng.randrange(1 << 30)

    def opened() -> Any:
        c = open_cache(spec=spec, io=io)
        if make_transport is not None:
            c.transport = make_transport(spec)
        return c

    with opened() as c, open_cache(spec=spec, io="posix") as host:
        runs = []
        for version, saver, src in ((2, c, kv.to(dev)), (1, host, kv)):
            hashes = c.block_hashes(list(range(start, start + n * spec.block_size)),
                                    extra=f"v{version}")
            saver.save(hashes, src)
            with open(c.path(hashes[0]), "rb") as f:
                got = blockfile.decode_header(f.read(4096)).version
            if got != version:
                failures.append(f"a block saved from {src.device} is version {got}, "
                                f"expected {version}")
            runs.append((version, hashes, src))
        for version, hashes, saved in runs:
            src = saved.to(dev)  # loaded into device memory, whichever version
            for form in ("load", "load_async", "load_paged"):
                j = rng.randrange(1, n)
                path = c.path(hashes[j])
                off = 4096 + rng.randrange(spec.block_payload_bytes)
                _corrupt_byte(path, off)
                try:  # the host's verdict on the same file, first
                    with open(path, "rb") as f:
                        blockfile.decode(f.read())
                    failures.append(f"the host accepted a corrupted file ({form})")
                except blockfile.BlockFormatError:
                    pass
                out = torch.full_like(src, 3.0)
                if form == "load":
                    got = c.load(hashes, out)
                    rest = out
                elif form == "load_async":
                    got = c.load_async(hashes, out).wait()
                    rest = out
                else:
                    layers = [torch.full((n, *spec.block_shape[1:]), 3.0, dtype=src.dtype,
                                         device=src.device) for _ in range(spec.num_layers)]
                    got = c.load_paged(hashes, layers, list(range(n)))
                    rest = torch.stack(layers, dim=1)
                ok = (got == j and torch.equal(rest[:j], src[:j])
                      and int(torch.count_nonzero(rest[j])) == 0)
                say(f"verdicts: version {version}, {form}, byte {off} of block {j} corrupted: "
                    f"{got} blocks loaded, {'a miss there, as on the host' if ok else 'WRONG'}")
                if not ok:
                    failures.append(f"version {version} {form}: loaded {got}, expected {j}")
                # Put the block back (the daemon quarantined it; a plain directory did not).
                if os.path.exists(path):
                    os.unlink(path)
                saver = c if version == 2 else host
                saver.save(hashes[j:j + 1], saved[j:j + 1], parent=hashes[j - 1])
            out = torch.zeros_like(src)
            if c.load(hashes, out) != n or not torch.equal(out, src):
                failures.append(f"version {version}: a sound load after the repairs failed")
    return failures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mount", nargs="?", help="a kvfs mount (default: mount one over --dir)")
    ap.add_argument("--tenant", default="gpu-check")
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--block-mib", type=float, default=16.0)
    ap.add_argument("--dir", help="where a temporary backing directory goes (default: $TMPDIR)")
    ap.add_argument("--warm", action="store_true",
                    help="leave the files in the page cache (measures the path, not the disk)")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--emulate", action="store_true",
                    help="no GPU: run the verdicts alone on the CPU through an emulated "
                         "device transport")
    args = ap.parse_args(argv)
    try:
        import torch
    except ImportError:
        say("torch is not installed: no GPU here to check")
        return 0
    if args.emulate:
        return emulate(args)
    if not torch.cuda.is_available():
        say("no CUDA GPU here (torch.cuda.is_available() is False): nothing to check")
        return 0

    from kvfs.client import KVCache, transport
    from kvfs.format.hashing import ModelSpec

    try:
        import kvikio
    except ImportError as exc:
        kvikio = None
        say(f"kvikio is not installed ({exc}): checking the POSIX transport only")

    class NoDaemon(KVCache):
        """The client over a plain directory: control calls are counted, not sent."""

        def _control(self, name: bytes, value: bytes) -> None:
            self._count(control_calls=1)

    per_token = 32 * 2 * 8 * 128 * 2
    spec = ModelSpec(model="kvfs/gpu-check", revision="1", kv_dtype="bfloat16",
                     block_size=max(1, round(args.block_mib * (1 << 20) / per_token)),
                     num_layers=32, num_kv_heads=8, head_dim=128)
    n, payload = args.blocks, spec.block_payload_bytes
    total = n * payload
    dev = torch.device("cuda", torch.cuda.current_device())
    say(f"device {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, "
        f"{n} blocks of {payload / (1 << 20):.1f} MiB ({total / GiB:.2f} GiB)")
    figures: dict[str, Any] = {"blocks": n, "block_bytes": payload,
                               "device": torch.cuda.get_device_name(dev)}
    failures = []

    with place(args.mount, args.tenant, args.dir) as where:
        say(f"store: {where.note}")

        def open_cache(spec: ModelSpec = spec, **kw: Any) -> KVCache:
            if where.mount:
                return KVCache.open(where.mount, tenant=args.tenant, spec=spec, **kw)
            return NoDaemon(where.data, where.data, spec, direct=True, **kw)

        kv = torch.randint(0, 256, (n, payload), dtype=torch.uint8, device=dev)
        kv = kv.view(torch.bfloat16).view(n, *spec.block_shape)
        start = int.from_bytes(os.urandom(3), "little")  # new blocks on every run
        tokens = list(range(start, start + n * spec.block_size))
        with open_cache(io="posix", fsync=True) as writer:
            hashes = writer.block_hashes(tokens)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            writer.save(hashes, kv)
            dt = time.perf_counter() - t0
            paths = [writer.path(h) for h in hashes]
            say(f"saved from CUDA (copy to host, checksum, pwritev, fsync, publish): "
                f"{total / dt / 1e9:.2f} GB/s; direct path: {writer.direct}; "
                f"control calls: {writer.stats['control_calls']}")
        def cache_state(paths: list[str]) -> str:
            if args.warm:
                return "warm: the block files were left in the page cache"
            return drop_cache(paths, kvikio)

        figures["backing"] = paths[0]
        figures["backing_fs"] = fs_type(paths[0])
        say(f"backing filesystem: {figures['backing_fs']}")
        if kvikio is not None:
            figures["cufile"] = gds_status(kvikio, transport, paths[0])
            say(f"cuFile: {figures['cufile']}")

        kv_bytes = kv.view(torch.uint8)
        runs = [("posix-staged", "posix", "full")]
        if kvikio is not None:
            runs = [("kvikio", "kvikio", "full"), ("kvikio-sampled", "kvikio", "sampled"),
                    *runs]
        for name, io, verify in runs:
            with open_cache(io=io, verify=verify) as cache:
                out = torch.zeros_like(kv)
                cache.load(hashes, out)  # untimed: pins the staging buffers, makes streams
                out.zero_()
                figures.setdefault("page_cache", cache_state(paths))
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                got = cache.load(hashes, out)
                torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                same = got == n and torch.equal(out.view(torch.uint8), kv_bytes)
                figures[name] = {"gbps": total / dt / 1e9, "loaded": got, "identical": same,
                                 "transport": cache.transport.name, "verify": verify,
                                 "fetch_amplification": cache.stats["fetch_amplification"]}
                say(f"load {name:15s} ({cache.transport.name}, verify={verify}): "
                    f"{total / dt / 1e9:6.2f} GB/s, {got}/{n} blocks, "
                    f"{'every byte identical' if same else 'BYTES DIFFER'}")
                if not same:
                    failures.append(name)
                if io == "kvikio":  # the layer-wise and paged forms, for correctness
                    out.zero_()
                    h = cache.load_async(hashes, out)
                    first = h.wait_layer(0)
                    ok = (first == n and h.wait() == n
                          and torch.equal(out.view(torch.uint8), kv_bytes))
                    layers = [torch.zeros((n + 1, *spec.block_shape[1:]), dtype=kv.dtype,
                                          device=dev) for _ in range(spec.num_layers)]
                    ids = list(range(n, 0, -1))
                    ok = ok and cache.load_paged(hashes, layers, ids) == n and all(
                        torch.equal(layers[la][ids[i]].view(torch.uint8), kv_bytes[i, la])
                        for la in range(spec.num_layers) for i in (0, n - 1))
                    say(f"load {name} layer-wise and paged: {'identical' if ok else 'DIFFER'}")
                    if not ok:
                        failures.append(f"{name} layer-wise/paged")
                    del layers
                del out

        # The baseline: threaded preadv of the same files into pinned memory, then H2D.
        host = torch.empty((n, payload), dtype=torch.uint8, pin_memory=True)
        views = [transport.host_view(host[i]) for i in range(n)]
        threads = min(32, 4 * (os.cpu_count() or 1))

        def read(i: int) -> int:
            fd = os.open(paths[i], os.O_RDONLY)
            try:
                return transport.preadv_all(fd, [views[i]], 4096)
            finally:
                os.close(fd)

        cache_state(paths)
        with ThreadPoolExecutor(threads) as pool:
            t0 = time.perf_counter()
            assert sum(pool.map(read, range(n))) == total
            t_read = time.perf_counter() - t0
        dest = torch.empty((n, payload), dtype=torch.uint8, device=dev)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dest.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        t_copy = time.perf_counter() - t0
        if not torch.equal(dest, kv_bytes.view(n, payload)):
            failures.append("baseline")
        base = total / (t_read + t_copy) / 1e9
        figures["baseline"] = {"preadv_gbps": total / t_read / 1e9,
                               "h2d_gbps": total / t_copy / 1e9, "preadv_then_h2d_gbps": base,
                               "threads": threads}
        # The device's own verification: payload sums over every block, on the GPU.
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        from kvfs.client import devsum

        devsum.as_tuples(devsum.block_sums(kv_bytes.view(n, payload)))
        dt = time.perf_counter() - t0
        figures["payload_sums_gbps"] = total / dt / 1e9
        say(f"payload sums of all {n} blocks on the GPU: {total / dt / 1e9:.1f} GB/s")
        io = "kvikio" if kvikio is not None else "posix"
        bad = verdicts(open_cache, dev, io)
        figures["codec"], codec_bad = codec_check(open_cache, spec, dev)
        bad += codec_bad
        figures["verdicts"] = {"transport": io, "failures": bad}
        failures += bad
        say(f"page cache before each load: {figures['page_cache']}")
        say(f"baseline: threaded preadv ({threads} threads) {total / t_read / 1e9:.2f} GB/s, "
            f"H2D copy {total / t_copy / 1e9:.2f} GB/s, both in turn {base:.2f} GB/s")
        for name, _, _ in runs:
            ratio = figures[name]["gbps"] / base
            figures[name]["vs_baseline"] = ratio
            say(f"{name}: {ratio:.2f}x the preadv-then-copy baseline")

    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2, sort_keys=True) + "\n")
    if failures:
        say(f"FAILED: {', '.join(failures)}")
        return 1
    say("OK: every byte loaded into GPU memory is identical to what was saved")
    return 0


def codec_check(open_cache: Any, spec: Any, dev: Any) -> tuple[dict[str, Any], list[str]]:
    """Planes-zstd blocks decoded on the GPU (kvfs.client.gpudecode, nvCOMP): bit-exact
    against the saved KV, a corrupt frame a miss, and GB/s against the host decoder plus
    the copy of the decoded payload to the device, on the same stored bytes; then blocks
    saved encoded through the client and loaded into CUDA tensors."""
    from dataclasses import replace

    import torch
    import xxhash

    from kvfs.client import gpudecode
    from kvfs.format import blockfile, codec

    if not codec.available():
        say("codec: kvfs.format._codec is not built: nothing to check")
        return {"skipped": "kvfs.format._codec not built"}, []
    frames = gpudecode.nvcomp_frames(dev)
    if frames is None:
        say("codec: nvCOMP is not installed (pip install nvidia-nvcomp-cu12): planes blocks "
            "loaded into GPU memory are decoded on the host, then copied")
        return {"skipped": "nvCOMP not installed"}, []
    failures = []
    n = 8 << 20  # 16 MiB of bfloat16 drawn like KV (normal, a few scales)
    scale = torch.tensor([0.5, 1.0, 4.0], device=dev)[torch.randint(0, 3, (n,), device=dev)]
    kv = (torch.randn(n, device=dev) * scale).to(torch.bfloat16).view(torch.uint8)
    payload = kv.cpu().numpy().tobytes()
    raw = blockfile.encode(block_hash=os.urandom(16), parent_hash=bytes(16),
                           fingerprint=b"g" * 16, token_count=16, dtype="bfloat16",
                           shape=(n,), payload=payload, sums=True)
    enc = codec.encode_file(raw)
    if enc is None:
        return {"error": "the KV-like payload did not shrink"}, ["codec: encode"]
    h = blockfile.decode_header(enc)
    stored = bytearray(enc[blockfile.HEADER_SIZE:blockfile.HEADER_SIZE + h.encoding.stored_len])
    out = torch.zeros_like(kv)
    gpudecode.decode_into(h, stored, [out], frames)  # untimed: nvCOMP's first call
    reps = 10
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        gpudecode.decode_into(h, stored, [out], frames)
    torch.cuda.synchronize()
    t_dev = (time.perf_counter() - t0) / reps
    if not torch.equal(out, kv):
        failures.append("codec: GPU decode differs")
    host = torch.empty(len(payload), dtype=torch.uint8, pin_memory=True)
    from kvfs.client.transport import host_view

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        codec.decode_payload(h, stored, host_view(host))
        out.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
    t_host = (time.perf_counter() - t0) / reps
    # A corrupt frame under a resealed stored checksum: only the decode can tell.
    (w0, _w1) = struct.unpack_from("<2Q", stored)
    bad = bytearray(stored)
    bad[16 + (w0 & ((1 << 48) - 1)) + 200] ^= 0x10
    forged = replace(h, encoding=replace(h.encoding,
                                         stored_checksum=xxhash.xxh3_64_intdigest(bad)))
    try:
        gpudecode.decode_into(forged, bad, [out], frames)
        failures.append("codec: a corrupt frame was decoded and served")
        refused = "SERVED"
    except blockfile.BlockFormatError as exc:
        refused = str(exc)
    # Through the client: saved encoded from CUDA, loaded into CUDA tensors.
    with open_cache(io="posix") as cache:
        cache.codec = "planes"
        blocks = 4
        kvb = (torch.randn((blocks, *spec.block_shape), device=dev) * 2).to(torch.bfloat16)
        start = int.from_bytes(os.urandom(3), "little")
        hashes = cache.block_hashes(list(range(start, start + blocks * spec.block_size)))
        cache.save(hashes, kvb)
        encoded_files = sum(blockfile.decode_header(open(cache.path(x), "rb").read(4096))
                            .encoding is not None for x in hashes)
        got = torch.zeros_like(kvb)
        loaded = cache.load(hashes, got)
        if loaded != blocks or not torch.equal(got.view(torch.uint8), kvb.view(torch.uint8)):
            failures.append("codec: encoded blocks loaded through the client differ")
    figures = {"payload_bytes": len(payload), "ratio": round(len(raw) / len(enc), 3),
               "gpu_decode_gbps": len(payload) / t_dev / 1e9,
               "host_decode_then_h2d_gbps": len(payload) / t_host / 1e9,
               "corrupt_frame": refused, "client_blocks_encoded": encoded_files,
               "client_loaded": loaded}
    say(f"codec: planes-zstd {figures['ratio']}x; decoded on the GPU (nvCOMP) "
        f"{figures['gpu_decode_gbps']:.2f} GB/s against host decode + H2D copy "
        f"{figures['host_decode_then_h2d_gbps']:.2f} GB/s; corrupt frame: {refused}; "
        f"through the client: {encoded_files}/{blocks} saved encoded, {loaded}/{blocks} loaded")
    return figures, failures


def emulate(args: argparse.Namespace) -> int:
    """The verdicts on the CPU: the client's device path, fed by a transport that acts for
    CPU tensors as kvikio does for CUDA ones (reads through the transport, never hashes on
    the host, verifies by payload sums). For a machine with no GPU; not a GPU check."""
    import torch

    from kvfs.client import KVCache, transport

    class EmulatedDevice(transport.PosixTransport):
        name = "emulated-device"

        def reads_to_host(self, t: Any) -> bool:
            return False

        def device_verifies(self, t: Any) -> bool:
            return True

    class NoDaemon(KVCache):
        def _control(self, name: bytes, value: bytes) -> None:
            self._count(control_calls=1)

    with place(args.mount, args.tenant, args.dir) as where:
        say(f"store: {where.note}; EMULATED device (CPU tensors): no GPU is checked")

        def open_cache(spec: Any, **kw: Any) -> KVCache:
            if where.mount:
                return KVCache.open(where.mount, tenant=args.tenant, spec=spec, **kw)
            return NoDaemon(where.data, where.data, spec, direct=True, **kw)

        failures = verdicts(open_cache, torch.device("cpu"), "posix",
                            lambda spec: EmulatedDevice(spec.block_payload_bytes, 4))
    if args.json:
        Path(args.json).write_text(json.dumps({"emulated": True, "failures": failures},
                                              indent=2) + "\n")
    if failures:
        say(f"FAILED: {', '.join(failures)}")
        return 1
    say("OK (emulated): every verdict as the host's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
