"""One step's loads, layer by layer: vLLM's forward pass computes layer ``l`` as soon as layer
``l`` of every block to load is in its pages, while the later layers are still being read.

The client's layer-wise load (:meth:`kvfs.KVCache.load_async`) reads every block's layer 0,
then layer 1, ..., into a contiguous staging tensor of the step's blocks (kvfs's contiguous
layout), in its own threads; a thread of this module copies each layer out of it into the
pages as it lands (one ``index_copy_`` per layer and request) and then sets that layer's
event, which :meth:`LayerLoad.wait_layer` waits for. Headers (right block, right model) are
checked before a layer counts as landed; payload checksums once every layer is in, so a
block that fails its checksum is known only after the forward pass has used it: it is then
reported with the blocks that did not load (``get_block_ids_with_load_errors``), and vLLM
discards that step's output for the request and recomputes from that block, as it does for a
block that failed before the pass.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import torch

from kvfs.client import cpus

if TYPE_CHECKING:
    from kvfs.client import KVCache
    from kvfs.format.hashing import ModelSpec

    from .scheduler import _Transfer

log = logging.getLogger(__name__)


class LayerLoad:
    """The loads of one step, running; ``failed``: vLLM block ids that did not load (final
    once :meth:`join` returned)."""

    def __init__(self, cache: KVCache, spec: ModelSpec, layers: list[torch.Tensor],
                 loads: list[_Transfer]) -> None:
        self.cache, self.spec, self.layers, self.loads = cache, spec, layers, loads
        self.ready = [threading.Event() for _ in layers]
        self.failed: set[int] = set()
        self.loaded = 0  # blocks loaded and verified
        self.seconds = 0.0
        self.waits = 0  # layers the forward pass waited for
        self._started = time.perf_counter()
        self._thread = threading.Thread(target=self._run, daemon=True, name="kvfs-layerload")
        self._thread.start()

    def wait_layer(self, layer: int) -> None:
        self.waits += 1
        self.ready[layer].wait()

    def join(self) -> None:
        self._thread.join()

    def _run(self) -> None:
        cpus.spread()  # vLLM's CPU build binds the thread that starts this one to its cores
        running: list = []
        done = 0  # loads accounted
        try:
            device = self.layers[0].device
            for ld in self.loads:
                staging = torch.empty(len(ld.hashes), *self.spec.block_shape,
                                      dtype=self.layers[0].dtype, device=device)
                idx = torch.tensor(ld.block_ids, dtype=torch.long, device=device)
                running.append((ld, staging, idx, self.cache.load_async(ld.hashes, staging)))
            landed = [len(ld.hashes) for ld in self.loads]
            for layer, pages in enumerate(self.layers):
                for r, (_ld, staging, idx, handle) in enumerate(running):
                    if landed[r]:
                        try:
                            landed[r] = min(landed[r], handle.wait_layer(layer))
                        except Exception:  # noqa: BLE001 - the final wait says why
                            landed[r] = 0
                    n = landed[r]
                    if n:
                        pages.index_copy_(0, idx[:n], staging[:n, layer])
                self.ready[layer].set()
            for ld, _staging, _idx, handle in running:
                try:
                    n = handle.wait()
                except Exception:  # noqa: BLE001 - a failed load is a recompute, never a crash
                    log.exception("kvfs load of %d blocks failed", len(ld.hashes))
                    n = 0
                self._account(ld, n)
                done += 1
        except Exception:  # noqa: BLE001
            log.exception("kvfs layer-wise load failed")
            for ld in self.loads[done:]:
                self._account(ld, 0)
        finally:
            for ev in self.ready:
                ev.set()
            self.seconds = time.perf_counter() - self._started

    def _account(self, ld: _Transfer, n: int) -> None:
        if n < len(ld.hashes):
            log.warning("kvfs: %d of %d blocks of request %s not loaded: vLLM recomputes "
                        "them", len(ld.hashes) - n, len(ld.hashes), ld.req_id)
            self.failed.update(ld.block_ids[n:])
        self.loaded += n
