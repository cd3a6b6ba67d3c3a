"""Engines' file backends replayed against a real mount.

Each test repeats, with ordinary system calls, the file-access pattern of one engine's storage
backend as its source code does it (docs/engines.md names the files and options): vLLM's
filesystem offload tier and llm-d's fs connector, SGLang HiCache's file backend, LMCache's
local-disk and GDS backends, and the kvfs client. Every test checks that what is read back is
byte for byte what was written (against a digest the writer computed), and the fixture fails
any test whose daemon logged a traceback.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import mmap
import os
import random
import struct
import threading
import time
import urllib.parse
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import kvfs as kvfs_pkg
from kvfs.client import KVCache
from kvfs.client.transport import host_view
from kvfs.format import hashing

from .conftest import Mount, kvfs

TENANT = "t"
PAGE = 4096


# -- helpers ------------------------------------------------------------------------------


def add_tenant(m: Mount) -> Path:
    kvfs("tenant", "add", str(m.mnt), TENANT, "--uid", "0", "--gid", "0")
    return m.mnt / TENANT


def counters(m: Mount, ns: str) -> dict[str, int]:
    return m.stats()["tenants"].get(TENANT, {}).get(ns, {})


def hits_misses(m: Mount, ns: str) -> tuple[int, int]:
    c = counters(m, ns)
    return c.get("mount_hits", 0), c.get("mount_misses", 0)


def sha(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def payload(seed: int | str, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def aligned(data: bytes) -> mmap.mmap:
    """A page-aligned buffer holding `data` (O_DIRECT on a real disk needs aligned memory)."""
    buf = mmap.mmap(-1, len(data))
    buf[:] = data
    return buf


def chain(n: int, tokens_per_block: int = 16, seed: int = 0) -> list[bytes]:
    """Prefix-chained sha256 block hashes, the way vLLM and SGLang name blocks."""
    out, prev = [], b""
    for i in range(n):
        h = hashlib.sha256(prev)
        for t in range(tokens_per_block):
            h.update((seed * 100_000 + i * tokens_per_block + t).to_bytes(4, "little"))
        prev = h.digest()
        out.append(prev)
    return out


def not_a_kvfs_block(path: Path) -> bool:
    try:
        os.getxattr(path, "user.kvfs.block_hash")
    except OSError as exc:
        return exc.errno == errno.ENODATA
    return False


# -- vLLM filesystem offload tier / llm-d fs connector -------------------------------------


class FsTier:
    """One rank of vLLM's filesystem tier or llm-d's fs connector: one file per block,
    written to a temporary beside it and renamed into place (`os.replace`).

    Layouts:
    - "vllm": <root>/<model>_<digest>/config.json and
      <root>/<model>_<digest>_r<rank>/<hhh>/<hh>_g<group>/<hash>.bin; temporaries
      `<file>_<n>.tmp` written with O_DIRECT, read back with O_DIRECT `readv`.
    - "llm-d" (earlier connector builds): <root>/<model>/block_size_<b>_blocks_per_file_<k>/
      tp_<tp>_pp_size_1_pcp_size_1/rank_<r>/<dtype>/<hhh>/<hh>/<hash>.bin; temporaries
      `<file>_<n>.tmp`, buffered I/O; a store first probes the target by opening it for
      reading and, when it is there, refreshes its atime instead of writing.
    - "hidden": the vLLM layout with hidden temporaries `.<file>.<n>.tmp`.
    """

    def __init__(self, root: Path, model: str, rank: int, tp: int, style: str) -> None:
        self.style = style
        self.suffix = f"_{random.Random(rank).getrandbits(63)}.tmp"
        if style == "llm-d":
            self.config_dir = None
            self.dir = (root / model / "block_size_256_blocks_per_file_16"
                        / f"tp_{tp}_pp_size_1_pcp_size_1" / f"rank_{rank}" / "bfloat16")
        else:
            fields = {"model_name": model, "hash_block_size": 16, "tp_size": tp,
                      "dtype": "bfloat16"}
            digest = sha(json.dumps(fields, sort_keys=True).encode())[:12]
            base = f"{model.replace('/', '_')}_{digest}"
            self.config_dir = root / base
            self.dir = root / f"{base}_r{rank}"

    def write_run_config(self) -> None:
        if self.config_dir is None:
            return
        os.makedirs(self.config_dir, exist_ok=True)
        target = self.config_dir / "config.json"
        if not os.path.exists(target):
            target.write_text(json.dumps({"block_size": 16}))

    def path(self, h: bytes) -> Path:
        x = h.hex()
        if self.style == "llm-d":
            return self.dir / x[:3] / x[3:5] / f"{x}.bin"
        return self.dir / x[:3] / f"{x[3:5]}_g0" / f"{x}.bin"

    def lookup(self, hashes: list[bytes]) -> int:
        """Consecutive blocks present from the start (`os.path.exists` per block)."""
        n = 0
        for h in hashes:
            if not os.path.exists(self.path(h)):
                break
            n += 1
        return n

    def store(self, h: bytes, data: bytes) -> bool:
        """Store one block unless it is there; True if this call wrote it."""
        dest = self.path(h)
        if self.style == "llm-d":
            try:
                with open(dest, "rb"):
                    pass  # the connector's `std::ifstream(dst).good()` probe
            except FileNotFoundError:
                pass
            else:
                os.utime(dest, ns=(time.time_ns(), os.stat(dest).st_mtime_ns))
                return False
        elif os.path.exists(dest):
            return False
        self.write(h, data)
        return True

    def write(self, h: bytes, data: bytes) -> None:
        dest = self.path(h)
        os.makedirs(dest.parent, exist_ok=True)
        if self.style == "hidden":
            tmp = dest.parent / f".{dest.name}.{os.getpid()}.{threading.get_ident()}.tmp"
        else:
            tmp = Path(f"{dest}{self.suffix}")
        try:
            if self.style == "llm-d":
                with open(tmp, "wb") as f:
                    f.write(data)
            else:
                fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_TRUNC | os.O_DIRECT,
                             0o644)
                try:
                    buf = aligned(data)
                    assert os.write(fd, buf) == len(data)
                    buf.close()
                finally:
                    os.close(fd)
            os.replace(tmp, dest)
        except BaseException:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise

    def load(self, h: bytes, size: int) -> bytes:
        if self.style == "llm-d":
            with open(self.path(h), "rb") as f:
                return f.read()
        fd = os.open(self.path(h), os.O_RDONLY | os.O_DIRECT)
        try:
            buf = mmap.mmap(-1, size)
            assert os.readv(fd, [buf]) == size
            return bytes(buf)
        finally:
            os.close(fd)


def probe_o_direct(directory: Path) -> bool:
    """vLLM's check that O_DIRECT works in a directory: one aligned page, hidden name."""
    path = directory / f".o_direct_probe_{os.getpid()}.tmp"
    page = mmap.mmap(-1, mmap.PAGESIZE)
    try:
        fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | os.O_DIRECT, 0o644)
        try:
            os.write(fd, page)
        finally:
            os.close(fd)
        return True
    except OSError:
        return False
    finally:
        page.close()
        if os.path.exists(path):
            os.remove(path)


def test_vllm_and_llmd_fs_tier(mount):
    root = add_tenant(mount)
    for style in ("vllm", "llm-d", "hidden"):
        replay_fs_tier(mount, root, style)


def replay_fs_tier(mount: Mount, root: Path, style: str) -> None:
    model = f"org/tiny-{style}"
    tp, n_stored, n_asked, size = 2, 12, 16, 64 << 10
    tiers = [FsTier(root, model, rank, tp, style) for rank in range(tp)]
    assert probe_o_direct(root)  # O_DIRECT works through the mount
    for tier in tiers:
        tier.write_run_config()
    hashes = chain(n_asked)
    digests: dict[tuple[int, int], str] = {}

    # Store: many writer threads, as the I/O thread pools of both engines do.
    def store(rank: int, i: int) -> bool:
        data = payload(f"{style}/{rank}/{i}", size)
        digests[rank, i] = sha(data)
        return tiers[rank].store(hashes[i], data)

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(lambda a: store(*a),
                            [(r, i) for r in range(tp) for i in range(n_stored)]))

    # Where the namespaces are: the second level below the tenant.
    ns = os.path.relpath(tiers[0].dir, root).split(os.sep)[0]
    if style == "llm-d":
        assert ns == "org"  # a Hugging Face id nests: the organisation is the namespace
    else:
        assert ns.endswith("_r0") and counters(mount, ns)["files"] == n_stored
        assert counters(mount, tiers[1].dir.name)["files"] == n_stored

    # Lookup: the prefix stops at the first absent block, one failed lookup, one miss.
    hits0, misses0 = hits_misses(mount, ns)
    assert tiers[0].lookup(hashes) == n_stored
    assert hits_misses(mount, ns) == (hits0, misses0 + 1)

    # Load: every block verifies; every open for reading is one hit.
    def load(rank: int, i: int) -> bool:
        return sha(tiers[rank].load(hashes[i], size)) == digests[rank, i]

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(lambda i: load(0, i), range(n_stored)))
    assert hits_misses(mount, ns) == (hits0 + n_stored, misses0 + 1)
    assert all(load(1, i) for i in range(n_stored))

    # A second store of a present block writes nothing; llm-d's probe opens it (a hit).
    before = hits_misses(mount, ns)
    assert not tiers[0].store(hashes[0], payload("again", size))
    probe_hits = 1 if style == "llm-d" else 0
    assert hits_misses(mount, ns) == (before[0] + probe_hits, before[1])
    assert load(0, 0)

    # Two writers that both passed the existence check: the second rename replaces the
    # first file. A reader that opened the old one keeps reading it; a new open sees the new.
    p0 = tiers[0].path(hashes[0])
    with open(p0, "rb") as old:
        new = payload("replacement", size)
        tiers[0].write(hashes[0], new)
        assert sha(old.read()) == digests[0, 0]
    assert sha(tiers[0].load(hashes[0], size)) == sha(new)

    # No temporaries left behind; engine files are plain files to kvfs (LRU, no header check).
    for rank in range(tp):
        names = [f for _, _, files in os.walk(tiers[rank].dir) for f in files]
        assert len(names) == n_stored and all(f.endswith(".bin") for f in names)
    assert not_a_kvfs_block(p0)
    # The bytes are the backing file's: what a reader of the backing directory would get.
    backing = os.fsdecode(os.getxattr(p0, "user.kvfs.backing"))
    assert sha(Path(backing).read_bytes()) == sha(new)


# -- SGLang HiCache file backend -----------------------------------------------------------


def get_hash_str(token_ids: list[int], prior_hash: str | None = None) -> str:
    """SGLang's page key: sha256 over the previous key and the page's uint32 token ids."""
    hasher = hashlib.sha256()
    if prior_hash:
        hasher.update(bytes.fromhex(prior_hash))
    for t in token_ids:
        hasher.update(t.to_bytes(4, byteorder="little", signed=False))
    return hasher.hexdigest()


class HiCacheFile:
    """One TP rank of SGLang's `HiCacheFile`: a flat directory of `<key><suffix>.bin`.

    - "torch" (earlier versions): suffix `_<rank>_<tp>`; `torch.save(value, path)` straight to
      the final name, `torch.load(path)` to read.
    - "raw" (recent versions): suffix `_<model>_<rank>_<tp>`; raw tensor bytes written to
      `<path>.tmp.<pid>.<tid>.<uuid>` and `os.replace`d into place; read with `readinto`
      into the destination tensor.
    Both check `os.path.exists` before a write and answer `exists()` with it.
    """

    def __init__(self, directory: Path, rank: int, tp: int, style: str) -> None:
        self.dir, self.style = directory, style
        self.suffix = f"_{rank}_{tp}" if style == "torch" else f"_org-tiny_{rank}_{tp}"
        if not os.path.exists(directory) and rank == 0:
            os.makedirs(directory)

    def path(self, key: str) -> Path:
        return self.dir / f"{key}{self.suffix}.bin"

    def exists(self, key: str) -> bool:
        return os.path.exists(self.path(key))

    def batch_exists(self, keys: list[str]) -> int:
        for i, key in enumerate(keys):
            if not self.exists(key):
                return i
        return len(keys)

    def set(self, key: str, value: torch.Tensor) -> bool:
        if self.exists(key):
            return True
        path = self.path(key)
        if self.style == "torch":
            torch.save(value, path)
            return True
        tmp = Path(f"{path}.tmp.{os.getpid()}.1.{os.urandom(16).hex()}")
        with open(tmp, "wb") as f:
            f.write(host_view(value.contiguous()))
        os.replace(tmp, path)
        return True

    def get(self, key: str, target: torch.Tensor) -> torch.Tensor | None:
        path = self.path(key)
        try:
            if self.style == "torch":
                return torch.load(path)
            expected = target.numel() * target.element_size()
            with open(path, "rb", buffering=0) as f:
                if f.readinto(host_view(target)) != expected:
                    raise OSError(f"short read of {path}")
            return target
        except FileNotFoundError:
            return None


def test_sglang_hicache_file(mount):
    root = add_tenant(mount)
    for style in ("torch", "raw"):
        replay_hicache_file(mount, root, style)


def replay_hicache_file(mount: Mount, root: Path, style: str) -> None:
    ns = f"hicache-{style}"  # SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR=<mount>/<tenant>/<ns>
    tp, n_stored, n_asked, page_tokens = 2, 6, 10, 16
    shape = (page_tokens, 3, 2, 2, 8)  # tokens, layers, K/V, heads, head dim
    ranks = [HiCacheFile(root / ns, rank, tp, style) for rank in range(tp)]
    keys, prev = [], None
    for i in range(n_asked):
        prev = get_hash_str(list(range(i * page_tokens, (i + 1) * page_tokens)), prev)
        keys.append(prev)

    written: dict[tuple[int, int], torch.Tensor] = {}
    digests: dict[tuple[int, int], str] = {}
    for rank, backend in enumerate(ranks):
        for i in range(n_stored):
            g = torch.Generator().manual_seed(rank * 1000 + i)
            value = torch.randn(shape, generator=g).to(torch.bfloat16)
            written[rank, i] = value
            digests[rank, i] = sha(host_view(value))
            assert backend.set(keys[i], value)
    # One flat directory: every rank's pages side by side, nothing else.
    names = sorted(os.listdir(root / ns))
    assert names == sorted(b.path(keys[i]).name for b in ranks for i in range(n_stored))

    # Lookups: a page that is absent is one miss, a present one costs nothing...
    hits0, misses0 = hits_misses(mount, ns)
    assert ranks[0].batch_exists(keys) == n_stored
    assert hits_misses(mount, ns) == (hits0, misses0 + 1)
    assert [ranks[1].exists(k) for k in keys[n_stored:]] == [False] * (n_asked - n_stored)
    misses = misses0 + 1 + n_asked - n_stored
    assert hits_misses(mount, ns) == (hits0, misses)
    # (A name not asked for before: kvfs counts repeated lookups of one absent name within a
    # minute as one miss, so that exists() and the create that follows are one miss.)
    unseen = get_hash_str(list(range(page_tokens)), keys[-1])
    assert ranks[0].get(unseen, torch.empty(shape, dtype=torch.bfloat16)) is None
    assert hits_misses(mount, ns) == (hits0, misses + 1)

    # ...and each read of a present page is one open for reading: one hit.
    for rank, backend in enumerate(ranks):
        for i in range(n_stored):
            got = backend.get(keys[i], torch.empty(shape, dtype=torch.bfloat16))
            assert got is not None and torch.equal(got, written[rank, i])
            assert sha(host_view(got.contiguous())) == digests[rank, i]
    assert hits_misses(mount, ns) == (hits0 + tp * n_stored, misses + 1)

    # Raw read-back through the mount equals the backing file, and decodes to the tensor.
    for i in range(n_stored):
        path = ranks[1].path(keys[i])
        raw = path.read_bytes()
        assert raw == Path(os.fsdecode(os.getxattr(path, "user.kvfs.backing"))).read_bytes()
        if style == "torch":
            assert torch.equal(torch.load(io.BytesIO(raw)), written[1, i])
        else:
            assert sha(raw) == digests[1, i]
    assert counters(mount, ns)["files"] == tp * n_stored


# -- LMCache local disk backend ------------------------------------------------------------


class LocalDisk:
    """LMCache's `LocalDiskBackend` file I/O: `<local_disk>/<key with / as ->.pt`, written
    in place at its final name (no temporary), with O_DIRECT when the size is a multiple of
    `statvfs().f_bsize` and `use_odirect` is set, else buffered; an in-memory index of what it
    wrote, in LRU order."""

    def __init__(self, directory: Path, use_odirect: bool = True) -> None:
        self.dir = directory
        os.makedirs(directory, exist_ok=True)
        self.bs = os.statvfs(directory).f_bsize
        self.use_odirect = use_odirect
        self.index: OrderedDict[str, str] = OrderedDict()  # file name -> sha256, LRU first

    def name(self, i: int) -> str:
        return f"vllm@org/tiny@1@0@{i:016x}".replace("/", "-") + ".pt"

    def write(self, name: str, data: bytes) -> None:
        path = self.dir / name
        if len(data) % self.bs or not self.use_odirect:
            with open(path, "wb") as f:
                f.write(data)
        else:
            fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o644)
            try:
                buf = aligned(data)
                assert os.write(fd, buf) == len(data)
                buf.close()
            finally:
                os.close(fd)
        self.index[name] = sha(data)

    def read(self, name: str, size: int) -> bytes:
        path = self.dir / name
        if size % self.bs or not self.use_odirect:
            buf = bytearray(size)
            with open(path, "rb") as f:
                assert f.readinto(buf) == size
            data = bytes(buf)
        else:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            with os.fdopen(fd, "rb", buffering=0) as f:
                mbuf = mmap.mmap(-1, size)
                assert f.readinto(mbuf) == size
                data = bytes(mbuf)
        self.index.move_to_end(name)
        return data

    def free_bytes(self) -> int:
        st = os.statvfs(self.dir)
        return st.f_bavail * st.f_frsize


def test_lmcache_local_disk_statvfs_eviction_loop(mount_factory):
    """An engine that evicts for itself (listdir + statvfs + remove) keeps working under a
    kvfs capacity: statvfs shows the capacity, the loop ends, and what it keeps verifies."""
    m = mount_factory(extra=["--capacity", "4M"])
    root = add_tenant(m)
    ns = "lmcache"
    disk = LocalDisk(root / ns)
    st = os.statvfs(disk.dir)
    assert st.f_blocks * st.f_frsize == 4 << 20  # df shows the capacity, not the disk
    chunk, reserve = 256 << 10, 1 << 20
    sizes = {}
    removed = iterations = 0
    for i in range(40):
        name = disk.name(i)
        size = chunk if i % 5 else chunk - 100  # an unaligned size takes the buffered path
        # Admission: remove least recently used files while statvfs shows too little room.
        while disk.free_bytes() < size + reserve:
            iterations += 1
            assert iterations < 200, "the eviction loop does not end"
            present = os.listdir(disk.dir)
            victim = next(n for n in disk.index if n in present)
            os.remove(disk.dir / victim)
            del disk.index[victim]
            removed += 1
        disk.write(name, payload(name, size))
        sizes[name] = size
        if i % 3 == 2:  # a hit on an older chunk makes it the most recently used
            old = next(iter(disk.index))
            assert sha(disk.read(old, sizes[old])) == disk.index[old]

    assert removed > 0  # the loop ran, and ended (bounded above)
    # What the engine believes is what is there, and all of it verifies.
    assert sorted(os.listdir(disk.dir)) == sorted(disk.index)
    for name, digest in list(disk.index.items()):
        assert sha(disk.read(name, sizes[name])) == digest
    # In-place overwrite at an offset (open "r+b"), then read back.
    name = next(n for n in disk.index if sizes[n] == chunk)
    patch = payload("patch", 2 * PAGE)
    expected = bytearray(disk.read(name, chunk))
    expected[3 * PAGE:5 * PAGE] = patch
    with open(disk.dir / name, "r+b") as f:
        f.seek(3 * PAGE)
        f.write(patch)
    assert disk.read(name, chunk) == bytes(expected)
    # The engine stayed below the watermark: kvfs had nothing to evict.
    c = counters(m, ns)
    assert c["evictions"] == 0
    assert c["bytes"] == sum(sizes[n] for n in disk.index) <= (4 << 20) - reserve


def test_lmcache_local_disk_without_its_own_eviction(mount_factory):
    """With the engine's own limit out of the way, kvfs evicts: writes keep succeeding, the
    least recently used files go, what stays verifies, and the engine's stale index entries
    are files that are gone (the engine must take that as a miss)."""
    m = mount_factory(extra=["--capacity", "4M"])
    root = add_tenant(m)
    ns = "lmcache"
    disk = LocalDisk(root / ns)
    chunk = 256 << 10
    order = []
    for i in range(40):
        name = disk.name(i)
        disk.write(name, payload(name, chunk))
        order.append(name)
    present = set(os.listdir(disk.dir))
    kept = [n for n in order if n in present]
    assert 0 < len(kept) < len(order)
    assert kept == order[-len(kept):]  # plain LRU: the oldest went first
    for name in kept:
        assert sha(disk.read(name, chunk)) == disk.index[name]
    gone = order[0]
    with pytest.raises(FileNotFoundError):
        disk.read(gone, chunk)
    c = counters(m, ns)
    assert c["evictions"] == len(order) - len(kept)
    assert c["bytes"] == len(kept) * chunk <= 4 << 20


# -- LMCache GDS backend -------------------------------------------------------------------


def pack_metadata(shape: list[int], nbytes: int) -> bytes:
    """LMCache GDS's 4 KiB header: an 8-byte length, then space-padded JSON."""
    meta = json.dumps({"kvcache": {"dtype": "BF16", "shape": shape, "data_offsets": [0, nbytes],
                                   "fmt": 1, "__metadata__": {"lmcache_version": "1"}}}).encode()
    meta += b" " * (PAGE - 8 - len(meta))
    return struct.pack("<Q", len(meta)) + meta


def test_lmcache_gds(mount):
    root = add_tenant(mount)
    for io_path in ("o_direct", "mmap"):
        replay_gds(mount, root, io_path)


def replay_gds(mount: Mount, root: Path, io_path: str) -> None:
    """LMCache's GDS backend with `use_direct_io` (cuFile's POSIX I/O: O_DIRECT at 4 KiB
    aligned offsets into aligned buffers) or with `use_gds: false` (its POSIX fallback: the
    file mapped with mmap). Layout: <gds_path>/<h[:2]>/<h[2:4]>/<quoted key>.kvcache.safetensors,
    a 4 KiB header then the payload, written under a `.tmp<8 hex>` name and renamed; plus a
    `.metadata` file beside it, also renamed into place."""
    ns = f"lmcache-gds-{io_path}"
    gds = root / ns
    os.makedirs(gds, exist_ok=True)
    size = 128 << 10
    files: dict[Path, str] = {}
    for i in range(8):
        chunk_hash = hashlib.sha256(f"chunk{i}".encode()).hexdigest()
        key = f"vllm@org/tiny@1@0@{chunk_hash}"
        path = gds / chunk_hash[:2] / chunk_hash[2:4] / (
            urllib.parse.quote(key, safe="") + ".kvcache.safetensors")
        os.makedirs(path.parent, exist_ok=True)
        tmp = Path(f"{path}.tmp{os.urandom(4).hex()}")
        data = payload(key, size)
        meta = pack_metadata([size // 2], size)
        with open(tmp, "wb") as f:
            f.write(meta)
        if io_path == "o_direct":
            fd = os.open(tmp, os.O_RDWR | os.O_DIRECT)
            try:
                buf = aligned(data)
                assert os.pwritev(fd, [buf], PAGE) == size
                buf.close()
            finally:
                os.close(fd)
        else:
            fd = os.open(tmp, os.O_RDWR)
            os.ftruncate(fd, PAGE + size)
            mm = mmap.mmap(fd, PAGE + size, prot=mmap.PROT_WRITE, flags=mmap.MAP_SHARED)
            os.close(fd)  # the mapping outlives the descriptor, as in LMCache
            mm[PAGE:] = data
            mm.close()
        os.rename(tmp, path)
        mtmp = Path(f"{path}.metadata.tmp{os.urandom(4).hex()}")
        mtmp.write_bytes(meta)
        os.rename(mtmp, f"{path}.metadata")
        files[path] = sha(data)

    hits0, _ = hits_misses(mount, ns)
    for path, digest in files.items():
        # The header, as LMCache reads it at startup (O_NOATIME, one 4 KiB read).
        fd = os.open(f"{path}.metadata", os.O_RDONLY | os.O_NOATIME)
        try:
            head = os.read(fd, PAGE)
        finally:
            os.close(fd)
        (n,) = struct.unpack("<Q", head[:8])
        assert json.loads(head[8:8 + n].rstrip(b" "))["kvcache"]["data_offsets"] == [0, size]
        if io_path == "o_direct":
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            try:
                buf = mmap.mmap(-1, size)
                assert os.preadv(fd, [buf], PAGE) == size
                assert sha(buf) == digest
                hbuf = mmap.mmap(-1, PAGE)
                assert os.preadv(fd, [hbuf], 0) == PAGE and bytes(hbuf) == head
            finally:
                os.close(fd)
        else:
            fd = os.open(path, os.O_RDONLY)
            file_size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, file_size, prot=mmap.PROT_READ,
                           flags=mmap.MAP_PRIVATE | mmap.MAP_POPULATE)
            os.close(fd)
            assert file_size == PAGE + size and sha(mm[PAGE:]) == digest
            mm.close()
        # What a cuFile reader pointed at the backing file would read: the same bytes.
        backing = os.fsdecode(os.getxattr(path, "user.kvfs.backing"))
        fd = os.open(backing, os.O_RDONLY | os.O_DIRECT)
        try:
            buf = mmap.mmap(-1, size)
            assert os.preadv(fd, [buf], PAGE) == size and sha(buf) == digest
        finally:
            os.close(fd)
    assert hits_misses(mount, ns)[0] == hits0 + 2 * len(files)  # data and metadata opens
    assert counters(mount, ns)["files"] == 2 * len(files)


# -- the kvfs client -----------------------------------------------------------------------


def test_kvfs_client_round_trip(mount):
    """Rank 0 uses the direct path (the backing files), rank 1 goes through the mount."""
    root = add_tenant(mount)
    tp = 2
    for rank in range(tp):
        direct = rank == 0
        spec = kvfs_pkg.ModelSpec(model="org/tiny", revision="r1", kv_dtype="bfloat16",
                                  block_size=4, num_layers=3, num_kv_heads=2, head_dim=8,
                                  tp_size=tp, tp_rank=rank)
        with KVCache.open(mount.mnt, tenant=TENANT, spec=spec, direct=direct) as cache:
            assert cache.direct is direct
            hashes = cache.block_hashes(list(range(6 * spec.block_size)))
            g = torch.Generator().manual_seed(rank)
            kv = torch.randn((len(hashes), *spec.block_shape), generator=g).to(torch.bfloat16)
            digest = sha(host_view(kv))
            assert cache.save(hashes[:4], kv[:4]) == 4
            assert cache.save(hashes, kv) == 2  # the first four are there already
            absent = cache.block_hashes(list(range(100, 104)), parent=hashes[-1])
            assert cache.lookup(hashes + absent) == len(hashes)
            out = torch.zeros_like(kv)
            assert cache.load(hashes, out) == len(hashes)
            assert torch.equal(out, kv) and sha(host_view(out)) == digest
        # Each rank is its own namespace; its blocks are kvfs-native, chain and all.
        ns = root / spec.namespace
        c = counters(mount, spec.namespace)
        assert c["files"] == len(hashes) + 1  # the blocks and manifest.json
        assert c["hit_blocks"] == len(hashes) and c["miss_blocks"] == len(absent)
        last = ns / hashing.block_relpath(hashes[-1])
        assert os.getxattr(last, "user.kvfs.block_hash") == hashes[-1].hex().encode()
        assert os.getxattr(last, "user.kvfs.parent_hash") == hashes[-2].hex().encode()
        names = sorted(str(p.relative_to(ns)) for p in ns.rglob("*") if p.is_file())
        assert names == sorted(["manifest.json",
                                *(hashing.block_relpath(h) for h in hashes)])


# -- what the mount counts -----------------------------------------------------------------


def test_temporaries_are_not_cache_misses(mount):
    """vLLM, llm-d, recent SGLang and LMCache GDS all store a block as: exists(name)? no ->
    write <name>_<n>.tmp -> rename onto <name>. One cache lookup failed per block: one miss."""
    root = add_tenant(mount)
    ns = root / "engine"
    (ns / "abc").mkdir(parents=True)
    before = hits_misses(mount, "engine")
    blocks = 4
    for i in range(blocks):
        dest = ns / "abc" / f"{i:064x}.bin"
        assert not dest.exists()
        tmp = Path(f"{dest}_1234.tmp")
        tmp.write_bytes(payload(i, PAGE))
        os.replace(tmp, dest)
    assert hits_misses(mount, "engine") == (before[0], before[1] + blocks)
    # New directories are creations too, not misses (os.makedirs would probe with exists()
    # first: an application's failed lookup, which is a miss).
    for d in (ns / "x", ns / "x" / "y", ns / "x" / "y" / "z"):
        os.mkdir(d)
    assert hits_misses(mount, "engine") == (before[0], before[1] + blocks)
