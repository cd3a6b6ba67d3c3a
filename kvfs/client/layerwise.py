"""Layer-wise loads: a load that returns at once and lands layer by layer.

:meth:`LayerwiseLoading.load_async` opens every block and checks its header first, then
reads layer 0 of every block, then layer 1, and so on (one read per block and layer), so
that a model may compute layer ``l`` while the later layers are still being read
(:class:`LoadHandle`). The payload checksums are checked once every layer is in; the
count :meth:`LoadHandle.wait` returns is the truth, as for a whole load
(:mod:`kvfs.client.load`). Blocks a lower tier holds load whole instead (one GET a block:
the network, not the layer order, sets the pace).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..format import blockfile
from . import devsum, encoded, leases, remote
from .load import Loading, _Outcome, _Prefix
from .transport import OpenBlock, preadv_all


@dataclass
class _Opened:
    """A block file opened, and its header checked, for a layer-wise load."""

    file: OpenBlock | None
    header: blockfile.BlockHeader | None
    outcome: _Outcome
    #: An encoded block, decoded whole into its destination when it was opened.
    decoded: bool = False


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


class LayerwiseLoading(Loading):
    """The layer-wise loads of :class:`~kvfs.client.KVCache` (a base class of it)."""

    def load_async(self, hashes: Sequence[bytes], out: torch.Tensor) -> LoadHandle:
        """Start a layer-wise load into ``out`` and return at once (see :class:`LoadHandle`).

        Reads are issued layer-major (layer 0 of every block first), one per block and layer.
        """
        self._check_open()
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
                if out.device.type == "cpu" and (remote.has_grants(self.ns_dir, hashes) or
                                                 leases.has_below(self.ns_dir, hashes)):
                    # Blocks to fetch from a shared tier: whole, each in one GET (the
                    # network, not the layer order, sets the pace), then every layer at once.
                    n = self.load(hashes, out)
                    for layer in range(self.spec.num_layers):
                        handle._layer_ready(layer, n)
                    handle._finish(n)
                    return
                handle._finish(self._load_layerwise(list(hashes), blocks, handle))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                handle._finish(0, exc)

        self._loads.submit(run)
        return handle

    def _open_verified(self, i: int, h: bytes, prefix: _Prefix,
                       dest: torch.Tensor | None = None) -> _Opened:
        """Open block i and check its header: the first step of a layer-wise load. An
        encoded block (a lower tier's file) is decoded whole into ``dest`` here."""
        out = _Outcome()
        try:
            f = self.transport.open(self._where(h, prefix))
        except OSError as exc:
            prefix.fail(i)
            out.error = None if isinstance(exc, FileNotFoundError) else exc
            return _Opened(None, None, out)
        try:
            header = bytearray(blockfile.HEADER_SIZE)
            out.read = preadv_all(f.fd, [memoryview(header)], 0)
            hdr = blockfile.check_head(header, self.transport.size(f))
            self._check_spec(h, hdr)
            if hdr.encoding is not None and dest is not None:
                out.read = encoded.decode_fd(f.fd, hdr, [dest.reshape(-1)], self.keys)
                return _Opened(f, hdr, out, decoded=True)
            if hdr.encoding is not None:
                raise blockfile.BlockFormatError("codec", "an encoded block, not decodable here")
        except (OSError, blockfile.BlockFormatError) as exc:
            self.transport.close(f)
            prefix.fail(i)
            out.error = exc
            return _Opened(None, None, out)
        return _Opened(f, hdr, out)

    def _load_layerwise(self, hashes: list[bytes], blocks: torch.Tensor,
                        handle: LoadHandle) -> int:
        below: set[int] = set()
        leased = {hashes[i]: fd for i, fd in leases.claim(self.ns_dir, hashes, below).items()}
        try:
            end = self._load_layers(hashes, blocks, handle, _Prefix(len(hashes), leased))
            # Blocks read from a directory tier's files (into device memory here): the
            # daemon places them hot.
            self._behind_below(hashes, sorted(i for i in below if i < end), leased,
                               lambda i: [blocks[i]], host=False, own=True)
            return end
        finally:
            leases.release(leased)

    def _load_layers(self, hashes: list[bytes], blocks: torch.Tensor, handle: LoadHandle,
                     prefix: _Prefix) -> int:
        opened = [f.result() for f in [self._pool.submit(self._open_verified, i, h, prefix,
                                                         blocks[i])
                                       for i, h in enumerate(hashes)]]
        outcomes = [o.outcome for o in opened]
        n = next((i for i, o in enumerate(opened) if o.file is None), len(opened))
        try:
            lb = self._layer_bytes
            reads = [[None if opened[i].decoded else
                      self._pool.submit(self.transport.read, opened[i].file,
                                        blockfile.HEADER_SIZE + layer * lb, [blocks[i, layer]])
                      for i in range(n)] for layer in range(self.spec.num_layers)]
            for layer, futures in enumerate(reads):
                for i, fut in enumerate(futures):
                    if fut is None:  # decoded whole when opened (and checked)
                        continue
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
            checked = [i for i in range(n)
                       if self._checksummed(hashes[i]) and not opened[i].decoded]
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


def _has_sums(o: _Opened) -> bool:
    return o.header is not None and o.header.sums is not None
