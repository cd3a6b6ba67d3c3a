"""The client's control channel: every call it makes to the daemon, in a constant number per
request.

Bulk bytes never go through the daemon; what it hears are control calls, ``setxattr`` on the
namespace directory (``user.kvfs.publish``, ``access``, ``corrupt``, ``fetch``, ``prefetch``;
payloads packed by :mod:`kvfs.format.control`), each carrying up to
:data:`kvfs.format.control.MAX_HASHES` block hashes. Access records leave the request's path: the
daemon's round trip (on a busy host, the wait for it to be scheduled) is paid by a control thread,
while the engine goes on. A lookup's record is held back to travel with the load that follows it
(one call per lookup + load). Any other control call, :meth:`ControlChannel.drain` and
:meth:`ControlChannel.close` wait for the records queued before them, so the daemon sees one
client's calls in the order it made them.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence

from ..format import control

log = logging.getLogger(__name__)

#: Access records queued for the control thread beyond which a request waits for it.
MAX_QUEUED_RECORDS = 8
#: Seconds the control thread waits for a record before it ends (the next record starts
#: another): a client that is never closed does not keep a thread, nor itself, alive.
CONTROL_IDLE_S = 1.0
#: Seconds reading the counters, or closing, waits for the queued access records to reach the
#: daemon. A daemon stopped without dying (SIGSTOP, a debugger) takes no call; the direct path
#: reads on without it, and neither the counters nor a close may hang on it.
DRAIN_WAIT_S = 5.0


class ControlChannel:
    """The control calls of one client on one namespace directory, ``ns_dir``.

    ``count(control_calls=1)`` is called once per call made. Thread-safe. State: the outbox
    (records queued for the control thread, with ``_sending`` while one is on its way) and
    the thread itself are guarded by ``_outbox_cv``; the held-back lookup record by ``_lock``.
    """

    def __init__(self, ns_dir: str, count: Callable[..., None]) -> None:
        self.ns_dir = ns_dir
        self._count = count
        self._lock = threading.Lock()
        # A lookup's access record, held back to travel with the load that follows it.
        self._pending: tuple[dict[str, int], list[bytes]] | None = None
        # Access records on their way to the daemon, sent in order by the control thread.
        self._outbox: list[tuple[bytes, bytes]] = []
        self._outbox_cv = threading.Condition()
        self._sending = False
        self._stopping = False
        self._sender: threading.Thread | None = None

    def call(self, name: bytes, value: bytes) -> None:
        """One control call: every call to the daemon goes through here."""
        self._count(control_calls=1)
        os.setxattr(self.ns_dir, name, value)

    def command(self, name: bytes, value: bytes) -> None:
        """A control call made now, after the access records queued before it (so the
        daemon sees this client's calls in the order it made them)."""
        self.drain()
        self.call(name, value)

    def report(self, name: bytes, value: bytes) -> None:
        """A control call whose failure must not fail the request (accounting, reports)."""
        try:
            self.command(name, value)
        except OSError as exc:
            log.warning("%s on %s failed: %s", name.decode(), self.ns_dir, exc)

    def _post(self, values: list[bytes]) -> None:
        """Queue access records for the control thread (waiting while it is far behind, at
        most :data:`DRAIN_WAIT_S`: then the records are dropped, with a warning)."""
        with self._outbox_cv:
            room = self._outbox_cv.wait_for(
                lambda: len(self._outbox) < MAX_QUEUED_RECORDS or self._stopping, DRAIN_WAIT_S)
            stopped = self._stopping
            if not room:  # the daemon takes no call: the request goes on without its record
                log.warning("%s: the daemon took no control call for %s s: an access record "
                            "dropped", self.ns_dir, DRAIN_WAIT_S)
            elif not stopped:
                self._outbox += [(control.ACCESS, v) for v in values]
            if self._sender is None:
                self._sender = threading.Thread(target=self._send_queued, daemon=True,
                                                name="kvfs-control")
                self._sender.start()
            self._outbox_cv.notify_all()
        for v in values if stopped else ():  # closed: no control thread any more
            self.report(control.ACCESS, v)

    def _send_queued(self) -> None:
        while True:
            with self._outbox_cv:
                while not self._outbox and not self._stopping:
                    if not self._outbox_cv.wait(CONTROL_IDLE_S) and not self._outbox:
                        break  # idle
                if not self._outbox:
                    self._sender = None
                    return
                name, value = self._outbox.pop(0)
                self._sending = True
            try:
                self.call(name, value)
            except OSError as exc:
                log.warning("%s on %s failed: %s", name.decode(), self.ns_dir, exc)
            except Exception:  # noqa: BLE001 - a lost record is a counting error, never fatal
                log.exception("%s on %s failed", name.decode(), self.ns_dir)
            finally:
                with self._outbox_cv:
                    self._sending = False
                    self._outbox_cv.notify_all()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every access record queued so far has been sent (at most ``timeout``
        seconds: then False)."""
        with self._outbox_cv:
            return self._outbox_cv.wait_for(lambda: not (self._outbox or self._sending),
                                            timeout)

    def access(self, hashes: Sequence[bytes], *, defer: bool = False, now: bool = False,
               **counts: int) -> None:
        """Queue an access record (more only past control.MAX_HASHES hit blocks), with the
        one held back before it, if any, merged in; ``now``: send it before returning.

        ``defer`` holds this one back instead (a lookup that found blocks: the load that
        follows sends both in one call); a record already held back then goes alone, so a
        lookup's record waits for at most the next request (or :meth:`close`).
        """
        with self._lock:
            held, self._pending = self._pending, None
            if defer:
                self._pending = (counts, list(hashes))
        if defer:
            if held is None:
                return
            counts, hashes = held
        elif held is not None:
            merged = dict(held[0])
            for k, v in counts.items():
                merged[k] = merged.get(k, 0) + v
            counts = merged
            # A hit reported by the lookup and read by the load is one access, as in the
            # simulator's model of a request.
            hashes = list(dict.fromkeys([*held[1], *hashes]))
        elif not hashes and not any(counts.values()):
            return  # nothing to say
        counts.setdefault("lookups", 0)
        m = control.MAX_HASHES
        values = [control.Access(hashes=tuple(hashes[:m]), **counts).pack()]
        values += [control.Access(lookups=0, hashes=tuple(hashes[i:i + m])).pack()
                   for i in range(m, len(hashes), m)]
        if now:
            for v in values:
                self.report(control.ACCESS, v)
        else:
            self._post(values)

    def close(self) -> None:
        """Send the held-back record and every queued one, then end the control thread; past
        :data:`DRAIN_WAIT_S` (a daemon that takes no call) the records left are given up,
        with an error logged, and the thread ends once its call returns."""
        self.access(())
        timeout = DRAIN_WAIT_S
        sent = self.drain(timeout)
        with self._outbox_cv:
            self._stopping = True
            lost = len(self._outbox) + self._sending
            self._outbox = []
            self._outbox_cv.notify_all()
            sender = self._sender
        if not sent:
            log.error("%s: the daemon took no control call for %s s: %d access records not "
                      "sent (counters and eviction order lag; no block is affected)",
                      self.ns_dir, timeout, lost)
        elif sender is not None:
            sender.join()
