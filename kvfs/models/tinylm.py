"""A small transformer in torch whose KV cache is saved to and restored from kvfs.

:class:`TinyLM` is a decoder-only model with random weights drawn from a fixed seed: RMSNorm,
rotary position embeddings, grouped-query attention (fewer KV heads than query heads), a
SwiGLU MLP, float32 on the CPU. It exists to show, and to test, that a KV cache restored
through kvfs is exactly the one a recompute would produce: the continuation decoded from a
restored prefix equals the one decoded after recomputing the whole context, token for token,
and the logits are bit for bit the same.

That needs a computation whose result for one token does not depend on how the tokens were
grouped into calls (a prefill of 2,000 tokens, a tail of 7, decoding one at a time). CPU
GEMM kernels do not promise that: their blocking and their threads' split depend on the
matrix shape, so a row's float32 sum comes out in another order when the row count changes.
So every operation runs on fixed shapes at fixed places:

- tokens are processed in *tiles* of ``config.tile`` positions aligned to absolute positions
  (tile j holds positions ``[j * tile, (j + 1) * tile)``); a call computes every tile it
  touches in full, with padding rows where it has no token, and keeps the rows it owns. A
  token is always row ``p % tile`` of the same shaped GEMM, whose other rows cannot change
  it;
- attention walks the keys in *chunks* of ``config.key_chunk`` positions, also aligned, with
  an online softmax in chunk order; a chunk is zero-padded past the keys that exist, and
  masked (causally) so padding never contributes. A chunk that is fully masked for a row is
  an exact no-op for it.

Decoding one token therefore costs a whole tile (``tile`` rows): the price of bit-exact
restores, negligible at this size. The float32 sums also depend on how many threads split
them, so the model computes with a fixed number of intra-op threads (``threads``, default 1,
set for each call and restored after it): every process that shares a cache must use the
same. One thread is also the fastest for tiles this small on a loaded machine.

The KV cache of a context of T tokens is a tensor ``[num_layers, 2, T, num_kv_heads,
head_dim]`` (2: keys, values; keys after the rotary embedding). :func:`kv_to_blocks` and
:func:`blocks_to_kv` convert it to and from the client's contiguous block layout ``[n,
num_layers, 2, block_size, num_kv_heads, head_dim]``; :func:`save_prefix` and
:func:`restore_prefix` do a whole save or restore through a :class:`kvfs.KVCache`.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
import xxhash

from ..format.hashing import ModelSpec

if TYPE_CHECKING:
    from ..client import KVCache

MODEL_ID = "kvfs/models/tinylm"


@dataclass(frozen=True)
class TinyLMConfig:
    """The model's shape. Every field, and the seed, goes into :meth:`TinyLM.spec`'s revision:
    ``tile`` and ``key_chunk`` too, since they fix the order of float32 sums."""

    vocab_size: int = 512
    d_model: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    ffn_dim: int = 1024
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    max_seq: int = 16384
    tile: int = 32
    key_chunk: int = 128

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "ffn_dim", "max_seq", "tile", "key_chunk"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads "
                             f"{self.num_kv_heads}")
        if self.max_seq % self.tile:
            raise ValueError(f"max_seq {self.max_seq} is not a multiple of tile {self.tile}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (rotary pairs), got {self.head_dim}")

    @property
    def kv_bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * 4


class _Work:
    """The KV of a context being extended: a buffer padded to whole tiles and key chunks."""

    def __init__(self, cfg: TinyLMConfig, past: torch.Tensor | None) -> None:
        self.cfg = cfg
        self.length = 0 if past is None else past.shape[2]
        self.buf = self._alloc(max(self.length, 1))
        if past is not None:
            self.buf[:, :, :self.length] = past

    def _alloc(self, n: int) -> torch.Tensor:
        c = self.cfg
        unit = math.lcm(c.tile, c.key_chunk)
        cap = -(-n // unit) * unit
        return torch.zeros((c.num_layers, 2, cap, c.num_kv_heads, c.head_dim))

    def reserve(self, n: int) -> None:
        """Room for ``n`` positions, and the padding of the tile and chunk they end in."""
        unit = math.lcm(self.cfg.tile, self.cfg.key_chunk)
        if -(-n // unit) * unit > self.buf.shape[2]:
            bigger = self._alloc(max(n, 2 * self.buf.shape[2]))
            bigger[:, :, :self.length] = self.buf[:, :, :self.length]
            self.buf = bigger

    def kv(self) -> torch.Tensor:
        return self.buf[:, :, :self.length].contiguous()


class TinyLM:
    """A decoder-only transformer with random weights drawn from ``seed``."""

    def __init__(self, config: TinyLMConfig | None = None, seed: int = 0, *,
                 threads: int = 1) -> None:
        c = self.config = config or TinyLMConfig()
        self.seed, self.threads = seed, threads
        g = torch.Generator().manual_seed(seed)

        def w(rows: int, cols: int) -> torch.Tensor:
            return torch.randn(rows, cols, generator=g) / math.sqrt(cols)

        qkv_rows = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        self.embed = torch.randn(c.vocab_size, c.d_model, generator=g)
        self.layers: list[dict[str, torch.Tensor]] = []
        for _ in range(c.num_layers):
            self.layers.append({
                "attn_norm": 1 + 0.1 * torch.randn(c.d_model, generator=g),
                "qkv": w(qkv_rows, c.d_model),
                "o": w(c.d_model, c.num_heads * c.head_dim),
                "mlp_norm": 1 + 0.1 * torch.randn(c.d_model, generator=g),
                "gate_up": w(2 * c.ffn_dim, c.d_model),
                "down": w(c.d_model, c.ffn_dim),
            })
        self.final_norm = 1 + 0.1 * torch.randn(c.d_model, generator=g)
        self.lm_head = w(c.vocab_size, c.d_model) * 4  # sharper distributions, livelier text
        half = c.head_dim // 2
        inv = 1.0 / (c.rope_theta ** (torch.arange(half, dtype=torch.float64) / half))
        ang = torch.arange(c.max_seq, dtype=torch.float64)[:, None] * inv[None, :]
        self._cos = ang.cos().to(torch.float32)  # [max_seq, head_dim / 2]
        self._sin = ang.sin().to(torch.float32)

    # -- identity ------------------------------------------------------------------------

    @property
    def revision(self) -> str:
        """Names the weights and the arithmetic: a hash of the config, the seed, the thread
        count and the torch version (the last two change the float32 sums' order)."""
        doc = json.dumps({"config": asdict(self.config), "seed": self.seed,
                          "threads": self.threads, "torch": torch.__version__.split("+")[0]},
                         sort_keys=True)
        return f"seed{self.seed}-{xxhash.xxh3_64_hexdigest(doc.encode())}"

    def spec(self, block_size: int) -> ModelSpec:
        """The kvfs namespace of this model's KV blocks of ``block_size`` tokens."""
        c = self.config
        return ModelSpec(model=MODEL_ID, revision=self.revision, kv_dtype="float32",
                         block_size=block_size, num_layers=c.num_layers,
                         num_kv_heads=c.num_kv_heads, head_dim=c.head_dim)

    # -- inference -----------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, tokens: Sequence[int] | torch.Tensor, past: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run ``tokens`` after the context whose KV is ``past`` (None: an empty context).

        Returns the logits of each new token, ``[len(tokens), vocab_size]``, and the KV of the
        whole context, past and new, ``[num_layers, 2, T, num_kv_heads, head_dim]``.
        """
        work = _Work(self.config, self._check_past(past))
        with self._threads():
            logits = self._extend(work, self._check_tokens(tokens))
        return logits, work.kv()

    @torch.inference_mode()
    def generate(self, tokens: Sequence[int] | torch.Tensor, n: int,
                 past: torch.Tensor | None = None) -> tuple[list[int], torch.Tensor]:
        """Greedy decoding of ``n`` tokens after ``tokens`` (which follow ``past``).

        Returns the new tokens and the KV of the whole context, the new tokens included (each
        is run through the model once more, so that the next turn can start from it).
        """
        toks = self._check_tokens(tokens)
        if not toks.numel():
            raise ValueError("generate needs at least one new token: its logits start the "
                             "decoding (restore_prefix always leaves one)")
        work = _Work(self.config, self._check_past(past))
        out: list[int] = []
        with self._threads():
            logits = self._extend(work, toks)
            for _ in range(n):
                nxt = int(torch.argmax(logits[-1]))
                out.append(nxt)
                logits = self._extend(work, torch.tensor([nxt]))
        return out, work.kv()

    @contextlib.contextmanager
    def _threads(self) -> Iterator[None]:
        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    def _check_tokens(self, tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
        t = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        if t.numel() and not (0 <= int(t.min()) and int(t.max()) < self.config.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.config.vocab_size})")
        return t

    def _check_past(self, past: torch.Tensor | None) -> torch.Tensor | None:
        if past is None:
            return None
        c = self.config
        want = (c.num_layers, 2, c.num_kv_heads, c.head_dim)
        if past.dim() != 5 or (*past.shape[:2], *past.shape[3:]) != want:
            raise ValueError(f"past has shape {tuple(past.shape)}, expected "
                             f"[{c.num_layers}, 2, T, {c.num_kv_heads}, {c.head_dim}]")
        if past.dtype != torch.float32:
            raise ValueError(f"past has dtype {past.dtype}, expected torch.float32")
        return past

    def _extend(self, work: _Work, tokens: torch.Tensor) -> torch.Tensor:
        """Append ``tokens`` to ``work``; the logits of each, computed tile by tile."""
        c = self.config
        start, n = work.length, tokens.numel()
        end = start + n
        if n == 0:
            return torch.empty(0, c.vocab_size)
        if end > c.max_seq:
            raise ValueError(f"context of {end} tokens exceeds max_seq {c.max_seq}")
        work.reserve(end)
        logits = torch.empty(n, c.vocab_size)
        for p0 in range(start // c.tile * c.tile, end, c.tile):
            lo, hi = max(start, p0) - p0, min(end, p0 + c.tile) - p0  # rows this call owns
            ids = torch.zeros(c.tile, dtype=torch.long)
            ids[lo:hi] = tokens[p0 + lo - start:p0 + hi - start]
            logits[p0 + lo - start:p0 + hi - start] = self._tile(work, p0, lo, hi, ids)[lo:hi]
        work.length = end
        return logits

    def _tile(self, work: _Work, p0: int, lo: int, hi: int, ids: torch.Tensor) -> torch.Tensor:
        """Every layer on tile ``[p0, p0 + tile)``; rows ``[lo, hi)`` are real and their K/V
        are written to ``work``. Every operation has the same shape for every tile."""
        c = self.config
        R, H, G, D = c.tile, c.num_heads, c.num_kv_heads, c.head_dim
        cos, sin = self._cos[p0:p0 + R, None, :], self._sin[p0:p0 + R, None, :]
        x = self.embed[ids]
        for li, lw in enumerate(self.layers):
            h = _rms_norm(x, lw["attn_norm"], c.norm_eps)
            qkv = F.linear(h, lw["qkv"])
            q = _rope(qkv[:, :H * D].reshape(R, H, D), cos, sin)
            k = _rope(qkv[:, H * D:(H + G) * D].reshape(R, G, D), cos, sin)
            v = qkv[:, (H + G) * D:].reshape(R, G, D)
            work.buf[li, 0, p0 + lo:p0 + hi] = k[lo:hi]
            work.buf[li, 1, p0 + lo:p0 + hi] = v[lo:hi]
            x = x + F.linear(self._attend(work.buf[li], q, p0), lw["o"])
            h = _rms_norm(x, lw["mlp_norm"], c.norm_eps)
            gate, up = F.linear(h, lw["gate_up"]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, lw["down"])
        return F.linear(_rms_norm(x, self.final_norm, c.norm_eps), self.lm_head)

    def _attend(self, kv: torch.Tensor, q: torch.Tensor, p0: int) -> torch.Tensor:
        """Causal attention of the tile's queries ``q`` ``[R, H, D]`` over ``kv`` ``[2, cap,
        G, D]``, key chunk by key chunk with an online softmax; returns ``[R, H * D]``."""
        c = self.config
        R, H, G, D, C = c.tile, c.num_heads, c.num_kv_heads, c.head_dim, c.key_chunk
        group = H // G
        # Query head h attends with KV head h // group: [G, group * R, D].
        qg = (q * (1.0 / math.sqrt(D))).permute(1, 0, 2).reshape(G, group * R, D)
        qpos = torch.arange(p0, p0 + R)
        m = torch.full((G, group * R, 1), -math.inf)
        denom = torch.zeros((G, group * R, 1))
        acc = torch.zeros((G, group * R, D))
        last = p0 + R - 1
        for k0 in range(0, last // C * C + 1, C):
            keys = kv[0, k0:k0 + C].permute(1, 2, 0)  # [G, D, C]
            vals = kv[1, k0:k0 + C].permute(1, 0, 2)  # [G, C, D]
            s = torch.bmm(qg, keys)
            if k0 + C - 1 > p0:  # keys after some query of the tile: mask them
                future = torch.arange(k0, k0 + C)[None, :] > qpos[:, None]  # [R, C]
                s = s.view(G, group, R, C).masked_fill(future, -math.inf).view(G, group * R, C)
            m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
            scale = torch.exp(m - m_new)
            p = torch.exp(s - m_new)
            denom = denom * scale + p.sum(dim=-1, keepdim=True)
            acc = acc * scale + torch.bmm(p, vals)
            m = m_new
        out = (acc / denom).view(G, group, R, D).permute(2, 0, 1, 3)  # [R, G, group, D]
        return out.reshape(R, H * D)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` ``[R, heads, D]`` (pairs: dimension i and i + D/2)."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)


# -- the client's block layout ---------------------------------------------------------------


def kv_to_blocks(kv: torch.Tensor, block_size: int) -> torch.Tensor:
    """The full blocks of ``kv`` ``[L, 2, T, H, D]`` as ``[T // block_size, L, 2, block_size,
    H, D]`` (contiguous); tokens past the last full block are left out."""
    L, two, T, H, D = kv.shape
    n = T // block_size
    blocks = kv[:, :, :n * block_size].reshape(L, two, n, block_size, H, D)
    return blocks.permute(2, 0, 1, 3, 4, 5).contiguous()


def blocks_to_kv(blocks: torch.Tensor) -> torch.Tensor:
    """``[n, L, 2, block_size, H, D]`` blocks back to one KV tensor ``[L, 2, n * block_size,
    H, D]`` (contiguous)."""
    n, L, two, bs, H, D = blocks.shape
    return blocks.permute(1, 2, 0, 3, 4, 5).reshape(L, two, n * bs, H, D).contiguous()


def save_prefix(cache: KVCache, tokens: Sequence[int], kv: torch.Tensor) -> tuple[int, int]:
    """Save the full blocks of the context ``tokens`` whose KV is ``kv``.

    Returns (full blocks, blocks newly written); blocks already cached are not rewritten.
    """
    bs = cache.spec.block_size
    hashes = cache.block_hashes(list(tokens))[:kv.shape[2] // bs]
    if not hashes:
        return 0, 0
    return len(hashes), cache.save(hashes, kv_to_blocks(kv[:, :, :len(hashes) * bs], bs))


def restore_prefix(cache: KVCache, tokens: Sequence[int]) -> tuple[int, torch.Tensor | None]:
    """Restore the longest cached prefix of the context ``tokens``: one lookup, one load.

    Returns the number of tokens restored (a multiple of the block size) and their KV
    ``[L, 2, T, H, D]``, or (0, None) on a miss. At least the last token is left out, even
    when every block is cached: its logits are what decoding starts from.
    """
    toks = list(tokens)
    hashes = cache.block_hashes(toks)[:(len(toks) - 1) // cache.spec.block_size]
    n = cache.lookup(hashes)
    if n == 0:
        return 0, None
    out = torch.empty((n, *cache.spec.block_shape), dtype=torch.float32)
    n = cache.load(hashes[:n], out)
    if n == 0:
        return 0, None
    return n * cache.spec.block_size, blocks_to_kv(out[:n])
