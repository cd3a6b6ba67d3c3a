"""The keys that open a namespace's sealed blocks (kvfs.format.seal), as the daemon gives them.

Blocks below the hot tier are sealed under their tenant's key. A load that reads one itself
(a handed-out cold file, a granted GET of a shared object) opens it with its namespace's key:
the daemon answers getxattr ``user.kvfs.keys`` on the namespace directory (the kernel checks
that the caller may read it) with the namespace keys of the tenant's live keys and how long
they may be kept. They are kept in this process's memory for that long at most (the mount's
``key_ttl``), asked again for a key id not among them, and never written anywhere; a
namespace key opens that namespace's blocks only, never another namespace's or tenant's.
"""

from __future__ import annotations

import os
import threading
import time

from ..format import control
from ..format.blockfile import BlockFormatError


class NamespaceKeys:
    """One namespace's keys, by id."""

    def __init__(self, ns_dir: str) -> None:
        self.ns_dir = ns_dir
        self.namespace = os.path.basename(ns_dir.rstrip("/"))
        self.tenant = os.path.basename(os.path.dirname(ns_dir.rstrip("/")))
        self._lock = threading.Lock()
        self._keys: dict[int, bytes] = {}
        self._order: list[int] = []
        self._until = 0.0

    def _ask(self, key_id: int | None) -> None:
        try:
            data = os.getxattr(self.ns_dir, control.keys_name(key_id))
            ttl_ms, keys = control.decode_keys(data)
        except (OSError, ValueError) as exc:
            raise BlockFormatError("sealed", f"no keys for {self.ns_dir}: {exc}") from None
        self._keys = dict(keys)
        self._order = [k for k, _ in keys]  # newest first
        self._until = time.monotonic() + ttl_ms / 1000

    def get(self, key_id: int) -> bytes:
        """Namespace key ``key_id``. Raises BlockFormatError ("sealed") where the daemon
        gives none (retired, the tenant forgotten, no keys on the mount)."""
        with self._lock:
            if time.monotonic() >= self._until:
                self._keys, self._order = {}, []
            key = self._keys.get(key_id)
            if key is None:
                self._ask(key_id)
                key = self._keys.get(key_id)
            if key is None:
                raise BlockFormatError("sealed", f"key {key_id:08x} of {self.ns_dir} is not "
                                       "given (retired, or the tenant forgotten)")
            return key

    def newest(self) -> tuple[int, bytes]:
        """(key id, namespace key) new blocks are sealed with (--hot-encrypt). Raises
        BlockFormatError ("sealed") where the daemon gives none."""
        with self._lock:
            if time.monotonic() >= self._until or not self._order:
                self._ask(None)
            if not self._order:
                raise BlockFormatError("sealed", f"no keys for {self.ns_dir}")
            kid = self._order[0]
            return kid, self._keys[kid]

    def forget(self) -> None:
        with self._lock:
            self._keys = {}
            self._until = 0.0
