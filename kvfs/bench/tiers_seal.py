"""Figure 4 of ``kvfs bench tiers``: what encryption at rest costs on the shared tier.

Two writers publish the same blocks to the same bucket (under two prefixes), one sealing them
(the default) and one with ``--no-encrypt``; two fresh readers restore them (``lookup`` +
``load``, one request of ``--blocks`` blocks, the client GETting the objects itself with its
grants and, sealed, opening them with its namespace's keys). First every round publishes a
fresh set on both writers (timed from the save to the last upload), then the sets are
restored, two per round, in the order sealed, plain, plain, sealed (the store left to settle
between the phases: a restore right after a publish, or right after another restore, ran
slower, whichever it was). The figures are the medians of the rounds and the ratio the
median of the per-round ratios (sealed over plain); the target: both >= 0.9x. Each publish
round also PUTs objects of the same size, as many, with the fastest plain client (presigned
PUTs by urllib3 on as many threads as the daemon's uploads): what a publish is held to.
Both sides' CPU is counted over the same spans (the writer daemon's, or this process's for
the client, and the store server's, from /proc), in seconds per GB: on a machine whose cores
the store shares, what each GB costs is what bounds the speed, and the difference is the
sender's own. The daemon's is counted without what the bench's own polls of its stats cost
it (measured per poll before the rounds). Beside it,
the bound of a sealed restore on this machine: the plain restore plus opening the same bytes
on every core (:func:`open_gbps` on one, times the cores: kvfs's C cipher opens without the
GIL, on the restore's threads; without it, on one core).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from ..client import KVCache
from ..format.hashing import ModelSpec
from .harness import Mount, cpu_seconds, log
from .tiers_restore import HEADER, RawURLs, Sets, request, wait_published

TENANT = "t"


def open_gbps(spec: ModelSpec, n: int = 16) -> float:
    """GB/s of opening sealed blocks in place on this core (kvfs.format.seal.open_in_place:
    AES-256-GCM, the payload hashed as it is decrypted), median of 5 passes over n blocks."""
    from ..format import blockfile, hashing, seal  # noqa: PLC0415

    payload = os.urandom(spec.block_payload_bytes)
    h = hashing.block_hashes(list(range(spec.block_size)), spec.block_size)[0]
    raw = blockfile.encode(block_hash=h, parent_hash=hashing.ROOT_PARENT, fingerprint=bytes(16),
                           token_count=spec.block_size, dtype="uint8",
                           shape=(spec.block_payload_bytes,), payload=payload)
    key = os.urandom(32)
    sealed = seal.seal_file(raw, key, 1, TENANT, "ns", encode=False)
    hdr = blockfile.decode_header(sealed)
    body = sealed[blockfile.HEADER_SIZE:blockfile.HEADER_SIZE + hdr.stored_len]
    bufs = [bytearray(body) for _ in range(n)]
    times = []
    for _ in range(5):
        for b in bufs:
            b[:] = body
        t0 = time.perf_counter()
        for b in bufs:
            seal.open_in_place(hdr, b, key, TENANT, "ns")
        times.append(time.perf_counter() - t0)
    return n * len(body) / statistics.median(times) / 1e9


def bench_seal(spec: ModelSpec, work: str, url_of: Callable[[str], str], *, blocks: int,
               rounds: int, payload: Callable[[ModelSpec, int, int], torch.Tensor],
               mounts: list[Mount], put_client: RawURLs | None = None,
               store_pid: int | None = None, extra: list[str] | None = None) -> dict[str, Any]:
    """The figure: publish and restore GB/s sealed and plain, and their ratios; the CPU
    seconds per GB published of the sender and of the store (``store_pid``) on each side.
    ``extra``: more arguments for every mount (the bench's ``--tier-codec``)."""
    sealed_url, plain_url = url_of("kvfs-sealed"), url_of("kvfs-plain")
    more = list(extra or [])
    side = {
        "sealed": (Mount.under(os.path.join(work, "w-sealed"), ["--shared", sealed_url, *more]),
                   Mount.under(os.path.join(work, "r-sealed"), ["--shared", sealed_url, *more])),
        "plain": (Mount.under(os.path.join(work, "w-plain"), ["--shared", plain_url,
                                                              "--no-encrypt", *more]),
                  Mount.under(os.path.join(work, "r-plain"), ["--shared", plain_url,
                                                              "--no-encrypt", *more])),
    }
    for w, r in side.values():
        for m in (w, r):
            m.start()
            mounts.append(m)
            m.add_tenant(TENANT)
    payload_bytes = blocks * spec.block_payload_bytes
    sets = Sets(spec, base=3 * 10**9)
    out = {k: {"publish_gbps": [], "upload_gbps": [], "restore_gbps": []} for k in side}
    ratios: dict[str, list[float]] = {"publish": [], "restore": []}
    published = {k: 0 for k in side}
    puts: list[float] = []  # the fastest client's PUT of as many objects, GB/s of payload
    put_ratios: dict[str, list[float]] = {k: [] for k in side}
    upload_ratios: dict[str, list[float]] = {k: [] for k in side}
    # CPU seconds per GB of payload published: the sender's (daemon, or this process for the
    # client) and the store's, by side.
    cpu: dict[str, dict[str, list[float]]] = {k: {"sender": [], "store": []}
                                              for k in (*side, "client")}

    def store_cpu() -> float:
        return cpu_seconds(store_pid) if store_pid is not None else 0.0

    # What one read of a writer's stats costs it (the publish is waited for by polling
    # them): measured before the rounds, taken off each round's CPU.
    poll_cpu = {}
    for k, (w, _) in side.items():
        c0 = cpu_seconds(w.pid())
        for _ in range(200):
            w.tier()
        poll_cpu[k] = (cpu_seconds(w.pid()) - c0) / 200
    file_bytes = HEADER + spec.block_payload_bytes
    caches = {k: (KVCache.open(w.mnt, tenant=TENANT, spec=spec, direct=True),
                  KVCache.open(r.mnt, tenant=TENANT, spec=spec, direct=True))
              for k, (w, r) in side.items()}
    try:
        sets_kv = []
        for rnd in range(rounds):  # publish: the save, then write-through to the bucket
            order = list(side) if rnd % 2 == 0 else list(side)[::-1]
            if put_client is not None:  # the plain PUTs first, last, or between the two
                order.insert(rnd % 3, "client")
            hashes = sets.make(caches["sealed"][0], 1, blocks)[0]
            kv = payload(spec, blocks, 7 * 10**6 + rnd)
            sets_kv.append((hashes, kv))
            got: dict[str, float] = {}
            for k in order:
                # Each side starts with nothing of the last one's left to write back (the
                # store's volumes and the hot tier on the same disk), untimed: a publish
                # behind another's write-back ran at a third of its speed, whichever it was.
                os.sync()
                if k == "client":
                    objects = [os.urandom(file_bytes) for _ in range(blocks)]  # untimed
                    c0, s0 = time.process_time(), store_cpu()
                    t = put_client.write([f"kvfs-put/{rnd}/{i}" for i in range(blocks)],
                                         objects)
                    cpu[k]["sender"].append((time.process_time() - c0) / payload_bytes * 1e9)
                    cpu[k]["store"].append((store_cpu() - s0) / payload_bytes * 1e9)
                    got[k] = payload_bytes / t / 1e9
                    puts.append(got[k])
                    time.sleep(0.3)
                    continue
                busy0 = side[k][0].tier()["upload_seconds"]
                pid = side[k][0].pid()
                c0, s0 = cpu_seconds(pid), store_cpu()
                t0 = time.monotonic()
                published[k] += caches[k][0].save(hashes, kv)
                polls: list[int] = []
                done = wait_published(side[k][0], published[k], 600, polls)
                spent = cpu_seconds(pid) - c0 - polls[0] * poll_cpu[k]
                cpu[k]["sender"].append(max(0.0, spent) / payload_bytes * 1e9)
                cpu[k]["store"].append((store_cpu() - s0) / payload_bytes * 1e9)
                got[k] = payload_bytes / (done - t0) / 1e9
                out[k]["publish_gbps"].append(got[k])
                # The uploads alone: the bytes over the time at least one was in flight.
                busy = side[k][0].tier()["upload_seconds"] - busy0
                got[f"{k}_upload"] = payload_bytes / busy / 1e9
                out[k]["upload_gbps"].append(got[f"{k}_upload"])
                time.sleep(0.3)
            ratios["publish"].append(got["sealed"] / got["plain"])
            if "client" in got:
                for k in side:
                    put_ratios[k].append(got[k] / got["client"])
                    upload_ratios[k].append(got[f"{k}_upload"] / got["client"])
            log(f"  publish {rnd + 1}: sealed {got['sealed']:.2f} / plain {got['plain']:.2f} "
                f"GB/s (uploading {got['sealed_upload']:.2f} / {got['plain_upload']:.2f})"
                + (f"; the fastest client's PUT {got['client']:.2f} GB/s"
                   if "client" in got else ""))
        time.sleep(3)  # the store settles after the writes
        for rnd in range(rounds // 2):  # restore on readers that never saw them: A B B A
            spent = {k: 0.0 for k in side}
            for j, order in enumerate((list(side), list(side)[::-1])):
                hashes, kv = sets_kv[2 * rnd + j]
                dest = torch.empty_like(kv)
                for k in order:
                    res = request(caches[k][1], hashes, dest, 120)
                    if res["blocks"] != blocks:
                        raise RuntimeError(f"{k} restore found {res['found']} and loaded "
                                           f"{res['blocks']} of {blocks} blocks")
                    if not torch.equal(dest.view(torch.int16), kv.view(torch.int16)):
                        raise RuntimeError(f"{k} restore gave other bytes than were saved")
                    spent[k] += res["seconds"]
                    caches[k][1].flush()  # its hot copies written behind, before the next
                    time.sleep(0.3)
            got = {k: 2 * payload_bytes / t / 1e9 for k, t in spent.items()}
            for k in side:
                out[k]["restore_gbps"].append(got[k])
            ratios["restore"].append(got["sealed"] / got["plain"])
            log(f"  restore {rnd + 1}: sealed {got['sealed']:.2f} / plain {got['plain']:.2f} "
                "GB/s")
    finally:
        for w, r in caches.values():
            w.close()
            r.close()
    aes = open_gbps(spec)
    # The bound of a sealed restore here: the plain one plus opening the same bytes (AES-256-GCM
    # and the payload's xxh3) on every core where the cipher lets go of the GIL, else on one.
    from ..format import seal  # noqa: PLC0415

    cores = (os.cpu_count() or 1) if seal._CGcm is not None else 1  # noqa: SLF001
    bounds = [1 / (1 / p + 1 / (aes * cores)) for p in out["plain"]["restore_gbps"]]
    return {
        "open_gbps": aes, "open_cores": cores,
        "cipher": ("kvfs.format._seal (libcrypto, without the GIL)"
                   if seal._CGcm is not None else "the cryptography package (holds the GIL)"),  # noqa: SLF001
        "bound_gbps": statistics.median(bounds),
        "bound_ratio": statistics.median(s / b for s, b in
                                         zip(out["sealed"]["restore_gbps"], bounds, strict=True)),
        "blocks": blocks, "block_mib": spec.block_payload_bytes / 2**20, "rounds": rounds,
        "restore_rounds": rounds // 2,
        "file_bytes": HEADER + spec.block_payload_bytes,
        **{f"{k}_{m}": statistics.median(v[f"{m}_gbps"]) for k, v in out.items()
           for m in ("publish", "upload", "restore")},
        "publish_ratio": statistics.median(ratios["publish"]),
        **({"client_put": statistics.median(puts),
            **{f"{k}_publish_vs_put": statistics.median(v) for k, v in put_ratios.items()},
            **{f"{k}_upload_vs_put": statistics.median(v) for k, v in upload_ratios.items()}}
           if puts else {}),
        "restore_ratio": statistics.median(ratios["restore"]),
        **({"cpu_per_gb": {k: {w: statistics.median(v) for w, v in c.items() if v}
                           for k, c in cpu.items() if c["sender"]},
            "stats_poll_cpu_ms": {k: round(v * 1e3, 3) for k, v in poll_cpu.items()}}
           if store_pid else {}),
        "per_round": {"ratios": ratios, **out, "cpu_per_gb": cpu},
    }

