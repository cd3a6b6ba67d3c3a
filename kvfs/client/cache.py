"""The cache object: :class:`KVCache`, one model namespace of a kvfs mount, opened for the
direct path.

A :class:`KVCache` is ``<mount>/<tenant>/<spec.namespace>``. Bulk bytes go straight to the
namespace's backing directory (which the daemon names in the ``user.kvfs.backing`` xattr):
`preadv` / kvikio reads into the caller's tensors (:mod:`.load`), and temporary files written
with `pwritev` and renamed into place (:mod:`.save`). The daemon hears about it in a constant
number of control calls per request, never one per block (:mod:`.channel`). Where the
backing directory is not accessible to this process, the same reads and writes go through
the mount (slower; the daemon completes blocks renamed into place there itself).

This module holds what is neither save nor load: opening (the namespace and its manifest:
one for another spec is refused with :class:`SpecMismatch`, a configuration error), closing,
the counters, block names, lookups (asking the lower tiers for a hot miss) and prefetches.

CUDA tensors: a call first waits for the work queued on the caller's current stream (kernels
still writing ``kv`` or reading ``out``); bytes land through the transport (kvikio, or pinned
host buffers and the I/O threads' own streams), all synchronized before the call (or the
handle) returns.

Every method may be called from several threads at once. A layer-wise load keeps the files of
all its blocks open, so opening a cache raises the process's soft open-file limit (up to
:data:`FD_LIMIT`, within the hard limit).
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import resource
import stat
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..format import blockfile, codec, control
from ..format.hashing import ModelSpec
from ..format.hashing import block_hashes as _block_hashes
from ..format.layout import MANIFEST as _MANIFEST
from ..format.layout import TEMP_PREFIX, TENANT_NAME
from . import cpus, leases, remote
from .channel import DRAIN_WAIT_S, ControlChannel
from .keys import NamespaceKeys
from .layerwise import LayerwiseLoading
from .layouts import DTYPES
from .save import Saving
from .transport import PosixTransport
from .transport import select as select_transport

log = logging.getLogger(__name__)

MANIFEST = os.fsdecode(_MANIFEST)
BACKING_XATTR = os.fsdecode(control.BACKING)
TIERS_XATTR = os.fsdecode(control.TIERS)
CODEC_XATTR = os.fsdecode(control.CODEC)
#: Threads of a load's GETs from a shared tier.
REMOTE_THREADS = 32
#: The soft open-file limit a client raises itself to (within the hard limit).
FD_LIMIT = 65536
_TEMP = os.fsdecode(TEMP_PREFIX)
_COUNTERS = (
    "lookups", "hit_blocks", "miss_blocks",  # lookup()
    "loaded_blocks", "read_bytes", "needed_bytes", "corrupt_blocks", "mismatched_blocks",
    "saved_blocks", "present_blocks", "written_bytes", "dropped_saves", "failed_saves",
    "control_calls",  # setxattr calls on the namespace directory
    # blocks (and bytes) a load read from a shared tier itself, their hot copies written
    # behind, and those skipped for want of room
    "remote_blocks", "remote_bytes", "behind_blocks", "behind_skipped",
)


def _handout(data_dir: str) -> remote.Handout | None:
    """The daemon's handout socket for the namespace backed by ``data_dir``
    (``<root>/<tenant>/<namespace>``), trusted as the daemon's where its peer runs as root
    or as the backing root's owner; None where there is none."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(data_dir)))
    path = control.socket_path(root)
    try:
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            return None
        owner = os.stat(root).st_uid
    except OSError:
        return None
    return remote.Handout(path, frozenset({0, owner}))


def _save_codec(ns_dir: str, spec: ModelSpec) -> str | None:
    """How this client stores the blocks it saves: the namespace's lossy codec (part of its
    spec), else the mount's hot-tier codec (``user.kvfs.codec``); None: as they are."""
    lossy = spec.extras.get(codec.SPEC_KEY)
    if lossy is not None:
        if lossy not in codec.LOSSY:
            raise ValueError(f"{codec.SPEC_KEY}={lossy!r}: not a lossy codec kvfs has (one of "
                             f"{', '.join(codec.LOSSY)})")
        if spec.kv_dtype not in blockfile.INT8_DTYPES:
            raise ValueError(f"{codec.SPEC_KEY}={lossy!r} takes {', '.join(blockfile.INT8_DTYPES)}"
                             f" KV, not {spec.kv_dtype}")
        if not codec.available():
            raise ValueError(f"{codec.SPEC_KEY}={lossy!r}: kvfs.format._codec is not built in this "
                             "install (reinstall kvfs with a C compiler and libzstd-dev)")
        return lossy
    try:
        hot = os.getxattr(ns_dir, CODEC_XATTR).decode()
    except OSError:
        return None
    return hot if hot in codec.NAMES and hot != "none" and codec.available() else None


class SpecMismatch(ValueError):
    """A namespace's manifest was written for another model spec."""


class KVCache(Saving, LayerwiseLoading):
    """The blocks of one model namespace of a kvfs mount. Use :meth:`open`.

    Save and load live in their base classes (:class:`~kvfs.client.save.Saving`,
    :class:`~kvfs.client.load.Loading` and, for loads layer by layer,
    :class:`~kvfs.client.layerwise.LayerwiseLoading`); control calls go through ``_channel``.
    """

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
        loads_here: bool = True,
    ) -> None:
        if verify not in ("full", "sampled"):
            raise ValueError(f"verify must be 'full' or 'sampled', got {verify!r}")
        threads = threads or min(32, 4 * (os.cpu_count() or 1))
        self.ns_dir, self.data_dir, self.spec, self.direct = ns_dir, data_dir, spec, direct
        #: The keys that open this namespace's sealed blocks (asked of the daemon when needed).
        self.keys = NamespaceKeys(ns_dir)
        self.verify, self.fsync = verify, fsync
        self._full = verify == "full"
        self.transport: PosixTransport = select_transport(io, spec.block_payload_bytes, threads)
        self._dtype = DTYPES[spec.kv_dtype]
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
        # Every I/O thread on every CPU the process may use, whatever binding the engine's
        # threads have (kvfs.client.cpus).
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvfs-io",
                                        initializer=cpus.spread)
        self._loads = ThreadPoolExecutor(8, thread_name_prefix="kvfs-load",
                                         initializer=cpus.spread)
        # GETs from a shared tier wait on the network, not the CPU: as many as its store
        # serves well at once.
        self._remote_pool = ThreadPoolExecutor(REMOTE_THREADS, thread_name_prefix="kvfs-get",
                                               initializer=cpus.spread)
        # The daemon answers grants (False once it refused one). What a grant leaves (answered
        # GETs, handed-out files) is this process's: where the loads run in another
        # (``loads_here`` False), the daemon places the blocks hot instead.
        self._grants = loads_here
        self._saves: queue.Queue[tuple[Any, ...] | None] = queue.Queue()
        self._save_slots = threading.BoundedSemaphore(max_pending_saves)
        self._writer: threading.Thread | None = None
        self._lock = threading.Lock()
        self._counters = dict.fromkeys(_COUNTERS, 0)
        # Every call to the daemon, access records sent in order by its control thread.
        self._channel = ControlChannel(ns_dir, self._count)
        self._closed = False  # no more save_async (close() has begun)
        self._shut = False  # close() is done: nothing more at all
        try:  # the mount's lower tiers: a hot miss may still be a hit there
            self.tiers = [t for t in os.getxattr(ns_dir, TIERS_XATTR).decode().split(",") if t]
        except OSError:
            self.tiers = []
        # A directory tier's files may be handed to this process by the daemon, where it
        # reads the backing tree itself (kvfs.daemon.handout).
        self._handout = _handout(data_dir) if direct and self.tiers else None
        self.codec = _save_codec(ns_dir, spec)
        try:
            self.hot_seal = os.getxattr(ns_dir, control.SEAL) == b"1"
        except OSError:
            self.hot_seal = False
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
        :meth:`save_async` queue bound, default 8), ``loads_here`` (default True: the loads
        that follow this cache's lookups run in this process; False, for a vLLM scheduler
        whose workers are other processes: a lookup of blocks below the hot tier has the
        daemon place them hot, read by name by the process that loads them).
        """
        mount = os.fspath(mount)
        if not TENANT_NAME.match(os.fsencode(tenant)):
            raise ValueError(f"{tenant!r} is not a tenant name (1 to 64 letters, digits and "
                             "_ . @ -, the first a letter, digit or _)")
        try:  # a kvfs mount's root answers it: nothing is made anywhere else
            os.getxattr(mount, control.TIER)
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, f"{mount} does not exist", mount) from None
        except OSError as exc:
            if exc.errno in (errno.ENODATA, errno.ENOTSUP):
                raise ValueError(f"{mount} is not a kvfs mount (no {os.fsdecode(control.TIER)})"
                                 ) from None
            raise
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
        self._channel.close()
        self._loads.shutdown(wait=True)
        self._remote_pool.shutdown(wait=True)
        self._pool.shutdown(wait=True)
        remote.forget(self.ns_dir)
        self.keys.forget()
        leases.forget(self.ns_dir)
        self._shut = True

    def __enter__(self) -> KVCache:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        mode = "direct" if self.direct else "through the mount"
        return f"KVCache({self.ns_dir!r}, {mode}, io={self.transport.name})"

    # -- counters ------------------------------------------------------------------------

    @property
    def stats(self) -> dict[str, Any]:
        """Counters of this client, once the access records queued before the call are
        sent (waiting at most ``DRAIN_WAIT_S`` for a daemon that takes no call: then with a
        warning); ``fetch_amplification`` = bytes read / bytes of the blocks loaded (1.0:
        every block read exactly once; None before any load)."""
        if not self._channel.drain(DRAIN_WAIT_S):
            log.warning("%s: the daemon took no control call for %s s: counters read before "
                        "the queued access records reached it", self.ns_dir, DRAIN_WAIT_S)
        with self._lock:
            out: dict[str, Any] = dict(self._counters)
        out["fetch_amplification"] = (out["read_bytes"] / out["needed_bytes"]
                                      if out["needed_bytes"] else None)
        return out

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                self._counters[k] += v

    # -- names ---------------------------------------------------------------------------

    def block_hashes(self, token_ids: Any, *, parent: bytes | None = None,
                     extra: bytes | str | None = None) -> list[bytes]:
        """Hashes of the full blocks of ``token_ids`` (:func:`kvfs.format.hashing.block_hashes`)."""
        return _block_hashes(token_ids, self.spec.block_size, parent=parent, extra=extra)

    def path(self, h: bytes) -> str:
        """Where block ``h`` is read and written (backing directory, or the mount):
        ``<data_dir>/<hh>/<hash>.kv`` (:func:`kvfs.format.hashing.block_relpath`)."""
        if not isinstance(h, (bytes, bytearray)) or len(h) != 16:
            raise ValueError("a block hash is 16 bytes, got "
                             + (f"{len(h)}" if isinstance(h, (bytes, bytearray))
                                else f"a {type(h).__name__}"))
        x = h.hex()
        return f"{self._data_prefix}{x[:2]}/{x}.kv"

    # -- lookup and prefetch -------------------------------------------------------------

    def lookup(self, hashes: Sequence[bytes], *, budget: float | None = None) -> int:
        """The length, in blocks, of the longest prefix of ``hashes`` that is cached.

        ``budget``: at most this many seconds for the blocks the lower tiers must supply
        (for example, the time to recompute them): what has not arrived by then is a miss
        for this lookup, and keeps arriving in the background for the next one. None: each
        fetch is bounded by the mount's fetch deadline only."""
        self._check_open()
        n = leases.take(self.ns_dir, self.path, hashes)  # the hot prefix, leased to the load
        fetched = n < len(hashes) and bool(self.tiers)
        if fetched and self._grants:
            # One control call per MAX_GRANT blocks: where each block below can be read
            # (a presigned GET for a shared tier's, sent now; the load reads its body).
            try:
                n += remote.ask(self._channel, self.ns_dir, hashes[n:], budget,
                                self._remote_pool, self._handout)
            except OSError as exc:
                if exc.errno not in (errno.EPERM, errno.EINVAL, errno.ENOTSUP):
                    raise
                log.info("%s: the daemon takes no grants (%s): fetches through it",
                         self.ns_dir, exc)
                self._grants = False
        if fetched and not self._grants:
            # One control call: the daemon fetches what the lower tiers have (each fetch
            # within its deadline) and places it hot.
            end = None if budget is None else time.monotonic() + budget
            for i in range(n, len(hashes), control.MAX_HASHES):
                left = None if end is None else max(0.0, end - time.monotonic())
                self._channel.report(control.FETCH, control.pack_fetch(
                    list(hashes[i:i + control.MAX_HASHES]), left))
            n = leases.take(self.ns_dir, self.path, hashes, n)
        miss, bs = len(hashes) - n, self.spec.block_size
        # A lookup that found blocks holds its record back for the load that follows (one
        # control call per lookup + load); one that found none, or had the daemon fetch,
        # sends it now (a granted lookup's load reads the blocks itself: it holds it back).
        daemon_fetched = fetched and not self._grants
        self._channel.access(hashes[:n], defer=n > 0 and not daemon_fetched,
                             now=daemon_fetched, lookups=1,
                     hit_blocks=n, miss_blocks=miss, hit_tokens=n * bs, miss_tokens=miss * bs)
        self._count(lookups=1, hit_blocks=n, miss_blocks=miss)
        return n

    def prefetch(self, hashes: Sequence[bytes]) -> Future[int]:
        """Start warming what a queued request will need: promotions from the lower tiers
        (the daemon runs them in the background) and the page cache for the hot prefix of
        ``hashes``; the future gives the number of hot blocks warmed."""
        if self.tiers:
            for i in range(0, len(hashes), control.MAX_HASHES):
                self._channel.report(control.PREFETCH, control.pack_hashes(
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
