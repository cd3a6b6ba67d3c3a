"""Latency while the store is slow or down (:mod:`kvfs.bench.tiers`): requests on a reader
whose lower tier is behind a :class:`kvfs.bench.harness.FaultProxy`, each a fresh miss,
with a delay added per store request, then while the store hangs and while it is down.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from ..client import KVCache
from ..format.hashing import ModelSpec
from .harness import FaultProxy, Mount, S3Server, median, summary
from .tiers_restore import (
    HEADER,
    TENANT,
    BenchError,
    RawS3,
    hist_quantile,
    log,
    ms,
    request,
    s3_key,
    tier_delta,
)

#: A request's latency may exceed the fetch deadline by this much (control calls, the load).
DEADLINE_SLACK = 1.0


class TailRun:
    """Requests on the tail mount, each of a set its hot tier lacks."""

    def __init__(self, args: argparse.Namespace, spec: ModelSpec, pool: list[list[bytes]],
                 mount: Mount, proxy: FaultProxy) -> None:
        self.args, self.spec, self.pool, self.mount, self.proxy = args, spec, pool, mount, proxy
        self.next = 0
        self.out = torch.zeros((args.tail_blocks, *spec.block_shape), dtype=torch.bfloat16)
        self.cache = KVCache.open(mount.mnt, tenant=TENANT, spec=spec, direct=True)
        self.raw = RawS3(f"http://127.0.0.1:{proxy.port}", args.tail_blocks)
        self.timeout = 3 * args.fetch_timeout + 60

    def close(self) -> None:
        self.cache.close()
        self.raw.close()

    def current(self) -> list[bytes]:
        if self.next >= len(self.pool):
            raise BenchError("ran out of prepared block sets (raise --tail-requests)")
        return self.pool[self.next]

    def one(self) -> dict[str, Any]:
        """A request of the current set; a set that gave any block is not used again."""
        hashes = self.current()
        res = request(self.cache, hashes, self.out, self.timeout)
        if res["found"]:
            self.next += 1
        return res

    def delay_stage(self, delay_ms: float) -> dict[str, Any]:
        self.proxy.delay = delay_ms / 1e3
        before = self.mount.tier()
        rows = []
        file_bytes = HEADER + self.spec.block_payload_bytes
        for i in range(self.args.tail_requests):
            hashes = self.current()
            keys = [s3_key(self.spec, h) for h in hashes]
            if i % 2:
                res = self.one()
                base_s = self.raw.read(keys, file_bytes)
            else:
                base_s = self.raw.read(keys, file_bytes)
                res = self.one()
            hot = request(self.cache, hashes, self.out, self.timeout)  # now a hot hit
            res.update(baseline_s=base_s, hot_s=hot["seconds"],
                       storage_share=res["lookup_s"] / res["seconds"])
            rows.append(res)
        self.proxy.delay = 0.0
        full = [r for r in rows if r["blocks"] == self.args.tail_blocks]
        secs = [r["seconds"] for r in full]
        daemon = tier_delta(before, self.mount.tier())
        return {
            "delay_ms": delay_ms, "requests": rows, "misses": len(rows) - len(full),
            "latency_ms": {k: ms(v) if k != "n" else v for k, v in summary(secs).items()},
            "baseline_ms": {k: ms(v) if k != "n" else v for k, v in
                            summary([r["baseline_s"] for r in rows]).items()},
            "hot_hit_ms": ms(median([r["hot_s"] for r in rows])),
            "storage_share": median([r["storage_share"] for r in full]),
            "daemon": daemon,
            "daemon_fetch_p50": hist_quantile(daemon["fetch_latency"], 0.5),
            "daemon_fetch_p99": hist_quantile(daemon["fetch_latency"], 0.99),
        }

    def wait_closed(self, timeout: float) -> None:
        """Wait until the tail mount's breaker is closed (a request that hits closes it)."""
        deadline = time.monotonic() + timeout
        while self.mount.tier()["circuit"] != "closed":
            if time.monotonic() > deadline:
                raise BenchError("the circuit did not close before an outage stage")
            self.one()
            time.sleep(0.2)

    def outage_stage(self, kind: str, server: S3Server) -> dict[str, Any]:
        """``kind`` "hang": the proxy swallows requests; "down": the S3 server is stopped."""
        a = self.args
        self.wait_closed(a.tier_cooldown * 3 + 30)
        before = self.mount.tier()
        t_stop = time.monotonic()
        if kind == "hang":
            self.proxy.mode = "silent"
        else:
            server.stop()
        dead_at = time.monotonic()
        during = []
        while time.monotonic() - dead_at < a.outage:
            t = time.monotonic() - dead_at
            res = self.one()
            res["t"] = t
            during.append(res)
            log(f"    {kind}: t={t:5.2f} s  {res['seconds'] * 1e3:7.1f} ms  "
                f"{res['blocks']}/{a.tail_blocks} blocks  "
                f"circuit {self.mount.tier()['circuit']}")
            time.sleep(a.interval)
        mid = self.mount.tier()
        t_restart = time.monotonic()
        if kind == "hang":
            self.proxy.mode = "forward"
        else:
            server.start(timeout=120)
        back_at = time.monotonic()
        after = []
        hits = 0
        while hits < a.recovery_hits:
            if time.monotonic() - back_at > a.tier_cooldown * 4 + 60:
                break
            res = self.one()
            res["t"] = time.monotonic() - back_at
            after.append(res)
            log(f"    back: t={res['t']:5.2f} s  {res['seconds'] * 1e3:7.1f} ms  "
                f"{res['blocks']}/{a.tail_blocks} blocks  "
                f"circuit {self.mount.tier()['circuit']}")
            hits += res["blocks"] == a.tail_blocks
            time.sleep(a.interval)
        first_hit = next((r for r in after if r["blocks"] == a.tail_blocks), None)
        first_any = next((r for r in after if r["blocks"]), None)
        rest = [r["seconds"] for r in during[1:]]
        deadline = a.fetch_timeout
        full_hits = [r["seconds"] for r in after if r["blocks"] == a.tail_blocks]
        return {
            "kind": kind,
            "during": during,
            "after": after,
            "store_stop_s": round(dead_at - t_stop, 3),
            "store_restart_s": round(back_at - t_restart, 3),
            "first_ms": ms(during[0]["seconds"]) if during else None,
            "rest_p50_ms": ms(median(rest)),
            "rest_max_ms": ms(max(rest)) if rest else None,
            "slow_requests": sum(r["seconds"] > deadline / 2 for r in during),
            "max_ms": ms(max(r["seconds"] for r in during)) if during else None,
            "hits_during": sum(r["blocks"] for r in during),
            "within_deadline": all(r["seconds"] <= deadline + DEADLINE_SLACK for r in during),
            "first_hit_after_s": round(first_hit["t"], 3) if first_hit else None,
            "first_block_after_s": round(first_any["t"], 3) if first_any else None,
            "requests_to_first_hit": after.index(first_hit) + 1 if first_hit else None,
            "hits_after": len(full_hits),
            "hit_p50_ms_after": ms(median(full_hits[1:] or full_hits)),
            "daemon_during": tier_delta(before, mid),
            "daemon_after": tier_delta(mid, self.mount.tier()),
        }


# -- the report ----------------------------------------------------------------------------------
