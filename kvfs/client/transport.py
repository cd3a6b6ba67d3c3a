"""How the client moves block bytes between backing files and tensors.

A transport reads byte ranges of an open block file into *destinations*: 1-D uint8 tensors
(views of the caller's KV memory) that lie back to back in the file. Two transports:

- :class:`PosixTransport`: `os.preadv` straight into host tensors, called from the client's
  thread pool. For a CUDA destination it reads into a pinned host staging buffer, then copies
  to the device (`copy_(non_blocking=True)` on a per-thread stream, synchronized before the
  buffer is reused). The pinned buffers (one block each, up to one per I/O thread) are made
  on first use; pinning memory is slow on some hosts, so the first CUDA load pays for it.
- :class:`KvikioTransport`: kvikio's `CuFile.pread` straight into CUDA tensors (GPUDirect
  Storage where cuFile supports the backing filesystem, kvikio's POSIX compatibility mode
  elsewhere). Host destinations go through the POSIX path.

Writes always go from host memory (the header's checksum needs the bytes on the host
anyway), with :func:`pwritev_all`. Selection (:func:`select`) is automatic; the environment
variable ``KVFS_IO=posix|kvikio`` forces one. Nothing here imports kvikio until it is chosen.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import importlib
import logging
import os
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from ..format import blockfile

log = logging.getLogger(__name__)

#: Payloads larger than this are read and checksummed in pieces of this size: each piece is
#: hashed right after it lands, while it is still in this core's cache (L2-sized pieces
#: measured best: 6.3 GB/s read+hash against 5.7 for 1 MiB pieces and 4.6 for read-then-hash
#: of a 64 MiB block from the page cache, 7.6 for the read alone, on one core). Checked
#: again on a 2-core host with 1 and 4 MiB blocks, 1 and 4 threads, interleaved: 64 and
#: 128 KiB pieces were slower (more transfers per block), 512 KiB no better.
HASH_PIECE = 256 << 10
#: A checksummed payload of at most this many bytes is read with the header in one transfer,
#: then hashed whole (still in this core's cache: L2 is 1-2 MiB per core on current server
#: CPUs), as the verified-read baseline does: pieces would add transfers and no cache hits.
ONE_READ_BYTES = 1 << 20
#: preadv2's RWF_NOWAIT (Linux): a piece read with it that would wait for the disk comes back
#: short instead, which tells a cold block from a cached one at no extra call (0: not here).
NOWAIT = getattr(os, "RWF_NOWAIT", 0)
#: Buffers per preadv call at most (Linux's IOV_MAX).
IOV_MAX = 1024
#: kvikio settings: its thread pool splits each read into tasks of this size.
KVIKIO_THREADS = 16
KVIKIO_TASK_SIZE = 1 << 20


def host_view(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (no copy, no numpy)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("host_view needs a contiguous CPU tensor")
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")


def checksum(views: list[memoryview]) -> int:
    """The payload checksum (:func:`kvfs.format.blockfile.payload_checksum`) of bytes given in
    pieces."""
    if len(views) == 1:
        return blockfile.payload_checksum(views[0])
    x = xxhash.xxh3_64()  # streaming: the same digest as over the concatenation
    for v in views:
        x.update(v)
    return x.intdigest()


def _advance(bufs: list[memoryview], n: int) -> list[memoryview]:
    """What is left of an iovec list after `n` bytes were transferred."""
    out = []
    for b in bufs:
        if n >= b.nbytes:
            n -= b.nbytes
            continue
        out.append(b[n:])
        n = 0
    return out


def preadv_all(fd: int, bufs: list[memoryview], offset: int) -> int:
    """`os.preadv` until every buffer is full or the file ends; returns the bytes read."""
    total = 0
    while bufs:
        n = os.preadv(fd, bufs, offset + total)
        if n == 0:
            break
        total += n
        bufs = _advance(bufs, n)
    return total


def _pieces(views: list[memoryview], size: int) -> Iterator[list[memoryview]]:
    """``views`` cut into consecutive iovec lists of ``size`` bytes (the last one shorter)."""
    piece: list[memoryview] = []
    filled = 0
    for v in views:
        off = 0
        while off < v.nbytes:
            take = min(size - filled, v.nbytes - off)
            piece.append(v[off:off + take])
            filled += take
            off += take
            if filled == size:
                yield piece
                piece, filled = [], 0
    if piece:
        yield piece


def _fill(fd: int, bufs: list[memoryview], offset: int, need: int) -> int:
    """`os.preadv` of ``bufs`` from ``offset`` until ``need`` bytes are in or the file ends;
    returns the bytes read. Buffers past the first ``need`` bytes take what the transfers
    that fill those bring, with no transfer of their own."""
    n = got = os.preadv(fd, bufs, offset)
    while got and n < need:  # a short transfer: go on from where it stopped
        bufs = _advance(bufs, got)
        got = os.preadv(fd, bufs, offset + n)
        n += got
    return n


def read_file(path: str | int, header: memoryview, views: list[memoryview], probe: memoryview,
              want_checksum: bool) -> tuple[int, int | None]:
    """Open ``path``, read ``header``, ``views`` and ``probe`` back to back from offset 0, close
    (``path`` an fd: read from it, left open: positional reads, so threads may share it).

    The host path of a block load: one `open`, one `preadv` (one per piece for a payload
    hashed in pieces, more after a short transfer), one `close`. Returns the bytes read,
    ``probe`` included (so a file longer than header + views + probe shows as a count that
    fills the probe; one of the right size leaves its last byte empty), and, if asked, the
    checksum of the bytes in ``views`` (None if the file ended before they were full). The
    probe's count is exact unless a transfer stops short of the file's end exactly where the
    payload ends: then a longer file looks the right size. Its header and payload were still
    read and checked in full, so that costs no wrong bytes, only the size check's strictness.
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC) if isinstance(path, str) else path
    try:
        payload = views[0].nbytes if len(views) == 1 else sum(v.nbytes for v in views)
        if not want_checksum or payload <= ONE_READ_BYTES:
            # Transfers go on until header and payload are full (or the file ends); the
            # probe takes what the last one brings. So a sound file costs one preadv, where
            # reading to the end of the file would cost a second one that returns 0.
            need = header.nbytes + payload
            n = _fill(fd, [header, *views, probe], 0, need)
            if not want_checksum or n < need:
                return n, None
            return n, xxhash.xxh3_64_intdigest(views[0]) if len(views) == 1 else checksum(views)
        # Piece by piece, each hashed right after it lands: the header travels with the
        # first piece and the probe with the last, so that a block costs one transfer per
        # piece (each a release and a retake of the GIL: with more I/O threads than cores,
        # every retake may wait).
        if len(views) == 1:
            v = views[0]
            pieces = [[v[o:o + HASH_PIECE]] for o in range(0, payload, HASH_PIECE)]
        else:
            pieces = list(_pieces(views, HASH_PIECE))
        # Each piece is asked for without waiting for the disk (RWF_NOWAIT): from the page
        # cache that changes nothing; a piece that is not all there (a cold block) comes
        # back short, and the rest of the block is then read in one transfer, as raw preadv
        # reads it (one large request the disk serves at its speed, where one request per
        # piece would leave it idle between them), and hashed after.
        last = len(pieces) - 1
        x = xxhash.xxh3_64()  # streaming: the digest of the whole payload
        n = 0
        nowait = NOWAIT
        for k, piece in enumerate(pieces):
            size = piece[0].nbytes if len(piece) == 1 else sum(p.nbytes for p in piece)
            if k == 0:
                size += header.nbytes
                bufs = [header, *piece, probe] if k == last else [header, *piece]
            else:
                bufs = [*piece, probe] if k == last else piece
            got = -1
            if nowait:
                try:
                    got = os.preadv(fd, bufs, n, nowait)
                except BlockingIOError:
                    got = 0
                except OSError as exc:  # a filesystem without it (EOPNOTSUPP): plain reads
                    if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                        raise
                    nowait = 0
            if 0 <= got < size:  # not all in the page cache: the rest in one transfer
                rest = _advance(bufs + [v for p in pieces[k + 1:] for v in p]
                                + ([probe] if k != last else []), got)
                need = header.nbytes + payload - n
                for a in range(0, len(rest), IOV_MAX):  # one transfer, unless too many
                    if got < need:
                        got += _fill(fd, rest[a:a + IOV_MAX], n + got, need - got)
                n += got
                if got < need:  # the file ends early: the caller sees the short count
                    return n, None
                for p in (v for q in pieces[k:] for v in q):
                    x.update(p)
                return n, x.intdigest()
            if got < 0:
                got = _fill(fd, bufs, n, size)
            n += got
            if got < size:  # the file ends early: the caller sees the short count
                return n, None
            for p in piece:
                x.update(p)
        return n, x.intdigest()
    finally:
        if isinstance(path, str):
            os.close(fd)


def pwritev_all(fd: int, bufs: list[memoryview], offset: int) -> None:
    """`os.pwritev` until every buffer is written."""
    bufs = [b for b in bufs if b.nbytes]
    total = 0
    while bufs:
        n = os.pwritev(fd, bufs, offset + total)
        total += n
        bufs = _advance(bufs, n)


def pwrite_hashed(fd: int, views: list[memoryview], offset: int) -> int:
    """Write ``views`` back to back from ``offset`` and return their checksum (as
    :func:`checksum`), each :data:`HASH_PIECE` hashed right before it is written: the write's
    copy then reads it from this core's cache, where hashing it all first and writing it
    after fetches every byte from memory twice (the mirror of :func:`read_file`)."""
    x = xxhash.xxh3_64()  # streaming: the digest of the whole payload
    for piece in _pieces(views, HASH_PIECE):
        for p in piece:
            x.update(p)
        pwritev_all(fd, piece, offset)
        offset += piece[0].nbytes if len(piece) == 1 else sum(p.nbytes for p in piece)
    return x.intdigest()


@dataclass
class OpenBlock:
    """A block file open for reading."""

    fd: int
    cufile: Any = None  # kvikio.CuFile, opened on first use for a CUDA destination


class _PinnedPool:
    """Pinned host buffers of a fixed size, created on demand up to `count`."""

    def __init__(self, nbytes: int, count: int) -> None:
        self.nbytes, self.count = nbytes, count
        self._free: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()
        self._made = 0
        self._lock = threading.Lock()

    def get(self, nbytes: int) -> torch.Tensor:
        if nbytes > self.nbytes:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        with self._lock:
            make = self._made < self.count and self._free.empty()
            self._made += make
        if make:
            return torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True)
        return self._free.get()

    def put(self, buf: torch.Tensor) -> None:
        if buf.numel() == self.nbytes:
            self._free.put(buf)


class PosixTransport:
    """Threaded preadv into host memory; pinned staging for CUDA destinations."""

    name = "posix"

    def __init__(self, staging_bytes: int, staging_buffers: int) -> None:
        self._pinned = _PinnedPool(staging_bytes, staging_buffers)
        self._local = threading.local()

    def reads_to_host(self, t: torch.Tensor) -> bool:
        """Whether the client reads blocks for ``t`` straight into its memory (host views)."""
        return t.device.type == "cpu"

    def device_verifies(self, t: torch.Tensor) -> bool:
        """Whether bytes read into ``t`` land where the host never sees them, so that a load
        verifies them there (payload sums, :mod:`kvfs.client.devsum`) rather than by xxh3 on the
        host. Here: never (CUDA destinations are staged through host memory, and hashed
        there)."""
        return False

    def open(self, path: str) -> OpenBlock:
        return OpenBlock(os.open(path, os.O_RDONLY | os.O_CLOEXEC))

    def close(self, f: OpenBlock) -> None:
        if f.cufile is not None:
            f.cufile.close()
        os.close(f.fd)

    def size(self, f: OpenBlock) -> int:
        return os.fstat(f.fd).st_size

    def read(self, f: OpenBlock, offset: int, dests: list[torch.Tensor],
             header: bytearray | None = None, want_checksum: bool = False
             ) -> tuple[int, int | None]:
        """Read `header` (if given) then `dests`, back to back from `offset`.

        Returns the bytes read (less than asked at the end of the file) and, if asked, the
        checksum of the bytes that went into `dests`.
        """
        if dests[0].device.type == "cuda":
            return self._read_staged(f, offset, dests, header, want_checksum)
        views = [host_view(d) for d in dests]
        head = [memoryview(header)] if header is not None else []
        if not want_checksum or sum(v.nbytes for v in views) <= HASH_PIECE:
            n = preadv_all(f.fd, head + views, offset)
            return n, checksum(views) if want_checksum else None
        # A large payload is read and hashed piece by piece, each piece hashed while it is
        # still in this core's cache: hashing it all after the read would fetch every byte
        # from memory a second time.
        n = 0
        if header is not None:
            n = preadv_all(f.fd, head, offset)
            if n < len(header):
                return n, None
        x = xxhash.xxh3_64()  # streaming: the digest of the whole payload
        for piece in _pieces(views, HASH_PIECE):
            want = sum(p.nbytes for p in piece)
            got = preadv_all(f.fd, piece, offset + n)
            n += got
            if got < want:  # the file ends early: the caller sees the short count
                return n, None
            for p in piece:
                x.update(p)
        return n, x.intdigest()

    def checksum(self, dests: list[torch.Tensor]) -> int:
        """Checksum of `dests` (a host copy first where they are on a CUDA device)."""
        if dests[0].device.type != "cuda":
            return checksum([host_view(d) for d in dests])
        total = sum(d.numel() for d in dests)
        buf = self._pinned.get(total)
        try:
            with self._on_stream(dests[0].device) as stream:
                off = 0
                for d in dests:
                    buf[off:off + d.numel()].copy_(d, non_blocking=True)
                    off += d.numel()
                stream.synchronize()
            return checksum([host_view(buf[:total])])
        finally:
            self._pinned.put(buf)

    def _read_staged(self, f: OpenBlock, offset: int, dests: list[torch.Tensor],
                     header: bytearray | None, want_checksum: bool) -> tuple[int, int | None]:
        total = sum(d.numel() for d in dests)
        buf = self._pinned.get(total)
        try:
            head = [memoryview(header)] if header is not None else []
            n = preadv_all(f.fd, [*head, host_view(buf[:total])], offset)
            with self._on_stream(dests[0].device) as stream:
                off = 0
                for d in dests:
                    d.copy_(buf[off:off + d.numel()], non_blocking=True)
                    off += d.numel()
                csum = checksum([host_view(buf[:total])]) if want_checksum else None
                stream.synchronize()
            return n, csum
        finally:
            self._pinned.put(buf)

    @contextlib.contextmanager
    def _on_stream(self, device: torch.device) -> Iterator[Any]:
        """This thread's own copy stream on `device`, made current for the `with` block."""
        streams = self._local.__dict__.setdefault("streams", {})
        s = streams.get(device)
        if s is None:
            s = streams[device] = torch.cuda.Stream(device=device)
        with torch.cuda.stream(s):
            yield s


class KvikioTransport(PosixTransport):
    """kvikio `CuFile.pread` into CUDA tensors; host destinations take the POSIX path.

    The header is read with a plain `pread`. Bytes that landed in GPU memory are verified
    there (:meth:`device_verifies`): the client checks a version 2 block's payload sums with
    torch ops on the device. Only a version 1 block (no sums) needs :meth:`checksum`, a copy
    to the host and xxh3 there.
    """

    name = "kvikio"

    def __init__(self, staging_bytes: int, staging_buffers: int) -> None:
        super().__init__(staging_bytes, staging_buffers)
        import kvikio  # noqa: PLC0415 - only where chosen

        self._kvikio = kvikio
        self._open_lock = threading.Lock()
        configure_kvikio(kvikio)

    def device_verifies(self, t: torch.Tensor) -> bool:
        return t.device.type == "cuda"

    def read(self, f: OpenBlock, offset: int, dests: list[torch.Tensor],
             header: bytearray | None = None, want_checksum: bool = False
             ) -> tuple[int, int | None]:
        if dests[0].device.type != "cuda":
            return super().read(f, offset, dests, header, want_checksum)
        n = 0
        if header is not None:
            n = preadv_all(f.fd, [memoryview(header)], offset)
            if n < len(header):
                return n, None
        if f.cufile is None:
            with self._open_lock:  # the layers of one block may be read by several threads
                if f.cufile is None:  # the very file whose header was read, even if unlinked
                    f.cufile = self._kvikio.CuFile(f"/proc/self/fd/{f.fd}", "r")
        pos = offset + n
        futures = []
        for d in dests:
            futures.append(f.cufile.pread(d, d.numel(), pos))
            pos += d.numel()
        n += sum(fut.get() for fut in futures)
        return n, self.checksum(dests) if want_checksum else None


def kvikio_module(kvikio: Any, name: str) -> Any:
    """A submodule of kvikio (``defaults``, ``cufile_driver``), or None if it has none."""
    try:
        return importlib.import_module(f"kvikio.{name}")
    except ImportError:
        return getattr(kvikio, name, None)


def configure_kvikio(kvikio: Any) -> None:
    """Set kvikio's thread pool and task size with whichever API this version has."""
    d = kvikio_module(kvikio, "defaults")
    if d is None:
        log.warning("kvikio has no defaults module: its thread pool is left as it is")
        return
    if hasattr(d, "set"):  # kvikio >= 25.02
        try:
            d.set({"num_threads": KVIKIO_THREADS, "task_size": KVIKIO_TASK_SIZE})
            return
        except Exception as exc:  # noqa: BLE001 - older key names: try the old API
            log.debug("kvikio.defaults.set failed (%s); trying the older API", exc)
    if hasattr(d, "num_threads_reset"):
        d.num_threads_reset(KVIKIO_THREADS)
    if hasattr(d, "task_size_reset"):
        d.task_size_reset(KVIKIO_TASK_SIZE)


def kvikio_compat_mode(kvikio: Any) -> str:
    """Whether kvikio reads through cuFile ("off": GDS possible) or POSIX ("on"), as text."""
    d = kvikio_module(kvikio, "defaults")
    try:
        mode = d.get("compat_mode") if hasattr(d, "get") else d.compat_mode()
        text = str(getattr(mode, "name", mode)).lower()
        if text == "auto" and hasattr(d, "is_compat_mode_preferred"):
            text += f" (inferred {'on' if d.is_compat_mode_preferred() else 'off'})"
    except Exception as exc:  # noqa: BLE001 - report, never fail on a probe
        return f"unknown ({exc})"
    return text


def cuda_driver_loads() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def select(io: str | None, staging_bytes: int, staging_buffers: int) -> PosixTransport:
    """The transport for `io` ("posix", "kvikio", or None: $KVFS_IO, else automatic)."""
    io = io or os.environ.get("KVFS_IO") or None
    if io not in (None, "posix", "kvikio"):
        raise ValueError(f"unknown I/O transport {io!r}: use posix or kvikio")
    if io == "posix":
        return PosixTransport(staging_bytes, staging_buffers)
    gpu = torch.cuda.is_available() and cuda_driver_loads()
    if io == "kvikio":
        if not gpu:
            raise RuntimeError("KVFS_IO=kvikio needs a CUDA device and driver; none is usable")
        return KvikioTransport(staging_bytes, staging_buffers)  # ImportError if not installed
    if gpu:
        try:
            return KvikioTransport(staging_bytes, staging_buffers)
        except ImportError:
            log.info("kvikio is not installed: CUDA loads go through pinned host buffers")
    return PosixTransport(staging_bytes, staging_buffers)
