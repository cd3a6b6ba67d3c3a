"""Counters per tenant and model namespace, and their JSON rendering.

Keys are (tenant inode, namespace inode); 0 stands for "none at that level" (a file directly
in a tenant directory has namespace 0). The counters of a namespace directory that is removed
are folded into one row per tenant, `REMOVED` (shown as "(removed namespaces)"), so that
they still count in the tenant's totals and never overwrite one another. The daemon updates
counters on its event-loop thread only, so plain integers suffice.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass

Key = tuple[int, int]

#: The namespace key of a tenant's removed namespaces (inodes are never negative).
REMOVED = -1
REMOVED_NAME = "(removed namespaces)"


@dataclass(slots=True)
class Counters:
    files: int = 0  # regular files that have a name
    bytes: int = 0  # their apparent sizes
    reads: int = 0  # read requests served through the mount
    read_bytes: int = 0
    writes: int = 0  # write requests through the mount
    write_bytes: int = 0
    # The direct path, as its clients report it through the control xattrs.
    lookups: int = 0
    hit_blocks: int = 0
    miss_blocks: int = 0
    hit_tokens: int = 0
    miss_tokens: int = 0
    direct_read_bytes: int = 0
    direct_needed_bytes: int = 0  # what those reads were for: read / needed = amplification
    published_blocks: int = 0
    published_bytes: int = 0
    refused_blocks: int = 0  # published blocks not placed: prefix not cached, or not admitted
    checksum_failures: int = 0
    # The mount door: a failed lookup in a model namespace is a miss, an open for reading a
    # hit (an engine's exists() + open() is its cache lookup).
    mount_hits: int = 0
    mount_misses: int = 0
    promotions: int = 0  # blocks fetched from a lower tier and placed hot
    demotions: int = 0  # evicted blocks kept in a lower tier
    evictions: int = 0  # files removed to make room
    expirations: int = 0  # files removed by retention

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def add(self, other: Counters) -> None:
        for name in self.__slots__:  # type: ignore[attr-defined]
            setattr(self, name, getattr(self, name) + getattr(other, name))


class Stats:
    """All counters of one mount."""

    def __init__(self) -> None:
        self.by_ns: defaultdict[Key, Counters] = defaultdict(Counters)

    def reset_usage(self, usage: dict[Key, tuple[int, int]]) -> None:
        for c in self.by_ns.values():
            c.files = c.bytes = 0
        for key, (files, size) in usage.items():
            c = self.by_ns[key]
            c.files, c.bytes = files, size

    def account(self, key: Key, files: int, size: int) -> None:
        c = self.by_ns[key]
        c.files += files
        c.bytes += size

    def read(self, key: Key, n: int, times: int = 1) -> None:
        c = self.by_ns[key]
        c.reads += times
        c.read_bytes += n

    def write(self, key: Key, n: int) -> None:
        c = self.by_ns[key]
        c.writes += 1
        c.write_bytes += n

    @property
    def used_bytes(self) -> int:
        return sum(c.bytes for c in self.by_ns.values())

    @property
    def total_files(self) -> int:
        return sum(c.files for c in self.by_ns.values())

    def tenant_files(self, tenant: int) -> int:
        return sum(c.files for (t, _), c in self.by_ns.items() if t == tenant)

    def tenant_bytes(self, tenant: int) -> int:
        return sum(c.bytes for (t, _), c in self.by_ns.items() if t == tenant)

    def fold_namespace(self, tenant: int, ns: int) -> None:
        """A namespace directory was removed: its counters join the tenant's REMOVED row."""
        c = self.by_ns.pop((tenant, ns), None)
        if c is not None:
            self.by_ns[(tenant, REMOVED)].add(c)

    def drop_tenant(self, tenant: int) -> None:
        for key in [k for k in self.by_ns if k[0] == tenant]:
            del self.by_ns[key]

    def render(self, names: dict[int, str], tenants: set[int] | None = None
               ) -> dict[str, dict[str, dict[str, int]]]:
        """{tenant name: {namespace name: counters}} of `tenants` (None: all); "" names files
        above any namespace, REMOVED_NAME the removed namespaces. Rows that come out under one
        name (a namespace whose name is not known any more) are added up, never overwritten."""
        out: dict[str, dict[str, dict[str, int]]] = {}
        merged: dict[tuple[str, str], Counters] = {}
        for (tenant, ns), c in sorted(self.by_ns.items()):
            if tenant == 0 or tenant not in names or (tenants is not None
                                                      and tenant not in tenants):
                continue
            name = "" if ns == 0 else REMOVED_NAME if ns == REMOVED else names.get(
                ns, REMOVED_NAME)
            row = merged.get((names[tenant], name))
            if row is None:
                row = merged[(names[tenant], name)] = Counters()
            row.add(c)
        for (tenant_name, name), c in merged.items():
            out.setdefault(tenant_name, {})[name] = c.as_dict()
        return out
