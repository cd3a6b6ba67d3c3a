"""Saving blocks: each written under a temporary name and renamed into place, then published.

A block file is written from host memory with one ``pwritev`` (header, payload, padding), or,
for a payload over :data:`~kvfs.client.transport.ONE_READ_BYTES`, piece by piece, each piece hashed
right before it is written (:func:`~kvfs.client.transport.pwrite_hashed`), the header last; where
:mod:`kvfs.client._fastread` is built, all of a block's file work (create, hash and write, rename)
is one call to its ``write_block`` without the GIL, by the same rules. A CUDA
block is copied to host memory first, and its checksum is computed there; where the bytes come
from a device, its payload sums are computed on the device too (block format version 2, so
that loads verify it there). Blocks already present are skipped (a name is its content). The
daemon hears of what a save wrote in one ``publish`` control call per
:data:`kvfs.format.control.MAX_HASHES` blocks, and may refuse them (:class:`CacheFull`);
:meth:`Saving.blocks_that_fit` says how many blocks one save can place at all.
:meth:`Saving.save_async` queues saves for a writer thread, bounded, dropping when full.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ..format import blockfile, codec, control, seal
from ..format.hashing import ROOT_PARENT
from ..format.layout import TEMP_PREFIX
from . import cpus, devsum
from .channel import ControlChannel
from .keys import NamespaceKeys
from .layouts import Layouts, stream_done
from .transport import (
    ONE_READ_BYTES,
    PosixTransport,
    checksum,
    host_view,
    pwrite_hashed,
    pwritev_all,
)

try:  # the per-block work of saves from host memory in C, without the GIL
    from ._fastread import write_block as _write_native
except ImportError:  # not built, or built before it had writes: the writes in Python
    _write_native = None

log = logging.getLogger(__name__)

_TEMP = os.fsdecode(TEMP_PREFIX)
_ZEROS = memoryview(bytes(blockfile.ALIGN))
#: Seconds :meth:`Saving.blocks_that_fit` keeps what the mount said of its limits.
ROOM_TTL = 1.0
#: A direct save publishes what it has written each time this many bytes are ready (and at
#: its end), so that the daemon's write-through uploads begin while the rest is written. A
#: part refused where the room is held by pinned blocks or other tenants' fair shares leaves
#: the parts before it kept (a prefix of the chain); a save larger than the mount's limits is
#: published in one command, refused whole.
PUBLISH_EVERY = 16 << 20


def _expected(csum: int, expect: int | None, path: str) -> None:
    if expect is not None and csum != expect:
        raise OSError(errno.EBADMSG, "the payload changed before its copy was written", path)


class CacheFull(OSError):
    """The daemon refused blocks: the hot tier (or the tenant's quota) is full."""


class Saving(Layouts):
    """The save path of :class:`~kvfs.client.KVCache` (a base class of it; the attributes
    below are set by its constructor)."""

    ns_dir: str
    direct: bool
    fsync: bool
    transport: PosixTransport
    _fingerprint: bytes
    _shape: tuple[int, ...]
    _pool: ThreadPoolExecutor
    _channel: ControlChannel
    _saves: queue.Queue[tuple[Any, ...] | None]
    _save_slots: threading.BoundedSemaphore
    _writer: threading.Thread | None
    _lock: threading.Lock
    _closed: bool
    path: Callable[[bytes], str]
    _count: Callable[..., None]
    _room: tuple[float, int | None] = (-ROOM_TTL, None)  # (when asked, bytes or None)
    #: Block files written by kvfs.client._fastread.write_block where it is built (False: the
    #: writes in Python, which it must agree with; the tests compare the two).
    _native_writes = True
    #: How saved blocks are stored (kvfs.format.codec: "planes", "int8"; None: as they are).
    codec: str | None = None
    #: The mount seals the hot tier's blocks (--hot-encrypt): saves are sealed with
    #: ``keys.newest()``.
    hot_seal: bool = False
    keys: NamespaceKeys
    #: int8: how the engine's bytes lay a block's rows out (blockfile.int8_tiles, 0: runs;
    #: the vLLM connector's worker.int8_tiles finds its engine's).
    int8_tiles: int = 0

    def save(self, hashes: Sequence[bytes], kv: torch.Tensor, *,
             parent: bytes | None = None) -> int:
        """Store blocks ``kv[i]`` as ``hashes[i]``; returns how many were new.

        ``parent`` is the hash before ``hashes[0]`` (a chain continued from elsewhere).
        Raises :class:`CacheFull` if the daemon refuses blocks for want of space.
        """
        self._check_open()
        blocks = self._blocks(kv, len(hashes), "kv")
        stream_done(kv)
        sums = None
        if hashes and self._wants_sums(kv):  # one batch for all blocks, where they are
            sums = devsum.as_tuples(devsum.block_sums(blocks[:len(hashes)].reshape(
                len(hashes), -1)))
        return self._save(list(hashes), lambda i: [blocks[i].reshape(-1)], parent, sums)

    def save_paged(self, hashes: Sequence[bytes], layers: Sequence[torch.Tensor],
                   block_ids: Sequence[int], *, parent: bytes | None = None) -> int:
        """Store page ``block_ids[i]`` of every layer as block ``hashes[i]``."""
        pages = self._pages(layers, block_ids, len(hashes))
        stream_done(layers[0])
        return self._save(list(hashes), pages, parent)

    def blocks_that_fit(self, n: int) -> int:
        """How many of ``n`` blocks one save can place at all (``n`` where no limit stops
        it): kvfs refuses a save whose blocks add up to more than the hot tier's capacity or
        the tenant's quota (:class:`CacheFull`, nothing kept) even with everything else
        evicted, so an engine that would rather store a prefix than nothing saves at most
        this many. The limits are read through the mount (``statvfs``: the capacity, or the
        backing filesystem's size where there is none; ``user.kvfs.quota`` of the tenant
        directory) at most once a :data:`ROOM_TTL`; a save within them may still be refused
        where the room is held by pinned blocks or other tenants' fair shares."""
        at, room = self._room
        now = time.monotonic()
        if now - at >= ROOM_TTL:
            room = self._ask_room()
            self._room = (now, room)
        if room is None:
            return n
        return min(n, room // (blockfile.HEADER_SIZE
                               + blockfile.padded_size(self.spec.block_payload_bytes)))

    def _ask_room(self) -> int | None:
        limits = []
        try:
            st = os.statvfs(self.ns_dir)
            limits.append(st.f_blocks * st.f_frsize)
        except OSError as exc:
            log.debug("statvfs of %s failed: %s", self.ns_dir, exc)
        try:
            quota = os.getxattr(os.path.dirname(self.ns_dir), control.limit_name("quota"))
            if quota.strip().isdigit():
                limits.append(int(quota))
        except OSError as exc:  # no quota attribute: not a tenant directory of kvfs
            log.debug("quota of %s unknown: %s", self.ns_dir, exc)
        return min(limits, default=None)

    def _wants_sums(self, t: torch.Tensor) -> bool:
        """Whether blocks saved from ``t`` get payload sums (version 2): where they are on a
        device, which computes them cheaply and whose loads verify them there."""
        return t.device.type != "cpu" or self.transport.device_verifies(t)

    def _save(self, hashes: list[bytes], parts_of: Callable[[int], list[torch.Tensor]],
              parent: bytes | None, sums: list[tuple[int, int, int]] | None = None, *,
              parents: list[bytes] | None = None, expects: list[int] | None = None) -> int:
        """Write and publish the blocks not present. ``parents``: each block's parent (else a
        chain from ``parent``); ``expects``: each payload's known checksum, a block whose
        bytes no longer have it is not written (a copy from memory that changed)."""
        if parents is None:
            parents = [ROOT_PARENT if parent is None else bytes(parent), *hashes[:-1]]
        todo = [i for i, h in enumerate(hashes) if not os.path.exists(self.path(h))]
        futures = [(i, self._pool.submit(self._write_block, hashes[i], parents[i], parts_of(i),
                                         sums[i] if sums is not None else None,
                                         expects[i] if expects is not None else None))
                   for i in todo]
        written: list[bytes] = []
        errors: list[BaseException] = []
        size = ready = 0  # bytes written; of them, not yet published
        start = 0  # written[start:] are not yet published
        refused: OSError | None = None
        # In parts only where the whole save fits the mount's limits: one that cannot is
        # refused whole (nothing kept), as one command refuses it.
        block_bytes = blockfile.HEADER_SIZE + blockfile.padded_size(self.spec.block_payload_bytes)
        every = (PUBLISH_EVERY if self.direct and len(todo) * block_bytes > PUBLISH_EVERY
                 and self.blocks_that_fit(len(todo)) >= len(todo) else 1 << 62)
        for n, (i, fut) in enumerate(futures, 1):
            try:
                got = fut.result()
                size += got
                ready += got
                written.append(hashes[i])
            except Exception as exc:  # noqa: BLE001 - publish what was written, then raise
                errors.append(exc)
            # Published as it is written (the write-through below begins meanwhile), in
            # batches of PUBLISH_EVERY bytes, and what is left at the end.
            if (self.direct and len(written) > start
                    and (ready >= every or len(written) - start >= control.MAX_HASHES
                         or n == len(futures))):
                try:
                    self._publish(written[start:], fetched=expects is not None)
                except OSError as exc:  # the next batches are published still: the daemon
                    refused = refused or exc  # keeps or removes each, as it did this one's
                start, ready = len(written), 0
        self._count(saved_blocks=len(written), present_blocks=len(hashes) - len(todo),
                    written_bytes=size)
        if refused is not None:
            if refused.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise CacheFull(refused.errno, "kvfs refused blocks: the cache is full "
                                "(the refused files were removed)", self.ns_dir) from None
            raise refused
        if errors:
            raise errors[0]
        return len(written)

    def _publish(self, batch: list[bytes], *, fetched: bool) -> None:
        """One PUBLISH command per :data:`kvfs.format.control.MAX_HASHES` blocks."""
        m = control.MAX_HASHES
        for k in range(0, len(batch), m):
            self._channel.command(control.PUBLISH, control.pack_publish(
                batch[k:k + m], fetched=fetched))

    def _write_block(self, h: bytes, parent: bytes, parts: list[torch.Tensor],
                     sums: tuple[int, int, int] | None = None, expect: int | None = None
                     ) -> int:
        """Write one block file under a temporary name and rename it into place: version 2
        (with the payload sums, given or computed here) where the parts are on a device.
        With ``expect``, a payload whose checksum is not it is not placed (EBADMSG)."""
        if sums is None and self._wants_sums(parts[0]):
            sums = devsum.payload_sums(parts)
        host = [p if p.device.type == "cpu" else p.to("cpu") for p in parts]
        views = [host_view(p) for p in host]
        plen = sum(v.nbytes for v in views)
        s = self.spec

        def header(csum: int) -> memoryview:
            return memoryview(blockfile.encode_header(blockfile.BlockHeader(
                block_hash=h, parent_hash=parent, fingerprint=self._fingerprint,
                token_count=s.block_size, dtype=s.kv_dtype, shape=self._shape,
                payload_len=plen, checksum=csum, sums=sums)))

        pad = _ZEROS[:blockfile.padded_size(plen) - plen]
        final = self.path(h)
        fan = os.path.dirname(final)
        tmp = os.path.join(fan, f"{_TEMP}{h.hex()}.{os.getpid()}.{os.urandom(4).hex()}")
        if (self.codec is not None or self.hot_seal) and plen:
            # Encoded (the namespace's lossy codec, or the mount's hot-tier codec) and/or
            # sealed (--hot-encrypt): the payload gathered, encoded, sealed, and written as one.
            payload = views[0] if len(views) == 1 else b"".join(views)
            csum = checksum([memoryview(payload)])
            _expected(csum, expect, tmp)
            raw = blockfile.decode_header(header(csum))
            got = (codec.encode_block(raw, payload, self.codec, tiles=self.int8_tiles)
                   if self.codec is not None else None)
            hdr, stored = got if got is not None else (raw, payload)
            if self.hot_seal:
                key_id, ns_key = self.keys.newest()
                hdr, stored = seal.seal_block(hdr, stored, ns_key, key_id, self.keys.tenant,
                                              self.keys.namespace)
                got = (hdr, stored)
            if got is None:  # it does not pay (or a value int8 cannot hold): as it is
                parts = [header(csum), memoryview(payload), pad]
            else:
                parts = [memoryview(p) for p in codec.file_parts(*got)]
            self._write_file(tmp, final, fan, lambda fd: pwritev_all(fd, parts, 0))
            return sum(p.nbytes for p in parts)
        if _write_native is not None and self._native_writes and plen:
            # One call, the GIL released: create (and the fan-out directory if new), hash and
            # write the payload, the header with its checksum, the padding, rename; the
            # temporary file is removed on a failure.
            _write_native(tmp, final, header(0), views, len(pad), self.fsync, expect)
            return blockfile.HEADER_SIZE + plen + len(pad)
        def write(fd: int) -> None:
            if plen > ONE_READ_BYTES:
                # A large payload is hashed piece by piece as it is written (each piece
                # still in this core's cache for the write's copy), the header last:
                # the file is renamed into place only once it is whole.
                csum = pwrite_hashed(fd, views, blockfile.HEADER_SIZE)
                _expected(csum, expect, tmp)
                pwritev_all(fd, [header(csum)], 0)
                pwritev_all(fd, [pad], blockfile.HEADER_SIZE + plen)
            else:
                csum = checksum(views)
                _expected(csum, expect, tmp)
                pwritev_all(fd, [header(csum), *views, pad], 0)

        self._write_file(tmp, final, fan, write)
        return blockfile.HEADER_SIZE + plen + len(pad)

    def _write_file(self, tmp: str, final: str, fan: str, write: Callable[[int], None]) -> None:
        """Create ``tmp`` (and its fan-out directory ``fan`` if new), ``write`` it (given its
        fd), sync it where the mount asks, and rename it to ``final``; on a failure the
        temporary file is removed."""
        os.makedirs(fan, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            try:
                write(fd)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

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

    def write_behind(self, hashes: list[bytes], parents: list[bytes],
                     parts: list[list[torch.Tensor]], expects: list[int]) -> bool:
        """Queue hot copies of blocks a load read from a lower tier, from the memory they
        landed in (``parts[i]``: host tensors), on the writer thread: each is written only
        if its payload still has checksum ``expects[i]`` (the caller may have reused the
        memory meanwhile) and only as many as the hot tier has room for. False if the queue
        was full (nothing queued)."""
        if self._closed or not hashes:
            return False
        if self.codec in codec.LOSSY:
            # Decoded lossy KV is not what was saved (encoding it again would change it):
            # the daemon places these blocks' hot copies as it fetches them, still encoded.
            self._channel.report(control.PREFETCH, control.pack_hashes(hashes))
            return True
        if not self._save_slots.acquire(blocking=False):
            return False
        with self._lock:
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_queued, daemon=True,
                                                name="kvfs-save")
                self._writer.start()
        self._saves.put(("behind", hashes, parents, parts, expects))
        return True

    def _write_behind(self, hashes: list[bytes], parents: list[bytes],
                      parts: list[list[torch.Tensor]], expects: list[int]) -> None:
        n = self.blocks_that_fit(len(hashes))
        if n < len(hashes):
            self._count(behind_skipped=len(hashes) - n)
        if n:
            written = self._save(hashes[:n], parts.__getitem__, None, parents=parents[:n],
                                 expects=expects[:n])
            self._count(behind_blocks=written)

    def _write_queued(self) -> None:
        cpus.spread()
        while (item := self._saves.get()) is not None:
            if item[0] == "behind":
                try:
                    self._write_behind(*item[1:])
                except Exception as exc:  # noqa: BLE001 - a lost hot copy is a later fetch
                    self._count(failed_saves=1)
                    log.info("hot copy of %d fetched blocks not written: %s", len(item[1]),
                             exc)
                finally:
                    self._save_slots.release()
                    self._saves.task_done()
                continue
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
        self._channel.access(())
        self._channel.drain()

    def save_parts(self, hashes: Sequence[bytes], parts: Sequence[Sequence[torch.Tensor]], *,
                   parent: bytes | None = None) -> int:
        """Store block ``hashes[i]`` from the tensors ``parts[i]`` (see :meth:`load_parts`);
        returns how many were new, like :meth:`save`."""
        srcs = self._parts(parts, len(hashes), "parts")
        if srcs:
            stream_done(srcs[0][0])
        return self._save(list(hashes), srcs.__getitem__, parent)
