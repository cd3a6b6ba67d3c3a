"""The audit log (`kvfs mount --audit FILE`): one JSON line per operation on cached KV.

The cache is derived from prompts and is governed like them, so who read, wrote, removed or
commanded what is recorded: time, uid, pid, tenant, model namespace, operation, blocks, bytes
and the path. Records are buffered (from the event loop and from worker threads: the keys'
life is recorded where it happens, under a lock that the buffer's swap takes too) and
appended by a trio task through a worker thread twice a second (and at unmount); the daemon
never waits on the log's disk.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import threading
import time
from typing import Any

import trio

log = logging.getLogger(__name__)

FLUSH_INTERVAL = 0.5


class Audit:
    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        if stat.S_ISREG(os.fstat(self._fd).st_mode):
            os.fchmod(self._fd, 0o600)  # who did what to which tenant: for root's eyes only
        self._pending: list[str] = []
        # Held for an append and for the swap: a worker thread's append to the list being
        # taken would otherwise be lost with it.
        self._lock = threading.Lock()

    def record(self, *, uid: int, pid: int, tenant: str, model: str, op: str, path: str,
               blocks: int = 0, nbytes: int = 0, **extra: Any) -> None:
        rec = {"time": round(time.time(), 6), "uid": uid, "pid": pid, "tenant": tenant,
               "model": model, "op": op, "path": path, "blocks": blocks, "bytes": nbytes}
        rec.update(extra)
        line = json.dumps(rec, separators=(",", ":"))
        with self._lock:
            self._pending.append(line)

    def _take(self) -> bytes:
        with self._lock:
            lines, self._pending = self._pending, []
        return "".join(line + "\n" for line in lines).encode()

    async def run(self) -> None:
        while True:
            await trio.sleep(FLUSH_INTERVAL)
            data = self._take()
            if data:
                try:
                    await trio.to_thread.run_sync(os.write, self._fd, data)
                except OSError as exc:
                    log.error("audit log %s: %s (records dropped)", self.path, exc)

    def close(self) -> None:
        data = self._take()
        try:
            if data:
                os.write(self._fd, data)
        finally:
            os.close(self._fd)
