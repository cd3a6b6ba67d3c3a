"""kvfs: a FUSE-mounted, shared KV-cache filesystem for LLM inference.

The daemon side (``kvfs.daemon.fs``, ``kvfs.daemon.mount``) needs pyfuse3 and trio; the format layer
(``kvfs.format.hashing``, ``kvfs.format.blockfile``) needs only xxhash; the client (``kvfs.client``,
``kvfs.client.transport``) needs torch. ``kvfs.ModelSpec`` and ``kvfs.KVCache`` are imported on
first use, so that ``import kvfs`` imports none of them.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {"ModelSpec": "format.hashing", "KVCache": "client", "SpecMismatch": "client",
         "CacheFull": "client"}
__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib  # noqa: PLC0415

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
