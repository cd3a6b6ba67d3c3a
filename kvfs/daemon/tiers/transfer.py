"""The worker-thread side of the mover (kvfs.daemon.tiers.mover): what a tier thread does with
a block's bytes.

- `put_block`: read a block from the hot tier (through a `Source` the daemon gives), encode it
  where that pays, seal it (encryption at rest) and put it into a tier.
- `fetch_block`: read a block from a tier into memory, check it there (header, size,
  checksums, name), opening a sealed block with its tenant's key where it lies and decoding
  an encoded one, so that the hot tier holds blocks as they were saved, and write it once into
  the temporary that is then renamed into its hot path.
- `Handoff`: who owns a fetch's outcome, its thread or the event loop that gave up waiting.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

from ...format import blockfile, codec, hashing, seal
from ..keys import Keyring
from .base import WRITE_PIECE, Tier


@dataclass
class Fetched:
    tier: int  # 1-based index of the tier that had it
    header: blockfile.BlockHeader
    size: int  # of the hot copy (the block as saved)
    moved: int = 0  # bytes fetched from the tier (its stored, maybe encoded, file)


class Handoff:
    """Who owns a fetch's outcome: its thread, or the event loop that gave up waiting.

    The thread places the block (renames it into its hot path) only while the fetch is still
    wanted, and records that it did; the loop, when the deadline passes, marks the fetch
    abandoned under the same lock and takes a block placed meanwhile as the result. So a block
    is never left in place without the daemon knowing of it.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.abandoned = False
        self.result: Fetched | None = None

    def place(self, tmp: str, put: Callable[[str], None], fetched: Fetched) -> Fetched | None:
        with self.lock:
            if self.abandoned:
                return None
            put(tmp)
            self.result = fetched
            return fetched

    def abandon(self) -> Fetched | None:
        with self.lock:
            self.abandoned = True
            return self.result


class SourceError(Exception):
    """The local copy of a block to upload or demote could not be read as one (gone, a
    symlink or FIFO a tenant put in its place, not a block): nothing to send. Not the tier's
    fault: no retry, and its circuit is not touched."""


#: A block to send to a tier: a local path the daemon alone writes, or a function (run in the
#: worker thread) that reads the block's bytes safely from the hot tier.
Source = str | Callable[[], bytes | bytearray]


class Destination(Protocol):
    """Where a fetched block goes when it is not a plain path (see store.Placement): its
    name, a temporary in a directory only the daemon writes, and the final move."""

    name: str

    def temporary(self, tag: str) -> str: ...

    def place(self, tmp: str) -> None: ...


#: Seals a block file for a tier key (kvfs.format.seal), encoding it first where asked.
Sealer = Callable[[str, bytes | bytearray, bool], bytes | bytearray]


def put_block(tier: Tier, key: str, src: Source, encode: bool,
              sealer: Sealer | None = None, *, probe: bool = True) -> tuple[bool, int, int]:
    """Thread: read the source (if it is a reader), encode it (``encode``, where that pays),
    seal it (``sealer``: encryption at rest) and put it (``probe``: see `Tier.put`):
    (written, raw bytes, stored bytes). A block that cannot be sealed (KeyUnavailable) is
    not put at all."""
    if callable(src) or encode or sealer is not None:
        try:
            if callable(src):
                src = src()
            else:
                with open(src, "rb") as f:
                    src = f.read()
            raw = len(src)
            if sealer is not None:
                src = sealer(key, src, encode)
            elif encode:
                src = codec.encode_file(src) or src
        except FileNotFoundError:
            raise  # evicted or removed meanwhile
        except (OSError, blockfile.BlockFormatError) as exc:
            raise SourceError(str(exc)) from exc
        return tier.put(key, src, probe=probe), raw, len(src)
    raw = os.stat(src).st_size
    return tier.put(key, src, probe=probe), raw, raw


#: The largest object a fetch takes (a guard against a store that answers with anything: block
#: files are far smaller).
FETCH_LIMIT = 1 << 32


def fetch_block(tier: Tier, key: str, tmp: str, name: str, owner: tuple[int, int, int], *,
                decode: bool = True, keyring: Keyring | None = None,
                keep_sealed: bool = False) -> Fetched | None:
    """Thread: `key` read from `tier` into memory (one copy), checked there and written once
    into the temporary `tmp` (a new file, owned and moded as ``owner`` says), ready to be
    renamed into its hot path; None where the tier does not have it. A sealed block is
    opened with its tenant's key (``keyring``; the hot tier keeps blocks unsealed) where it
    lies, an encoded block decoded where ``decode`` (the hot tier holds blocks as saved: a
    mount whose clients save them encoded keeps them so), never a lossy one (it was saved
    so); ``keep_sealed`` (--hot-encrypt): a sealed block, once it opens, is placed sealed.
    (No size is expected: another host may have stored the block otherwise encoded.) Raises
    BlockFormatError, KeyUnavailable, TierError."""
    data = tier.read(key, FETCH_LIMIT)
    if data is None:
        return None
    moved = len(data)
    out, hdr = open_fetched(data, name, key, decode=decode, keyring=keyring,
                            keep_sealed=keep_sealed)
    uid, gid, mode = owner
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        view, done = memoryview(out).cast("B"), 0
        while done < len(view):
            done += os.write(fd, view[done:done + WRITE_PIECE])
        os.fchown(fd, uid, gid)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)
    return Fetched(0, hdr, len(out), moved)


def open_fetched(data: bytearray, name: str, key: str, *, decode: bool = True,
                 keyring: Keyring | None = None, keep_sealed: bool = False
                 ) -> tuple[bytes | bytearray, blockfile.BlockHeader]:
    """A fetched object checked (see `fetch_block`): the bytes of its hot copy (``data``
    itself where nothing changes or it was opened in place) and their header."""
    head = blockfile.decode_header(data)
    block_hash = hashing.parse_block_filename(name)
    if seal.is_sealed(head):
        if keyring is None:
            raise blockfile.BlockFormatError("sealed", "an encrypted block, and this mount "
                                             "has no keys (--no-encrypt)")
        tenant, ns = key.split("/", 2)[:2]
        kid = seal.key_id_of(head)
        assert kid is not None
        ns_key = keyring.namespace_key(tenant, ns, kid)
        if keep_sealed:  # opened (a copy) to be checked, placed as it came
            opened = seal.open_file(data, ns_key, tenant, ns)
            blockfile.check(blockfile.decode_header(opened), block_hash=block_hash)
            return data, head
        opened = seal.open_file(data, ns_key, tenant, ns, in_place=True)
        if opened is data:  # a raw block, opened and checked where it lies
            hdr = blockfile.decode_header(data)
            blockfile.check(hdr, block_hash=block_hash)
            return data, hdr
        data = opened  # type: ignore[assignment]
    hdr, payload = blockfile.decode(data)  # header, size, checksums, padding (and decoded)
    blockfile.check(hdr, block_hash=block_hash)
    if hdr.encoding is not None and decode and not codec.is_lossy(hdr):
        return codec.raw_file(hdr, payload), replace(hdr, encoding=None)
    return data, hdr
