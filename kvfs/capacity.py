"""Capacity and tenant limits: how many bytes may be placed, and how many must go.

Pure arithmetic and parsing; the Operations carry the decisions out. The hot tier has a byte
capacity with a high and a low watermark: crossing the high mark wakes background eviction,
which frees down to the low mark; a write that would cross the capacity itself first evicts
synchronously, and gets ENOSPC only when nothing evictable is left. A tenant's quota works the
same way on that tenant's own files (EDQUOT). Retention (maximum idle time, maximum age) is
per tenant.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

from .config import ConfigError, parse_size

_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> float:
    """'90', '30m', '12h', '7d' -> seconds."""
    m = _DURATION_RE.match(text)
    if not m:
        raise ConfigError(f"not a duration: {text!r} (use e.g. 90, 30m, 12h, 7d)")
    return float(m.group(1)) * _SECONDS[m.group(2)]


@dataclass
class Limits:
    """A tenant's limits; None means unlimited. Stored as trusted.kvfs.* xattrs on the tenant's
    backing directory (the truth, beyond the reach of the tenant itself) and shown as
    user.kvfs.* xattrs on the tenant directory in the mount."""

    quota: int | None = None  # bytes
    max_idle: float | None = None  # seconds since last access
    max_age: float | None = None  # seconds since written

    @staticmethod
    def parse(name: str, value: str) -> int | float | None:
        """Parse one limit given as text ('' or 'none' clears it)."""
        if value.strip().lower() in ("", "none"):
            return None
        if name == "quota":
            return parse_size(value)
        if name in ("max_idle", "max_age"):
            return parse_duration(value)
        raise ConfigError(f"unknown tenant limit {name!r}")

    @staticmethod
    def names() -> list[str]:
        return [f.name for f in fields(Limits)]

    def render(self, name: str) -> str:
        value = getattr(self, name)
        if value is None:
            return "none"
        return str(int(value)) if name == "quota" else f"{value:g}"


@dataclass
class Budget:
    """The hot tier's byte budget and watermarks (fractions of the capacity)."""

    capacity: int | None
    high: float = 0.95
    low: float = 0.90

    def __post_init__(self) -> None:
        if not 0 < self.low <= self.high <= 1:
            raise ConfigError(f"watermarks must satisfy 0 < low <= high <= 1, got "
                              f"low={self.low} high={self.high}")

    def overflow(self, used: int, growth: int) -> int:
        """Bytes that must be freed before `growth` more bytes fit under the capacity."""
        if self.capacity is None or growth <= 0:
            return 0
        return max(0, used + growth - self.capacity)

    def excess(self, used: int) -> int:
        """Bytes background eviction should free now (0 below the high watermark)."""
        if self.capacity is None or used <= self.high * self.capacity:
            return 0
        return int(used - self.low * self.capacity)


def quota_overflow(limits: Limits | None, tenant_used: int, growth: int) -> int:
    if limits is None or limits.quota is None or growth <= 0:
        return 0
    return max(0, tenant_used + growth - limits.quota)
