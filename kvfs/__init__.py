"""kvfs: a FUSE-mounted, shared KV-cache filesystem for LLM inference.

The daemon side (``kvfs.fs``, ``kvfs.mount``) needs pyfuse3 and trio; the format layer
(``kvfs.hashing``, ``kvfs.blockfile``) needs only xxhash.
"""

from __future__ import annotations

__version__ = "0.1.0"
