"""Blocks read from a shared tier by the client itself, once, into their destination.

A lookup whose blocks the hot tier lacks asks the daemon for a *grant* (control.GRANT, one
setxattr and one getxattr per :data:`kvfs.format.control.MAX_GRANT` blocks): each block is hot
(perhaps promoted just now from a directory tier) or gets a presigned GET of its one object
in the shared tier, valid for seconds. The lookup sends those GETs at once and waits for
their answers' headers only (one round trip: a 200 says the block is there, a 404 ends the
prefix); the bodies wait in the sockets. The answered GETs are kept in this process
(:data:`_TABLE`, so a vLLM scheduler's lookup serves its worker's load in the same process)
until a load reads them or they go stale (:data:`USE_WITHIN`). The load reads each body
straight into its destination (:func:`get_into`: the header into a buffer, the payload into
the caller's memory, hashed piece by piece as it lands), verifies it as a read of the hot
file is verified, and queues the hot copy behind it, written from that memory
(:meth:`kvfs.client.save.Saving.write_behind`). A GET that fails (not a 404) is left to the
daemon: the blocks are sent as a ``prefetch``, so its deadlines and circuit breaker see the
store's state, and its next grants say so.

The HTTP client is the standard library's (``http.client``, one keep-alive connection per
thread and host, ``readinto`` into the destination): on the same objects it matched or beat
the other clients (``kvfs bench s3clients``, docs/benchmarks.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import http.client
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from concurrent.futures import wait as wait_all
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import xxhash

from ..format import blockfile, control
from . import handout as handout_client
from . import leases
from .transport import HASH_PIECE

#: Seconds after its lookup within which a load uses a grant (its URL is valid longer).
USE_WITHIN = 10.0
#: Answered GETs kept at most in one process (each holds a connection, and the kernel its
#: socket's buffered body): past it the oldest are closed.
MAX_KEPT = 1024
#: Idle kept-alive connections per store.
MAX_IDLE = 64
#: A granted GET's deadline where the daemon gave none.
FETCH_FLOOR_S = 1.0

_lock = threading.Lock()
log = logging.getLogger(__name__)


@dataclass
class Answered:
    """A granted block's GET whose answer (200, with its length) has come; its body waits
    in the connection's socket for the load."""

    url: str
    size: int
    timeout: float
    conn: http.client.HTTPConnection | None
    resp: http.client.HTTPResponse | None

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.conn = self.resp = None


#: (namespace directory, block hash) -> (monotonic time answered, its GET)
_TABLE: dict[tuple[str, bytes], tuple[float, Answered]] = {}
_idle: dict[tuple[str, str], list[http.client.HTTPConnection]] = {}
#: (scheme, host) of a store whose GET failed -> monotonic time until which it is skipped.
_failing: dict[tuple[str, str], float] = {}


def _store(url: str) -> tuple[str, str]:
    u = urlsplit(url)
    return u.scheme, u.netloc

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.getxattr.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t]
_libc.getxattr.restype = ctypes.c_ssize_t


def _getxattr(path: str, name: bytes) -> bytes:
    """One getxattr into a 64 KiB buffer (os.getxattr asks first with 128 bytes: two
    requests to the daemon for an answer longer than that)."""
    buf = ctypes.create_string_buffer(control.XATTR_MAX)
    n = _libc.getxattr(os.fsencode(path), name, buf, control.XATTR_MAX)
    if n < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), path)
    return buf.raw[:n]


@dataclass
class Handout:
    """Where this process may be handed a directory tier's files (kvfs.daemon.handout): the
    daemon's socket, and the uids the daemon may run as (its peer must be one). ``usable``
    turns False when the socket cannot be reached (then the daemon promotes, as before)."""

    path: str
    uids: frozenset[int]
    usable: bool = True


def ask(channel, ns_dir: str, hashes: Sequence[bytes], budget: float | None,
        pool: Executor, handout: Handout | None = None) -> int:
    """The length of the prefix of ``hashes`` that can be loaded: hot, answered by its
    GET (see the module's docstring), or handed over as a directory tier's file (with
    ``handout``); the answered GETs and the files are kept for the load. Raises OSError
    where the daemon does not take grants (an older kvfs)."""
    end = None if budget is None else time.monotonic() + budget
    n = 0
    for i in range(0, len(hashes), control.MAX_GRANT):
        flags = control.GRANT_TAKES_FDS if handout is not None and handout.usable else 0
        chunk = list(hashes[i:i + control.MAX_GRANT])
        left = None if end is None else max(0.001, end - time.monotonic())
        nonce = os.urandom(16)
        channel.command(control.GRANT, control.pack_grant(nonce, chunk, left, flags))
        got = control.unpack_grant_reply(_getxattr(ns_dir, control.GRANT_REPLY
                                                   + nonce.hex().encode()))[:len(chunk)]
        if flags:
            got = got[:_take_files(channel, ns_dir, chunk, got, nonce, handout)]
        k = _answer(channel, ns_dir, chunk, got, end, pool)
        n += k
        if k < len(chunk):
            break
    return n


def _take_files(channel, ns_dir: str, chunk: list[bytes], got: list[control.Granted],
                nonce: bytes, handout: Handout) -> int:
    """Collect the files the daemon hands out for the GRANT_FD blocks of ``got`` and lease
    them to the load (kvfs.client.leases): the length of the prefix of ``got`` still
    loadable (it ends at a block whose file did not come). A socket this process cannot
    use is not asked again; the blocks are then left to the daemon (a prefetch)."""
    wanted = [i for i, g in enumerate(got) if g.kind == control.GRANT_FD]
    if not wanted:
        return len(got)
    try:
        fds = handout_client.collect(handout.path, nonce, set(handout.uids))
    except OSError as exc:
        log.warning("%s: the handout socket %s failed (%s): blocks below are fetched by "
                    "the daemon", ns_dir, handout.path, exc)
        fds = None
    if fds is None:
        handout.usable = False
        channel.report(control.PREFETCH, control.pack_hashes([chunk[i] for i in wanted]))
        return wanted[0]
    for fd in fds[len(wanted):]:
        os.close(fd)
    leases.keep_below(ns_dir, [(chunk[i], fd) for i, fd in zip(wanted, fds, strict=False)])
    return wanted[len(fds)] if len(fds) < len(wanted) else len(got)


def _answer(channel, ns_dir: str, chunk: list[bytes], got: list[control.Granted],
            end: float | None, pool: Executor) -> int:
    """Send the GETs of the URL grants in ``got`` and wait for their answers (within the
    daemon's deadline for each, and the lookup's budget): the length of the loadable
    prefix. Answers past it are closed."""
    urls = [i for i, g in enumerate(got) if g.kind == control.GRANT_URL]
    answers: dict[int, Answered | None | BaseException] = {}
    store = _store(got[urls[0]].url) if urls else None
    if urls and time.monotonic() < _failing.get(store, 0.0):
        # This store failed a GET within its deadline: its blocks are misses at once (the
        # daemon, told by a prefetch, decides by then whether to open its circuit).
        return urls[0]
    if urls:
        futures = {i: pool.submit(_send, got[i]) for i in urls}
        # One deadline for all the answers (the daemon's for one block), however many wait
        # for a thread, and never past the lookup's budget.
        limit = max(got[i].deadline_ms for i in urls) / 1000 or FETCH_FLOOR_S
        left = limit if end is None else max(0.0, min(limit, end - time.monotonic()))
        wait_all(futures.values(), timeout=left)
        for i, f in futures.items():
            if f.done():
                answers[i] = f.exception() or f.result()
            else:  # past the deadline or the budget: closed when it comes
                f.add_done_callback(lambda f: f.exception() or (f.result() and
                                                                  f.result().close()))
    n = next((i for i, g in enumerate(got) if g.kind == control.GRANT_URL
              and not isinstance(answers.get(i), Answered)), len(got))
    now = time.monotonic()
    kept, failed = [], []
    for i in urls:
        a = answers.get(i)
        if isinstance(a, Answered):
            if i < n:
                kept.append((chunk[i], a))
            else:
                a.close()
        elif a is None and i in answers:
            pass  # absent (404): a miss
        else:
            failed.append(chunk[i])  # failed or late: the daemon tries, in the background
    if failed:
        if store is not None and (end is None or time.monotonic() < end):
            # The store failed (not merely the lookup's budget spent): skipped for two
            # deadlines, by when the daemon's own fetches of these blocks have failed too and
            # its circuit says so.
            _failing[store] = (time.monotonic()
                               + 2 * max(got[i].deadline_ms for i in urls) / 1000)
        channel.report(control.PREFETCH, control.pack_hashes(failed))
    gone = []
    with _lock:
        # Answers no load came for: stale ones, then the oldest past MAX_KEPT (the table is
        # in insertion order).
        gone += [_TABLE.pop(k)[1] for k in [k for k, (at, _) in _TABLE.items()
                                             if now - at > USE_WITHIN]]
        for h, a in kept:
            old = _TABLE.pop((ns_dir, bytes(h)), None)
            if old is not None:
                gone.append(old[1])
            _TABLE[(ns_dir, bytes(h))] = (now, a)
        while len(_TABLE) > MAX_KEPT:
            gone.append(_TABLE.pop(next(iter(_TABLE)))[1])
    for a in gone:
        a.close()
    return n


def _send(g: control.Granted) -> Answered | None:
    """One granted GET, up to its answer's headers: an Answered for a 200, None for an
    absent object (403, 404: no longer granted, or not there). Raises OSError otherwise."""
    u = urlsplit(g.url)
    timeout = max(0.1, g.deadline_ms / 1000 or FETCH_FLOOR_S)
    target = f"{u.path}?{u.query}" if u.query else u.path
    for attempt in (0, 1):
        conn = _take(u.scheme, u.netloc, timeout)
        try:
            conn.request("GET", target)
            resp = conn.getresponse()
            break
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            # A kept-alive connection the server closed meanwhile: one new one.
            if attempt or not isinstance(exc, http.client.RemoteDisconnected | ConnectionError):
                raise OSError(f"GET {u.path}: {exc}") from exc
    if resp.status in (403, 404):
        resp.read()
        _give(u.scheme, u.netloc, conn)
        return None
    if resp.status != 200:
        conn.close()
        raise OSError(f"GET {u.path}: HTTP {resp.status} {resp.reason}")
    return Answered(g.url, resp.length or 0, timeout, conn, resp)


def _take(scheme: str, netloc: str, timeout: float) -> http.client.HTTPConnection:
    with _lock:
        idle = _idle.get((scheme, netloc))
        conn = idle.pop() if idle else None
    if conn is None:
        cls = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
        conn = cls(netloc, timeout=timeout)
    conn.timeout = timeout
    if conn.sock is not None:
        conn.sock.settimeout(timeout)
    return conn


def _give(scheme: str, netloc: str, conn: http.client.HTTPConnection) -> None:
    with _lock:
        idle = _idle.setdefault((scheme, netloc), [])
        if len(idle) < MAX_IDLE:
            idle.append(conn)
            return
    conn.close()


def granted(ns_dir: str, hashes: Sequence[bytes]) -> dict[int, Answered]:
    """The answered GETs of ``hashes`` (by index), now the caller's to read
    (:func:`get_into`) or close."""
    now, out, stale = time.monotonic(), {}, []
    with _lock:
        if not _TABLE:
            return out
        for i, h in enumerate(hashes):
            got = _TABLE.pop((ns_dir, bytes(h)), None)
            if got is None:
                continue
            if now - got[0] <= USE_WITHIN:
                out[i] = got[1]
            else:
                stale.append(got[1])
    for a in stale:
        a.close()
    return out


def has_grants(ns_dir: str, hashes: Sequence[bytes]) -> bool:
    """Whether some of ``hashes`` have a URL grant (left in the table)."""
    with _lock:
        return bool(_TABLE) and any((ns_dir, bytes(h)) in _TABLE for h in hashes)


def forget(ns_dir: str) -> None:
    """Drop this namespace's answered GETs (the cache is closing)."""
    with _lock:
        gone = [_TABLE.pop(k)[1] for k in [k for k in _TABLE if k[0] == ns_dir]]
    for a in gone:
        a.close()


def _fill(resp: http.client.HTTPResponse, view: memoryview) -> int:
    got = 0
    while got < len(view):
        n = resp.readinto(view[got:])
        if not n:
            break
        got += n
    return got


def get_into(a: Answered, header: memoryview, views: list[memoryview], probe: memoryview,
             want_checksum: bool, opener_for: Callable[[memoryview], Any] | None = None
             ) -> tuple[int, int | None]:
    """Read answered GET ``a``'s body into ``header``, ``views`` (the payload's destination)
    and ``probe`` (the padding and one byte more, which only an overlong object fills),
    hashing the payload piece by piece as it lands: (bytes received, payload xxh3 or None).
    An answer that is no longer there (stale, or from another process) is asked again.
    Raises FileNotFoundError for an object that is absent or no longer granted, OSError for
    anything else (timeouts included)."""
    if a.resp is None:
        again = _send(control.Granted(control.GRANT_URL, url=a.url,
                                      deadline_ms=round(a.timeout * 1000)))
        if again is None:
            raise FileNotFoundError(f"GET {urlsplit(a.url).path}: gone")
        a = again
    resp, conn = a.resp, a.conn
    assert resp is not None and conn is not None
    u = urlsplit(a.url)
    try:
        total = _fill(resp, header)
        # An encoded (or sealed) object's bytes are checked as they are decoded, not here; a
        # sealed one stored as is is opened as it lands (``opener_for``: a seal.Opener).
        encoded = total > 8 and header[8] == blockfile.ENCODED_VERSION
        opener = opener_for(header) if encoded and opener_for is not None else None
        x = xxhash.xxh3_64() if want_checksum and not encoded else None
        for v in views:
            for lo in range(0, len(v), HASH_PIECE):
                piece = v[lo:lo + HASH_PIECE]
                n = _fill(resp, piece)
                total += n
                if x is not None:
                    x.update(piece[:n])
                if opener is not None:
                    opener.feed(piece[:n])
                if n < len(piece):
                    break
        total += _fill(resp, probe)
    except (http.client.HTTPException, OSError) as exc:
        a.close()
        raise OSError(f"GET {u.path}: {exc}") from exc
    if resp.isclosed():
        _give(u.scheme, u.netloc, conn)  # the whole body read: the connection is reusable
    else:
        a.close()  # overlong: the rest is not read
    return total, (x.intdigest() if x is not None else None)
