"""Capacity and tenant limits: how many bytes may be placed, and how many must go.

Pure arithmetic and parsing; the Operations carry the decisions out. The hot tier has a byte
capacity with a high and a low watermark: crossing the high mark wakes background eviction,
which frees down to the low mark; a write that would cross the capacity itself first evicts
synchronously. A request decides first whether it can fit at all, and is refused at once
(EFBIG, ENOSPC, EDQUOT) with nothing evicted when it cannot. A tenant's quota works the same
way on that tenant's own files (EDQUOT). One tenant's growth takes other tenants' files only
down to their fair share (`fair_shares`, `room_order`). Retention (maximum idle time, maximum
age) is per tenant.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any

from ..format.config import ConfigError, parse_size
from .settings import DEFAULTS

_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_TIER_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


#: The longest duration a limit takes: a century (longer means no limit: 'none').
MAX_DURATION = 100 * 365 * 86400


def parse_duration(text: str) -> float:
    """'90', '30m', '12h', '7d' -> seconds."""
    m = _DURATION_RE.match(text)
    if not m:
        raise ConfigError(f"not a duration: {text!r} (use e.g. 90, 30m, 12h, 7d)")
    seconds = float(m.group(1)) * _SECONDS[m.group(2)]
    if not seconds <= MAX_DURATION:
        raise ConfigError(f"duration {text[:40]!r} is beyond a century (for no limit: none)")
    return seconds


@dataclass
class Limits:
    """A tenant's limits; None means unlimited. Stored as trusted.kvfs.* xattrs on the tenant's
    backing directory (the truth, beyond the reach of the tenant itself) and shown as
    user.kvfs.* xattrs on the tenant directory in the mount."""

    quota: int | None = None  # bytes
    max_idle: float | None = None  # seconds since last access
    max_age: float | None = None  # seconds since written
    #: The tiers the tenant's blocks may reach, by name ("hot", "cold", a shared tier's):
    #: None: every tier of the mount.
    placement: tuple[str, ...] | None = None

    @staticmethod
    def parse(name: str, value: str) -> Any:
        """Parse one limit given as text ('' or 'none' clears it; a placement: 'all')."""
        if name == "placement":
            items = tuple(dict.fromkeys(v.strip() for v in value.split(",") if v.strip()))
            if value.strip().lower() in ("", "all", "none"):
                return None
            if any(not _TIER_NAME.match(v) for v in items):
                raise ConfigError(f"placement {value!r}: tier names separated by commas "
                                  "(hot, cold, a shared tier's name) or 'all'")
            return items
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
        if name == "placement":
            return "all" if value is None else ",".join(value)
        if value is None:
            return "none"
        return str(int(value)) if name == "quota" else f"{value:g}"


@dataclass
class Budget:
    """The hot tier's byte budget and watermarks (fractions of the capacity)."""

    capacity: int | None
    high: float = DEFAULTS["high_watermark"]
    low: float = DEFAULTS["low_watermark"]

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


#: "No limit" in a room order: a growing tenant may evict any of its own evictable files.
UNLIMITED = 1 << 62


def fair_shares(usage: dict[int, int], capacity: int, quotas: dict[int, int | None],
                grower: int | None = None) -> dict[int, int]:
    """Each tenant's fair share of the capacity: an equal part among the tenants that hold
    bytes in the hot tier (and `grower`, the tenant about to grow), never more than its
    quota. The shares add up to the capacity at most, so a tenant below its share can always
    be given room from the files of the tenants above theirs."""
    active = {t for t, b in usage.items() if b > 0}
    if grower is not None:
        active.add(grower)
    if not active:
        return {}
    equal = capacity // len(active)
    out = {}
    for t in active:
        quota = quotas.get(t)
        out[t] = equal if quota is None else min(equal, quota)
    return out


def room_order(usage: dict[int, int], shares: dict[int, int], grower: int | None,
               need: int) -> list[tuple[int, int, int]]:
    """Whose files capacity eviction may take, in order: [(tenant, bytes wanted, bytes at
    most)].

    First the tenants above their fair share, furthest above first, each down to its share
    and never below it (a file that would take it below is not taken). Then, when a tenant
    grows (`grower`), its own files, without limit: one tenant's growth never takes another
    tenant below its share. Without a grower (background eviction to the low watermark),
    what is still needed is then taken from every tenant in proportion to what it holds, so
    that no tenant is emptied for the others."""
    over = {t: usage.get(t, 0) - s for t, s in shares.items()}
    order = [(t, o, o) for t, o in sorted(over.items(), key=lambda kv: (-kv[1], kv[0]))
             if o > 0]
    if grower is not None:
        order.append((grower, UNLIMITED, UNLIMITED))
        return order
    left = need - sum(o for _, o, _ in order)
    after = {t: usage.get(t, 0) - max(over.get(t, 0), 0) for t in usage}
    total = sum(b for b in after.values() if b > 0)
    if left > 0 and total > 0:
        for t, b in sorted(after.items(), key=lambda kv: (-kv[1], kv[0])):
            if b > 0:
                order.append((t, min(b, -(-left * b // total)), UNLIMITED))
    return order
