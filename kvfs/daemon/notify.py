"""systemd's readiness protocol (sd_notify), without a dependency: one datagram to the socket
that $NOTIFY_SOCKET names, when there is one."""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)


def notify(state: str) -> bool:
    """Send e.g. "READY=1" to systemd; False where the daemon does not run under it."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]  # abstract namespace
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(addr)
            s.sendall(state.encode())
    except OSError as exc:
        log.warning("cannot notify systemd at %s: %s", addr, exc)
        return False
    return True
