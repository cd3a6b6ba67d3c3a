"""Lookup leases: the hot blocks a lookup reports stay loadable until a load reads them or
:data:`LEASE_S` passes, whatever eviction, demotion or ``rm`` does meanwhile.

A lookup opens each hot block file it counts (an ``open`` where it used to ``faccessat``:
about 0.4 us more a block) and keeps the descriptor here, per process, so that a vLLM
scheduler's lookup serves its worker's load in the same process. The load reads from those
descriptors (``kvfs.client._fastread`` takes an fd in place of a path; the Python and device reads
open ``/proc/self/fd/N``) instead of opening the names, and closes them: a block the daemon
evicted between the two has lost its name, not its bytes, so the load still gets it, verified
as ever. The bytes of an evicted block stay on the disk until its lease ends (the capacity
is exceeded by at most what leases hold, for at most :data:`LEASE_S`). A load in another
process (vLLM workers with tensor parallelism) finds no lease and reads by name, as before.

A lookup's grant may also lease blocks of a directory tier, whose files the daemon handed
over as descriptors (kvfs.daemon.handout, :func:`keep_below`): the load reads them the same way,
and writes their hot copies behind.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable, Sequence

#: Seconds a lookup's descriptors are kept for the load that follows it.
LEASE_S = 10.0
#: Leases held at most in one process (each is an open file); past it lookups lease nothing.
MAX_LEASES = 16384

_lock = threading.Lock()
#: (namespace directory, block hash) -> (monotonic time leased, fd)
_TABLE: dict[tuple[str, bytes], tuple[float, int]] = {}
#: The keys of _TABLE whose fd is a lower tier's file (handed out by the daemon).
_BELOW: set[tuple[str, bytes]] = set()


def take(ns_dir: str, path: Callable[[bytes], str], hashes: Sequence[bytes],
         start: int = 0) -> int:
    """The hot prefix of ``hashes`` from ``start``, each block of it leased: the length of
    the run of blocks from ``start`` whose files could be opened."""
    now, n = time.monotonic(), start
    _sweep(now)
    got: list[tuple[bytes, int]] = []
    for h in hashes[start:]:
        if len(_TABLE) + len(got) >= MAX_LEASES:
            # Too many open: the rest is looked at, not leased.
            return n + _exists(path, hashes[n:], got, ns_dir, now)
        try:
            fd = os.open(path(h), os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                return n + _exists(path, hashes[n:], got, ns_dir, now)
            break
        got.append((bytes(h), fd))
        n += 1
    _keep(ns_dir, got, now)
    return n


def _exists(path: Callable[[bytes], str], rest: Sequence[bytes], got: list[tuple[bytes, int]],
            ns_dir: str, now: float) -> int:
    _keep(ns_dir, got, now)
    k = 0
    for h in rest:
        if not os.access(path(h), os.F_OK, effective_ids=True):
            break
        k += 1
    return k


def keep_below(ns_dir: str, got: list[tuple[bytes, int]]) -> None:
    """Lease the descriptors of lower-tier files the daemon handed out for ``got``'s
    blocks (now this table's to close)."""
    now = time.monotonic()
    _sweep(now)
    _keep(ns_dir, got, now, below=True)


def _keep(ns_dir: str, got: list[tuple[bytes, int]], now: float, below: bool = False
          ) -> None:
    old = []
    with _lock:
        for h, fd in got:
            prev = _TABLE.get((ns_dir, h))
            if prev is not None:
                old.append(prev[1])
            _TABLE[(ns_dir, h)] = (now, fd)
            if below:
                _BELOW.add((ns_dir, h))
            else:
                _BELOW.discard((ns_dir, h))
    for fd in old:
        os.close(fd)


def _sweep(now: float) -> None:
    with _lock:
        stale = [k for k, (at, _) in _TABLE.items() if now - at > LEASE_S] if _TABLE else []
        fds = [_TABLE.pop(k)[1] for k in stale]
        _BELOW.difference_update(stale)
    for fd in fds:
        os.close(fd)


def claim(ns_dir: str, hashes: Sequence[bytes], below: set[int] | None = None
          ) -> dict[int, int]:
    """The leased descriptors of ``hashes`` (by index), now the caller's to read and
    :func:`release`; the indexes of those that are lower-tier files are added to
    ``below``."""
    out: dict[int, int] = {}
    if not _TABLE:
        return out
    now = time.monotonic()
    stale = []
    with _lock:
        for i, h in enumerate(hashes):
            key = (ns_dir, bytes(h))
            got = _TABLE.pop(key, None)
            if got is None:
                continue
            lower = key in _BELOW
            _BELOW.discard(key)
            if now - got[0] > LEASE_S:
                stale.append(got[1])
            else:
                out[i] = got[1]
                if lower and below is not None:
                    below.add(i)
    for fd in stale:
        os.close(fd)
    return out


def has_below(ns_dir: str, hashes: Sequence[bytes]) -> bool:
    """Whether any of ``hashes`` is leased as a lower tier's file."""
    return bool(_BELOW) and any((ns_dir, bytes(h)) in _BELOW for h in hashes)


def release(fds: dict[int, int]) -> None:
    for fd in fds.values():
        os.close(fd)


def forget(ns_dir: str) -> None:
    """Close this namespace's leases (its cache is closing)."""
    with _lock:
        mine = [k for k in _TABLE if k[0] == ns_dir]
        fds = [_TABLE.pop(k)[1] for k in mine]
        _BELOW.difference_update(mine)
    for fd in fds:
        os.close(fd)


def held() -> int:
    """Leases held in this process."""
    return len(_TABLE)
