"""The Prometheus endpoint (`kvfs mount --metrics HOST:PORT`), with prometheus-client.

The HTTP server runs in prometheus-client's own thread. It never touches the daemon's state:
a trio task copies a snapshot (the same dict `.kvfs/stats.json` shows) once a second, and the
collector turns the latest snapshot into metric families. prometheus-client is imported only
when the endpoint is asked for.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import trio

log = logging.getLogger(__name__)

#: Per-namespace counters: stats name -> (metric name, help, extra labels).
COUNTERS: dict[str, tuple[str, str, dict[str, str]]] = {
    "lookups": ("kvfs_lookups", "Lookups by the kvfs client", {}),
    "hit_blocks": ("kvfs_hit_blocks", "Blocks found cached", {"door": "direct"}),
    "miss_blocks": ("kvfs_miss_blocks", "Blocks not cached", {"door": "direct"}),
    "mount_hits": ("kvfs_hit_blocks", "Blocks found cached", {"door": "mount"}),
    "mount_misses": ("kvfs_miss_blocks", "Blocks not cached", {"door": "mount"}),
    "hit_tokens": ("kvfs_hit_tokens", "Tokens whose KV was found cached", {}),
    "miss_tokens": ("kvfs_miss_tokens", "Tokens whose KV was not cached", {}),
    "read_bytes": ("kvfs_read_bytes", "Bytes read", {"door": "mount"}),
    "direct_read_bytes": ("kvfs_read_bytes", "Bytes read", {"door": "direct"}),
    "write_bytes": ("kvfs_written_bytes", "Bytes written", {"door": "mount"}),
    "published_bytes": ("kvfs_written_bytes", "Bytes written", {"door": "direct"}),
    "evictions": ("kvfs_evictions", "Files evicted to make room", {}),
    "demotions": ("kvfs_demotions", "Blocks moved to a lower tier on eviction", {}),
    "promotions": ("kvfs_promotions", "Blocks fetched from a lower tier and placed hot", {}),
    "expirations": ("kvfs_expirations", "Files removed by retention", {}),
    "checksum_failures": ("kvfs_checksum_failures", "Blocks that failed verification", {}),
}
TIER_COUNTERS = ("hits", "misses", "timeouts", "errors", "bad_blocks", "skipped", "demotions",
                 "demotion_failures", "uploads", "upload_failures", "uploads_dropped",
                 "fetched_bytes", "put_raw_bytes", "put_stored_bytes", "upload_seconds")


def families(snap: dict[str, Any]) -> Iterator[Any]:
    """Metric families for one snapshot of the daemon's counters."""
    from prometheus_client.core import (  # noqa: PLC0415
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )

    ns_labels = ["tenant", "model"]
    counters: dict[str, Any] = {}
    for name, doc, extra in COUNTERS.values():
        if name not in counters:
            counters[name] = CounterMetricFamily(name, doc, labels=[*ns_labels, *extra])
    files = GaugeMetricFamily("kvfs_files", "Files in the hot tier", labels=ns_labels)
    used = GaugeMetricFamily("kvfs_bytes", "Bytes in the hot tier", labels=ns_labels)
    ratio = GaugeMetricFamily("kvfs_hit_ratio", "Block hit ratio, both doors, since start",
                              labels=ns_labels)
    amp = GaugeMetricFamily("kvfs_fetch_amplification",
                            "Bytes the kvfs client read per byte its loads needed",
                            labels=ns_labels)
    for tenant, spaces in snap["tenants"].items():
        for model, c in spaces.items():
            labels = [tenant, model]
            for stat, (name, _doc, extra) in COUNTERS.items():
                counters[name].add_metric([*labels, *extra.values()], c[stat])
            files.add_metric(labels, c["files"])
            used.add_metric(labels, c["bytes"])
            hits = c["hit_blocks"] + c["mount_hits"]
            total = hits + c["miss_blocks"] + c["mount_misses"]
            ratio.add_metric(labels, hits / total if total else 0.0)
            if c["direct_needed_bytes"]:
                amp.add_metric(labels, c["direct_read_bytes"] / c["direct_needed_bytes"])
    yield from counters.values()
    yield from (files, used, ratio, amp)
    cap = GaugeMetricFamily("kvfs_capacity_bytes", "Capacity of the tier", labels=["tier"])
    use = GaugeMetricFamily("kvfs_used_bytes", "Bytes used in the tier", labels=["tier"])
    use.add_metric(["hot"], snap["used_bytes"])
    for t in snap.get("tiers", []):
        use.add_metric([t["name"]], t["known_bytes"])  # what this host put or knows there
    if snap.get("capacity_bytes") is not None:
        cap.add_metric(["hot"], snap["capacity_bytes"])
    yield from (cap, use)
    tier_c = {k: CounterMetricFamily(f"kvfs_tier_{k}", f"Lower tier: {k.replace('_', ' ')}",
                                     labels=["tier"]) for k in TIER_COUNTERS}
    circuit = GaugeMetricFamily("kvfs_tier_circuit_open", "1 while a tier's circuit is open",
                                labels=["tier"])
    latency = HistogramMetricFamily("kvfs_tier_fetch_latency_seconds",
                                    "Latency of fetches from a lower tier", labels=["tier"])
    for t in snap.get("tiers", []):
        for k in TIER_COUNTERS:
            tier_c[k].add_metric([t["name"]], t[k])
        circuit.add_metric([t["name"]], 0 if t["circuit"] == "closed" else 1)
        cumulative, buckets = 0, []
        for le, n in t["fetch_latency"].items():
            cumulative += n
            buckets.append((le, cumulative))
        latency.add_metric([t["name"]], buckets, sum_value=float("nan"))
    yield from tier_c.values()
    yield from (circuit, latency)


class Metrics:
    """Serves the latest snapshot of `snapshot()` on HOST:PORT."""

    def __init__(self, address: str, snapshot: Callable[[], dict[str, Any]]) -> None:
        host, _, port = address.rpartition(":")
        if not port.isdigit():
            raise ValueError(f"--metrics wants HOST:PORT, got {address!r}")
        self.host, self.port = host or "127.0.0.1", int(port)
        self.snapshot = snapshot
        self.latest: dict[str, Any] = snapshot()

    def start(self) -> None:
        """Start the HTTP thread (before serving: a port in use fails the mount)."""
        from prometheus_client import start_http_server  # noqa: PLC0415
        from prometheus_client.core import CollectorRegistry  # noqa: PLC0415

        registry = CollectorRegistry()
        registry.register(self)
        start_http_server(self.port, addr=self.host, registry=registry)
        log.info("metrics on http://%s:%d/metrics", self.host, self.port)

    def collect(self) -> Iterator[Any]:
        return families(self.latest)

    async def run(self, interval: float = 1.0) -> None:
        while True:
            await trio.sleep(interval)
            self.latest = self.snapshot()
