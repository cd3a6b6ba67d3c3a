"""Block hashes, block file names and model fingerprints.

A block's hash names its KV content: it chains the hash of the previous block, an optional
``extra`` (LoRA id, cache salt) and the block's token ids. A :class:`ModelSpec` fingerprint
names the KV layout, so blocks of different models or layouts never share a namespace.
The recipes are specified byte by byte in ``docs/format.md``.
"""

from __future__ import annotations

import json
import math
import re
import struct
import sys
from array import array
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import xxhash

from kvfs.format.blockfile import DTYPE_SIZES, FORMAT_VERSION

ROOT_PARENT = bytes(16)
BLOCK_TAG = b"kvfs-block-v1\x00"
FINGERPRINT_VERSION = 1

_U32 = next(tc for tc in "IL" if array(tc).itemsize == 4)  # "I" on every common platform
_BLOCK_NAME = re.compile(r"[0-9a-f]{32}\.kv")
_HEX32 = re.compile(r"[0-9a-fA-F]{32}")
_NAMESPACE = re.compile(r"([A-Za-z0-9_-][A-Za-z0-9._-]{0,199})@([0-9a-f]{16})")


def _tokens_le_u32(token_ids: Iterable[int]) -> bytes:
    seq = token_ids.tolist() if hasattr(token_ids, "tolist") else token_ids
    seq = seq if isinstance(seq, list | tuple | range) else list(seq)
    try:
        arr = array(_U32, seq)
    except (OverflowError, TypeError):
        for i, t in enumerate(seq):
            if isinstance(t, bool) or not isinstance(t, int):
                raise TypeError(f"token id at index {i} is {t!r}, not an int") from None
            if not 0 <= t <= 0xFFFFFFFF:
                raise ValueError(f"token id {t} at index {i} not in [0, 2**32-1]") from None
        raise
    if sys.byteorder == "big":
        arr.byteswap()
    return arr.tobytes()


def block_hashes(
    token_ids: Iterable[int],
    block_size: int,
    *,
    parent: bytes | None = None,
    extra: bytes | str | None = None,
) -> list[bytes]:
    """16-byte hashes of each FULL block of ``token_ids``; a trailing partial block has none.

    ``parent`` is the hash of the block before the first one (default :data:`ROOT_PARENT`);
    ``extra`` (bytes, or str encoded as UTF-8) is mixed into every block's hash.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    h = ROOT_PARENT if parent is None else bytes(parent)
    if len(h) != 16:
        raise ValueError(f"parent hash must be 16 bytes, got {len(h)}")
    ex = extra.encode() if isinstance(extra, str) else bytes(extra or b"")
    tail = struct.pack("<I", len(ex)) + ex
    data = _tokens_le_u32(token_ids)
    step = 4 * block_size
    out = []
    for off in range(0, len(data) - step + 1, step):
        h = xxhash.xxh3_128_digest(BLOCK_TAG + h + tail + data[off : off + step])
        out.append(h)
    return out


def hash_hex(h: bytes) -> str:
    if len(h) != 16:
        raise ValueError(f"a block hash is 16 bytes, got {len(h)}")
    return bytes(h).hex()


def parse_hash(s: str) -> bytes:
    if not isinstance(s, str) or not _HEX32.fullmatch(s):
        raise ValueError(f"not a 32-hex-digit hash: {s!r}")
    return bytes.fromhex(s)


def block_filename(h: bytes) -> str:
    return f"{hash_hex(h)}.kv"


def block_relpath(h: bytes) -> str:
    """``<first byte hex>/<hash hex>.kv``: 256-way fan-out by the first hash byte."""
    return f"{hash_hex(h)[:2]}/{hash_hex(h)}.kv"


def parse_block_filename(name: str) -> bytes | None:
    """The hash named by a block file name, or None if it is not one (32 lowercase hex + .kv)."""
    return bytes.fromhex(name[:32]) if _BLOCK_NAME.fullmatch(name) else None


def slugify(model: str) -> str:
    """Filesystem-safe form of a model id: ``org/name`` becomes ``org--name``."""
    slug = re.sub(r"[^A-Za-z0-9._-]", "_", model.replace("/", "--"))
    return ("_" + slug[1:] if slug.startswith(".") else slug)[:200]


def parse_namespace(name: str) -> tuple[str, str] | None:
    """``(slug, 16-hex fingerprint prefix)`` of a namespace directory name, else None."""
    m = _NAMESPACE.fullmatch(name)
    return (m.group(1), m.group(2)) if m else None


class _FrozenMap(Mapping[str, str]):
    """A read-only, hashable str -> str mapping (kept sorted by key)."""

    def __init__(self, items: Mapping[str, str]) -> None:
        self._d = dict(sorted(items.items()))

    def __getitem__(self, key: str) -> str:
        return self._d[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)

    def __hash__(self) -> int:
        return hash(tuple(self._d.items()))

    def __repr__(self) -> str:
        return repr(self._d)


_INT_FIELDS = ("block_size", "num_layers", "num_kv_heads", "head_dim", "tp_size", "tp_rank")


@dataclass(frozen=True)
class ModelSpec:
    """What a KV block's bytes mean: model, dtype and per-rank layout.

    ``num_kv_heads`` is the number of KV heads held in this rank's blocks (the per-shard
    count under tensor parallelism). ``extras`` holds any further str -> str facts that
    change the KV bytes (e.g. quantization scheme, rope scaling).
    """

    model: str
    revision: str
    kv_dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tp_size: int = 1
    tp_rank: int = 0
    extras: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("model must be a non-empty str")
        if not isinstance(self.revision, str):
            raise ValueError(f"revision must be a str, got {self.revision!r}")
        if self.kv_dtype not in DTYPE_SIZES:
            raise ValueError(f"kv_dtype {self.kv_dtype!r} not one of {sorted(DTYPE_SIZES)}")
        for name in _INT_FIELDS:
            v = getattr(self, name)
            low = 0 if name == "tp_rank" else 1
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
        if self.tp_rank >= self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} must be < tp_size {self.tp_size}")
        extras = dict(self.extras)
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in extras.items()):
            raise ValueError(f"extras must map str to str, got {extras!r}")
        object.__setattr__(self, "extras", _FrozenMap(extras))

    def _fields(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)} | {"extras": dict(self.extras)}

    def canonical_bytes(self) -> bytes:
        """The exact bytes the fingerprint hashes (compact, key-sorted, ASCII JSON)."""
        doc = {"kvfs_fingerprint": FINGERPRINT_VERSION, **self._fields()}
        return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()

    @property
    def fingerprint(self) -> bytes:
        return xxhash.xxh3_128_digest(self.canonical_bytes())

    @property
    def namespace(self) -> str:
        return f"{slugify(self.model)}@{self.fingerprint[:8].hex()}"

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_payload_bytes(self) -> int:
        return math.prod(self.block_shape) * DTYPE_SIZES[self.kv_dtype]

    def manifest(self) -> dict[str, Any]:
        return self._fields() | {
            "fingerprint": self.fingerprint.hex(),
            "namespace": self.namespace,
            "format_version": FORMAT_VERSION,
        }

    def manifest_json(self) -> bytes:
        return (json.dumps(self.manifest(), indent=2, sort_keys=True) + "\n").encode()

    @classmethod
    def from_manifest(cls, doc: Mapping[str, Any] | bytes | str) -> ModelSpec:
        """Rebuild a spec from :meth:`manifest` output; checks fingerprint and namespace."""
        if isinstance(doc, bytes | bytearray | str):
            try:
                doc = json.loads(doc)
            except json.JSONDecodeError as e:
                raise ValueError(f"manifest is not valid JSON: {e}") from None
        if not isinstance(doc, Mapping):
            raise ValueError("manifest must be a JSON object")
        if doc.get("format_version") != FORMAT_VERSION:
            raise ValueError(
                f"manifest format_version {doc.get('format_version')!r}, supported {FORMAT_VERSION}"
            )
        names = [f for f in cls.__dataclass_fields__ if f not in ("tp_size", "tp_rank", "extras")]
        missing = [n for n in names if n not in doc]
        if missing:
            raise ValueError(f"manifest lacks {', '.join(missing)}")
        kwargs = {n: doc[n] for n in cls.__dataclass_fields__ if n in doc}
        spec = cls(**kwargs)
        if doc.get("fingerprint") != spec.fingerprint.hex():
            raise ValueError(
                f"manifest fingerprint {doc.get('fingerprint')!r} does not match "
                f"its fields ({spec.fingerprint.hex()})"
            )
        if "namespace" in doc and doc["namespace"] != spec.namespace:
            raise ValueError(f"manifest namespace {doc['namespace']!r} != {spec.namespace!r}")
        return spec
