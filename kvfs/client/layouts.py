"""The tensor layouts a client reads blocks into and writes them from, checked.

- contiguous: ``kv`` / ``out`` of shape ``[n, num_layers, 2, block_size, num_kv_heads,
  head_dim]`` in ``spec.kv_dtype``; block i is ``kv[i]``, the payload of its file.
- paged: ``layers``, one tensor per layer of shape ``[num_pages, 2, block_size,
  num_kv_heads, head_dim]``, and ``block_ids``: block i is page ``block_ids[i]`` of every
  layer. Layer l of a block is the contiguous slice at file offset 4096 + l * layer_bytes, so
  each page is read or written in place, with no copy of the whole context.
- parts (engine layouts): block i is a list of contiguous tensors of any dtype whose bytes, in
  order, are its payload (a K and a V region, one run per layer).

Each is turned into flat uint8 tensors per block, after checks that raise a clear error.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..format import blockfile
from ..format.hashing import ModelSpec

DTYPES = {name: getattr(torch, name) for name in blockfile.DTYPE_SIZES}


def stream_done(t: torch.Tensor) -> None:
    """Wait for the work queued on this thread's stream of ``t``'s CUDA device (the caller's
    kernels still writing ``kv`` or reading ``out``; a zeroing of ours). A no-op on the CPU."""
    if t.device.type == "cuda":
        torch.cuda.current_stream(t.device).synchronize()


class Layouts:
    """The layout checks of :class:`~kvfs.client.KVCache` (a base class of it)."""

    spec: ModelSpec
    _dtype: torch.dtype
    _shut: bool

    def _check_open(self) -> None:
        """A save, load or lookup after close() is refused (its threads are gone); those that
        close() itself finishes (the queued saves) are not."""
        if self._shut:
            raise RuntimeError("KVCache is closed")

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

