"""The lower tiers below the hot one (``--cold dir:///path``, ``--shared s3://...``) and the
moving of blocks between them.

- :mod:`.base`: the :class:`Tier` interface (a blocking, thread-safe store of immutable block
  files under content-addressed keys), :func:`check_key`, :class:`TierError`;
- :mod:`.dir`: :class:`DirTier`, a directory (HDD, NFS, CephFS, Lustre);
- :mod:`.s3`: :class:`S3Tier`, an S3-compatible bucket (boto3, imported only when built);
- :mod:`.url`: :func:`parse_tier_url`, a tier from its URL;
- :mod:`.breaker`: :class:`Breaker`, the circuit breaker of one tier, and
  :func:`fetch_deadline`;
- :mod:`.mover`: :class:`~kvfs.daemon.tiers.mover.Tiering`, the daemon's mover on its event loop
  (fetch with single flight, demote, write-through uploads). It imports trio, so it is not
  imported here: ``from kvfs.daemon.tiers.mover import Tiering``.

Daemon side only: the client never imports this package.

Imports: :mod:`kvfs.format`, and of the rest of the daemon only :mod:`kvfs.daemon.backing`
(its system calls on paths) and, in the mover, :mod:`kvfs.daemon.keys` (sealing and opening
blocks); the rest of the daemon uses the tiers through :mod:`.mover`.
"""

from __future__ import annotations

from .base import TMP_PREFIX, Tier, TierError, check_key
from .breaker import Breaker, fetch_deadline
from .dir import DirTier
from .s3 import S3Tier
from .url import parse_shared, parse_tier_url

__all__ = [
    "TMP_PREFIX",
    "Breaker",
    "DirTier",
    "S3Tier",
    "Tier",
    "TierError",
    "check_key",
    "fetch_deadline",
    "parse_shared",
    "parse_tier_url",
]
