"""Blocks read from a shared tier by the client itself, once, into their destination.

A lookup whose blocks the hot tier lacks asks the daemon for a *grant* (control.GRANT, one
setxattr and one getxattr per :data:`kvfs.control.MAX_GRANT` blocks): for the longest prefix
that some tier holds, each block is hot (perhaps promoted just now from a directory tier) or
has a presigned GET of its one object, valid for seconds. The grants are kept in this
process (:data:`_TABLE`, so a vLLM scheduler's lookup serves its worker's load in the same
process) until a load uses them or they go stale (:data:`USE_WITHIN`). The load GETs each
granted block straight into its destination (:func:`get_into`: the header into a buffer, the
payload into the caller's memory, hashed piece by piece as it lands), verifies it as a read
of the hot file is verified, and queues the hot copy behind it, written from that memory
(:meth:`kvfs.client.save.Saving.write_behind`).

The HTTP client is the standard library's (``http.client``, one keep-alive connection per
thread and host, ``readinto`` into the destination): on the same objects it matched or beat
the other clients (``kvfs bench s3clients``, docs/benchmarks.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import http.client
import os
import threading
import time
from collections.abc import Sequence
from urllib.parse import urlsplit

import xxhash

from .. import control
from ..transport import HASH_PIECE

#: Seconds after its lookup within which a load uses a grant (its URL is valid longer).
USE_WITHIN = 10.0
#: Grants kept at most in one process.
MAX_KEPT = 65536

_lock = threading.Lock()
#: (namespace directory, block hash) -> (monotonic time granted, what was granted)
_TABLE: dict[tuple[str, bytes], tuple[float, control.Granted]] = {}
_tls = threading.local()

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


def ask(channel, ns_dir: str, hashes: Sequence[bytes], budget: float | None
        ) -> list[control.Granted]:
    """The granted prefix of ``hashes`` (see the module's docstring), kept for the load.
    Raises OSError where the daemon does not take grants (an older kvfs)."""
    out: list[control.Granted] = []
    end = None if budget is None else time.monotonic() + budget
    for i in range(0, len(hashes), control.MAX_GRANT):
        chunk = list(hashes[i:i + control.MAX_GRANT])
        left = None if end is None else max(0.001, end - time.monotonic())
        nonce = os.urandom(16)
        channel.command(control.GRANT, control.pack_grant(nonce, chunk, left))
        got = control.unpack_grant_reply(_getxattr(ns_dir, control.GRANT_REPLY
                                                   + nonce.hex().encode()))
        out += got[:len(chunk)]
        if len(got) < len(chunk):
            break
    now = time.monotonic()
    with _lock:
        if len(_TABLE) > MAX_KEPT:
            for k in [k for k, (at, _) in _TABLE.items() if now - at > USE_WITHIN]:
                del _TABLE[k]
        for h, g in zip(hashes, out, strict=False):
            if g.kind == control.GRANT_URL:
                _TABLE[(ns_dir, bytes(h))] = (now, g)
    return out


def granted(ns_dir: str, hashes: Sequence[bytes]) -> dict[int, control.Granted]:
    """The fresh URL grants of ``hashes`` (by index), taken from the table."""
    now, out = time.monotonic(), {}
    with _lock:
        if not _TABLE:
            return out
        for i, h in enumerate(hashes):
            got = _TABLE.pop((ns_dir, bytes(h)), None)
            if got is not None and now - got[0] <= USE_WITHIN:
                out[i] = got[1]
    return out


def has_grants(ns_dir: str, hashes: Sequence[bytes]) -> bool:
    """Whether some of ``hashes`` have a URL grant (left in the table)."""
    with _lock:
        return bool(_TABLE) and any((ns_dir, bytes(h)) in _TABLE for h in hashes)


def forget(ns_dir: str) -> None:
    """Drop this namespace's grants (the cache is closing)."""
    with _lock:
        for k in [k for k in _TABLE if k[0] == ns_dir]:
            del _TABLE[k]


def _connection(scheme: str, netloc: str, timeout: float) -> http.client.HTTPConnection:
    conns = getattr(_tls, "conns", None)
    if conns is None:
        conns = _tls.conns = {}
    conn = conns.get((scheme, netloc))
    if conn is None:
        cls = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
        conn = conns[(scheme, netloc)] = cls(netloc, timeout=timeout)
    conn.timeout = timeout
    if conn.sock is not None:
        conn.sock.settimeout(timeout)
    return conn


def _drop(scheme: str, netloc: str) -> None:
    conn = getattr(_tls, "conns", {}).pop((scheme, netloc), None)
    if conn is not None:
        conn.close()


def _fill(resp: http.client.HTTPResponse, view: memoryview) -> int:
    got = 0
    while got < len(view):
        n = resp.readinto(view[got:])
        if not n:
            break
        got += n
    return got


def get_into(url: str, header: memoryview, views: list[memoryview], probe: memoryview,
             want_checksum: bool, timeout: float) -> tuple[int, int | None]:
    """GET ``url`` into ``header``, ``views`` (the payload's destination) and ``probe``
    (the padding and one byte more, which only an overlong object fills), hashing the
    payload piece by piece as it lands: (bytes received, payload xxh3 or None). Raises
    FileNotFoundError for an object that is absent or no longer granted (403, 404), OSError
    for anything else (timeouts included)."""
    u = urlsplit(url)
    target = f"{u.path}?{u.query}" if u.query else u.path
    for attempt in (0, 1):
        conn = _connection(u.scheme, u.netloc, timeout)
        try:
            conn.request("GET", target)
            resp = conn.getresponse()
            break
        except (OSError, http.client.HTTPException) as exc:
            _drop(u.scheme, u.netloc)
            # A kept-alive connection the server closed meanwhile: one new one.
            if attempt or not isinstance(exc, http.client.RemoteDisconnected | ConnectionError):
                raise OSError(f"GET {u.path}: {exc}") from exc
    try:
        if resp.status in (403, 404):
            resp.read()
            raise FileNotFoundError(f"GET {u.path}: HTTP {resp.status}")
        if resp.status != 200:
            resp.read()
            raise OSError(f"GET {u.path}: HTTP {resp.status} {resp.reason}")
        total = _fill(resp, header)
        x = xxhash.xxh3_64() if want_checksum else None
        for v in views:
            for lo in range(0, len(v), HASH_PIECE):
                piece = v[lo:lo + HASH_PIECE]
                n = _fill(resp, piece)
                total += n
                if x is not None:
                    x.update(piece[:n])
                if n < len(piece):
                    break
        total += _fill(resp, probe)
        if not resp.isclosed() and resp.length:  # overlong: the rest is not read
            _drop(u.scheme, u.netloc)
        return total, (x.intdigest() if x is not None else None)
    except (http.client.HTTPException, OSError) as exc:
        _drop(u.scheme, u.netloc)
        if isinstance(exc, FileNotFoundError):
            raise
        raise OSError(f"GET {u.path}: {exc}") from exc
