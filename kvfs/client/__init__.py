"""The kvfs client: save and load the KV blocks of one model through the direct path.

:class:`KVCache` (``KVCache.open(mount, tenant=..., spec=ModelSpec(...))``) is one model
namespace of a kvfs mount: bulk bytes go straight to the namespace's backing files, and the
daemon hears of them in a constant number of control calls per request. The package:

- :mod:`.cache`: the cache object (opening, the manifest, closing, counters, block names,
  lookups through the lower tiers, prefetches);
- :mod:`.channel`: its control channel (every ``user.kvfs.*`` call to the daemon, access
  records batched and sent by a control thread);
- :mod:`.save`: writing blocks (temporaries renamed into place) and publishing them;
- :mod:`.load`: the direct read path and the verification of every block read;
- :mod:`.layouts`: the tensor layouts (contiguous, paged, engine parts), checked.

Integrity: every loaded block's header is checked and, with ``verify="full"`` (the default),
its payload checksum; a block that fails is a miss, and so is every block after it. A
namespace whose manifest names another spec is refused at :meth:`KVCache.open` with
:class:`SpecMismatch`. The client imports torch (and kvikio, lazily), never pyfuse3 nor the
daemon's modules: on-disk names come from :mod:`kvfs.format.layout`, attribute names and payloads
from :mod:`kvfs.format.control`, the block format from :mod:`kvfs.format.blockfile`.

Imports: :mod:`kvfs.format` only (and torch, kvikio lazily); never the daemon, the
models, the integrations, the benchmarks or the command line.
"""

from __future__ import annotations

from ..format.hashing import ModelSpec
from .cache import BACKING_XATTR, FD_LIMIT, MANIFEST, TIERS_XATTR, KVCache, SpecMismatch
from .channel import CONTROL_IDLE_S, MAX_QUEUED_RECORDS, ControlChannel
from .layerwise import LoadHandle
from .load import SAMPLE_EVERY, THREAD_BYTES
from .save import CacheFull

__all__ = [
    "BACKING_XATTR",
    "CONTROL_IDLE_S",
    "FD_LIMIT",
    "MANIFEST",
    "MAX_QUEUED_RECORDS",
    "SAMPLE_EVERY",
    "THREAD_BYTES",
    "TIERS_XATTR",
    "CacheFull",
    "ControlChannel",
    "KVCache",
    "LoadHandle",
    "ModelSpec",
    "SpecMismatch",
]
