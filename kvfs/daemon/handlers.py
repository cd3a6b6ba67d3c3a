"""The wrapper every pyfuse3 handler of kvfs.daemon.fs has: failures mapped to an errno, requests
counted.

No exception escapes a handler (pyfuse3 would end the session for every client): `handler`
turns anything but a `FUSEError(errno)` into one (EIO, logged). It also counts the requests
served by kind (`REQUESTS`, shown as `requests` in `.kvfs/stats.json`): what a workload costs
in FUSE requests (`kvfs bench door`).
"""

from __future__ import annotations

import errno
import functools
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from pyfuse3 import FUSEError

from .index import NoSuchNode

log = logging.getLogger(__name__)
T = TypeVar("T")

#: FUSE requests served, by handler (stats.json "requests"): event loop only.
REQUESTS: Counter[str] = Counter()


def handler(fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """Map every failure of a handler to a FUSEError; never let one escape."""

    name = fn.__name__

    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> T:
        REQUESTS[name] += 1
        try:
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
        except Exception:
            log.exception("unexpected error in %s", name)
            raise FUSEError(errno.EIO) from None

    return wrapper
