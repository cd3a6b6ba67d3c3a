"""Payload sums computed with torch ops where the bytes are: a GPU verifies what it loaded.

With kvikio, a block's payload goes from the file straight into GPU memory and the host never
sees it, so the host's xxh3_64 (sequential rounds over the bytes) cannot check it. A block
file of version 2 also records the payload *sums* (:func:`kvfs.format.blockfile.payload_sums`,
docs/format.md): word, row and column sums of the payload's 32-bit words, reduced exactly in
64-bit integers. Integer addition does not depend on its order, so a GPU's parallel reduction
gives the very value that the reference code gives on the host, bit for bit, and so the same
verdict for the same file. A few passes over the block at the device's memory speed, no copy
to the host but the three numbers.

The same code runs on CPU tensors (the tests run it there), where it is slow (torch's
integer reductions on a CPU: a few hundred MB/s): writers from host memory keep version 1,
which the host's xxh3 checks. Client side only (imports torch).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..format.blockfile import SUMS_PRIME, SUMS_ROW_WORDS

_ROW_BYTES = 4 * SUMS_ROW_WORDS
#: Rows reduced per step: bounds the int64 temporaries (rows x columns of a step) on the device.
_STEP_ROWS = 1 << 14


def block_sums(blocks: torch.Tensor) -> torch.Tensor:
    """The payload sums of each row of ``blocks`` (uint8 ``[n, payload_bytes]``, any
    device): int64 ``[n, 3]`` (word sum as a signed 64-bit value, row sum, column sum) on
    the same device, computed without waiting for the device (see :func:`as_tuples`)."""
    if blocks.dtype != torch.uint8 or blocks.dim() != 2:
        raise ValueError("block_sums takes a uint8 tensor of shape [blocks, payload bytes]")
    n, nbytes = blocks.shape
    rows = -(-nbytes // _ROW_BYTES)
    if not rows:
        return torch.zeros((n, 3), dtype=torch.int64, device=blocks.device)
    if (nbytes % _ROW_BYTES or blocks.stride(1) != 1 or blocks.stride(0) % _ROW_BYTES
            or blocks.data_ptr() % 4):
        # Not whole aligned rows: one copy, zero-padded to whole rows (zeros add nothing).
        padded = torch.zeros((n, rows * _ROW_BYTES), dtype=torch.uint8, device=blocks.device)
        padded[:, :nbytes] = blocks
        blocks = padded
    words = blocks.view(torch.int32).view(n, rows, SUMS_ROW_WORDS)
    p = SUMS_PRIME
    row_part = torch.zeros(n, dtype=torch.int64, device=blocks.device)
    total = torch.zeros(n, dtype=torch.int64, device=blocks.device)
    cols = torch.zeros((n, SUMS_ROW_WORDS), dtype=torch.int64, device=blocks.device)
    for start in range(0, rows, _STEP_ROWS):
        part = words[:, start:start + _STEP_ROWS]
        r = part.sum(dim=2, dtype=torch.int64)  # exact: |r| < 2**41
        total += r.sum(dim=1)
        weight = torch.arange(start + 1, start + 1 + part.shape[1], dtype=torch.int64,
                              device=blocks.device)
        row_part = (row_part + (r.remainder(p) * weight).remainder(p).sum(dim=1)).remainder(p)
        cols += part.sum(dim=1, dtype=torch.int64)
    weight = torch.arange(1, SUMS_ROW_WORDS + 1, dtype=torch.int64, device=blocks.device)
    col_part = (cols.remainder(p) * weight).remainder(p).sum(dim=1).remainder(p)
    return torch.stack([total, row_part, col_part], dim=1)


def as_tuples(sums: torch.Tensor) -> list[tuple[int, int, int]]:
    """:func:`block_sums`'s result as the header's numbers (waits for the device once)."""
    return [(t % 2**64, r, c) for t, r, c in sums.tolist()]


def payload_sums(dests: Sequence[torch.Tensor]) -> tuple[int, int, int]:
    """The payload sums of one block whose bytes lie in ``dests`` (1-D uint8 tensors, back
    to back in the file, all on one device)."""
    if len(dests) == 1:
        flat = dests[0].reshape(1, -1)
    elif all(d.numel() % _ROW_BYTES == 0 for d in dests[:-1]):
        # Whole rows each (a paged block's layers, as a rule): summed piece by piece.
        return _combine([block_sums(d.reshape(1, -1)) for d in dests],
                        [d.numel() // _ROW_BYTES for d in dests])
    else:
        flat = torch.cat([d.reshape(-1) for d in dests]).reshape(1, -1)
    return as_tuples(block_sums(flat))[0]


def _combine(parts: list[torch.Tensor], rows: list[int]) -> tuple[int, int, int]:
    """Sums of consecutive pieces of whole rows -> the sums of their concatenation.

    Modulo P, the row sum is linear in the rows' sums: a piece shifted by ``k`` rows weighs
    its rows k + 1, k + 2, ..., which adds k times its word sum. Columns do not move (whole
    rows), so column sums add; word sums add."""
    p = SUMS_PRIME
    total = row = col = k = 0
    for (t, r, c), n in zip(torch.cat(parts).tolist(), rows, strict=True):
        total += t
        row = (row + r + k * (t % p)) % p
        col = (col + c) % p
        k += n
    return total % 2**64, row, col
