"""The mover: moving blocks between the hot tier and the lower tiers, on the daemon's event loop.

The tiers themselves (`kvfs.daemon.tiers.dir`, `kvfs.daemon.tiers.s3`) are blocking stores; this
module's
:class:`Tiering` runs them from worker threads with deadlines, circuit breakers
(`kvfs.daemon.tiers.breaker`) and one fetch per key at a time:

- `fetch(key, rel)`: a hot miss looks in each lower tier in order. The first that has the
  block gives its bytes into memory (`Tier.read`), where they are verified (header, size,
  checksum, name; a sealed block opened in place) before they are written once into a
  temporary in a directory only the daemon writes (the backing tree's staging directory),
  which is renamed into its verified hot directory (`store.Placement`). A tier past
  its deadline or failing is a miss (counted); its breaker opens after repeated failures,
  so a dead store costs one deadline, not one per block (nor one per batch of blocks:
  fetches that were waiting for a thread when the circuit opened are skipped, not made).
  Concurrent fetches of one key wait on the first.
- `demote(key, rel)`: eviction puts the block into the first lower tier before the hot copy
  is unlinked. Uploads and demotions read the hot copy through a `Source` the daemon gives:
  a reader of the file on a verified fd (never through a tenant's symlink).
- `enqueue_upload(key, rel)`: write-through publishing to the shared tiers, asynchronous:
  a bounded queue drained by a few uploader tasks; a full queue drops (counted), failures are
  retried a few times with backoff and then dropped. A save never waits for it.

Blocks go below encoded (`kvfs.format.codec`, the mount's `--tier-codec`, lossless by default): the
worker thread that reads the hot copy encodes it, and a fetch decodes it (both checksums
checked) before the hot copy is placed, so the hot tier holds blocks as they were saved.
Each tier counts the raw and the stored bytes it was given (its ratio).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import trio

from ...format import blockfile, codec, seal
from ..keys import Keyring, KeyUnavailable
from .base import Tier, TierError
from .breaker import Breaker, fetch_deadline
from .transfer import (
    Destination,
    Fetched,
    Handoff,
    Sealer,
    Source,
    SourceError,
    fetch_block,
    put_block,
)

log = logging.getLogger(__name__)

UPLOAD_QUEUE = 4096
UPLOADERS = 4
UPLOAD_RETRIES = 3
#: Deadline for a fetch whose size is unknown (a block this host has never seen).
DEFAULT_BLOCK_BYTES = 64 << 20
#: Upper bounds (seconds) of the fetch latency histogram's buckets.
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, math.inf)


@dataclass
class TierCounters:
    hits: int = 0  # blocks fetched from this tier and served
    misses: int = 0  # fetches this tier could not answer (absent)
    timeouts: int = 0
    errors: int = 0
    bad_blocks: int = 0  # fetched but failed verification
    skipped: int = 0  # not asked: circuit open
    demotions: int = 0
    demotion_failures: int = 0
    uploads: int = 0
    upload_failures: int = 0
    uploads_dropped: int = 0
    upload_seconds: float = 0.0  # seconds during which at least one upload was in flight
    fetched_bytes: int = 0  # stored bytes fetched (encoded, where the tier's blocks are)
    put_raw_bytes: int = 0  # bytes of the blocks put here (demoted, uploaded), as saved
    put_stored_bytes: int = 0  # what they took here (encoded where that paid)
    grants: int = 0  # blocks a client was given a URL to read from this tier itself
    key_errors: int = 0  # blocks not put here or not read from here: their key unavailable
    refused_placements: int = 0  # blocks not put here: their tenant may not reach this tier
    latency: list[int] = field(default_factory=lambda: [0] * len(LATENCY_BUCKETS))

    def observe(self, seconds: float) -> None:
        for i, bound in enumerate(LATENCY_BUCKETS):
            if seconds <= bound:
                self.latency[i] += 1
                return


class _Refused(Exception):
    """A call not made: its tier's circuit opened while the call waited for a thread."""


class Tiering:
    """The lower tiers of one mount, in order: index 1 is the first below hot."""

    def __init__(self, tiers: list[Tier], limiter: trio.CapacityLimiter, *,
                 write_through: bool = True, fetch_timeout: float | None = None,
                 breaker_threshold: int = 3, breaker_cooldown: float = 10.0,
                 encode: bool = True, hot_encoded: bool = False, hot_sealed: bool = False,
                 keyring: Keyring | None = None,
                 placement: Callable[[str], frozenset[str] | None] | None = None) -> None:
        self.tiers = tiers
        #: The tenants' keys: blocks are sealed before they are put below (None: plaintext).
        self.keyring = keyring
        #: The hot tier keeps blocks sealed (--hot-encrypt): a fetched one is placed so.
        self.hot_sealed = hot_sealed
        #: A tenant's placement: the names of the tiers its blocks may reach (None: all).
        self.placement = placement or (lambda tenant: None)
        #: Told (tenant, tier name) of each block not put in a tier outside its placement.
        self.on_refused: Callable[[str, str], None] = lambda tenant, tier: None
        #: Clients save blocks encoded in the hot tier: fetched ones are kept encoded too.
        self.hot_encoded = hot_encoded
        #: Blocks put below are encoded where that pays (kvfs.format.codec; and it is built).
        self.encode = encode and codec.available()
        self.limiter = limiter
        self.write_through = write_through
        self.fetch_timeout = fetch_timeout
        # Threads for tier calls: `limiter` bounds the calls in flight, this the threads,
        # which outlive abandoned calls.
        self._threads = trio.CapacityLimiter(4 * limiter.total_tokens)
        self.breakers = [Breaker(breaker_threshold, breaker_cooldown, name=t.name)
                         for t in tiers]
        self.counters = [TierCounters() for _ in tiers]
        #: (tenant, namespace) -> [raw, stored] bytes of the blocks put below (all tiers).
        self.ns_bytes: dict[tuple[str, str], list[int]] = {}
        self._inflight: dict[str, trio.Event] = {}
        self._results: dict[str, Fetched | None] = {}
        self._send, self._recv = trio.open_memory_channel[tuple[str, Source, int]](
            UPLOAD_QUEUE)
        #: Per tier: uploads in flight, and since when at least one was (upload_seconds).
        self._uploading = [[0, 0.0] for _ in tiers]

    def reachable(self) -> bool:
        """Whether some tier may be asked now (its circuit is not open)."""
        return any(b.state != "open" for b in self.breakers)

    @property
    def shared(self) -> list[int]:
        """Indexes (0-based) of the tiers that other hosts read: write-through targets."""
        return [i for i, t in enumerate(self.tiers) if t.shared]

    def allowed(self, i: int, key: str) -> bool:
        """Whether tier ``i`` is in the placement of the tenant of tier key (or tenant) ``key``."""
        names = self.placement(key.split("/", 1)[0])
        return names is None or self.tiers[i].name in names

    def reach(self, tenant: str) -> list[int]:
        """The tiers ``tenant``'s blocks may reach."""
        return [i for i in range(len(self.tiers)) if self.allowed(i, tenant)]

    def _sealer(self) -> Sealer | None:
        keyring = self.keyring
        if keyring is None:
            return None

        def sealer(key: str, data: bytes | bytearray, encode: bool) -> bytes | bytearray:
            tenant, ns = key.split("/", 2)[:2]
            if seal.is_sealed(blockfile.decode_header(data)):
                return data
            key_id, ns_key = keyring.sealing_key(tenant, ns)
            return seal.seal_file(data, ns_key, key_id, tenant, ns, encode=encode,
                                  in_place=True)  # (a buffer of the upload's own)

        return sealer

    async def run(self) -> None:
        """The uploader tasks; runs for the mount's lifetime."""
        async with trio.open_nursery() as nursery:
            for _ in range(UPLOADERS):
                nursery.start_soon(self._uploader)

    def deadline(self, size: int | None) -> float:
        if self.fetch_timeout is not None:
            return self.fetch_timeout
        return fetch_deadline(size if size is not None else DEFAULT_BLOCK_BYTES, floor=1.0)

    async def _call(self, i: int, fn: Callable[..., Any], *args: Any,
                    timeout: float, opens: int | None = None) -> tuple[bool, Any]:
        """Run a blocking tier call with a deadline: (done, result). The deadline starts when
        the call gets a thread (waiting for one is not the tier's fault); a call past it is
        abandoned (its thread finishes on its own) and counted as a timeout. With `opens`
        (the breaker's `opens` when the call was allowed), a call whose tier's circuit opened
        while it waited for a thread raises `_Refused` instead of paying another deadline."""
        async with self.limiter:
            if opens is not None and self.breakers[i].opens != opens:
                raise _Refused
            with trio.move_on_after(timeout):
                return True, await trio.to_thread.run_sync(fn, *args, limiter=self._threads,
                                                           abandon_on_cancel=True)
        return False, None

    async def fetch(self, key: str, final: str | Destination, owner: tuple[int, int, int],
                    size: int | None = None) -> Fetched | None:
        """Bring a block from the first lower tier that has it to `final` (a path in a tree
        only the daemon writes, or a `Destination`); None on a miss."""
        event = self._inflight.get(key)
        if event is not None:
            await event.wait()
            return self._results.get(key)
        event = self._inflight[key] = trio.Event()
        result = None
        try:
            result = await self._fetch(key, final, owner, size)
        finally:
            self._results[key] = result
            del self._inflight[key]
            event.set()
            if len(self._results) > 1024:  # keep only what waiters may still read
                self._results.clear()
        return result

    async def _fetch(self, key: str, final: str | Destination, owner: tuple[int, int, int],
                     size: int | None) -> Fetched | None:
        if isinstance(final, str):
            name, where = os.path.basename(final), os.path.dirname(final)

            def temporary(tag: str) -> str:
                return f"{where}/.kvfs-tmp.{tag}"

            def put(tmp: str) -> None:
                os.rename(tmp, final)
        else:
            name, temporary, put = final.name, final.temporary, final.place
        for i, tier in enumerate(self.tiers):
            c, breaker = self.counters[i], self.breakers[i]
            if not self.allowed(i, key):
                continue
            opens = breaker.opens
            if not breaker.allow():
                c.skipped += 1
                continue
            tmp = temporary(f"fetch.{time.monotonic_ns()}")
            handoff = Handoff()

            def work(tier: Tier = tier, tmp: str = tmp, handoff: Handoff = handoff
                     ) -> Fetched | None:
                try:
                    fetched = fetch_block(tier, key, tmp, name, owner,
                                          decode=not self.hot_encoded, keyring=self.keyring,
                                          keep_sealed=self.hot_sealed)
                    return None if fetched is None else handoff.place(tmp, put, fetched)
                finally:
                    if os.path.exists(tmp):
                        os.unlink(tmp)

            start = time.monotonic()
            try:
                done, got = await self._call(i, work, timeout=self.deadline(size),
                                             opens=opens)
            except _Refused:
                c.skipped += 1
                continue
            except TierError as exc:
                c.errors += 1
                breaker.failure()
                log.warning("fetch %s: %s", key, exc)
                continue
            except blockfile.BlockFormatError as exc:
                c.bad_blocks += 1
                breaker.success()
                log.warning("fetch %s from %s tier: bad block, not served: %s", key, tier.name,
                            exc)
                continue
            except KeyUnavailable as exc:
                c.key_errors += 1
                breaker.success()
                log.warning("fetch %s from %s tier: not opened, a miss: %s", key, tier.name,
                            exc)
                continue
            except OSError as exc:
                c.errors += 1
                log.warning("fetch %s from %s tier: %s", key, tier.name, exc)
                continue
            if not done and (got := handoff.abandon()) is not None:
                done = True  # placed just as the deadline passed: keep it
            if not done:
                c.timeouts += 1
                breaker.failure()
                log.warning("fetch %s from %s tier: no answer within %.1f s", key, tier.name,
                            self.deadline(size))
                continue
            breaker.success()
            c.observe(time.monotonic() - start)
            if got is None:
                c.misses += 1
                continue
            c.hits += 1
            c.fetched_bytes += got.moved
            got.tier = i + 1
            return got
        return None

    async def locate(self, key: str, *, ask_presigned: bool = True, start: int = 0
                     ) -> tuple[int, int | None] | None:
        """(0-based index, size) of the first lower tier that holds `key`, asked in order
        (an S3 tier: one HEAD) within the deadlines and circuits of a fetch; None if none
        does. Without `ask_presigned`, a tier whose objects a presigned GET reads is not
        asked while its circuit is closed: it is the answer, size None (the client's GET
        will tell); while the circuit is half-open the HEAD is its probe. `start`: the
        tiers before it are not asked (the caller did). Moves no block."""
        for i, tier in enumerate(self.tiers):
            if i < start or not self.allowed(i, key):
                continue
            c, breaker = self.counters[i], self.breakers[i]
            if not ask_presigned and tier.presigns and breaker.state == "closed":
                return i, None
            opens = breaker.opens
            if not breaker.allow():
                c.skipped += 1
                continue
            try:
                done, size = await self._call(i, tier.size, key, timeout=self.deadline(0),
                                              opens=opens)
            except _Refused:
                c.skipped += 1
                continue
            except (TierError, OSError) as exc:
                c.errors += 1
                breaker.failure()
                log.warning("locate %s: %s", key, exc)
                continue
            if not done:
                c.timeouts += 1
                breaker.failure()
                continue
            breaker.success()
            if size is None:
                c.misses += 1
                continue
            return i, size
        return None

    async def open_many(self, i: int, keys: list[str]
                        ) -> list[tuple[int, int] | None] | None:
        """(descriptor, size) of `keys`' files in tier `i` (None: absent), opened in one thread call
        within one lookup's deadline and the tier's circuit (a tier of files: kvfs.daemon.handout);
        None if the tier could not answer. The caller closes them; a call abandoned at its
        deadline closes its own."""
        c, breaker, tier = self.counters[i], self.breakers[i], self.tiers[i]
        if keys and not self.allowed(i, keys[0]):  # one grant: one tenant's keys
            return None
        lock, box = threading.Lock(), {"abandoned": False}

        def opener() -> list[tuple[int, int] | None]:
            fds = []
            try:
                for k in keys:
                    fds.append(tier.open_block(k))
            except BaseException:
                _close(fds)
                raise
            with lock:
                if box["abandoned"]:
                    _close(fds)
                    return []
                box["fds"] = fds
            return fds

        def abandon() -> None:
            with lock:
                box["abandoned"] = True
                _close(box.pop("fds", []))  # type: ignore[arg-type]

        opens = breaker.opens
        if not breaker.allow():
            c.skipped += len(keys)
            return None
        try:
            done, got = await self._call(i, opener, timeout=self.deadline(0), opens=opens)
        except _Refused:
            c.skipped += len(keys)
            return None
        except (TierError, OSError) as exc:
            c.errors += 1
            breaker.failure()
            log.warning("open %d keys: %s", len(keys), exc)
            return None
        except BaseException:  # cancelled (a grant's budget spent): nothing left open
            abandon()
            raise
        if not done:
            abandon()
            c.timeouts += 1
            breaker.failure()
            return None
        breaker.success()
        c.misses += sum(1 for fd in got if fd is None)
        return got

    async def demote(self, key: str, path: Source, size: int) -> int:
        """Put a block being evicted into the first lower tier its tenant may reach: its
        1-based index, 0 if it could not be placed there (then the block is simply
        deleted; never put unsealed where its key is unavailable)."""
        reach = self.reach(key.split("/", 1)[0])
        if not reach:
            if self.tiers:
                self.counters[0].refused_placements += 1
                self.on_refused(key.split("/", 1)[0], self.tiers[0].name)
            return 0
        i = reach[0]
        c, breaker = self.counters[i], self.breakers[i]
        if not breaker.allow():
            c.demotion_failures += 1
            return 0
        try:
            done, put = await self._call(i, put_block, self.tiers[i], key, path, self.encode,
                                         self._sealer(), timeout=self.deadline(size) * 4)
        except SourceError as exc:
            c.demotion_failures += 1
            log.warning("demote %s: the hot copy is not a block: %s", key, exc)
            return 0
        except KeyUnavailable as exc:
            c.demotion_failures += 1
            c.key_errors += 1
            log.error("demote %s: not sealed, so not demoted (deleted): %s", key, exc)
            return 0
        except (TierError, OSError) as exc:
            breaker.failure()
            c.demotion_failures += 1
            log.warning("demote %s: %s", key, exc)
            return 0
        if not done:
            breaker.failure()
            c.demotion_failures += 1
            return 0
        breaker.success()
        c.demotions += 1
        self._count_put(c, key, put)
        return i + 1

    def enqueue_upload(self, key: str, path: Source) -> None:
        if not self.write_through:
            return
        for i in self.shared:
            if not self.allowed(i, key):
                self.counters[i].refused_placements += 1
                self.on_refused(key.split("/", 1)[0], self.tiers[i].name)
                continue
            try:
                self._send.send_nowait((key, path, i))
            except trio.WouldBlock:
                self.counters[i].uploads_dropped += 1

    async def _uploader(self) -> None:
        async for key, path, i in self._recv:
            c, breaker = self.counters[i], self.breakers[i]
            for attempt in range(UPLOAD_RETRIES):
                if not breaker.allow():
                    await trio.sleep(breaker.cooldown / 2 + attempt)
                    continue
                try:
                    with self._publishing(i):
                        done, put = await self._call(i, _upload, self.tiers[i], key, path,
                                                     self.encode, self._sealer(),
                                                     timeout=self.deadline(None) * 4)
                except FileNotFoundError:
                    break  # evicted or removed before it was uploaded: nothing to publish
                except KeyUnavailable as exc:
                    log.error("upload %s: not sealed, so not uploaded: %s", key, exc)
                    c.key_errors += 1
                    c.upload_failures += 1
                    break
                except SourceError as exc:
                    log.warning("upload %s: the hot copy is not a block: %s", key, exc)
                    c.upload_failures += 1
                    break
                except (TierError, OSError) as exc:
                    breaker.failure()
                    log.info("upload %s (attempt %d): %s", key, attempt + 1, exc)
                    await trio.sleep(0.5 * 2 ** attempt)
                    continue
                if done:
                    breaker.success()
                    c.uploads += 1
                    self._count_put(c, key, put)
                    break
                breaker.failure()
            else:
                c.upload_failures += 1

    @contextlib.contextmanager
    def _publishing(self, i: int) -> Iterator[None]:
        """Count the time tier ``i`` has at least one upload in flight (``upload_seconds``: the
        bytes published over it are the publish's speed, whatever the saves around it)."""
        busy = self._uploading[i]
        if busy[0] == 0:
            busy[1] = time.monotonic()
        busy[0] += 1
        try:
            yield
        finally:
            busy[0] -= 1
            if busy[0] == 0:
                self.counters[i].upload_seconds += time.monotonic() - busy[1]

    def _count_put(self, c: TierCounters, key: str, put: tuple[bool, int, int]) -> None:
        wrote, raw, stored = put
        if wrote:
            c.put_raw_bytes += raw
            c.put_stored_bytes += stored
            tenant, ns = key.split("/", 2)[:2]
            got = self.ns_bytes.setdefault((tenant, ns), [0, 0])
            got[0] += raw
            got[1] += stored

    async def delete(self, key: str, shared: bool = True) -> None:
        """Best effort: remove a block from the lower tiers (with `shared`, from the tiers
        other hosts read too)."""
        for i, tier in enumerate(self.tiers):
            if (shared or i not in self.shared) and self.breakers[i].allow():
                try:
                    await self._call(i, tier.delete, key, timeout=self.deadline(0) * 4)
                except (TierError, OSError) as exc:
                    log.info("delete %s from %s tier: %s", key, tier.name, exc)

    def snapshot(self) -> list[dict[str, Any]]:
        out = []
        for tier, c, b in zip(self.tiers, self.counters, self.breakers, strict=True):
            d = {k: v for k, v in c.__dict__.items() if k != "latency"}
            d.update(name=tier.name, url=tier.url, circuit=b.state, shared=tier.shared,
                     codec="planes" if self.encode else "none",
                     sealed=self.keyring is not None,
                     ratio=codec.ratio(c.put_raw_bytes, c.put_stored_bytes),
                     fetch_latency={("+Inf" if math.isinf(le) else str(le)): n
                                    for le, n in zip(LATENCY_BUCKETS, c.latency, strict=True)})
            out.append(d)
        return out

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()


#: A write-through upload: a block just saved here, put without asking first whether the
#: tier has it (see `Tier.put`).
_upload = functools.partial(put_block, probe=False)


def _close(files: list[tuple[int, int] | None]) -> None:
    for f in files:
        if f is not None:
            os.close(f[0])
