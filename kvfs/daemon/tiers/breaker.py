"""Failure handling for the lower tiers: the deadline of one fetch, and the circuit breaker
that stops calling a tier that keeps failing, so that a dead store costs one deadline, not one
per block."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


def fetch_deadline(size_bytes: int, *, floor: float = 0.5, bandwidth: float = 200e6) -> float:
    """Seconds to allow for fetching one block of `size_bytes` from a lower tier: a fixed
    `floor` for the round trips (connect, request, first byte) plus the transfer at
    `bandwidth` bytes/s, a rate well below what a healthy HDD, NFS mount or object store gives
    one stream. Past it the fetch counts as a miss and the block is recomputed."""
    if size_bytes < 0:
        raise ValueError(f"negative size {size_bytes}")
    return floor + size_bytes / bandwidth


class Breaker:
    """A circuit breaker for one tier.

    Closed: calls go through. After `threshold` consecutive failures it opens: `allow()` says
    no for `cooldown` seconds. Then it is half-open: one probe call goes through; its success
    closes the breaker, its failure opens it for another cooldown. A probe that never reports
    (its caller gave up) is replaced by another after a further cooldown. Thread-safe; `clock`
    is injectable for tests.
    """

    def __init__(self, threshold: int = 3, cooldown: float = 10.0, *, name: str = "",
                 clock: Callable[[], float] = time.monotonic) -> None:
        if threshold < 1 or cooldown < 0:
            raise ValueError("threshold must be >= 1 and cooldown >= 0")
        self.name = name
        self.threshold = threshold
        self.cooldown = cooldown
        self._clock = clock
        self._lock = threading.Lock()
        self._consecutive = 0
        self._opened_at: float | None = None  # None: closed
        self._probe_at: float | None = None  # when the half-open probe was let through
        #: Counters: failures reported, times opened, calls refused.
        self.failures = 0
        self.opens = 0
        self.rejected = 0

    @property
    def state(self) -> str:
        with self._lock:
            return self._state(self._clock())

    def _state(self, now: float) -> str:
        if self._opened_at is None:
            return "closed"
        return "open" if now < self._opened_at + self.cooldown else "half-open"

    def allow(self) -> bool:
        with self._lock:
            now = self._clock()
            state = self._state(now)
            if state == "closed":
                return True
            if state == "half-open" and (self._probe_at is None
                                         or now >= self._probe_at + self.cooldown):
                self._probe_at = now
                return True
            self.rejected += 1
            return False

    def success(self) -> None:
        with self._lock:
            self._consecutive = 0
            self._opened_at = self._probe_at = None

    def failure(self) -> None:
        with self._lock:
            now = self._clock()
            self.failures += 1
            self._consecutive += 1
            state = self._state(now)
            if state == "half-open" or (state == "closed"
                                        and self._consecutive >= self.threshold):
                self._opened_at = now
                self._probe_at = None
                self.opens += 1
                log.warning("%s tier: circuit open for %gs after %d consecutive failures",
                            self.name or "a", self.cooldown, self._consecutive)
