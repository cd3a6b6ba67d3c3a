"""The control protocol of the direct path: batched commands as xattrs on a directory.

A client that reads and writes backing files itself tells the daemon what it did in a
constant number of calls per request, never one per block. Each command is a `setxattr` on
the directory that holds the blocks (normally the model namespace), so the kernel checks the
caller's write permission on it exactly as for a file write: a tenant can only command its
own directories. Payloads are packed binary, at most 64 KiB (the kernel's xattr limit);
clients split larger batches.

- ``user.kvfs.publish``: N x 16-byte block hashes. The files ``<hh>/<hash>.kv`` below the
  directory were written and renamed into place: verify their headers and index them.
- ``user.kvfs.access``: an `Access` record followed by N x 16-byte hashes of blocks that
  were hits (their access time drives LRU). Counts a lookup's hits and misses.
- ``user.kvfs.corrupt``: N x 16-byte hashes of blocks that failed verification on read:
  quarantine them, so that they become misses for everyone.
- ``user.kvfs.fetch``: N x 16-byte hashes the hot tier lacks: fetch them from the lower
  tiers (each within its deadline) and place them hot; returns when done. Optionally
  preceded by ``KVF1`` and a little-endian u32 budget in milliseconds: the call returns once
  the budget is spent, and the fetches still running finish in the background.
- ``user.kvfs.prefetch``: the same, but returns at once (the promotions run in the
  background), so that a queued request finds its blocks hot when its turn comes.

Queries are plain getxattr: ``user.kvfs.backing`` on any node gives its backing path.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

#: Every kvfs attribute name starts so; the daemon answers them, the kernel never stores them.
XATTR_PREFIX = b"user.kvfs."

# Commands (setxattr on a directory).
PUBLISH = b"user.kvfs.publish"
ACCESS = b"user.kvfs.access"
CORRUPT = b"user.kvfs.corrupt"
FETCH = b"user.kvfs.fetch"
PREFETCH = b"user.kvfs.prefetch"
COMMANDS = (PUBLISH, ACCESS, CORRUPT, FETCH, PREFETCH)

# Queries (getxattr on any node): what the daemon knows of it.
TIER = b"user.kvfs.tier"  #: the tier that holds a file: hot or a lower tier's name
BACKING = b"user.kvfs.backing"  #: the node's path in the backing tree (the direct path)
TIERS = b"user.kvfs.tiers"  #: on a directory: the lower tiers' names, comma-separated
BLOCK_HASH = b"user.kvfs.block_hash"  #: a block's own hash, hex
PARENT_HASH = b"user.kvfs.parent_hash"  #: the hash of the block before it in the chain, hex
USED = b"user.kvfs.used"  #: on a tenant directory: bytes it holds

# Settings (setxattr / getxattr / removexattr).
PIN = b"user.kvfs.pin"  #: on a file or directory: exempt from eviction and retention


def limit_name(key: str) -> bytes:
    """The attribute of one per-directory limit (a `kvfs.capacity.Limits` field)."""
    return XATTR_PREFIX + key.encode()

HASH_LEN = 16
XATTR_MAX = 65536
_ACCESS = struct.Struct("<4sIIIQQQQ")
ACCESS_MAGIC = b"KVA2"
#: The first version, without needed_bytes: still accepted from older clients.
_ACCESS_V1 = struct.Struct("<4sIIIQQQ")
#: Hashes that fit in one command.
MAX_HASHES = (XATTR_MAX - _ACCESS.size) // HASH_LEN


class ControlError(ValueError):
    """A malformed control payload."""


def pack_hashes(hashes: list[bytes]) -> bytes:
    if any(len(h) != HASH_LEN for h in hashes):
        raise ControlError("block hashes are 16 bytes")
    if len(hashes) > MAX_HASHES:
        raise ControlError(f"at most {MAX_HASHES} hashes per command")
    return b"".join(hashes)


def unpack_hashes(value: bytes) -> list[bytes]:
    if len(value) % HASH_LEN:
        raise ControlError(f"payload of {len(value)} bytes is not a list of 16-byte hashes")
    return [value[i:i + HASH_LEN] for i in range(0, len(value), HASH_LEN)]


_FETCH_BUDGET = struct.Struct("<4sI")
FETCH_MAGIC = b"KVF1"


def pack_fetch(hashes: list[bytes], budget: float | None = None) -> bytes:
    """A fetch command; `budget`: seconds the call may take (None: each fetch's deadline)."""
    if budget is None:
        return pack_hashes(hashes)
    if not 0 <= budget < 4e6:
        raise ControlError(f"a fetch budget of {budget} s is out of range")
    if len(hashes) * HASH_LEN + _FETCH_BUDGET.size > XATTR_MAX:
        raise ControlError(f"at most {MAX_HASHES} hashes per command")
    return _FETCH_BUDGET.pack(FETCH_MAGIC, round(budget * 1000)) + pack_hashes(hashes)


def unpack_fetch(value: bytes) -> tuple[list[bytes], float | None]:
    """(hashes, budget in seconds or None) of a fetch command. A budgeted payload is 8 bytes
    longer than a multiple of 16, so the two forms cannot be mistaken for each other."""
    if len(value) % HASH_LEN == _FETCH_BUDGET.size and value[:4] == FETCH_MAGIC:
        _, ms = _FETCH_BUDGET.unpack_from(value)
        return unpack_hashes(value[_FETCH_BUDGET.size:]), ms / 1000
    return unpack_hashes(value), None


@dataclass(frozen=True)
class Access:
    """What one lookup or load found."""

    lookups: int = 1  # lookup calls this record stands for
    hit_blocks: int = 0
    miss_blocks: int = 0
    hit_tokens: int = 0
    miss_tokens: int = 0
    read_bytes: int = 0  # bytes the client read from backing files itself
    needed_bytes: int = 0  # bytes the blocks it loaded hold: read / needed = amplification
    hashes: tuple[bytes, ...] = ()  # blocks that were hits, for their access time

    def pack(self) -> bytes:
        head = _ACCESS.pack(ACCESS_MAGIC, self.lookups, self.hit_blocks, self.miss_blocks,
                            self.hit_tokens, self.miss_tokens, self.read_bytes,
                            self.needed_bytes)
        return head + pack_hashes(list(self.hashes))

    @classmethod
    def unpack(cls, value: bytes) -> Access:
        if value[:4] == b"KVA1" and len(value) >= _ACCESS_V1.size:
            _, lookups, hb, mb, ht, mt, rb = _ACCESS_V1.unpack_from(value)
            return cls(lookups, hb, mb, ht, mt, rb, 0,
                       tuple(unpack_hashes(value[_ACCESS_V1.size:])))
        if len(value) < _ACCESS.size:
            raise ControlError("access record too short")
        magic, lookups, hb, mb, ht, mt, rb, nb = _ACCESS.unpack_from(value)
        if magic != ACCESS_MAGIC:
            raise ControlError(f"access record has magic {magic!r}, expected {ACCESS_MAGIC!r}")
        return cls(lookups, hb, mb, ht, mt, rb, nb, tuple(unpack_hashes(value[_ACCESS.size:])))
