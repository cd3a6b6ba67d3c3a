"""Grants: where a client may read, itself, the blocks its hot tier lacks (control.GRANT).

A restore from the shared S3 tier moves each block's bytes once: the client GETs the object
straight into its destination and verifies it as it lands, and writes the hot copy behind
(kvfs.client.remote). The daemon stays the authority: it answers only for the namespace
directory the command was sent to (the kernel checked the caller's write permission on it),
looks for each block in the tiers in order (a directory tier: a stat; the S3 tier is not
asked while its circuit is closed, the client's GET tells, and while half-open a HEAD is the
probe) and signs, with its own credentials, a GET of that one object valid for
:data:`GRANT_SECONDS`, with the deadline its own fetch would have. The client never holds
a credential, nor a URL that reaches another object or outlives its request by more than
seconds. A block in a directory tier is handed to a client that takes descriptors
(control.GRANT_TAKES_FDS, while the handout socket listens) as its open file
(kvfs.daemon.handout: ``GRANT_FD``, read once by the client, which writes the hot copy behind);
for any other it is promoted as by ``fetch``, and the answer says it is hot.

State (event loop only): the answers not yet read (`_replies`), each for one uid and one
directory, kept :data:`kvfs.format.control.GRANT_REPLY_TTL` seconds (getxattr may ask twice: once
for the size), and beside each the files it granted as descriptors, until handed out once.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

import pyfuse3
import trio
from pyfuse3 import FUSEError

from ..format import control, hashing
from .adoption import Adoption
from .index import Node
from .promotion import Promotion
from .tree import Tree, join

log = logging.getLogger(__name__)

#: Seconds a granted URL stays valid: a lookup, then the load that follows it.
GRANT_SECONDS = 15
#: Answers kept unread at most (older ones go first).
MAX_REPLIES = 256
#: Open files held for grants not yet collected; past it a directory tier's blocks are
#: promoted instead of handed out.
MAX_HELD = 4096


class Grants:
    def __init__(self, tree: Tree, adoption: Adoption, promotion: Promotion) -> None:
        self.tree = tree
        self.index = tree.index
        self.adoption = adoption
        self.promotion = promotion
        # nonce -> (expires at, uid, directory inode, answer)
        self._replies: OrderedDict[bytes, tuple[float, int, int, bytes]] = OrderedDict()
        # nonce -> the open files of its answer's GRANT_FD blocks, in order, until handed out
        self._fds: dict[bytes, list[int]] = {}
        self.held = 0  # descriptors in _fds
        #: Whether the handout socket listens (kvfs.daemon.handout sets it).
        self.handout_on: Callable[[], bool] = lambda: False

    async def grant(self, dnode: Node, value: bytes, uid: int) -> None:
        """Answer a grant command (see kvfs.format.control): the longest prefix of its blocks that
        some tier holds, each hot or with a URL, stored for :meth:`reply`."""
        nonce, hashes, budget, flags = control.unpack_grant(value)
        found: list[control.Granted | None] = [None] * len(hashes)
        files: dict[int, int] = {}  # block index -> its open file (GRANT_FD)
        fds = bool(flags & control.GRANT_TAKES_FDS) and self.handout_on()
        await self.adoption.listed_fans(dnode, hashes)
        dpath = self.tree.path(dnode)
        fds = fds and self.held + len(hashes) <= MAX_HELD
        try:
            with trio.move_on_after(budget if budget is not None else float("inf")) as scope:
                start = (await self._files_first(dnode, dpath, hashes, found, files)
                         if fds else 0)
                nodes = self._nodes(dnode, [h for i, h in enumerate(hashes) if found[i] is None])
                async with trio.open_nursery() as nursery:
                    for i, h in enumerate(hashes):
                        if found[i] is None:
                            nursery.start_soon(self._one, dnode, dpath, h, nodes.get(h), found,
                                               i, files if fds else None, start)
        except BaseException:
            _close(files.values())
            raise
        n = next((i for i, g in enumerate(found) if g is None), len(found))
        if scope.cancelled_caught and self.tree.nursery is not None:
            # The budget is spent: what was not found in time is fetched in the background
            # (placed hot whole, or not at all) and serves the next request.
            self.tree.nursery.start_soon(self.promotion.fetch_many, dnode,
                                         [h for h, g in zip(hashes, found, strict=True)
                                          if g is None])
        now = time.monotonic()
        while self._replies and (len(self._replies) >= MAX_REPLIES
                                 or next(iter(self._replies.values()))[0] < now):
            self._drop_fds(self._replies.popitem(last=False)[0])
        answer, n = _fitting(found[:n])  # type: ignore[arg-type]
        self._drop_fds(nonce)  # a nonce used twice: the first answer's files go
        self._replies[nonce] = (now + control.GRANT_REPLY_TTL, uid, dnode.inode, answer)
        kept = [files.pop(i) for i in range(n) if i in files]
        _close(files.values())  # past the answered prefix
        if kept:
            self._fds[nonce] = kept
            self.held += len(kept)

    def _drop_fds(self, nonce: bytes) -> None:
        fds = self._fds.pop(nonce, None)
        if fds:
            self.held -= len(fds)
            _close(fds)

    def take_fds(self, nonce: bytes, uid: int) -> list[int]:
        """The open files grant `nonce` granted as descriptors (now the caller's to close),
        for the uid that asked, once, while its answer is kept (kvfs.daemon.handout)."""
        got = self._replies.get(nonce)
        if got is None or got[0] < time.monotonic() or got[1] != uid:
            return []
        fds = self._fds.pop(nonce, [])
        self.held -= len(fds)
        return fds

    def close(self) -> None:
        """The mount ends: the files not handed out are closed."""
        for nonce in list(self._fds):
            self._drop_fds(nonce)

    def _nodes(self, dnode: Node, hashes: list[bytes]) -> dict[bytes, Node]:
        """The index's nodes of these blocks of namespace directory `dnode` (one query)."""
        pairs = {h: (h[:1].hex().encode(), hashing.block_filename(h).encode()) for h in hashes}
        found = self.index.lookup_blocks(dnode.inode, pairs.values())
        return {h: found[p] for h, p in pairs.items() if p in found}

    async def _files_first(self, dnode: Node, dpath: bytes, hashes: list[bytes],
                           found: list[control.Granted | None], files: dict[int, int]) -> int:
        """Where the first lower tier is one of files: the blocks the hot tier lacks are
        opened there in one thread call and granted as descriptors (kvfs.daemon.handout). The
        number of tiers asked (0 or 1)."""
        tiering = self.tree.tiering
        if tiering is None or not tiering.tiers[0].hands_files or not tiering.reachable():
            return 0
        todo = []
        nodes = self._nodes(dnode, hashes)
        for i, h in enumerate(hashes):
            node = nodes.get(h)
            if node is not None and not node.tier:
                found[i] = control.Granted(control.GRANT_HOT)
            else:
                todo.append(i)
        if not todo:
            return 1
        keys = [self.tree.tier_key(join(dpath, hashing.block_relpath(hashes[i]).encode()))
                for i in todo]
        opened = await tiering.open_many(0, keys)
        if opened is None:
            return 0
        for i, f in zip(todo, opened, strict=True):
            if f is not None:
                self._grant_fd(found, files, i, 0, *f)
        return 1

    def _grant_fd(self, found: list[control.Granted | None], files: dict[int, int], i: int,
                  t: int, fd: int, size: int) -> None:
        assert self.tree.tiering is not None
        self.tree.tiering.counters[t].grants += 1
        files[i] = fd
        found[i] = control.Granted(control.GRANT_FD, t + 1, size)

    async def _one(self, dnode: Node, dpath: bytes, h: bytes, node: Node | None,
                   found: list[control.Granted | None], i: int,
                   files: dict[int, int] | None, start: int = 0) -> None:
        """Where block `h` (its index node: `node`, None if unknown) is to be read from."""
        tiering = self.tree.tiering
        name = hashing.block_filename(h).encode()
        fan_name = h[:1].hex().encode()
        if node is not None and not node.tier:
            found[i] = control.Granted(control.GRANT_HOT)
            return
        if tiering is None or not tiering.reachable():
            return
        key = self.tree.tier_key(join(dpath, hashing.block_relpath(h).encode()))
        where = await tiering.locate(key, ask_presigned=False, start=start)
        if where is None:
            return
        t, size = where
        url = tiering.tiers[t].presign_get(key, GRANT_SECONDS)
        if url is not None:
            tiering.counters[t].grants += 1
            deadline = tiering.deadline(node.size if node is not None else size)
            found[i] = control.Granted(control.GRANT_URL, t + 1, size or 0, url,
                                       round(deadline * 1000))
            return
        if files is not None and tiering.tiers[t].hands_files:
            # A directory tier's file, handed to the client as a descriptor (kvfs.daemon.handout).
            got = await tiering.open_many(t, [key])
            if got and got[0] is not None:
                self._grant_fd(found, files, i, t, *got[0])
            return
        # A tier the client cannot read itself: promoted here, then read hot. Run in the
        # mount's nursery, so that a spent budget leaves it to finish (placed whole or not).
        done, box = trio.Event(), []

        async def promote() -> None:
            try:
                fan_node = await self.promotion.fan_dir(self.index.get(dnode.inode), fan_name)
                box.append(await self.promotion.fetch_block(fan_node, name, node))
            except OSError as exc:
                log.warning("not fetching %s: %s", h.hex(), exc)
            finally:
                done.set()

        nursery = self.tree.nursery
        if nursery is None:
            await promote()
        else:
            nursery.start_soon(promote)
            await done.wait()
        if box and box[0] is not None:
            found[i] = control.Granted(control.GRANT_HOT)

    def reply(self, dnode: Node, name: bytes, uid: int) -> bytes:
        """The answer to the grant whose nonce (hex) ends `name`, for the uid that asked, on
        the directory it was asked on."""
        try:
            nonce = bytes.fromhex(name[len(control.GRANT_REPLY):].decode())
        except ValueError:
            raise FUSEError(errno.EINVAL) from None
        got = self._replies.get(nonce)
        if got is None or got[0] < time.monotonic() or got[1] != uid or got[2] != dnode.inode:
            raise FUSEError(pyfuse3.ENOATTR)
        return got[3]


def _fitting(entries: list[control.Granted]) -> tuple[bytes, int]:
    """The answer of the longest prefix of `entries` that fits one xattr, and its length
    (URLs carrying a session token are longer: the client takes a shorter answer as the
    prefix's end)."""
    while True:
        try:
            return control.pack_grant_reply(entries), len(entries)
        except control.ControlError:
            entries = entries[:len(entries) * 3 // 4]


def _close(fds: Iterable[int]) -> None:
    for fd in fds:
        os.close(fd)
