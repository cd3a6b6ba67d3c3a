"""The daemon's closer: backing fds closed in a thread of its own, off the event loop."""

from __future__ import annotations

import logging
import os
import queue
import threading

log = logging.getLogger(__name__)


class Closer:
    """Closes the fds of the daemon's handles in a thread of its own, in order, while the
    event loop goes on: a `release` hands its fd over and answers at once. A close can
    wait for the disk (the last close of an unlinked file frees its blocks; ext4 starts
    write-back at the close of a file truncated and rewritten), so it never runs on the
    event loop; and it needs no answer, so it costs a queue entry, not a worker thread's
    round trip through the scheduler (~70-130 us of CPU each on the 2-core VM, against
    ~10 us). One thread for the process, started at first use."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[int | threading.Event] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start = threading.Lock()

    def close(self, fd: int) -> None:
        """Close `fd` soon, in the closer's thread (errors are logged)."""
        if self._thread is None:
            with self._start:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="kvfs-closer",
                                                    daemon=True)
                    self._thread.start()
        self._queue.put(fd)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every fd handed over so far is closed (False: timed out)."""
        if self._thread is None:
            return True
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if isinstance(item, threading.Event):
                item.set()
                continue
            try:
                os.close(item)
            except OSError as exc:
                log.warning("closing a backing file's fd %d failed: %s", item, exc)


#: The process's one closer (every BackingStore's handles).
closer = Closer()
