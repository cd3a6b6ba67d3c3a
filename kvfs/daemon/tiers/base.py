"""What every lower tier is: the :class:`Tier` interface, its keys and its one error.

A tier is a small blocking store of immutable, content-addressed block files under keys like
``<tenant>/<model-namespace>/<hh>/<hash>.kv``. Every method blocks (file or network I/O): the
daemon calls them from worker threads through `trio.to_thread.run_sync`, never on the event
loop, and one tier object is shared by all those threads, so every method is thread-safe.

Because a key names its content, a put is idempotent: the first writer wins and later ones are
no-ops, which is what lets many hosts share a tier with no coordination. A get never verifies
the bytes; the daemon checks the block's checksums itself before serving them.
"""

from __future__ import annotations

import os
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterator

from ...format.layout import TEMP_PREFIX

#: Temporaries (in a tier, or next to a get's destination) start with this; list skips them.
TMP_PREFIX = TEMP_PREFIX.decode()


class TierError(Exception):
    """A tier operation failed for a reason other than an absent key (I/O error, timeout,
    refused connection, denied access). Names the tier, the operation and the cause."""

    def __init__(self, tier: str, op: str, key: str, cause: BaseException | str) -> None:
        super().__init__(f"{tier} tier: {op} {key}: {cause}")
        self.tier = tier
        self.op = op
        self.key = key
        self.cause = cause


def check_key(key: str) -> str:
    """A key is a relative path of plain names: no '', '.', '..' or temporary components."""
    parts = key.split("/")
    if (not key or "\0" in key or any(p in ("", ".", "..") for p in parts)
            or any(p.startswith(TMP_PREFIX) for p in parts)):
        raise ValueError(f"bad tier key {key!r}")
    return key

def temp_beside(path: str) -> tuple[str, int]:
    """Create an exclusive 0600 temporary in the directory of `path`: (name, fd)."""
    tmp = os.path.join(os.path.dirname(path), f"{TMP_PREFIX}{uuid.uuid4().hex}")
    return tmp, os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)




def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


#: A block file is written this many bytes a call (a fetch into staging, a put into a directory
#: tier): several threads each writing multi-MiB buffers into new files in one call each spent
#: 2-8x the CPU (the kernel's copy into fresh page-cache folios, contended) on the 2-core VM:
#: a fetch through the daemon wrote 2 MiB in 25 ms.
WRITE_PIECE = 1 << 18


class Tier(ABC):
    """A blocking, thread-safe store of immutable block files."""

    name: str
    url: str
    #: Whether `presign_get` gives URLs (a client may read this tier's objects itself).
    presigns = False
    #: Whether `open_block` gives descriptors (the daemon may hand a client the file).
    hands_files = False
    #: Whether other hosts read this tier (a `--shared` one): new blocks are published to it.
    shared = False

    @abstractmethod
    def put(self, key: str, src: str | bytes | bytearray, *, probe: bool = True) -> bool:
        """Store the file at local path `src` (or the bytes `src`) under `key`, atomically.
        Idempotent: False (and nothing written) if the key already exists, True if this call
        wrote it. ``probe``: ask first whether the key is there, where that is a request of
        its own (a block being demoted may be there already, published when it was saved);
        False for a block this host has just saved (a write-through upload), which almost
        never is, where the store refuses a key that is there by itself."""

    @abstractmethod
    def get(self, key: str, dest: str) -> bool:
        """Fetch `key` into local path `dest` (a temporary beside it, then a rename); False if
        the key is absent."""

    def read(self, key: str, limit: int) -> bytearray | None:
        """`key`'s bytes in memory, None if the key is absent; an object larger than `limit`
        is a TierError, read no further. This default goes through `get` (a temporary file);
        the directory and S3 tiers read straight into the buffer."""
        import tempfile  # noqa: PLC0415

        with tempfile.TemporaryDirectory(prefix=TEMP_PREFIX.decode()) as d:
            dest = os.path.join(d, "object")
            if not self.get(key, dest):
                return None
            with open(dest, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size > limit:
                    raise TierError(self.name, "get", key, f"{size} bytes, over {limit}")
                return bytearray(f.read())

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove `key`; an absent key is fine."""

    @abstractmethod
    def size(self, key: str) -> int | None:
        """The object's size in bytes, None if absent."""

    @abstractmethod
    def list(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        """(key, size) of every object whose key starts with `prefix`."""

    def presign_get(self, key: str, expires: int) -> str | None:
        """A URL that reads `key` alone, by anyone holding it, for `expires` seconds; None
        where the tier has no such thing (a directory). Makes no request."""
        return None

    def open_block(self, key: str) -> tuple[int, int] | None:
        """(an open read-only descriptor, size) of `key`'s file, for the daemon to hand to a
        client it granted the block (kvfs.daemon.handout); None where the tier has no files (S3)
        or the key is absent. The caller closes it."""
        return None

    def usage(self) -> tuple[int, int]:
        """(bytes, objects) held. Lists the whole tier: a walk of the tree for a directory,
        one LIST request per 1000 objects for S3. Meant for status and fsck, not hot paths."""
        nbytes = count = 0
        for _key, size in self.list():
            nbytes += size
            count += 1
        return nbytes, count

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections; the tier is not used afterwards."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} {self.url}>"


