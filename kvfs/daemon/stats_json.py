"""What `.kvfs/stats.json` shows (and the metrics endpoint serves): the daemon's identity, its
usage, the counters of kvfs.daemon.stats per tenant and model, the policies' size, the tiers, the
FUSE requests served by kind, and the progress of indexing an adopted tree; and which tenants'
counters a caller may see.

Read-only: it reads the shared state (kvfs.daemon.tree) on the event loop and changes nothing.
"""

from __future__ import annotations

import json
import stat
import time
from typing import Any

from .. import __version__
from ..format import codec
from . import wakeup
from .adoption import Adoption
from .handlers import REQUESTS
from .tree import Tree


def snapshot(tree: Tree, adoption: Adoption, tenants: set[int] | None = None
             ) -> dict[str, Any]:
    """Everything `.kvfs/stats.json` shows; the counters of `tenants` only (None: all)."""
    tree.collect_opens()
    stats, info = tree.stats, tree.info
    keys = set(stats.by_ns)
    names = tree.names_of({t for t, _ in keys} | {n for _, n in keys if n > 0})
    return {
        "version": __version__,
        "pid": info.pid,
        "mountpoint": info.mountpoint,
        "backing": info.backing,
        "uptime_s": round(time.time() - info.started, 3),
        "capacity_bytes": info.capacity,
        "used_bytes": stats.used_bytes,
        "files": stats.total_files,
        "open_files": len(tree.open_files),
        # Files with eviction state in memory (at most policy_entries); the others are
        # cold: cached, known to the index only, evicted first.
        "policy": {"name": info.policy, "entries_limit": info.policy_entries,
                   "entries": tree.residency.entries()},
        "tenants": _below(tree, stats.render(names, tenants)),
        "tiers": _tiers(tree),
        # Each tenant's placement (the tiers its blocks may reach) and keys
        # (kvfs.daemon.governance).
        "governance": (tree.governance.snapshot(
            None if tenants is None else set(tree.names_of(tenants).values()))
            if tree.governance is not None else {}),
        # Whether the kernel reads and writes open files itself (kvfs.daemon.passthrough), and why
        # not.
        "passthrough": tree.passthrough.snapshot(),
        # FUSE requests served, by kind (kvfs.daemon.handlers), and those the request thread
        # answered without the daemon's loop (`thread_<kind>`, kvfs.daemon.passthrough).
        "requests": {**REQUESTS, **tree.passthrough.thread_requests()},
        # The CPU the kernel wakes the daemon on for a request, and what this mount did about
        # it (kvfs.daemon.wakeup).
        "fuse_wake": wakeup.snapshot(info.wake),
        # A tree adopted at its first mount until every directory is indexed: usage and
        # eviction see only what is indexed so far.
        "indexing": {"directories_left": len(adoption.unlisted),
                     "entries_indexed": adoption.reconciler.report.entries},
    }


def _below(tree: Tree, rendered: dict[str, Any]) -> dict[str, Any]:
    """Each namespace's bytes put below hot since the mount, as saved and as stored
    (kvfs.format.codec), and their ratio."""
    if tree.tiering is not None:
        for (tenant, ns), (raw, stored) in tree.tiering.ns_bytes.items():
            c = rendered.get(tenant, {}).get(ns)
            if c is not None:
                c.update(below_raw_bytes=raw, below_stored_bytes=stored,
                         below_ratio=codec.ratio(raw, stored))
    return rendered


def _tiers(tree: Tree) -> list[dict[str, Any]]:
    if tree.tiering is None:
        return []
    out = tree.tiering.snapshot()
    known = tree.index.tier_usage()
    for i, t in enumerate(out, start=1):
        t["known_files"], t["known_bytes"] = known.get(i, (0, 0))
    return out


def render(tree: Tree, adoption: Adoption, tenants: set[int] | None = None) -> bytes:
    """The content of `.kvfs/stats.json`."""
    return json.dumps(snapshot(tree, adoption, tenants), indent=2, sort_keys=True).encode() + b"\n"


async def visible_tenants(tree: Tree, ctx: Any) -> set[int] | None:
    """The tenants whose counters a caller may see: those whose directory it may enter
    (search permission, by its uid, gid and supplementary groups); None (all) for root and
    the mount's owner. Model names and usage are the tenant's data too."""
    if ctx.uid in (0, tree.owner_uid):
        return None
    groups = {ctx.gid} | await tree.io(groups_of, ctx.pid)
    out = set()
    for t in tree.index.tenants():
        if t.uid == ctx.uid:
            bit = stat.S_IXUSR
        elif t.gid in groups:
            bit = stat.S_IXGRP
        else:
            bit = stat.S_IXOTH
        if t.mode & bit:
            out.add(t.inode)
    return out


def groups_of(pid: int) -> set[int]:
    """Thread: the supplementary groups of a process (none if it is gone)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Groups:"):
                    return {int(g) for g in line.split()[1:]}
    except (OSError, ValueError):
        pass
    return set()
