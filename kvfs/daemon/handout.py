"""The handout socket: a directory tier's block files handed, as open descriptors, to the
client the daemon granted them, so that a restore from the cold tier moves each block's
bytes once, by the client, straight into its destination.

A grant that says it takes descriptors (control.GRANT_TAKES_FDS) gets ``GRANT_FD`` for a
block found in a directory tier instead of having it promoted first (kvfs.daemon.grants). The
client then connects to the Unix socket :data:`kvfs.format.layout.HANDOUT_SOCKET` in the backing
root (0666: any local process may connect; what it is given is decided below) and sends
``KVD1`` and the grant's nonce. The daemon answers only the uid that sent that grant
(``SO_PEERCRED``), once, within the grant's answer TTL: it sends ``KVD1``, a count, and
the files the grant opened (read-only, ``O_NOFOLLOW``, regular files only: in the grant's
one thread call, which is how it learnt they are there) as descriptors (``SCM_RIGHTS``),
in the order granted. Files never collected are closed when their answer expires. A
tenant is only ever handed files of blocks it was granted in its own namespace (the kernel
checked its write permission on that directory for the grant), and a descriptor reaches
that one file, read-only. The client verifies each block as it reads it, as a hot read,
and writes its hot copy behind.

Runs in the mount's nursery; nothing a connection does escapes its handler (a bad peer is
logged and dropped). State: none of its own (the grants keep what they handed out).
"""

from __future__ import annotations

import array
import logging
import os
import socket
from collections.abc import Callable

import trio

from ..format.control import HANDOUT_ANSWER, HANDOUT_ASK, HANDOUT_MAGIC, PEERCRED, socket_path

log = logging.getLogger(__name__)

#: Seconds a connection may take to send its question, and to take its answer.
ASK_TIMEOUT = 2.0


class Handout:
    """The daemon's side: `take(nonce, uid)` gives the open files a grant granted, once
    (kvfs.daemon.grants.Grants.take_fds: then this closes them); `release()` closes those never
    collected when the socket closes."""

    def __init__(self, root: bytes, take: Callable[[bytes, int], list[int]],
                 release: Callable[[], None]) -> None:
        self.path = socket_path(root)
        self.take = take
        self.release = release
        self.on = False

    async def run(self) -> None:
        """Listen until cancelled (the mount's end); without a socket, grants promote."""
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            try:
                os.unlink(self.path)  # a crashed daemon's (this one holds the mount's lock)
            except FileNotFoundError:
                pass
            try:
                await sock.bind(self.path)
                os.chmod(self.path, 0o666)
                sock.listen(64)
            except OSError as exc:
                log.warning("no handout socket at %s (%s): a directory tier's blocks are "
                            "promoted before the client reads them", self.path, exc)
                return
            self.on = True
            async with trio.open_nursery() as nursery:
                while True:
                    conn, _ = await sock.accept()
                    nursery.start_soon(self._serve, conn)
        finally:
            self.on = False
            self.release()
            sock.close()
            try:
                os.unlink(self.path)
            except OSError:
                pass

    async def _serve(self, conn: trio.socket.SocketType) -> None:
        with conn:
            try:
                await self._answer(conn)
            except (OSError, ValueError, trio.TooSlowError) as exc:
                log.info("handout: a connection dropped: %s", exc)
            except Exception:  # noqa: BLE001 - never the daemon's end
                log.exception("handout: a connection failed")

    async def _answer(self, conn: trio.socket.SocketType) -> None:
        _pid, uid, _gid = PEERCRED.unpack(
            conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEERCRED.size))
        data = b""
        with trio.fail_after(ASK_TIMEOUT):
            while len(data) < HANDOUT_ASK.size:
                got = await conn.recv(HANDOUT_ASK.size - len(data))
                if not got:
                    raise ValueError("closed before its question")
                data += got
        magic, nonce = HANDOUT_ASK.unpack(data)
        if magic != HANDOUT_MAGIC:
            raise ValueError("a handout question starts with KVD1")
        fds = self.take(nonce, uid)
        try:
            head = HANDOUT_ANSWER.pack(HANDOUT_MAGIC, len(fds))
            with trio.fail_after(ASK_TIMEOUT):
                if fds:
                    await conn.sendmsg([head], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                                  array.array("i", fds))])
                else:
                    await conn.send(head)
        finally:
            for fd in fds:
                os.close(fd)
