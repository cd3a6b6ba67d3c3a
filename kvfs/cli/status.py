"""`kvfs status` and `kvfs top`: a mount's usage, tiers and per-tenant counters, from its
`.kvfs/stats.json`."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from .common import human, read_stats, table_lines


def _hit_pct(c: dict[str, int]) -> str:
    hits = c["hit_blocks"] + c["mount_hits"]
    total = hits + c["miss_blocks"] + c["mount_misses"]
    return f"{100 * hits / total:.1f}" if total else "-"


def _backing_free(backing: str) -> str:
    """What the backing filesystem has free, as said beside a mount without a capacity."""
    try:
        st = os.statvfs(backing)
    except OSError:
        return ""
    free = st.f_bavail * st.f_frsize
    return f" ({human(free)} free{': full, writes are refused' if free == 0 else ''})"


def status_lines(stats: dict[str, Any]) -> list[str]:
    cap = stats.get("capacity_bytes")
    used = stats["used_bytes"]
    pct = f" ({100 * used / cap:.1f} %)" if cap else _backing_free(stats["backing"])
    lines = [f"kvfs {stats['version']}  mount {stats['mountpoint']}  backing {stats['backing']}  "
             f"pid {stats['pid']}",
             f"hot: {human(used)} of {human(cap) if cap else 'the backing filesystem'}{pct}, "
             f"{stats['files']} files, {stats['open_files']} open"]
    pt = stats.get("passthrough")
    if pt is not None:
        lines.append(f"passthrough: {pt['state']} ({pt['reason']})" + (
            f", {pt['open_files']} files open through it, {pt['cut']} writers cut back at "
            f"close" if pt["state"] == "on" else ""))
        if pt.get("request_thread"):
            answered = sum(v for k, v in (stats.get("requests") or {}).items()
                           if k.startswith("thread_"))
            reqs = stats.get("requests") or {}
            lines.append(f"request thread: {pt['delegated']} files it opens itself, "
                         f"{pt.get('directories', 0)} directories whose misses it answers, "
                         f"{reqs.get('thread_create', 0)} files it created "
                         f"({'on' if pt.get('thread_creates') else 'off'}"
                         + (f", halted: {pt['thread_creates_halted']}"
                            if pt.get("thread_creates_halted") else "") + "), "
                         f"{answered} requests answered, {pt['forwarded']} passed on")
    wake = stats.get("fuse_wake") or {}
    if wake.get("wake_here") is not None:
        lines.append("FUSE wake-ups: " + (
            "on the caller's CPU" if wake["wake_here"] == "on" else
            "on another CPU (each request the daemon answers waits for it to wake: "
            "`kvfs mount --wake-here on`)") + f" (fuse.wake_here {wake['wake_here']}: "
            f"{wake['mount']})")
    left = stats.get("indexing", {}).get("directories_left", 0)
    if left:
        lines.append(f"indexing the backing tree: {stats['indexing']['entries_indexed']} "
                     f"entries so far, {left} directories left (usage counts what is indexed)")
    for t in stats.get("tiers", []):
        lines.append(f"{t['name']}: {t['url']}  holds {t['known_files']} blocks of this host "
                     f"({human(t['known_bytes'])})  circuit {t['circuit']}  hits {t['hits']}  "
                     f"misses {t['misses']}  timeouts {t['timeouts']}  errors {t['errors']}  "
                     f"uploads {t['uploads']} (failed {t['upload_failures']})  "
                     f"codec {t['codec']}" + (f" ({t['ratio']}x)" if t.get("ratio") else "")
                     + ("  sealed" if t.get("sealed") else "  not encrypted")
                     + (f"  key errors {t['key_errors']}" if t.get("key_errors") else "")
                     + (f"  refused by placement {t['refused_placements']}"
                        if t.get("refused_placements") else ""))
    for tenant, g in sorted(stats.get("governance", {}).items()):
        keys = g["keys"]
        lines.append(f"tenant {tenant}: placement {g['placement']}  keys "
                     f"{', '.join(keys['live']) or 'none'}"
                     + (f" (retired {', '.join(keys['retired'])})" if keys["retired"] else "")
                     + ("  forgotten before" if keys.get("forgotten") else ""))
    rows = [("TENANT", "NAMESPACE", "FILES", "BYTES", "HIT%", "HITS", "MISSES", "READ",
             "WRITTEN", "EVICTED")]
    for tenant, spaces in sorted(stats["tenants"].items()):
        for ns, c in sorted(spaces.items()):
            rows.append((tenant, ns or "-", str(c["files"]), human(c["bytes"]), _hit_pct(c),
                         str(c["hit_blocks"] + c["mount_hits"]),
                         str(c["miss_blocks"] + c["mount_misses"]),
                         human(c["read_bytes"] + c["direct_read_bytes"]),
                         human(c["write_bytes"] + c["published_bytes"]),
                         str(c["evictions"] + c["demotions"] + c["expirations"])))
    return lines + table_lines(rows)


def cmd_status(args: argparse.Namespace) -> int:
    stats = read_stats(os.path.abspath(args.mountpoint))
    if args.json:
        print(json.dumps(stats, indent=2, sort_keys=True))
        return 0
    print("\n".join(status_lines(stats)))
    return 0


def cmd_top(args: argparse.Namespace) -> int:
    """Refresh per-tenant hit rate, throughput and evictions per second."""
    mountpoint = os.path.abspath(args.mountpoint)
    prev, prev_t = read_stats(mountpoint), time.monotonic()
    shown = 0
    while args.count is None or shown < args.count:
        time.sleep(args.interval)
        cur, now = read_stats(mountpoint), time.monotonic()
        dt = max(now - prev_t, 1e-9)
        rows = [("TENANT", "NAMESPACE", "HIT%", "HIT%NOW", "READ/s", "WRITE/s", "EVICT/s",
                 "BYTES")]
        for tenant, spaces in sorted(cur["tenants"].items()):
            for ns, c in sorted(spaces.items()):
                p = prev["tenants"].get(tenant, {}).get(ns) or dict.fromkeys(c, 0)
                d = {k: c[k] - p.get(k, 0) for k in c}
                rows.append((tenant, ns or "-", _hit_pct(c), _hit_pct(d),
                             human((d["read_bytes"] + d["direct_read_bytes"]) / dt) + "/s",
                             human((d["write_bytes"] + d["published_bytes"]) / dt) + "/s",
                             f"{(d['evictions'] + d['demotions'] + d['expirations']) / dt:.1f}",
                             human(c["bytes"])))
        if sys.stdout.isatty():
            print("\033[H\033[2J", end="")
        print("\n".join(status_lines(cur)[:2] + table_lines(rows)), flush=True)
        prev, prev_t = cur, now
        shown += 1
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add this module's subcommands to `kvfs`."""
    s = sub.add_parser("status", help="usage, tenants and counters of a mount")
    s.add_argument("mountpoint")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_status)

    tp = sub.add_parser("top", help="live per-tenant hit rate, throughput, evictions")
    tp.add_argument("mountpoint")
    tp.add_argument("--interval", type=float, default=1.0)
    tp.add_argument("--count", type=int, help="refreshes before exiting (default: forever)")
    tp.set_defaults(func=cmd_top)
