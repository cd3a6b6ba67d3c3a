"""The client's side of the handout socket (kvfs.daemon.handout): the open files of a directory
tier's blocks the daemon granted this process, as descriptors."""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat

from ..format import control

log = logging.getLogger(__name__)

#: At most this many descriptors come in one answer (a grant's blocks: control.MAX_GRANT).
MAX_FDS = control.MAX_GRANT


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
        _pid, uid, _gid = control.PEERCRED.unpack(
            s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, control.PEERCRED.size))
        if uid not in trusted_uids:
            log.warning("%s: its peer is uid %d, not the daemon: not used", path, uid)
            return None
        s.sendall(control.pack_ask(nonce))
        data, fds, _flags, _addr = socket.recv_fds(s, control.HANDOUT_ANSWER.size, MAX_FDS,
                                                   socket.MSG_CMSG_CLOEXEC)
        try:
            n = control.unpack_answer(data)
        except control.ControlError:
            n = -1
        if n != len(fds) or not all(stat.S_ISREG(os.fstat(fd).st_mode) for fd in fds):
            for fd in fds:  # nothing but the regular files announced is read
                os.close(fd)
            return []
        return fds
    finally:
        s.close()
