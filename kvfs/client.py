"""The kvfs client: save and load the KV blocks of one model through the direct path.

A :class:`KVCache` is one model namespace, ``<mount>/<tenant>/<spec.namespace>``, of a kvfs
mount. Bulk bytes go straight to the namespace's backing directory (which the daemon names
in the ``user.kvfs.backing`` xattr): `preadv` / kvikio reads into the caller's tensors, and
temporary files written with `pwritev` and renamed into place. The daemon hears about it in
a constant number of control calls per request (``user.kvfs.publish``, ``access``,
``corrupt``; see :mod:`kvfs.control`), never one per block: one per save, one per lookup +
load (the lookup's access record rides with the load's), sent by a control thread of the
client so that the request does not wait for the daemon. Where the backing directory is
not accessible to this process, the same reads and writes go through the mount (slower; the
daemon completes blocks renamed into place there itself).

Layouts (``spec`` = the namespace's :class:`~kvfs.hashing.ModelSpec`):

- contiguous: ``kv`` / ``out`` of shape ``[n, num_layers, 2, block_size, num_kv_heads,
  head_dim]`` in ``spec.kv_dtype``; block i is ``kv[i]``, the payload of its file.
- paged: ``layers``, one tensor per layer of shape ``[num_pages, 2, block_size,
  num_kv_heads, head_dim]``, and ``block_ids``: block i is page ``block_ids[i]`` of every
  layer. Layer l of a block is the contiguous slice at file offset 4096 + l * layer_bytes, so
  each page is read or written in place, with no copy of the whole context.

Integrity: every loaded block's header is checked (format, block hash, model fingerprint,
dtype, shape, file size) and, with ``verify="full"`` (the default), its payload checksum.
``verify="sampled"`` checksums a deterministic one-in-8 sample of blocks (chosen by hash),
for trusted media. A block that fails is a miss and so is every block after it: `load`
returns the length of the verified prefix, and the failed block's slice of ``out`` is
zeroed. A corrupt block is reported to the daemon (which re-verifies and quarantines it). A
block written for another spec (wrong fingerprint, dtype or shape in its header) is never
loaded either: it is a miss, logged as an error naming the difference. Raising instead would
let one stray file fail every request of a namespace, whereas a miss only costs a recompute.
A namespace whose manifest names another spec, though, is refused at :meth:`KVCache.open`
with :class:`SpecMismatch`: that is a configuration error, and nothing in it may be
reinterpreted.

CUDA tensors: a call first waits for the work queued on the caller's current stream (kernels
still writing ``kv`` or reading ``out``); bytes land through the transport (kvikio, or pinned
host buffers and the I/O threads' own streams), all synchronized before the call (or the
handle) returns. Saving copies each block to host memory: its checksum is computed there.

Every method may be called from several threads at once. A layer-wise load keeps the files of
all its blocks open, so opening a cache raises the process's soft open-file limit (up to
:data:`FD_LIMIT`, within the hard limit).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import queue
import resource
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import torch

from . import blockfile, control, devsum
from .hashing import ROOT_PARENT, ModelSpec
from .hashing import block_hashes as _block_hashes
from .layout import MANIFEST as _MANIFEST
from .layout import TEMP_PREFIX
from .transport import (
    OpenBlock,
    PosixTransport,
    checksum,
    host_view,
    preadv_all,
    pwritev_all,
    read_file,
)
from .transport import select as select_transport

log = logging.getLogger(__name__)

MANIFEST = os.fsdecode(_MANIFEST)
BACKING_XATTR = os.fsdecode(control.BACKING)
TIERS_XATTR = os.fsdecode(control.TIERS)
#: verify="sampled" checksums the blocks whose hash's last byte is a multiple of this.
SAMPLE_EVERY = 8
#: The soft open-file limit a client raises itself to (within the hard limit).
FD_LIMIT = 65536
#: Access records queued for the control thread beyond which a request waits for it.
MAX_QUEUED_RECORDS = 8
#: Seconds the control thread waits for a record before it ends (the next record starts
#: another): a client that is never closed does not keep a thread, nor itself, alive.
CONTROL_IDLE_S = 1.0
#: A load hands blocks to as many I/O threads as it has this many bytes for (at least one):
#: below that, a thread hand-off costs more than the read it would take over.
THREAD_BYTES = 1 << 20
_TEMP = os.fsdecode(TEMP_PREFIX)
_ZEROS = memoryview(bytes(blockfile.ALIGN))
_DTYPES = {name: getattr(torch, name) for name in blockfile.DTYPE_SIZES}
_COUNTERS = (
    "lookups", "hit_blocks", "miss_blocks",  # lookup()
    "loaded_blocks", "read_bytes", "needed_bytes", "corrupt_blocks", "mismatched_blocks",
    "saved_blocks", "present_blocks", "written_bytes", "dropped_saves", "failed_saves",
    "control_calls",  # setxattr calls on the namespace directory
)


class SpecMismatch(ValueError):
    """A namespace's manifest was written for another model spec."""


class CacheFull(OSError):
    """The daemon refused blocks: the hot tier (or the tenant's quota) is full."""


@dataclass(slots=True)
class _Outcome:
    """What reading one block gave."""

    read: int = 0  # bytes read from its file
    ok: bool = False
    error: Exception | None = None  # why it is not loaded, where that is more than "absent"
    # The payload sums its header records, to be checked where the bytes landed (a device
    # the host never reads) once the load's reads are done; ok stays False until then.
    sums: tuple[int, int, int] | None = None


@dataclass
class _Opened:
    """A block file opened, and its header checked, for a layer-wise load."""

    file: OpenBlock | None
    header: blockfile.BlockHeader | None
    outcome: _Outcome


class _Prefix:
    """The first failed block of a load, shared by its reader threads."""

    def __init__(self, n: int) -> None:
        self.end = n
        self._lock = threading.Lock()

    def fail(self, i: int) -> None:
        with self._lock:
            self.end = min(self.end, i)

    def beyond(self, i: int) -> bool:
        return i > self.end


class LoadHandle:
    """A load in flight (:meth:`KVCache.load_async`).

    :meth:`wait_layer` returns once layer ``l`` of every block has landed, with the number of
    leading blocks that have it: their headers were verified (right block, right model), but
    their payload checksums are checked only once every layer is in, so a model may compute
    layer ``l`` early but must take :meth:`wait`'s count as the truth before it uses the
    result (a block past that count is a miss, and its slice of ``out`` is zeroed).
    """

    def __init__(self, num_layers: int) -> None:
        self._layer = [threading.Event() for _ in range(num_layers)]
        self._layer_n = [0] * num_layers
        self._done = threading.Event()
        self._n = 0
        self._error: BaseException | None = None

    def _layer_ready(self, layer: int, n: int) -> None:
        self._layer_n[layer] = n
        self._layer[layer].set()

    def _finish(self, n: int, error: BaseException | None = None) -> None:
        self._n, self._error = n, error
        for layer, ev in enumerate(self._layer):
            if not ev.is_set():
                self._layer_ready(layer, 0)
        self._done.set()

    def wait_layer(self, layer: int, timeout: float | None = None) -> int:
        if not self._layer[layer].wait(timeout):
            raise TimeoutError(f"layer {layer} not loaded after {timeout} s")
        if self._error is not None:
            raise self._error
        return self._layer_n[layer]

    def wait(self, timeout: float | None = None) -> int:
        """The number of leading blocks loaded and verified."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"load not finished after {timeout} s")
        if self._error is not None:
            raise self._error
        return self._n

    def done(self) -> bool:
        return self._done.is_set()


class KVCache:
    """The blocks of one model namespace of a kvfs mount. Use :meth:`open`."""

    def __init__(
        self,
        ns_dir: str,
        data_dir: str,
        spec: ModelSpec,
        *,
        direct: bool,
        io: str | None = None,
        threads: int | None = None,
        verify: str = "full",
        fsync: bool = False,
        max_pending_saves: int = 8,
    ) -> None:
        if verify not in ("full", "sampled"):
            raise ValueError(f"verify must be 'full' or 'sampled', got {verify!r}")
        threads = threads or min(32, 4 * (os.cpu_count() or 1))
        self.ns_dir, self.data_dir, self.spec, self.direct = ns_dir, data_dir, spec, direct
        self.verify, self.fsync = verify, fsync
        self._full = verify == "full"
        self.transport: PosixTransport = select_transport(io, spec.block_payload_bytes, threads)
        self._dtype = _DTYPES[spec.kv_dtype]
        # ModelSpec computes these on each access (the fingerprint hashes a JSON encoding:
        # ~50 us), and every block read or written checks or writes them.
        self._fingerprint, self._shape = spec.fingerprint, spec.block_shape
        self._layer_bytes = spec.block_payload_bytes // spec.num_layers
        self._file_bytes = blockfile.HEADER_SIZE + spec.block_payload_bytes
        self._header_check = blockfile.HeaderCheck(
            fingerprint=self._fingerprint, token_count=spec.block_size, dtype=spec.kv_dtype,
            shape=self._shape)
        self._pad = self._header_check.file_size - self._file_bytes
        self._data_prefix = os.path.join(data_dir, "")
        self._threads = threads
        self._tls = threading.local()  # each I/O thread's header and probe buffers
        # A lookup's access record, held back to travel with the load that follows it.
        self._pending: tuple[dict[str, int], list[bytes]] | None = None
        # Access records on their way to the daemon, sent in order by the control thread.
        self._outbox: list[tuple[bytes, bytes]] = []
        self._outbox_cv = threading.Condition()
        self._sending = False
        self._stopping = False
        self._sender: threading.Thread | None = None
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvfs-io")
        self._loads = ThreadPoolExecutor(8, thread_name_prefix="kvfs-load")
        self._saves: queue.Queue[tuple[Any, ...] | None] = queue.Queue()
        self._save_slots = threading.BoundedSemaphore(max_pending_saves)
        self._writer: threading.Thread | None = None
        self._lock = threading.Lock()
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._closed = False
        try:  # the mount's lower tiers: a hot miss may still be a hit there
            self.tiers = [t for t in os.getxattr(ns_dir, TIERS_XATTR).decode().split(",") if t]
        except OSError:
            self.tiers = []
        _raise_fd_limit()

    # -- opening -------------------------------------------------------------------------

    @classmethod
    def open(cls, mount: str | os.PathLike[str], *, tenant: str, spec: ModelSpec,
             direct: bool | None = None, **options: Any) -> KVCache:
        """Open (making it if absent) ``spec``'s namespace of ``tenant`` in a kvfs mount.

        ``direct``: None uses the backing directory where this process may (else the mount);
        True insists on it; False always goes through the mount. ``options``: ``io``
        ("posix" / "kvikio"; default $KVFS_IO, else automatic), ``threads`` (I/O pool size,
        default min(32, 4 * cpus)), ``verify`` ("full" / "sampled"), ``fsync`` (fsync each
        block before renaming it into place; default off), ``max_pending_saves`` (the
        :meth:`save_async` queue bound, default 8).
        """
        mount = os.fspath(mount)
        tenant_dir = os.path.join(mount, tenant)
        ns_dir = os.path.join(tenant_dir, spec.namespace)
        try:
            os.mkdir(ns_dir)  # through the mount: the daemon indexes it
        except FileExistsError:
            pass
        except FileNotFoundError:
            raise FileNotFoundError(
                errno.ENOENT, f"no tenant {tenant!r} in {mount} (see: kvfs tenant add)",
                tenant_dir) from None
        except PermissionError:
            raise PermissionError(
                errno.EACCES, f"this process (uid {os.getuid()}) may not use tenant {tenant!r}",
                tenant_dir) from None
        _check_manifest(ns_dir, spec)
        try:
            backing = os.fsdecode(os.getxattr(ns_dir, BACKING_XATTR))
        except OSError as exc:
            if exc.errno in (errno.ENODATA, errno.ENOTSUP):
                raise ValueError(f"{mount} is not a kvfs mount (no {BACKING_XATTR})") from None
            raise
        usable = os.access(backing, os.R_OK | os.W_OK | os.X_OK)
        if direct and not usable:
            raise PermissionError(errno.EACCES, "backing directory not accessible", backing)
        direct = usable if direct is None else direct
        if not direct:
            log.warning("%s: blocks are read and written through the mount, not the backing "
                        "directory %s (slower)", ns_dir, backing)
        return cls(ns_dir, backing if direct else ns_dir, spec, direct=direct, **options)

    def close(self) -> None:
        """Finish queued saves, send a held-back access record, then stop the I/O threads."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._writer is not None:
            self._saves.put(None)
            self._writer.join()
        self._access(())
        self._drain()
        with self._outbox_cv:
            self._stopping = True
            self._outbox_cv.notify_all()
            sender = self._sender
        if sender is not None:
            sender.join()
        self._loads.shutdown(wait=True)
        self._pool.shutdown(wait=True)

    def __enter__(self) -> KVCache:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        mode = "direct" if self.direct else "through the mount"
        return f"KVCache({self.ns_dir!r}, {mode}, io={self.transport.name})"

    # -- counters and control ------------------------------------------------------------

    @property
    def stats(self) -> dict[str, Any]:
        """Counters of this client, once the access records queued before the call are
        sent; ``fetch_amplification`` = bytes read / bytes of the blocks loaded (1.0: every
        block read exactly once; None before any load)."""
        self._drain()
        with self._lock:
            out: dict[str, Any] = dict(self._counters)
        out["fetch_amplification"] = (out["read_bytes"] / out["needed_bytes"]
                                      if out["needed_bytes"] else None)
        return out

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                self._counters[k] += v

    def _control(self, name: bytes, value: bytes) -> None:
        """One control call: every call to the daemon goes through here."""
        self._count(control_calls=1)
        os.setxattr(self.ns_dir, name, value)

    def _command(self, name: bytes, value: bytes) -> None:
        """A control call made now, after the access records queued before it (so the
        daemon sees this client's calls in the order it made them)."""
        self._drain()
        self._control(name, value)

    def _report(self, name: bytes, value: bytes) -> None:
        """A control call whose failure must not fail the request (accounting, reports)."""
        try:
            self._command(name, value)
        except OSError as exc:
            log.warning("%s on %s failed: %s", name.decode(), self.ns_dir, exc)

    # Access records leave the request's path: the daemon's round trip (on a busy host, the
    # wait for it to be scheduled) is paid by the control thread, while the engine goes on.
    # Any other control call, :meth:`flush`, :meth:`close` and :attr:`stats` wait for the
    # records queued before them, so the daemon sees one client's calls in their order.

    def _post(self, values: list[bytes]) -> None:
        """Queue access records for the control thread (waiting while it is far behind)."""
        with self._outbox_cv:
            while len(self._outbox) >= MAX_QUEUED_RECORDS and not self._stopping:
                self._outbox_cv.wait()
            stopped = self._stopping
            if not stopped:
                self._outbox += [(control.ACCESS, v) for v in values]
            if self._sender is None:
                self._sender = threading.Thread(target=self._send_queued, daemon=True,
                                                name="kvfs-control")
                self._sender.start()
            self._outbox_cv.notify_all()
        for v in values if stopped else ():  # closed: no control thread any more
            self._report(control.ACCESS, v)

    def _send_queued(self) -> None:
        while True:
            with self._outbox_cv:
                while not self._outbox and not self._stopping:
                    if not self._outbox_cv.wait(CONTROL_IDLE_S) and not self._outbox:
                        break  # idle
                if not self._outbox:
                    self._sender = None
                    return
                name, value = self._outbox.pop(0)
                self._sending = True
            try:
                self._control(name, value)
            except OSError as exc:
                log.warning("%s on %s failed: %s", name.decode(), self.ns_dir, exc)
            except Exception:  # noqa: BLE001 - a lost record is a counting error, never fatal
                log.exception("%s on %s failed", name.decode(), self.ns_dir)
            finally:
                with self._outbox_cv:
                    self._sending = False
                    self._outbox_cv.notify_all()

    def _drain(self) -> None:
        """Wait until every access record queued so far has been sent."""
        with self._outbox_cv:
            while self._outbox or self._sending:
                self._outbox_cv.wait()

    def _access(self, hashes: Sequence[bytes], *, defer: bool = False, now: bool = False,
                **counts: int) -> None:
        """Queue an access record (more only past control.MAX_HASHES hit blocks), with the
        one held back before it, if any, merged in; ``now``: send it before returning.

        ``defer`` holds this one back instead (a lookup that found blocks: the load that
        follows sends both in one call); a record already held back then goes alone, so a
        lookup's record waits for at most the next request (or :meth:`close`).
        """
        with self._lock:
            held, self._pending = self._pending, None
            if defer:
                self._pending = (counts, list(hashes))
        if defer:
            if held is None:
                return
            counts, hashes = held
        elif held is not None:
            merged = dict(held[0])
            for k, v in counts.items():
                merged[k] = merged.get(k, 0) + v
            counts = merged
            # A hit reported by the lookup and read by the load is one access, as in the
            # simulator's model of a request.
            hashes = list(dict.fromkeys([*held[1], *hashes]))
        elif not hashes and not any(counts.values()):
            return  # nothing to say
        counts.setdefault("lookups", 0)
        m = control.MAX_HASHES
        values = [control.Access(hashes=tuple(hashes[:m]), **counts).pack()]
        values += [control.Access(lookups=0, hashes=tuple(hashes[i:i + m])).pack()
                   for i in range(m, len(hashes), m)]
        if now:
            for v in values:
                self._report(control.ACCESS, v)
        else:
            self._post(values)

    # -- names ---------------------------------------------------------------------------

    def block_hashes(self, token_ids: Any, *, parent: bytes | None = None,
                     extra: bytes | str | None = None) -> list[bytes]:
        """Hashes of the full blocks of ``token_ids`` (:func:`kvfs.hashing.block_hashes`)."""
        return _block_hashes(token_ids, self.spec.block_size, parent=parent, extra=extra)

    def path(self, h: bytes) -> str:
        """Where block ``h`` is read and written (backing directory, or the mount):
        ``<data_dir>/<hh>/<hash>.kv`` (:func:`kvfs.hashing.block_relpath`)."""
        if len(h) != 16:
            raise ValueError(f"a block hash is 16 bytes, got {len(h)}")
        x = h.hex()
        return f"{self._data_prefix}{x[:2]}/{x}.kv"

    # -- lookup and prefetch -------------------------------------------------------------

    def lookup(self, hashes: Sequence[bytes], *, budget: float | None = None) -> int:
        """The length, in blocks, of the longest prefix of ``hashes`` that is cached.

        ``budget``: at most this many seconds for the blocks the lower tiers must supply
        (for example, the time to recompute them): what has not arrived by then is a miss
        for this lookup, and keeps arriving in the background for the next one. None: each
        fetch is bounded by the mount's fetch deadline only."""
        n = self._hot_prefix(hashes, 0)
        fetched = n < len(hashes) and bool(self.tiers)
        if fetched:
            # One control call: the daemon fetches what the lower tiers have (each fetch
            # within its deadline) and places it hot.
            end = None if budget is None else time.monotonic() + budget
            for i in range(n, len(hashes), control.MAX_HASHES):
                left = None if end is None else max(0.0, end - time.monotonic())
                self._report(control.FETCH, control.pack_fetch(
                    list(hashes[i:i + control.MAX_HASHES]), left))
            n = self._hot_prefix(hashes, n)
        miss, bs = len(hashes) - n, self.spec.block_size
        # A lookup that found blocks holds its record back for the load that follows (one
        # control call per lookup + load); one that found none, or fetched, sends it now.
        self._access(hashes[:n], defer=n > 0 and not fetched, now=fetched, lookups=1,
                     hit_blocks=n, miss_blocks=miss, hit_tokens=n * bs, miss_tokens=miss * bs)
        self._count(lookups=1, hit_blocks=n, miss_blocks=miss)
        return n

    def _hot_prefix(self, hashes: Sequence[bytes], start: int) -> int:
        n, path, access, there = start, self.path, os.access, os.F_OK
        for h in hashes[start:]:
            # faccessat(F_OK) as this process's effective ids, as stat would: half the cost
            # of os.path.exists, which builds a stat result.
            if not access(path(h), there, effective_ids=True):
                break
            n += 1
        return n

    def prefetch(self, hashes: Sequence[bytes]) -> Future[int]:
        """Start warming what a queued request will need: promotions from the lower tiers
        (the daemon runs them in the background) and the page cache for the hot prefix of
        ``hashes``; the future gives the number of hot blocks warmed."""
        if self.tiers:
            for i in range(0, len(hashes), control.MAX_HASHES):
                self._report(control.PREFETCH, control.pack_hashes(
                    list(hashes[i:i + control.MAX_HASHES])))
        return self._pool.submit(self._prefetch, list(hashes))

    def _prefetch(self, hashes: list[bytes]) -> int:
        n = 0
        for h in hashes:
            try:
                fd = os.open(self.path(h), os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                break
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)
            n += 1
        return n

    # -- tensor layouts ------------------------------------------------------------------

    def _check_tensor(self, t: torch.Tensor, what: str, shape: tuple[int, ...]) -> None:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != self._dtype:
            raise ValueError(f"{what} has dtype {t.dtype}, the spec says {self.spec.kv_dtype}")
        if tuple(t.shape[1:]) != shape:
            raise ValueError(f"{what} has shape {tuple(t.shape)}, expected [N, *{shape}]")
        if not t.is_contiguous():
            raise ValueError(f"{what} must be contiguous")

    def _blocks(self, t: torch.Tensor, n: int, what: str) -> torch.Tensor:
        """Bytes of contiguous-layout blocks: uint8 ``[N, num_layers, layer_bytes]``."""
        self._check_tensor(t, what, self.spec.block_shape)
        if t.shape[0] < n:
            raise ValueError(f"{what} holds {t.shape[0]} blocks, {n} hashes were given")
        return t.view(torch.uint8).reshape(t.shape[0], self.spec.num_layers, -1)

    def _pages(self, layers: Sequence[torch.Tensor], block_ids: Sequence[int], n: int
               ) -> Callable[[int], list[torch.Tensor]]:
        """Block i -> its per-layer page bytes, in file order."""
        if len(layers) != self.spec.num_layers:
            raise ValueError(f"{len(layers)} layers given, the spec has {self.spec.num_layers}")
        if len(block_ids) < n:
            raise ValueError(f"{len(block_ids)} block ids for {n} hashes")
        pages = []
        for layer, t in enumerate(layers):
            self._check_tensor(t, f"layers[{layer}]", self.spec.block_shape[1:])
            pages.append(t.view(torch.uint8).reshape(t.shape[0], -1))
        ids = [int(b) for b in block_ids]
        for b in ids[:n]:
            if not 0 <= b < pages[0].shape[0]:
                raise IndexError(f"block id {b} outside the {pages[0].shape[0]} pages")
        return lambda i: [p[ids[i]] for p in pages]

    # -- save ----------------------------------------------------------------------------

    def save(self, hashes: Sequence[bytes], kv: torch.Tensor, *,
             parent: bytes | None = None) -> int:
        """Store blocks ``kv[i]`` as ``hashes[i]``; returns how many were new.

        ``parent`` is the hash before ``hashes[0]`` (a chain continued from elsewhere).
        Raises :class:`CacheFull` if the daemon refuses blocks for want of space.
        """
        blocks = self._blocks(kv, len(hashes), "kv")
        _stream_done(kv)
        sums = None
        if hashes and self._wants_sums(kv):  # one batch for all blocks, where they are
            sums = devsum.as_tuples(devsum.block_sums(blocks[:len(hashes)].reshape(
                len(hashes), -1)))
        return self._save(list(hashes), lambda i: [blocks[i].reshape(-1)], parent, sums)

    def save_paged(self, hashes: Sequence[bytes], layers: Sequence[torch.Tensor],
                   block_ids: Sequence[int], *, parent: bytes | None = None) -> int:
        """Store page ``block_ids[i]`` of every layer as block ``hashes[i]``."""
        pages = self._pages(layers, block_ids, len(hashes))
        _stream_done(layers[0])
        return self._save(list(hashes), pages, parent)

    def _wants_sums(self, t: torch.Tensor) -> bool:
        """Whether blocks saved from ``t`` get payload sums (version 2): where they are on a
        device, which computes them cheaply and whose loads verify them there."""
        return t.device.type != "cpu" or self.transport.device_verifies(t)

    def _save(self, hashes: list[bytes], parts_of: Callable[[int], list[torch.Tensor]],
              parent: bytes | None, sums: list[tuple[int, int, int]] | None = None) -> int:
        parents = [ROOT_PARENT if parent is None else bytes(parent), *hashes[:-1]]
        todo = [i for i, h in enumerate(hashes) if not os.path.exists(self.path(h))]
        futures = [(i, self._pool.submit(self._write_block, hashes[i], parents[i], parts_of(i),
                                         sums[i] if sums is not None else None))
                   for i in todo]
        written: list[bytes] = []
        errors: list[BaseException] = []
        size = 0
        for i, fut in futures:
            try:
                size += fut.result()
                written.append(hashes[i])
            except Exception as exc:  # noqa: BLE001 - publish what was written, then raise
                errors.append(exc)
        self._count(saved_blocks=len(written), present_blocks=len(hashes) - len(todo),
                    written_bytes=size)
        if self.direct:
            m = control.MAX_HASHES
            for k in range(0, len(written), m):
                batch = written[k:k + m]
                try:
                    self._command(control.PUBLISH, control.pack_hashes(batch))
                except OSError as exc:
                    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                        raise CacheFull(exc.errno, "kvfs refused blocks: the cache is full "
                                        "(the refused files were removed)", self.ns_dir) from None
                    raise
        if errors:
            raise errors[0]
        return len(written)

    def _write_block(self, h: bytes, parent: bytes, parts: list[torch.Tensor],
                     sums: tuple[int, int, int] | None = None) -> int:
        """Write one block file under a temporary name and rename it into place: version 2
        (with the payload sums, given or computed here) where the parts are on a device."""
        if sums is None and self._wants_sums(parts[0]):
            sums = devsum.payload_sums(parts)
        host = [p if p.device.type == "cpu" else p.to("cpu") for p in parts]
        views = [host_view(p) for p in host]
        plen = sum(v.nbytes for v in views)
        s = self.spec
        head = blockfile.encode_header(blockfile.BlockHeader(
            block_hash=h, parent_hash=parent, fingerprint=self._fingerprint,
            token_count=s.block_size, dtype=s.kv_dtype, shape=self._shape,
            payload_len=plen, checksum=checksum(views), sums=sums))
        pad = _ZEROS[:blockfile.padded_size(plen) - plen]
        final = self.path(h)
        fan = os.path.dirname(final)
        os.makedirs(fan, exist_ok=True)
        tmp = os.path.join(fan, f"{_TEMP}{h.hex()}.{os.getpid()}.{os.urandom(4).hex()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            try:
                pwritev_all(fd, [memoryview(head), *views, pad], 0)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return len(head) + plen + len(pad)

    def save_async(self, hashes: Sequence[bytes], kv: torch.Tensor, *,
                   parent: bytes | None = None) -> bool:
        """Queue a save and return at once; False if the queue was full and it was dropped.

        A CUDA ``kv`` is copied to pinned host memory here (asynchronously, on the current
        stream); a CPU ``kv`` is written from where it is and must not change until
        :meth:`flush`.
        """
        self._blocks(kv, len(hashes), "kv")
        if self._closed:
            raise RuntimeError("KVCache is closed")
        if not self._save_slots.acquire(blocking=False):
            self._count(dropped_saves=1)
            log.debug("save queue full: dropped a save of %d blocks", len(hashes))
            return False
        event = sums = None
        if kv.device.type == "cuda":
            # The payload sums are computed on the device, queued with the copy on the
            # caller's stream; the writer waits for both.
            n = len(hashes)
            sums = torch.empty((n, 3), dtype=torch.int64, pin_memory=True)
            if n:
                blocks = kv.view(torch.uint8).reshape(kv.shape[0], -1)[:n]
                sums.copy_(devsum.block_sums(blocks), non_blocking=True)
            host = torch.empty(kv.shape, dtype=kv.dtype, pin_memory=True)
            host.copy_(kv, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            kv = host
        with self._lock:
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_queued, daemon=True,
                                                name="kvfs-save")
                self._writer.start()
        self._saves.put((list(hashes), kv, parent, event, sums))
        return True

    def _write_queued(self) -> None:
        while (item := self._saves.get()) is not None:
            hashes, kv, parent, event, sums = item
            try:
                if event is not None:
                    event.synchronize()
                if sums is None:
                    self.save(hashes, kv, parent=parent)
                else:  # copied from a device, with the sums computed there
                    blocks = self._blocks(kv, len(hashes), "kv")
                    self._save(list(hashes), lambda i, b=blocks: [b[i].reshape(-1)], parent,
                               devsum.as_tuples(sums))
            except Exception as exc:  # noqa: BLE001 - a lost save is a later miss, never fatal
                self._count(failed_saves=1)
                log.warning("queued save of %d blocks failed: %s", len(hashes), exc)
            finally:
                self._save_slots.release()
                self._saves.task_done()
        self._saves.task_done()

    def flush(self) -> None:
        """Wait until every queued save is written and published, and every access record
        (a held-back one included) is sent."""
        self._saves.join()
        self._access(())
        self._drain()

    # -- load ----------------------------------------------------------------------------

    def load(self, hashes: Sequence[bytes], out: torch.Tensor) -> int:
        """Read blocks into ``out[i]``; returns the number of leading blocks loaded."""
        blocks = self._blocks(out, len(hashes), "out")
        _stream_done(out)
        views_of = None
        if self.transport.reads_to_host(out):
            base, size = host_view(out), self.spec.block_payload_bytes
            views_of = lambda i: [base[i * size:(i + 1) * size]]  # noqa: E731
        return self._load(list(hashes), lambda i: [blocks[i].reshape(-1)], views_of, blocks)

    def load_paged(self, hashes: Sequence[bytes], layers: Sequence[torch.Tensor],
                   block_ids: Sequence[int]) -> int:
        """Read block ``hashes[i]`` into page ``block_ids[i]`` of every layer."""
        pages = self._pages(layers, block_ids, len(hashes))
        _stream_done(layers[0])
        views_of = None
        if all(self.transport.reads_to_host(t) for t in layers):
            bases, size = [host_view(t) for t in layers], self._layer_bytes
            ids = [int(b) for b in block_ids[:len(hashes)]]
            views_of = lambda i: [b[ids[i] * size:(ids[i] + 1) * size]  # noqa: E731
                                  for b in bases]
        return self._load(list(hashes), pages, views_of)

    # -- engine layouts: a block as a list of byte ranges in the engine's own memory ---------

    def load_parts(self, hashes: Sequence[bytes],
                   parts: Sequence[Sequence[torch.Tensor]]) -> int:
        """Read block ``hashes[i]`` into the tensors ``parts[i]``: their bytes, in order, are
        its payload (each contiguous, any dtype, together ``spec.block_payload_bytes``). For
        engines whose pages are not one tensor (a K and a V region, one run per layer):
        the bytes land where the engine keeps them, with no staging copy. Returns the
        number of leading blocks loaded, like :meth:`load`."""
        dests = self._parts(parts, len(hashes), "parts")
        if dests:
            _stream_done(dests[0][0])
        views_of = None
        if all(t.device.type == "cpu" for d in dests for t in d):
            views = [[host_view(t) for t in d] for d in dests]
            views_of = views.__getitem__
        return self._load(list(hashes), dests.__getitem__, views_of)

    def save_parts(self, hashes: Sequence[bytes], parts: Sequence[Sequence[torch.Tensor]], *,
                   parent: bytes | None = None) -> int:
        """Store block ``hashes[i]`` from the tensors ``parts[i]`` (see :meth:`load_parts`);
        returns how many were new, like :meth:`save`."""
        srcs = self._parts(parts, len(hashes), "parts")
        if srcs:
            _stream_done(srcs[0][0])
        return self._save(list(hashes), srcs.__getitem__, parent)

    def _parts(self, parts: Sequence[Sequence[torch.Tensor]], n: int, what: str
               ) -> list[list[torch.Tensor]]:
        """Each block's parts as flat uint8 tensors, checked: contiguous, the payload's size."""
        if len(parts) < n:
            raise ValueError(f"{what} holds {len(parts)} blocks, {n} hashes were given")
        want = self.spec.block_payload_bytes
        out = []
        for i, ts in enumerate(parts[:n]):
            flat = []
            for t in ts:
                if not isinstance(t, torch.Tensor):
                    raise TypeError(f"{what}[{i}] holds a {type(t).__name__}, not a tensor")
                if not t.is_contiguous():
                    raise ValueError(f"{what}[{i}] holds a tensor that is not contiguous")
                flat.append(t.reshape(-1).view(torch.uint8))
            got = sum(t.numel() for t in flat)
            if got != want:
                raise ValueError(f"{what}[{i}] holds {got} bytes, a block's payload is {want}")
            out.append(flat)
        return out

    def load_async(self, hashes: Sequence[bytes], out: torch.Tensor) -> LoadHandle:
        """Start a layer-wise load into ``out`` and return at once (see :class:`LoadHandle`).

        Reads are issued layer-major (layer 0 of every block first), one per block and layer.
        """
        blocks = self._blocks(out, len(hashes), "out")
        handle = LoadHandle(self.spec.num_layers)
        ready = None
        if out.device.type == "cuda":  # what the caller's stream still does with `out`
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(out.device))

        def run() -> None:
            try:
                if ready is not None:
                    ready.synchronize()
                handle._finish(self._load_layerwise(list(hashes), blocks, handle))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                handle._finish(0, exc)

        self._loads.submit(run)
        return handle

    def _load(self, hashes: list[bytes], tensors_of: Callable[[int], list[torch.Tensor]],
              views_of: Callable[[int], list[memoryview]] | None = None,
              batch: torch.Tensor | None = None) -> int:
        """Read block i into ``tensors_of(i)`` (host memory: into ``views_of(i)``, byte views
        of the same memory). The calling thread reads too, beside as many pool threads as
        the bytes justify (:data:`THREAD_BYTES`), each taking the next block not yet taken;
        none reads past a block that failed. Blocks whose bytes landed where the host does
        not read them are then verified there (:meth:`_verify_on_device`; ``batch``: the
        contiguous layout's blocks, ``[N, ...]`` bytes)."""
        prefix = _Prefix(len(hashes))
        outcomes: list[_Outcome | None] = [None] * len(hashes)
        if views_of is not None:
            read: Callable[..., _Outcome] = self._read_host
            dests: Callable[[int], list[Any]] = views_of
        else:
            read, dests = self._read_device, tensors_of
        todo = iter(range(len(hashes)))  # next() on it is atomic: each block is read once

        def work() -> None:
            scratch = self._scratch()
            for i in todo:
                if i <= prefix.end:  # not past a block that failed
                    outcomes[i] = read(i, hashes[i], dests(i), prefix, scratch)

        helpers = min(self._threads, len(hashes),
                      len(hashes) * self._file_bytes // THREAD_BYTES) - 1
        futures = [self._pool.submit(work) for _ in range(max(0, helpers))]
        try:
            work()
        finally:
            wait(futures)
        for f in futures:
            f.result()
        self._verify_on_device(outcomes, tensors_of, batch)
        return self._finish_load(hashes, outcomes, tensors_of)

    def _verify_on_device(self, outcomes: Sequence[_Outcome | None],
                          tensors_of: Callable[[int], list[torch.Tensor]],
                          batch: torch.Tensor | None) -> None:
        """Check the payload sums of the blocks read so far that await them (a version 2
        block read where the host never sees its bytes), with torch ops on their device:
        one batch for the contiguous layout, one block at a time for pages. Blocks past the
        first failure stay unverified: they are past the prefix, never returned."""
        pending = []
        for i, o in enumerate(outcomes):
            if o is None or (not o.ok and o.sums is None):
                break
            if o.sums is not None:
                pending.append(i)
        if not pending:
            return
        if batch is not None:
            batch = batch.reshape(batch.shape[0], -1)
            rows = batch[:pending[-1] + 1] if pending[-1] + 1 == len(pending) else \
                batch[torch.tensor(pending, device=batch.device)]
            got = dict(zip(pending, devsum.as_tuples(devsum.block_sums(rows)), strict=True))
        else:
            got = {i: devsum.payload_sums(tensors_of(i)) for i in pending}
        for i in pending:
            o = outcomes[i]
            assert o is not None and o.sums is not None
            if got[i] == o.sums:
                o.ok = True
            else:
                o.error = blockfile.BlockFormatError(
                    "checksum", f"payload sums {got[i]}, header says {o.sums}")
            o.sums = None

    def _scratch(self) -> tuple[bytearray, memoryview, memoryview]:
        """This thread's header buffer (and a view of it) and its probe: the padding after
        the payload and one byte more, which only an overlong file fills."""
        s = getattr(self._tls, "scratch", None)
        if s is None:
            header = bytearray(blockfile.HEADER_SIZE)
            s = self._tls.scratch = (header, memoryview(header),
                                     memoryview(bytearray(self._pad + 1)))
        return s

    def _read_host(self, i: int, h: bytes, views: list[memoryview], prefix: _Prefix,
                   scratch: tuple[bytearray, memoryview, memoryview]) -> _Outcome:
        """Header, payload and probe in one `preadv` (hashed piecewise if large), straight
        into ``views``; then verify. No `fstat`: the bytes read give the file's size."""
        header, hview, probe = scratch
        try:
            total, csum = read_file(self.path(h), hview, views, probe,
                                    self._full or h[-1] % SAMPLE_EVERY == 0)
        except FileNotFoundError:
            prefix.fail(i)
            return _Outcome()
        except OSError as exc:
            prefix.fail(i)
            return _Outcome(error=exc)
        out = _Outcome(read=min(total, self._file_bytes))  # padding and probe not counted
        if total == self._header_check.file_size:  # the common case, checked inline
            want = self._header_check.payload_checksum(header, h)
            if want is not None and (csum is None or csum == want):
                out.ok = True
                return out
        try:
            self._verify_read(h, header, total, csum)  # raises, saying why
            out.ok = True
        except blockfile.BlockFormatError as exc:
            prefix.fail(i)
            out.error = exc
        return out

    def _read_device(self, i: int, h: bytes, dests: list[torch.Tensor], prefix: _Prefix,
                     scratch: tuple[bytearray, memoryview, memoryview]) -> _Outcome:
        """The same for CUDA destinations, through the transport (staged, or kvikio)."""
        header = scratch[0]
        out = _Outcome()
        checksummed = self._checksummed(h)
        # Bytes that land where the host never sees them (kvikio into GPU memory) are
        # checked there, by their payload sums, once the load's reads are done.
        on_device = checksummed and self.transport.device_verifies(dests[0])
        try:
            f = self.transport.open(self.path(h))
            try:
                n, csum = self.transport.read(f, 0, dests, header,
                                              want_checksum=checksummed and not on_device)
                size = self.transport.size(f) if n >= self._file_bytes else n
                out.read = n
                self._verify_read(h, header, size, csum)  # all but the payload if on_device
                if on_device:
                    out.sums = blockfile.HeaderCheck.sums(header)
                    if out.sums is not None:
                        return out
                    # Version 1 (no sums): the host checks it, from a copy of its bytes.
                    self._verify_read(h, header, size, self.transport.checksum(dests))
            finally:
                self.transport.close(f)
            out.ok = True
        except FileNotFoundError:
            prefix.fail(i)
        except (OSError, blockfile.BlockFormatError) as exc:
            prefix.fail(i)
            out.error = exc
        return out

    def _verify_read(self, h: bytes, header: bytearray, total: int, csum: int | None) -> None:
        """Raise unless a read that gave ``header``, ``total`` bytes in all (the file's size,
        or one more if it is longer) and payload checksum ``csum`` (None: not checked) is
        block ``h`` of this spec, whole and sound."""
        if total < blockfile.HEADER_SIZE:
            raise blockfile.BlockFormatError(
                "short", f"{total} bytes, header needs {blockfile.HEADER_SIZE}")
        want = self._header_check.payload_checksum(header, h)
        if want is None:  # not exactly the expected header: the full check says why
            want = self._verify_header(h, header).checksum
        size = self._header_check.file_size
        if total != size:
            raise blockfile.BlockFormatError(
                "short" if total < size else "length",
                f"file is {total if total < size else f'more than {size}'} bytes, "
                f"expected {size}")
        if csum is not None and csum != want:
            raise blockfile.BlockFormatError(
                "checksum", f"payload checksum {csum:#018x}, header says {want:#018x}")

    def _checksummed(self, h: bytes) -> bool:
        return self._full or h[-1] % SAMPLE_EVERY == 0

    def _verify_header(self, h: bytes, header: bytearray) -> blockfile.BlockHeader:
        hdr = blockfile.decode_header(header)
        blockfile.check(hdr, block_hash=h, fingerprint=self._fingerprint,
                        dtype=self.spec.kv_dtype, shape=self._shape)
        return hdr

    def _open_verified(self, i: int, h: bytes, prefix: _Prefix) -> _Opened:
        """Open block i and check its header: the first step of a layer-wise load."""
        out = _Outcome()
        try:
            f = self.transport.open(self.path(h))
        except OSError as exc:
            prefix.fail(i)
            out.error = None if isinstance(exc, FileNotFoundError) else exc
            return _Opened(None, None, out)
        try:
            header = bytearray(blockfile.HEADER_SIZE)
            out.read = preadv_all(f.fd, [memoryview(header)], 0)
            hdr = self._verify_header(h, header)
            blockfile.verify_file_size(hdr, self.transport.size(f))
        except (OSError, blockfile.BlockFormatError) as exc:
            self.transport.close(f)
            prefix.fail(i)
            out.error = exc
            return _Opened(None, None, out)
        return _Opened(f, hdr, out)

    def _load_layerwise(self, hashes: list[bytes], blocks: torch.Tensor,
                        handle: LoadHandle) -> int:
        prefix = _Prefix(len(hashes))
        opened = [f.result() for f in [self._pool.submit(self._open_verified, i, h, prefix)
                                       for i, h in enumerate(hashes)]]
        outcomes = [o.outcome for o in opened]
        n = next((i for i, o in enumerate(opened) if o.file is None), len(opened))
        try:
            lb = self._layer_bytes
            reads = [[self._pool.submit(self.transport.read, opened[i].file,
                                        blockfile.HEADER_SIZE + layer * lb, [blocks[i, layer]])
                      for i in range(n)] for layer in range(self.spec.num_layers)]
            for layer, futures in enumerate(reads):
                for i, fut in enumerate(futures):
                    try:
                        got, _ = fut.result()
                        outcomes[i].read += got
                        if got < lb:
                            raise blockfile.BlockFormatError("short", f"layer {layer} is short")
                    except (OSError, blockfile.BlockFormatError) as exc:
                        if outcomes[i].error is None:
                            outcomes[i].error = exc
                        n = min(n, i)
                handle._layer_ready(layer, n)
            checked = [i for i in range(n) if self._checksummed(hashes[i])]
            # Version 2 blocks in memory the host does not read: their sums, on the device.
            on_device = self.transport.device_verifies(blocks)
            device = [i for i in checked if on_device and _has_sums(opened[i])]
            checks = [(i, self._pool.submit(self.transport.checksum, [blocks[i].reshape(-1)]))
                      for i in checked if not (device and i in device)]
            got: dict[int, Any] = {i: fut.result() for i, fut in checks}
            if device:
                rows = blocks.reshape(blocks.shape[0], -1)[torch.tensor(device,
                                                                        device=blocks.device)]
                got.update(zip(device, devsum.as_tuples(devsum.block_sums(rows)), strict=True))
            for i in range(n):
                hdr = opened[i].header
                assert hdr is not None
                want: Any = hdr.sums if i in device else hdr.checksum
                if i in got and got[i] != want:
                    what = (f"payload sums {got[i]}, header says {want}" if i in device else
                            f"payload checksum {got[i]:#018x}, header says {want:#018x}")
                    outcomes[i].error = blockfile.BlockFormatError("checksum", what)
                    break
                outcomes[i].ok = True
        finally:
            for o in opened:
                if o.file is not None:
                    self.transport.close(o.file)
        return self._finish_load(hashes, outcomes, lambda i: [blocks[i].reshape(-1)])

    def _finish_load(self, hashes: list[bytes], outcomes: Sequence[_Outcome | None],
                     dests_of: Callable[[int], list[torch.Tensor]]) -> int:
        """Zero what failed, report corrupt blocks, account: one control call (two with a
        corrupt block) whatever the number of blocks."""
        n = next((i for i, o in enumerate(outcomes) if o is None or not o.ok), len(outcomes))
        corrupt, mismatched = [], 0
        for i, o in enumerate(outcomes):
            if o is None or o.ok or o.error is None:
                continue  # loaded, or absent (bytes past the prefix are valid or unread)
            for d in dests_of(i) if o.read else ():
                d.zero_()
                _stream_done(d)
            if isinstance(o.error, blockfile.BlockMismatchError):
                mismatched += 1
                log.error("block %s in %s was written for another model or layout (%s): "
                          "treated as a miss", hashes[i].hex(), self.ns_dir, o.error)
            elif isinstance(o.error, blockfile.BlockFormatError):
                corrupt.append(hashes[i])
                log.warning("block %s in %s is corrupt (%s): treated as a miss, reported",
                            hashes[i].hex(), self.ns_dir, o.error)
            elif o.error is not None:
                log.warning("block %s in %s could not be read: %s", hashes[i].hex(),
                            self.ns_dir, o.error)
        m = control.MAX_HASHES
        for k in range(0, len(corrupt), m):
            self._report(control.CORRUPT, control.pack_hashes(corrupt[k:k + m]))
        read = sum(o.read for o in outcomes if o is not None)
        self._access(hashes[:n], lookups=0, read_bytes=read, needed_bytes=n * self._file_bytes)
        self._count(loaded_blocks=n, read_bytes=read, needed_bytes=n * self._file_bytes,
                    corrupt_blocks=len(corrupt), mismatched_blocks=mismatched)
        return n


def _has_sums(o: _Opened) -> bool:
    return o.header is not None and o.header.sums is not None


def _stream_done(t: torch.Tensor) -> None:
    """Wait for the work queued on this thread's stream of ``t``'s CUDA device (the caller's
    kernels still writing ``kv`` or reading ``out``; a zeroing of ours). A no-op on the CPU."""
    if t.device.type == "cuda":
        torch.cuda.current_stream(t.device).synchronize()


def _raise_fd_limit() -> None:
    """A layer-wise load keeps every block of a request open: allow many open files."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = FD_LIMIT if hard == resource.RLIM_INFINITY else min(hard, FD_LIMIT)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        log.debug("raised the open-file limit from %d to %d", soft, want)


def _check_manifest(ns_dir: str, spec: ModelSpec) -> None:
    """Write the namespace's manifest if it has none; refuse one for another spec."""
    path = os.path.join(ns_dir, MANIFEST)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        tmp = os.path.join(ns_dir, f"{_TEMP}{MANIFEST}.{os.getpid()}.{os.urandom(4).hex()}")
        with open(tmp, "xb") as f:
            f.write(spec.manifest_json())
        os.rename(tmp, path)  # atomic: a concurrent opener reads all of it or none
        return
    try:
        found = ModelSpec.from_manifest(data)
    except (ValueError, TypeError) as exc:
        raise SpecMismatch(f"{path} is not a valid manifest ({exc}); refusing to use "
                           f"this namespace") from None
    if found.fingerprint != spec.fingerprint:
        raise SpecMismatch(
            f"{path} is for fingerprint {found.fingerprint.hex()} ({found.model} "
            f"{found.revision} {found.kv_dtype}), not {spec.fingerprint.hex()} "
            f"({spec.model} {spec.revision} {spec.kv_dtype}): its blocks are not this model's")
