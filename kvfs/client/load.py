"""Loading blocks: the direct read path and the verification of every block read.

A load reads each block's file (header, payload, and a probe past its end) into the caller's
tensors: host memory with one ``preadv`` a block, CUDA memory through the transport (pinned
staging, or kvikio). Every loaded block's header is checked (format, block hash, model
fingerprint, dtype, shape, file size) and, with ``verify="full"``, its payload checksum;
``verify="sampled"`` checksums a deterministic one-in-:data:`SAMPLE_EVERY` sample (chosen by
hash). Bytes that land where the host never reads them are checked there, by their payload
sums (block format version 2), with torch ops. A block that fails is a miss and so is every
block after it: a load returns the length of the verified prefix, and the failed block's
slice of ``out`` is zeroed. A corrupt block is reported to the daemon (``corrupt``); a block
written for another spec is a miss, logged as an error naming the difference. A load's access
record (with the lookup's held back before it) is one control call whatever the number of
blocks. Layer-wise loads (`load_async`) are :mod:`kvfs.client.layerwise`'s.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import torch

from ..format import blockfile, control, seal
from . import devsum, encoded, leases, remote
from .channel import ControlChannel
from .keys import NamespaceKeys
from .layouts import Layouts, stream_done
from .transport import PosixTransport, checksum, host_view, read_file

try:  # the per-block work of host loads in C, without the GIL (kvfs/client/_fastread.c)
    from . import _fastread
except ImportError:  # not built (no compiler or xxhash header at install): the Python reads
    _fastread = None  # type: ignore[assignment]
_unbuilt_said = False

log = logging.getLogger(__name__)

#: verify="sampled" checksums the blocks whose hash's last byte is a multiple of this.
SAMPLE_EVERY = 8
#: A load hands blocks to as many I/O threads as it has this many bytes for (at least one):
#: below that, a thread hand-off costs more than the read it would take over.
THREAD_BYTES = 1 << 20


@dataclass(slots=True)
class _Outcome:
    """What reading one block gave."""

    read: int = 0  # bytes read from its file
    ok: bool = False
    error: Exception | None = None  # why it is not loaded, where that is more than "absent"
    # The payload sums its header records, to be checked where the bytes landed (a device
    # the host never reads) once the load's reads are done; ok stays False until then.
    sums: tuple[int, int, int] | None = None


class _Prefix:
    """The first failed block of a load, shared by its reader threads, the descriptors its
    lookup leased (block hash -> fd), read in place of the names, and which of those are a
    lower tier's files (`below`: usually sealed or encoded, so read without hashing, then
    opened or decoded where they landed)."""

    def __init__(self, n: int, leased: dict[bytes, int] | None = None,
                 below: set[bytes] | None = None) -> None:
        self.end = n
        self.leased = leased or {}
        self.below = below or set()
        self._lock = threading.Lock()

    def fail(self, i: int) -> None:
        with self._lock:
            self.end = min(self.end, i)

    def beyond(self, i: int) -> bool:
        return i > self.end


class Loading(Layouts):
    """The load path of :class:`~kvfs.client.KVCache` (a base class of it; the attributes
    below are set by its constructor)."""

    ns_dir: str
    transport: PosixTransport
    keys: NamespaceKeys
    _full: bool
    _fingerprint: bytes
    _shape: tuple[int, ...]
    _layer_bytes: int
    _file_bytes: int
    _header_check: blockfile.HeaderCheck
    _pad: int
    _threads: int
    _tls: threading.local
    _pool: ThreadPoolExecutor
    _loads: ThreadPoolExecutor
    _channel: ControlChannel
    path: Callable[[bytes], str]
    _count: Callable[..., None]
    _remote_pool: ThreadPoolExecutor
    write_behind: Callable[..., bool]
    #: Host loads through kvfs.client._fastread where it is built (False: the reads in Python, which
    #: it must agree with; the tests compare the two).
    _native = True

    def load(self, hashes: Sequence[bytes], out: torch.Tensor) -> int:
        """Read blocks into ``out[i]``; returns the number of leading blocks loaded."""
        blocks = self._blocks(out, len(hashes), "out")
        stream_done(out)
        views_of = None
        if self.transport.reads_to_host(out):
            base, size = host_view(out), self.spec.block_payload_bytes
            views_of = lambda i: [base[i * size:(i + 1) * size]]  # noqa: E731
        return self._load(list(hashes), lambda i: [blocks[i].reshape(-1)], views_of, blocks)

    def load_paged(self, hashes: Sequence[bytes], layers: Sequence[torch.Tensor],
                   block_ids: Sequence[int]) -> int:
        """Read block ``hashes[i]`` into page ``block_ids[i]`` of every layer."""
        pages = self._pages(layers, block_ids, len(hashes))
        stream_done(layers[0])
        views_of = None
        if all(self.transport.reads_to_host(t) for t in layers):
            bases, size = [host_view(t) for t in layers], self._layer_bytes
            ids = [int(b) for b in block_ids[:len(hashes)]]
            views_of = lambda i: [b[ids[i] * size:(ids[i] + 1) * size]  # noqa: E731
                                  for b in bases]
        return self._load(list(hashes), pages, views_of)

    def load_parts(self, hashes: Sequence[bytes],
                   parts: Sequence[Sequence[torch.Tensor]]) -> int:
        """Read block ``hashes[i]`` into the tensors ``parts[i]``: their bytes, in order, are
        its payload (each contiguous, any dtype, together ``spec.block_payload_bytes``). For
        engines whose pages are not one tensor (a K and a V region, one run per layer):
        the bytes land where the engine keeps them, with no staging copy. Returns the
        number of leading blocks loaded, like :meth:`load`."""
        dests = self._parts(parts, len(hashes), "parts")
        if dests:
            stream_done(dests[0][0])
        views_of = None
        if all(t.device.type == "cpu" for d in dests for t in d):
            views = [[host_view(t) for t in d] for d in dests]
            views_of = views.__getitem__
        # The engine's memory may be freed or reused by it once the load returns (an LMCache
        # allocator closed before its backends): blocks fetched from a shared tier are
        # copied for their hot copy, not written from there.
        return self._load(list(hashes), dests.__getitem__, views_of, own=False)

    def _load(self, hashes: list[bytes], tensors_of: Callable[[int], list[torch.Tensor]],
              views_of: Callable[[int], list[memoryview]] | None = None,
              batch: torch.Tensor | None = None, *, own: bool = True) -> int:
        """Read block i into ``tensors_of(i)`` (host memory: into ``views_of(i)``, byte views
        of the same memory). The calling thread reads too, beside as many pool threads as
        the bytes justify (:data:`THREAD_BYTES`), each taking the next block not yet taken;
        none reads past a block that failed. Blocks whose bytes landed where the host does
        not read them are then verified there (:meth:`_verify_on_device`; ``batch``: the
        contiguous layout's blocks, ``[N, ...]`` bytes). Blocks a lookup was granted a URL
        for are fetched from their tier into the same memory (:meth:`_load_granted`);
        their hot copies are written from it (``own``: torch tensors, which the writer
        holds alive) or from copies (memory the caller's engine manages)."""
        self._check_open()
        below: set[int] = set()
        leased = {hashes[i]: fd for i, fd in leases.claim(self.ns_dir, hashes, below).items()}
        try:
            end = self._load_leased(hashes, tensors_of, views_of, batch, leased, own,
                                    {hashes[i] for i in below})
            if below:
                self._behind_below(hashes, sorted(i for i in below if i < end), leased,
                                   tensors_of, host=views_of is not None, own=own)
            return end
        finally:
            leases.release(leased)

    def _behind_below(self, hashes: list[bytes], loaded: list[int], leased: dict[bytes, int],
                      tensors_of: Callable[[int], list[torch.Tensor]], *, host: bool,
                      own: bool) -> None:
        """The hot copies of blocks a load read from files of a directory tier the daemon
        handed out (kvfs.daemon.handout): written behind from the memory they landed in (copies of
        an engine's memory); for device memory the daemon promotes them (a prefetch)."""
        if not loaded:
            return
        self._count(remote_blocks=len(loaded),
                    remote_bytes=len(loaded) * self._file_bytes)
        if not host:
            self._channel.report(control.PREFETCH,
                                 control.pack_hashes([hashes[i] for i in loaded]))
            return
        check = self._header_check
        headers = [os.pread(leased[hashes[i]], blockfile.HEADER_SIZE, 0) for i in loaded]
        parts = [tensors_of(i) if own else
                 [torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors_of(i)])]
                 for i in loaded]
        self.write_behind([hashes[i] for i in loaded], [hdr[32:48] for hdr in headers], parts,
                          [check.payload_checksum(hdr, hashes[i]) or
                           blockfile.decode_header(hdr).checksum
                           for i, hdr in zip(loaded, headers, strict=True)])

    def _load_leased(self, hashes: list[bytes],
                     tensors_of: Callable[[int], list[torch.Tensor]],
                     views_of: Callable[[int], list[memoryview]] | None,
                     batch: torch.Tensor | None, leased: dict[bytes, int], own: bool,
                     below: set[bytes] | None = None) -> int:
        grants = remote.granted(self.ns_dir, hashes)
        if grants:
            if views_of is not None:
                return self._load_granted(hashes, tensors_of, views_of, grants, leased, own)
            # Device memory: the daemon places them hot first (two passes, as before).
            for a in grants.values():
                a.close()
            self._channel.report(control.FETCH, control.pack_fetch(
                [hashes[i] for i in sorted(grants)]))
        # A lower tier's files (sealed or encoded, usually) go to the Python reader, which
        # opens or decodes each block right after reading it, on every thread; the C reader
        # would read them only to leave them to it.
        if views_of is not None and self._native and not below:
            if _fastread is not None:
                return self._finish_load(
                    hashes, self._native_outcomes(hashes, views_of, leased), tensors_of)
            _say_unbuilt()
        prefix = _Prefix(len(hashes), leased, below)
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

        self._on_threads(work, len(hashes))
        self._verify_on_device(outcomes, tensors_of, batch)
        return self._finish_load(hashes, outcomes, tensors_of)

    def _on_threads(self, work: Callable[[], None], n: int) -> None:
        """Run ``work`` on the calling thread and on as many pool threads as ``n`` blocks
        justify (:data:`THREAD_BYTES`; at most ``threads`` in all), until each returns."""
        helpers = min(self._threads, n, n * self._file_bytes // THREAD_BYTES) - 1
        futures = [self._pool.submit(work) for _ in range(max(0, helpers))]
        try:
            work()
        finally:
            wait(futures)
        for f in futures:
            f.result()

    def _load_granted(self, hashes: list[bytes],
                      tensors_of: Callable[[int], list[torch.Tensor]],
                      views_of: Callable[[int], list[memoryview]],
                      grants: dict[int, remote.Answered], leased: dict[bytes, int],
                      own: bool = True) -> int:
        """A load into host memory of which some blocks come from a shared tier: those are
        fetched with their granted URLs on the remote threads (one GET each, into
        ``views_of(i)``, verified as they land) while the others are read from the hot
        tier; then the fetched blocks' hot copies are queued behind (written from this
        memory, only if it has not changed)."""
        n = len(hashes)
        prefix = _Prefix(n, leased)
        outcomes: list[_Outcome | None] = [None] * n
        headers: dict[int, bytearray] = {}
        copies: dict[int, list[torch.Tensor]] = {}
        far = sorted(grants)

        def fetch(i: int) -> None:
            if prefix.beyond(i):
                grants[i].close()  # past a block that failed: not read
                return
            headers[i] = bytearray(blockfile.HEADER_SIZE)
            try:
                o = self._read_remote(i, hashes[i], views_of(i), prefix, headers[i], grants[i])
            except Exception as exc:  # noqa: BLE001 - a defect: said, and the block a miss
                log.exception("fetching block %s into %s failed", hashes[i].hex(), self.ns_dir)
                grants[i].close()
                prefix.fail(i)
                for t in tensors_of(i):  # nothing of it is left to be taken for KV
                    t.zero_()
                o = _Outcome(error=exc)
            outcomes[i] = o
            if o.ok and not own:  # copied while the bytes are in this core's cache
                copies[i] = [torch.cat([t.reshape(-1).view(torch.uint8)
                                        for t in tensors_of(i)])]

        futures = [self._remote_pool.submit(fetch, i) for i in far]
        near = [i for i in range(n) if i not in grants]
        try:
            if near:
                sub = [hashes[i] for i in near]
                if self._native and _fastread is not None:
                    got = self._native_outcomes(sub, lambda k: views_of(near[k]), leased)
                else:
                    got = [self._read_host(near[k], sub[k], views_of(near[k]), prefix,
                                           self._scratch()) for k in range(len(near))]
                for k, o in zip(near, got, strict=True):
                    outcomes[k] = o
                    if o is None or not o.ok:
                        prefix.fail(k)
        finally:
            wait(futures)
        end = self._finish_load(hashes, outcomes, tensors_of)
        fetched = [i for i in far if i < end]
        self._count(remote_blocks=len(fetched),
                    remote_bytes=sum(outcomes[i].read for i in fetched))  # type: ignore[union-attr]
        if fetched:
            check = self._header_check
            self.write_behind([hashes[i] for i in fetched],
                              [bytes(headers[i][32:48]) for i in fetched],
                              [copies[i] if i in copies else tensors_of(i) for i in fetched],
                              [check.payload_checksum(headers[i], hashes[i]) or
                               blockfile.decode_header(headers[i]).checksum for i in fetched])
        return end

    def _read_remote(self, i: int, h: bytes, views: list[memoryview], prefix: _Prefix,
                     header: bytearray, answered: remote.Answered) -> _Outcome:
        """:meth:`_read_host` for a granted block: its GET's body, verified the same way,
        each socket read within the daemon's deadline for the block (a store that stops
        sending costs a miss, not a hang)."""
        probe = memoryview(bytearray(self._pad + 1))
        opened: list[seal.Opener] = []

        def opener_for(_landed: memoryview) -> seal.Opener | None:
            """A sealed object stored as is: opened as its body lands."""
            try:
                hdr = self._verify_header(h, header)
                kid = seal.key_id_of(hdr)
                if kid is None or hdr.encoding.codec != blockfile.CODEC_NONE:  # type: ignore[union-attr]
                    return None
                opened.append(seal.Opener(hdr, self.keys.get(kid), self.keys.tenant,
                                          self.keys.namespace))
                return opened[0]
            except blockfile.BlockFormatError:
                return None  # said again, with the reason, once the body is read

        try:
            total, csum = remote.get_into(answered, memoryview(header), views, probe,
                                          self._checksummed(h), opener_for)
        except FileNotFoundError:
            prefix.fail(i)
            return _Outcome()
        except OSError as exc:
            prefix.fail(i)
            return _Outcome(error=exc)
        out = _Outcome(read=min(total, self._file_bytes))
        try:
            if opened:
                if total != opened[0].h.file_size:
                    raise blockfile.BlockFormatError("length", f"sealed object is {total} "
                                                     "bytes, header says "
                                                     f"{opened[0].h.file_size}")
                opened[0].finish()
            elif encoded.is_encoded(header):
                encoded.decode_landed(self._verify_header(h, header), views, total,
                                       self.keys)
            else:
                self._verify_read(h, header, total, csum)
            out.ok = True
        except blockfile.BlockFormatError as exc:
            prefix.fail(i)
            out.error = exc
        return out

    def _native_outcomes(self, hashes: list[bytes],
                         views_of: Callable[[int], list[memoryview]],
                         leased: dict[bytes, int]) -> list[_Outcome | None]:
        """:meth:`_load`'s reads into host memory with :mod:`kvfs.client._fastread`: each
        thread's reads, header checks and checksums in one call without the GIL, by the
        rules of :meth:`_read_host` (a leased block read from its fd). A block it does not
        accept outright is read again by :meth:`_read_host`, which says why it fails."""
        n, check = len(hashes), self._header_check
        want = bytes(self._full or h[-1] % SAMPLE_EVERY == 0 for h in hashes)
        reads = _fastread.Reads([self.path(h) if (fd := leased.get(h)) is None else fd
                                 for h in hashes],
                                [views_of(i) for i in range(n)], hashes, want, *check.expected,
                                self.spec.block_payload_bytes, check.file_size)
        self._on_threads(reads.run, n)
        prefix = _Prefix(n, leased)
        outcomes: list[_Outcome | None] = []
        again: list[int] = []  # read again in Python: the first not accepted, and after it
        for i, (status, total, err) in enumerate(reads.results()):
            o: _Outcome | None = None
            if again or status == _fastread.ST_RECHECK:
                # The reason, or sound after all (an encoded block, decoded); the blocks
                # after it were not read.
                again.append(i)
            elif status == _fastread.ST_OK:
                o = _Outcome(read=min(total, self._file_bytes), ok=True)
            elif status == _fastread.ST_ABSENT:
                o = _Outcome()
            elif status == _fastread.ST_OSERROR:
                o = _Outcome(error=OSError(err, os.strerror(err), self.path(hashes[i])))
            outcomes.append(o)
        if again:
            todo = iter(again)

            def work() -> None:
                scratch = self._scratch()
                for i in todo:
                    if i <= prefix.end:
                        outcomes[i] = self._read_host(i, hashes[i], views_of(i), prefix,
                                                      scratch)

            self._on_threads(work, len(again))
        return outcomes

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
        checksummed = self._checksummed(h)
        # A lower tier's file is sealed or encoded as a rule: its stored bytes are checked as
        # they are opened or decoded, not hashed as read (a raw one is hashed after).
        later = checksummed and h in prefix.below
        try:
            fd = prefix.leased.get(h)  # the lookup's descriptor: read from it as it is
            total, csum = read_file(self.path(h) if fd is None else fd, hview, views, probe,
                                    checksummed and not later)
        except FileNotFoundError:
            prefix.fail(i)
            return _Outcome()
        except OSError as exc:
            prefix.fail(i)
            return _Outcome(error=exc)
        out = _Outcome(read=min(total, self._file_bytes))  # padding and probe not counted
        if total == self._header_check.file_size and not later:  # the common case, inline
            want = self._header_check.payload_checksum(header, h)
            if want is not None and (csum is None or csum == want):
                out.ok = True
                return out
        try:
            if encoded.is_encoded(header):  # a lower tier's (encoded) file: decoded in place
                encoded.decode_landed(self._verify_header(h, header), views, total,
                                       self.keys)
            else:
                if later and total >= blockfile.HEADER_SIZE + self.spec.block_payload_bytes:
                    csum = checksum(views)  # raw after all: hashed now
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
            f = self.transport.open(self._where(h, prefix))
            try:
                n, csum = self.transport.read(f, 0, dests, header,
                                              want_checksum=checksummed and not on_device)
                size = self.transport.size(f) if n >= self._file_bytes else n
                out.read = n
                if encoded.is_encoded(header):  # decoded on the host, then copied
                    out.read = encoded.decode_fd(f.fd, self._verify_header(h, header), dests,
                                                 self.keys)
                    out.ok = True
                    return out
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

    def _where(self, h: bytes, prefix: _Prefix) -> str:
        """Where block ``h`` is read: its lookup's leased descriptor, or its name."""
        fd = prefix.leased.get(h)
        return self.path(h) if fd is None else f"/proc/self/fd/{fd}"

    def _checksummed(self, h: bytes) -> bool:
        return self._full or h[-1] % SAMPLE_EVERY == 0

    def _verify_header(self, h: bytes, header: bytearray) -> blockfile.BlockHeader:
        hdr = blockfile.decode_header(header)
        self._check_spec(h, hdr)
        return hdr

    def _check_spec(self, h: bytes, hdr: blockfile.BlockHeader) -> None:
        """Raise :class:`~kvfs.format.blockfile.BlockMismatchError` unless ``hdr`` is block ``h``
        of this spec (a block written for another model or layout is a miss, not corrupt)."""
        blockfile.check(hdr, block_hash=h, fingerprint=self._fingerprint,
                        dtype=self.spec.kv_dtype, shape=self._shape)

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
                stream_done(d)
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
            self._channel.report(control.CORRUPT, control.pack_hashes(corrupt[k:k + m]))
        read = sum(o.read for o in outcomes if o is not None)
        self._channel.access(hashes[:n], lookups=0, read_bytes=read,
                             needed_bytes=n * self._file_bytes)
        self._count(loaded_blocks=n, read_bytes=read, needed_bytes=n * self._file_bytes,
                    corrupt_blocks=len(corrupt), mismatched_blocks=mismatched)
        return n


def _say_unbuilt() -> None:
    global _unbuilt_said
    if not _unbuilt_said:
        _unbuilt_said = True
        log.warning("kvfs.client._fastread is not built (it needs gcc and the xxhash header, "
                    "libxxhash-dev; then reinstall kvfs): host loads take the slower reads "
                    "in Python")
