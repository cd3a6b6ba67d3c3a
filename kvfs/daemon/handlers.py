"""The wrapper every pyfuse3 handler of kvfs.daemon.fs has: failures mapped to an errno, requests
counted, and first what the request thread created harvested (kvfs.daemon.made).

No exception escapes a handler (pyfuse3 would end the session for every client): `handler`
turns anything but a `FUSEError(errno)` into one (EIO, logged). It also counts the requests
served by kind (`REQUESTS`, shown as `requests` in `.kvfs/stats.json`): what a workload costs
in FUSE requests (`kvfs bench door`).
"""

from __future__ import annotations

import errno
import functools
import logging
import sqlite3
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from pyfuse3 import FUSEError

from .index import NoSuchNode

log = logging.getLogger(__name__)
T = TypeVar("T")

#: FUSE requests served, by handler (stats.json "requests"): event loop only.
REQUESTS: Counter[str] = Counter()


_full_said: float | None = None


def is_full(exc: BaseException) -> bool:
    """Whether `exc` is SQLite's "database or disk is full" (the index's disk)."""
    return (isinstance(exc, sqlite3.OperationalError)
            and exc.sqlite_errorcode == sqlite3.SQLITE_FULL)  # type: ignore[attr-defined]


def say_full(name: str) -> None:
    """Say that the index's disk is full, at most once a minute (a full disk refuses every
    request that writes, and the log may be on it too)."""
    global _full_said
    now = time.monotonic()
    if _full_said is None or now - _full_said >= 60:
        _full_said = now
        log.warning("%s refused: the index's disk is full (ENOSPC); free space on the backing "
                    "filesystem or set --capacity below its size", name)


def handler(fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """Map every failure of a handler to a FUSEError; never let one escape."""

    name = fn.__name__

    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> T:
        REQUESTS[name] += 1
        try:
            # What the request thread created and flushed is indexed before anything else
            # (kvfs.daemon.made): a request about a new file comes after its record.
            args[0].made.harvest()
            return await fn(*args, **kwargs)
        except FUSEError:
            raise
        except NoSuchNode:
            raise FUSEError(errno.ENOENT) from None
        except OSError as exc:
            if exc.errno is None:
                log.exception("%s failed", name)
                raise FUSEError(errno.EIO) from None
            raise FUSEError(exc.errno) from None
        except sqlite3.OperationalError as exc:
            if not is_full(exc):
                log.exception("unexpected error in %s", name)
                raise FUSEError(errno.EIO) from None
            # The index's disk is full (the backing filesystem, without --capacity): what
            # a full disk answers, nothing changed (the statement's transaction undone).
            say_full(name)
            raise FUSEError(errno.ENOSPC) from None
        except Exception:
            log.exception("unexpected error in %s", name)
            raise FUSEError(errno.EIO) from None

    return wrapper
