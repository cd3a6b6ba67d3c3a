"""Whether the kvfs mount is still there, asked so that the engine never hangs on it.

A daemon that died leaves its mount failing every call (ENOTCONN), or, in a corner of the
kernel, hanging every call until the connection is aborted; a lazily unmounted one leaves the
bare mount-point directory. The direct path would go on reading and writing the backing
directory regardless, with no daemon to index, evict or verify: the connector asks this
watch first, and while the mount is gone every lookup is a miss and nothing is loaded or
saved (vLLM recomputes), with one error logged when it goes and one line when it is back.
"""

from __future__ import annotations

import logging
import os
import threading
import time

log = logging.getLogger(__name__)

#: Seconds a probe (a stat of the namespace directory through the mount) may take before
#: the mount counts as gone (a hung daemon).
PROBE_TIMEOUT_S = 1.0
#: Seconds an answer is reused before the next probe.
PROBE_EVERY_S = 0.05


class MountWatch:
    """``alive()``: the namespace directory answers through the mount, on the same device as
    when the connector started, within :data:`PROBE_TIMEOUT_S`; never blocks longer."""

    def __init__(self, mount: str, ns_dir: str) -> None:
        self.mount, self.ns_dir = mount, ns_dir
        self._dev = os.stat(ns_dir).st_dev
        self._lock = threading.Lock()
        self._probe: _Probe | None = None
        self._alive = True
        self._checked = time.monotonic()
        self.gone = 0  # times the mount was found gone

    def alive(self) -> bool:
        with self._lock:
            now = time.monotonic()
            if now - self._checked < PROBE_EVERY_S:
                return self._alive
            why = self._ask()
            self._checked = time.monotonic()
            if why is None and not self._alive:
                log.warning("kvfs mount %s is back: lookups and saves resume", self.mount)
            elif why is not None and self._alive:
                self.gone += 1
                log.error("kvfs mount %s is gone (%s): every lookup is a miss and nothing is "
                          "loaded or saved until it is back (vLLM recomputes)", self.mount, why)
            self._alive = why is None
            return self._alive

    def _ask(self) -> str | None:
        """None if the mount answered as itself, else why not."""
        probe = self._probe
        if probe is None or probe.done.is_set():
            probe = self._probe = _Probe(self.ns_dir)
            probe.done.wait(PROBE_TIMEOUT_S)
        # else: the last probe is still stuck in the kernel: no other piles up behind it,
        # and nobody waits for it again
        if not probe.done.is_set():
            return f"{self.ns_dir} did not answer within {PROBE_TIMEOUT_S} s"
        if probe.error is not None:
            return f"{self.ns_dir}: {probe.error.strerror or probe.error}"
        assert probe.result is not None
        if probe.result.st_dev != self._dev:
            return f"{self.mount} no longer holds the kvfs mount"
        return None


class _Probe:
    """One stat in a daemon thread of its own (one stuck in a hung mount must not keep the
    process from exiting, as a pool's thread would)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.done = threading.Event()
        self.result: os.stat_result | None = None
        self.error: OSError | None = None
        threading.Thread(target=self._run, daemon=True, name="kvfs-mountwatch").start()

    def _run(self) -> None:
        try:
            self.result = os.stat(self.path)
        except OSError as exc:
            self.error = exc
        finally:
            self.done.set()
