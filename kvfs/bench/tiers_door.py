"""Figure 5 of ``kvfs bench tiers``: another host picks up a context through its mount.

An engine without the kvfs client (vLLM's or llm-d's file tier, SGLang's HiCacheFile,
LMCache's local disk backend) reads block files through the mount. On a host that has never
seen them (reader ``r-door``, ``--shared`` on the same bucket), each file is a hot miss: its
lookup has the daemon fetch the block from S3 (read into memory, verified, a sealed one
opened, written once into the hot tier), then the kernel reads the hot file (passthrough).
Each round reads one fresh set of ``--blocks`` published blocks on :data:`DOOR_THREADS`
threads, as such an engine does, and beside it the same objects with the fastest plain client
(presigned GETs read by urllib3 on 32 threads) and with boto3 on 32 threads, in an order that
rotates between rounds. The figure is the median of the rounds, the ratio the median of the
per-round ratios; the daemon's CPU per GB is counted beside it.
"""

from __future__ import annotations

import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..client import KVCache
from ..format.hashing import ModelSpec, block_relpath
from .harness import Mount, cpu_seconds, log
from .tiers_restore import HEADER, TENANT, RawS3, RawURLs, s3_key

#: Threads that read the files through the mount (an engine's I/O pool).
DOOR_THREADS = 8


def read_through(mount: Mount, spec: ModelSpec, hashes: list[bytes]) -> int:
    """Read every block file of ``hashes`` through ``mount`` on DOOR_THREADS threads; the
    payload bytes read (a file missing or short is an error)."""
    ns = os.path.join(mount.mnt, TENANT, spec.namespace)
    want = HEADER + spec.block_payload_bytes

    def one(h: bytes) -> int:
        with open(os.path.join(ns, block_relpath(h)), "rb", buffering=0) as f:
            buf = bytearray(want + 1)
            view, got = memoryview(buf), 0
            while n := f.readinto(view[got:]):
                got += n
        if got != want:
            raise OSError(f"{block_relpath(h)}: {got} bytes through the mount, {want} saved")
        return got - HEADER

    with ThreadPoolExecutor(DOOR_THREADS, thread_name_prefix="door") as pool:
        return sum(pool.map(one, hashes))


def bench_door(spec: ModelSpec, sets: list[list[bytes]], reader: Mount,
               s3_endpoint: str) -> dict[str, Any]:
    """The figure: GB/s of payload through the reader's mount, of the fastest client's and
    of boto3's GETs of the same objects, per round, and the daemon's CPU per GB."""
    file_bytes = HEADER + spec.block_payload_bytes
    raw_s3 = RawS3(s3_endpoint, 32)
    fastest = RawURLs(raw_s3, file_bytes, max(len(s) for s in sets))
    per: dict[str, list[float]] = {"kvfs": [], "fastest": [], "boto3": []}
    cpu: list[float] = []
    ratios: dict[str, list[float]] = {"fastest": [], "boto3": []}
    pid = reader.pid()
    KVCache.open(reader.mnt, tenant=TENANT, spec=spec).close()  # its namespace directory
    try:
        for rnd, hashes in enumerate(sets):
            keys = [s3_key(spec, h) for h in hashes]
            payload = len(hashes) * spec.block_payload_bytes
            order = ["kvfs", "fastest", "boto3"]
            order = order[rnd % 3:] + order[:rnd % 3]
            got: dict[str, float] = {}
            for k in order:
                os.sync()  # (untimed) nothing of the last one's left to write back
                if k == "kvfs":
                    c0, t0 = cpu_seconds(pid), time.perf_counter()
                    if read_through(reader, spec, hashes) != payload:
                        raise OSError("the mount gave other sizes than were saved")
                    seconds = time.perf_counter() - t0
                    cpu.append((cpu_seconds(pid) - c0) / payload * 1e9)
                elif k == "fastest":
                    seconds = fastest.read(keys)
                else:
                    seconds = raw_s3.read(keys, file_bytes)
                got[k] = payload / seconds / 1e9
                per[k].append(got[k])
            for k in ratios:
                ratios[k].append(got["kvfs"] / got[k])
            log(f"  door {rnd + 1}: through the mount {got['kvfs']:.2f} GB/s; the fastest "
                f"client {got['fastest']:.2f}, boto3 {got['boto3']:.2f} GB/s")
    finally:
        fastest.close()
        raw_s3.close()
    tier = reader.tier()
    return {
        "blocks": len(sets[0]), "block_mib": spec.block_payload_bytes / 2**20,
        "rounds": len(sets), "threads": DOOR_THREADS,
        **{f"{k}_gbps": statistics.median(v) for k, v in per.items()},
        **{f"vs_{k}": statistics.median(v) for k, v in ratios.items()},
        "daemon_cpu_s_per_gb": statistics.median(cpu),
        "daemon": {k: tier.get(k) for k in ("hits", "misses", "timeouts", "errors",
                                            "fetched_bytes")},
        "per_round": {**per, "ratios": ratios, "daemon_cpu_s_per_gb": cpu},
    }


def door_rows(dr: dict[str, Any]) -> list[tuple[str, str, str, float | None, str]]:
    what = (f"{dr['blocks']} x {dr['block_mib']:g} MiB per round read through a fresh "
            f"host's mount on {dr['threads']} threads (each a hot miss fetched by its daemon), "
            f"median of {dr['rounds']} rounds")
    return [
        ("restore through the mount from shared S3", f"{dr['kvfs_gbps']:.2f} GB/s",
         f"{dr['fastest_gbps']:.2f} GB/s (presigned GET + urllib3 readinto x32, the same "
         "objects)", dr["vs_fastest"], what),
        ("  through the mount vs boto3", f"{dr['kvfs_gbps']:.2f} GB/s",
         f"{dr['boto3_gbps']:.2f} GB/s (boto3 GET x32, the same objects)", dr["vs_boto3"],
         "the client most engines' S3 backends use"),
        ("  daemon CPU per GB through the mount", f"{dr['daemon_cpu_s_per_gb']:.2f} s", "-",
         None, "GET, verify (and open, where sealed), write into the hot tier; the reader's "
         "reads pass through to the kernel"),
    ]
