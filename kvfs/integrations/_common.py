"""What the engine adapters share: checking a mount and tenant, naming blocks, describing pages.

No engine is imported here.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from typing import Any

import torch
import xxhash

from ..client import CacheFull, KVCache
from ..format.blockfile import DTYPE_SIZES
from ..format.hashing import ModelSpec

log = logging.getLogger(__name__)

_HEX64 = re.compile(r"[0-9a-f]{64}")


class BadConfig(ValueError):
    """An adapter's kvfs settings are missing or wrong; the message says which and how."""


def check_target(mount: Any, tenant: Any, engine: str, where: str) -> tuple[str, str]:
    """``(mount, tenant)`` once both are usable: a kvfs mount, a tenant this process may
    write. ``where`` names the engine setting that holds them, for the error."""
    if not isinstance(mount, str) or not mount:
        raise BadConfig(f"{engine}: no kvfs mount: set 'mount' in {where}")
    if not isinstance(tenant, str) or not tenant or "/" in tenant or tenant.startswith("."):
        raise BadConfig(f"{engine}: set 'tenant' in {where} to a tenant of {mount} "
                        f"(got {tenant!r})")
    if not os.path.exists(os.path.join(mount, ".kvfs", "version")):
        raise BadConfig(f"{engine}: {mount} is not a kvfs mount (no .kvfs/version there)")
    tdir = os.path.join(mount, tenant)
    if not os.path.isdir(tdir):
        raise BadConfig(f"{engine}: no tenant {tenant!r} in {mount} (see: kvfs tenant add)")
    if not os.access(tdir, os.W_OK | os.X_OK):
        raise BadConfig(f"{engine}: this process (uid {os.getuid()}) may not write tenant "
                        f"{tenant!r} of {mount}")
    return mount, tenant


def key_hash(key: str) -> bytes:
    """The kvfs block hash an engine's key names: a 64-hex key (a sha256, as SGLang's page
    keys are) keeps its first 16 bytes, so block files are named by the key's prefix; any
    other key is hashed (xxh3-128 of its UTF-8 bytes)."""
    if _HEX64.fullmatch(key):
        return bytes.fromhex(key[:32])
    return xxhash.xxh3_128_digest(key.encode())


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_SIZES:
        raise BadConfig(f"KV dtype {name} has no kvfs name (one of {sorted(DTYPE_SIZES)})")
    return name


def page_spec(*, model: str, dtype: torch.dtype, page_bytes: int, num_layers: int,
              tokens: int, heads: int | None, head_dim: int | None, tp_size: int,
              tp_rank: int, extras: dict[str, str]) -> ModelSpec:
    """The spec of an engine's page (or chunk) of ``page_bytes``: K and V of ``heads`` x
    ``head_dim`` per token and layer where they add up, else (MLA's one latent row per token
    and layer) one head of half the row, so that the block's size is the page's."""
    kv_dtype = dtype_name(dtype)
    per = page_bytes // (DTYPE_SIZES[kv_dtype] * num_layers * tokens)
    if per * DTYPE_SIZES[kv_dtype] * num_layers * tokens != page_bytes:
        raise BadConfig(f"a page of {page_bytes} bytes is not {num_layers} layers x "
                        f"{tokens} tokens of {kv_dtype}")
    if not (heads and head_dim and 2 * heads * head_dim == per):
        if per % 2:
            raise BadConfig(f"a row of {per} {kv_dtype} values per token and layer cannot be "
                            "described as K and V halves")
        heads, head_dim = 1, per // 2
    return ModelSpec(model=model or "unknown", revision="", kv_dtype=kv_dtype,
                     block_size=tokens, num_layers=num_layers, num_kv_heads=heads,
                     head_dim=head_dim, tp_size=tp_size, tp_rank=tp_rank, extras=extras)


def runs(t: torch.Tensor) -> list[torch.Tensor]:
    """The contiguous pieces of a strided view, in its row-major order: their bytes, one
    after the other, are ``t.flatten()``'s."""
    if t.is_contiguous():
        return [t]
    return [r for i in range(t.shape[0]) for r in runs(t[i])]


def save_prefix(cache: KVCache, hashes: Sequence[bytes],
                parts: Sequence[Sequence[torch.Tensor]], *, parent: bytes | None = None) -> int:
    """Store block ``hashes[i]`` from ``parts[i]`` (:meth:`KVCache.save_parts`); returns how
    many leading blocks are stored: all of them, or, where kvfs refuses the batch for want of
    space (:class:`~kvfs.client.CacheFull`: a batch larger than the cache or the tenant's
    quota can hold is refused whole and its files removed), a prefix that fits. A prefix of a
    chain is useful (a prefix hit); the rest are later misses. The batch is cut first to what
    the capacity and the quota can hold at all (:meth:`KVCache.blocks_that_fit`), so a batch
    larger than the cache is written once, not refused and written again; where kvfs still
    refuses it (room held by pinned blocks or other tenants), each refusal halves it and
    writes it again. Other errors are raised."""
    n = cache.blocks_that_fit(len(hashes))
    while n:
        try:
            cache.save_parts(hashes[:n], parts[:n], parent=parent)
            break
        except CacheFull:
            n //= 2
    if n < len(hashes):
        log.warning("kvfs refused %d blocks for want of space: stored the first %d",
                    len(hashes), n)
    return n
