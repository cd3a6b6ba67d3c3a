"""The handout socket: a directory tier's block files handed, as open descriptors, to the
client the daemon granted them, so that a restore from the cold tier moves each block's
bytes once, by the client, straight into its destination.

A grant that says it takes descriptors (control.GRANT_TAKES_FDS) gets ``GRANT_FD`` for a
block found in a directory tier instead of having it promoted first (kvfs.grants). The
client then connects to the Unix socket :data:`kvfs.layout.HANDOUT_SOCKET` in the backing
root (0666: any local process may connect; what it is given is decided below) and sends
``KVD1`` and the grant's nonce. The daemon answers only the uid that sent that grant
(``SO_PEERCRED``), once, within the grant's answer TTL: it opens the granted files
read-only (``O_NOFOLLOW``, regular files only) and sends ``KVD1``, their count, and the
descriptors (``SCM_RIGHTS``), in the order granted; a file gone since ends the run. A
tenant is only ever handed files of blocks it was granted in its own namespace (the kernel
checked its write permission on that directory for the grant), and a descriptor reaches
that one file, read-only. The client verifies each block as it reads it, as a hot read,
and writes its hot copy behind.

Runs in the mount's nursery; nothing a connection does escapes its handler (a bad peer is
logged and dropped). State: none of its own (the grants keep what they handed out).
"""

from __future__ import annotations

import array
import errno
import logging
import os
import socket
import stat
import struct
from collections.abc import Callable

import trio

from .layout import HANDOUT_SOCKET

log = logging.getLogger(__name__)

HANDOUT_MAGIC = b"KVD1"
_ASK = struct.Struct("<4s16s")
_ANSWER = struct.Struct("<4sB")
#: Seconds a connection may take to send its question.
ASK_TIMEOUT = 2.0
#: Connections served at once (each is short: one question, one answer).
MAX_CONCURRENT = 32
_PEERCRED = struct.Struct("3i")


def socket_path(root: str | bytes) -> str:
    """The handout socket's path in backing root `root`."""
    return os.path.join(os.fsdecode(root), os.fsdecode(HANDOUT_SOCKET))


def pack_ask(nonce: bytes) -> bytes:
    return _ASK.pack(HANDOUT_MAGIC, nonce)


def unpack_answer(data: bytes) -> int:
    """The number of descriptors an answer carries."""
    if len(data) < _ANSWER.size or data[:4] != HANDOUT_MAGIC:
        raise ValueError("a handout answer starts with KVD1")
    return _ANSWER.unpack_from(data)[1]


class Handout:
    """The daemon's side: `take(nonce, uid)` gives the (open_block, key) pairs a grant
    handed out, once (kvfs.grants.Grants.take_fds)."""

    def __init__(self, root: bytes,
                 take: Callable[[bytes, int], list[tuple[Callable[[str], int | None], str]]
                                | None],
                 io: Callable) -> None:
        self.path = socket_path(root)
        self.take = take
        self.io = io
        self.on = False
        self.served = 0
        self._slots = trio.CapacityLimiter(MAX_CONCURRENT)

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
            sock.close()
            try:
                os.unlink(self.path)
            except OSError:
                pass

    async def _serve(self, conn: trio.socket.SocketType) -> None:
        with conn:
            try:
                async with self._slots:
                    await self._answer(conn)
            except (OSError, ValueError, trio.TooSlowError) as exc:
                log.info("handout: a connection dropped: %s", exc)
            except Exception:  # noqa: BLE001 - never the daemon's end
                log.exception("handout: a connection failed")

    async def _answer(self, conn: trio.socket.SocketType) -> None:
        _pid, uid, _gid = _PEERCRED.unpack(
            conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
        data = b""
        with trio.fail_after(ASK_TIMEOUT):
            while len(data) < _ASK.size:
                got = await conn.recv(_ASK.size - len(data))
                if not got:
                    raise ValueError("closed before its question")
                data += got
        magic, nonce = _ASK.unpack(data)
        if magic != HANDOUT_MAGIC:
            raise ValueError("a handout question starts with KVD1")
        granted = self.take(nonce, uid) or []
        fds = await self.io(_open_all, granted) if granted else []
        try:
            head = _ANSWER.pack(HANDOUT_MAGIC, len(fds))
            if fds:
                await conn.sendmsg([head], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                              array.array("i", fds))])
            else:
                await conn.send(head)
            self.served += len(fds)
        finally:
            for fd in fds:
                os.close(fd)


def _open_all(granted: list[tuple[Callable[[str], int | None], str]]) -> list[int]:
    """The granted files opened, in order, up to the first that cannot be (gone, or not a
    regular file)."""
    fds: list[int] = []
    for open_block, key in granted:
        try:
            fd = open_block(key)
        except OSError as exc:
            log.warning("handout: not opening %s: %s", key, exc)
            fd = None
        if fd is None:
            break
        fds.append(fd)
    return fds


# -- the client's side ----------------------------------------------------------------------

def collect(path: str, nonce: bytes, trusted_uids: set[int], timeout: float = 2.0
            ) -> list[int] | None:
    """The descriptors the daemon hands out for grant `nonce`, in order granted (perhaps
    fewer; [] where it hands out none, or its answer is malformed). None where the socket
    is not there or its peer is not the daemon (not a uid in `trusted_uids`). The caller
    owns them."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        s.settimeout(timeout)
        try:
            s.connect(path)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ECONNREFUSED, errno.EACCES):
                return None
            raise
        _pid, uid, _gid = _PEERCRED.unpack(
            s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
        if uid not in trusted_uids:
            log.warning("%s: its peer is uid %d, not the daemon: not used", path, uid)
            return None
        s.sendall(pack_ask(nonce))
        data, fds, _flags, _addr = socket.recv_fds(s, _ANSWER.size, 253,
                                                    socket.MSG_CMSG_CLOEXEC)
        try:
            n = unpack_answer(data)
        except ValueError:
            n = -1
        if n != len(fds):
            for fd in fds:
                os.close(fd)
            return []
        for fd in fds:  # nothing but regular files is read
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                for f in fds:
                    os.close(f)
                return []
        return fds
    finally:
        s.close()
