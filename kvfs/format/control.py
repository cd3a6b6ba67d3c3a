"""The control protocol of the direct path: batched commands as xattrs on a directory.

A client that reads and writes backing files itself tells the daemon what it did in a
constant number of calls per request, never one per block. Each command is a `setxattr` on
the directory that holds the blocks (normally the model namespace), so the kernel checks the
caller's write permission on it exactly as for a file write: a tenant can only command its
own directories. Payloads are packed binary, at most 64 KiB (the kernel's xattr limit);
clients split larger batches.

- ``user.kvfs.publish``: N x 16-byte block hashes. The files ``<hh>/<hash>.kv`` below the
  directory were written and renamed into place: verify their headers and index them.
  Optionally preceded by ``KVP1`` and a little-endian u32 of flags: ``PUBLISH_FETCHED``,
  the blocks are hot copies of what a load read from a shared tier (not uploaded again).
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
- ``user.kvfs.grant``: ``KVG1``, a 16-byte nonce, a u32 budget in milliseconds (0: none)
  and N x 16-byte hashes the hot tier lacks: for the longest prefix of them that some tier
  may hold, say where each can be read. A block not in a directory tier gets a presigned GET
  of its one object in the shared S3 tier, valid for seconds (the client's GET, sent at its
  lookup, says whether it is there; its body is read into the destination by the load);
  a block in a directory tier is promoted, as by ``fetch``, and is then hot, unless the
  command is ``KVG2`` (the same, then a u32 of flags) with ``GRANT_TAKES_FDS``: then its
  file is handed to the client as an open descriptor (``kvfs.daemon.handout``). The answer is read
  with getxattr ``user.kvfs.grant.<nonce hex>`` on the same directory, by the same uid,
  within :data:`GRANT_REPLY_TTL` seconds.

Queries are plain getxattr: ``user.kvfs.backing`` on any node gives its backing path.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

from .layout import HANDOUT_SOCKET

#: Every kvfs attribute name starts so; the daemon answers them, the kernel never stores them.
XATTR_PREFIX = b"user.kvfs."

# Commands (setxattr on a directory).
PUBLISH = b"user.kvfs.publish"
ACCESS = b"user.kvfs.access"
CORRUPT = b"user.kvfs.corrupt"
FETCH = b"user.kvfs.fetch"
PREFETCH = b"user.kvfs.prefetch"
GRANT = b"user.kvfs.grant"
COMMANDS = (PUBLISH, ACCESS, CORRUPT, FETCH, PREFETCH, GRANT)
#: getxattr of this prefix + a grant's nonce (hex) on its directory: the grant's answer.
GRANT_REPLY = b"user.kvfs.grant."

# Queries (getxattr on any node): what the daemon knows of it.
TIER = b"user.kvfs.tier"  #: the tier that holds a file: hot or a lower tier's name
BACKING = b"user.kvfs.backing"  #: the node's path in the backing tree (the direct path)
TIERS = b"user.kvfs.tiers"  #: on a directory: the lower tiers' names, comma-separated
#: On a directory: how clients store the blocks they save in the hot tier ("planes", "none").
CODEC = b"user.kvfs.codec"
#: On a directory, where the mount seals the hot tier's blocks: "1" (clients seal what they save).
SEAL = b"user.kvfs.seal"
BLOCK_HASH = b"user.kvfs.block_hash"  #: a block's own hash, hex
PARENT_HASH = b"user.kvfs.parent_hash"  #: the hash of the block before it in the chain, hex
USED = b"user.kvfs.used"  #: on a tenant directory: bytes it holds

# Settings (setxattr / getxattr / removexattr).
PIN = b"user.kvfs.pin"  #: on a file or directory: exempt from eviction and retention

# Tenant keys (kvfs.daemon.keys).
#: getxattr on a model namespace directory, by a uid that may use it: its namespace keys
#: (:func:`encode_keys`), which open the sealed blocks it is granted from the lower tiers.
KEYS = b"user.kvfs.keys"
#: setxattr on a tenant directory, by root: "1" crypto-shreds the tenant (its keys destroyed
#: in every tier, then its blocks deleted); getxattr: the last forgetting's report (JSON).
FORGET = b"user.kvfs.forget"
#: setxattr on a tenant directory, by root: "1" makes a new key (new blocks are sealed with it).
ROTATE_KEY = b"user.kvfs.rotate_key"
#: setxattr on a tenant directory, by root: a key id (hex): it opens nothing any more.
RETIRE_KEY = b"user.kvfs.retire_key"
#: getxattr on a tenant directory: its keys (JSON: live, retired, forgotten).
KEY_STATE = b"user.kvfs.key_state"
_KEYS = struct.Struct("<4sII")
_KEYS_MAGIC = b"KVK1"


def keys_name(key_id: int | None = None) -> bytes:
    """The attribute that asks for a namespace's keys, naming a key id it needs."""
    return KEYS if key_id is None else KEYS + b".%08x" % key_id


def wanted_key(name: bytes) -> int | None:
    """The key id a :func:`keys_name` names (-1: none named; None: not such a name)."""
    if name == KEYS:
        return -1
    tail = name[len(KEYS):]
    if len(tail) == 9 and tail[:1] == b"." and all(c in b"0123456789abcdef" for c in tail[1:]):
        return int(tail[1:], 16)
    return None


def encode_keys(ttl_ms: int, keys: list[tuple[int, bytes]]) -> bytes:
    """The answer to :data:`KEYS`: how long it may be kept, then (key id, 32-byte key) each,
    newest first."""
    return _KEYS.pack(_KEYS_MAGIC, ttl_ms, len(keys)) + b"".join(
        struct.pack("<I", i) + k for i, k in keys)


def decode_keys(data: bytes) -> tuple[int, list[tuple[int, bytes]]]:
    """(ttl in ms, [(key id, key)]) from a :data:`KEYS` answer; ValueError if malformed."""
    if len(data) < _KEYS.size:
        raise ValueError("short keys answer")
    magic, ttl, n = _KEYS.unpack_from(data)
    if magic != _KEYS_MAGIC or len(data) != _KEYS.size + 36 * n:
        raise ValueError("malformed keys answer")
    out, at = [], _KEYS.size
    for _ in range(n):
        out.append((struct.unpack_from("<I", data, at)[0], bytes(data[at + 4:at + 36])))
        at += 36
    return ttl, out


def limit_name(key: str) -> bytes:
    """The attribute of one per-directory limit (a `kvfs.daemon.capacity.Limits` field)."""
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


_PUBLISH_FLAGS = struct.Struct("<4sI")
PUBLISH_MAGIC = b"KVP1"
#: Publish flag: hot copies of blocks read from a shared tier, which holds them already.
PUBLISH_FETCHED = 1


def pack_publish(hashes: list[bytes], *, fetched: bool = False) -> bytes:
    if not fetched:
        return pack_hashes(hashes)
    if len(hashes) * HASH_LEN + _PUBLISH_FLAGS.size > XATTR_MAX:
        raise ControlError(f"at most {MAX_HASHES} hashes per command")
    return _PUBLISH_FLAGS.pack(PUBLISH_MAGIC, PUBLISH_FETCHED) + pack_hashes(hashes)


def unpack_publish(value: bytes) -> tuple[list[bytes], bool]:
    """(hashes, fetched) of a publish command; the flagged form is 8 bytes longer than a
    multiple of 16, so the two cannot be mistaken for each other."""
    if len(value) % HASH_LEN == _PUBLISH_FLAGS.size and value[:4] == PUBLISH_MAGIC:
        _, flags = _PUBLISH_FLAGS.unpack_from(value)
        return unpack_hashes(value[_PUBLISH_FLAGS.size:]), bool(flags & PUBLISH_FETCHED)
    return unpack_hashes(value), False


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


# -- grants: where the blocks the hot tier lacks can be read ----------------------------------

GRANT_MAGIC = b"KVG1"
GRANT_FLAGS_MAGIC = b"KVG2"
GRANT_REPLY_MAGIC = b"KVR1"
_GRANT = struct.Struct("<4s16sI")
_GRANT_FLAGS = struct.Struct("<I")
#: The client takes a directory tier's blocks as descriptors from the handout socket.
GRANT_TAKES_FDS = 1
_REPLY = struct.Struct("<4sI")
_ENTRY = struct.Struct("<BBQIH")
#: Seconds an answer waits to be read (getxattr may be asked twice: for its size, then it).
GRANT_REPLY_TTL = 10.0
#: Hashes per grant command: each answer's URLs (about 600 bytes each) fit one xattr.
MAX_GRANT = 64
#: Where a granted block is read.
GRANT_HOT = 0  #: in the hot tier now: read its backing file
GRANT_URL = 1  #: one presigned GET of its object in a shared tier
GRANT_FD = 2  #: its file in a directory tier, handed over the handout socket (kvfs.daemon.handout)


@dataclass(frozen=True)
class Granted:
    """Where one block can be read: `kind` (GRANT_HOT, GRANT_URL or GRANT_FD), the 1-based
    lower tier it is in (0: hot), its object's size in bytes (0: not asked: the GET says
    whether it is there), the URL (GRANT_URL) and the milliseconds the daemon's own fetch
    of it would be given (the GET's deadline)."""

    kind: int
    tier: int = 0
    size: int = 0
    url: str = ""
    deadline_ms: int = 0


def pack_grant(nonce: bytes, hashes: list[bytes], budget: float | None = None,
               flags: int = 0) -> bytes:
    if len(nonce) != 16:
        raise ControlError("a grant nonce is 16 bytes")
    if not hashes or len(hashes) > MAX_GRANT:
        raise ControlError(f"a grant asks for 1 to {MAX_GRANT} blocks")
    ms = 0 if budget is None else max(1, round(budget * 1000))
    if not 0 <= ms < 1 << 32:
        raise ControlError(f"a grant budget of {budget} s is out of range")
    if not flags:
        return _GRANT.pack(GRANT_MAGIC, nonce, ms) + pack_hashes(hashes)
    return (_GRANT.pack(GRANT_FLAGS_MAGIC, nonce, ms) + _GRANT_FLAGS.pack(flags)
            + pack_hashes(hashes))


def unpack_grant(value: bytes) -> tuple[bytes, list[bytes], float | None, int]:
    """(nonce, hashes, budget in seconds or None, flags) of a grant command."""
    if len(value) < _GRANT.size or value[:4] not in (GRANT_MAGIC, GRANT_FLAGS_MAGIC):
        raise ControlError("a grant starts with KVG1, a nonce and a budget")
    magic, nonce, ms = _GRANT.unpack_from(value)
    pos, flags = _GRANT.size, 0
    if magic == GRANT_FLAGS_MAGIC:
        if len(value) < pos + _GRANT_FLAGS.size:
            raise ControlError("a KVG2 grant carries its flags")
        (flags,), pos = _GRANT_FLAGS.unpack_from(value, pos), pos + _GRANT_FLAGS.size
    hashes = unpack_hashes(value[pos:])
    if not hashes or len(hashes) > MAX_GRANT:
        raise ControlError(f"a grant asks for 1 to {MAX_GRANT} blocks")
    return nonce, hashes, (ms / 1000 if ms else None), flags


def pack_grant_reply(entries: list[Granted]) -> bytes:
    out = [_REPLY.pack(GRANT_REPLY_MAGIC, len(entries))]
    for e in entries:
        url = e.url.encode()
        out.append(_ENTRY.pack(e.kind, e.tier, e.size, e.deadline_ms, len(url)) + url)
    value = b"".join(out)
    if len(value) > XATTR_MAX:
        raise ControlError(f"a grant answer of {len(value)} bytes does not fit an xattr")
    return value


def unpack_grant_reply(value: bytes) -> list[Granted]:
    """The granted prefix, in the order asked."""
    if len(value) < _REPLY.size or value[:4] != GRANT_REPLY_MAGIC:
        raise ControlError("a grant answer starts with KVR1")
    _, n = _REPLY.unpack_from(value)
    pos, out = _REPLY.size, []
    for _ in range(n):
        if pos + _ENTRY.size > len(value):
            raise ControlError("a grant answer is cut short")
        kind, tier, size, deadline_ms, ulen = _ENTRY.unpack_from(value, pos)
        pos += _ENTRY.size
        url = value[pos:pos + ulen].decode()
        pos += ulen
        if kind not in (GRANT_HOT, GRANT_URL, GRANT_FD) or len(url) != ulen:
            raise ControlError("a grant answer holds an unknown entry")
        out.append(Granted(kind, tier, size, url, deadline_ms))
    if pos != len(value):
        raise ControlError("a grant answer has trailing bytes")
    return out


# -- the handout socket (kvfs.daemon.handout): a grant's files, as descriptors ---------------------

HANDOUT_MAGIC = b"KVD1"
#: The question: KVD1 and the grant's nonce.
HANDOUT_ASK = struct.Struct("<4s16s")
#: The answer: KVD1 and the number of descriptors it carries (SCM_RIGHTS), in grant order.
HANDOUT_ANSWER = struct.Struct("<4sB")
#: struct ucred, as SO_PEERCRED gives it: pid, uid, gid.
PEERCRED = struct.Struct("3i")


def socket_path(root: str | bytes) -> str:
    """The handout socket's path in backing root `root`."""
    return os.path.join(os.fsdecode(root), os.fsdecode(HANDOUT_SOCKET))


def pack_ask(nonce: bytes) -> bytes:
    return HANDOUT_ASK.pack(HANDOUT_MAGIC, nonce)


def unpack_answer(data: bytes) -> int:
    """The number of descriptors a handout answer carries."""
    if len(data) < HANDOUT_ANSWER.size or data[:4] != HANDOUT_MAGIC:
        raise ControlError("a handout answer starts with KVD1")
    return HANDOUT_ANSWER.unpack_from(data)[1]
