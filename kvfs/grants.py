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
(kvfs.handout: ``GRANT_FD``, read once by the client, which writes the hot copy behind);
for any other it is promoted as by ``fetch``, and the answer says it is hot.

State (event loop only): the answers not yet read (`_replies`), each for one uid and one
directory, kept :data:`kvfs.control.GRANT_REPLY_TTL` seconds (getxattr may ask twice: once
for the size), and beside each the files it granted as descriptors, until handed out once.
"""

from __future__ import annotations

import errno
import logging
import time
from collections import OrderedDict
from collections.abc import Callable

import pyfuse3
import trio
from pyfuse3 import FUSEError

from . import control, hashing
from .adoption import Adoption
from .index import Node
from .promotion import Promotion
from .tree import Tree, join

log = logging.getLogger(__name__)

#: Seconds a granted URL stays valid: a lookup, then the load that follows it.
GRANT_SECONDS = 15
#: Answers kept unread at most (older ones go first).
MAX_REPLIES = 256


class Grants:
    def __init__(self, tree: Tree, adoption: Adoption, promotion: Promotion) -> None:
        self.tree = tree
        self.index = tree.index
        self.adoption = adoption
        self.promotion = promotion
        # nonce -> (expires at, uid, directory inode, answer)
        self._replies: OrderedDict[bytes, tuple[float, int, int, bytes]] = OrderedDict()
        # nonce -> the GRANT_FD blocks of its answer, in order: (tier's open_block, key)
        self._fds: dict[bytes, list[tuple[Callable[[str], int | None], str]]] = {}
        #: Whether the handout socket listens (kvfs.handout sets it).
        self.handout_on: Callable[[], bool] = lambda: False

    async def grant(self, dnode: Node, value: bytes, uid: int) -> None:
        """Answer a grant command (see kvfs.control): the longest prefix of its blocks that
        some tier holds, each hot or with a URL, stored for :meth:`reply`."""
        nonce, hashes, budget, flags = control.unpack_grant(value)
        found: list[control.Granted | None] = [None] * len(hashes)
        files: dict[int, tuple[Callable[[str], int | None], str]] = {}
        fds = bool(flags & control.GRANT_TAKES_FDS) and self.handout_on()
        await self.adoption.listed_fans(dnode, hashes)
        dpath = self.tree.path(dnode)
        with trio.move_on_after(budget if budget is not None else float("inf")) as scope:
            async with trio.open_nursery() as nursery:
                for i, h in enumerate(hashes):
                    nursery.start_soon(self._one, dnode, dpath, h, found, i,
                                       files if fds else None)
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
            self._fds.pop(self._replies.popitem(last=False)[0], None)
        answer = _fitting(found[:n])  # type: ignore[arg-type]
        n = len(control.unpack_grant_reply(answer))
        self._replies[nonce] = (now + control.GRANT_REPLY_TTL, uid, dnode.inode, answer)
        if files:
            self._fds[nonce] = [files[i] for i in range(n) if i in files]

    def take_fds(self, nonce: bytes, uid: int
                 ) -> list[tuple[Callable[[str], int | None], str]] | None:
        """The files grant `nonce` handed out as descriptors, for the uid that asked, once,
        while its answer is kept (kvfs.handout)."""
        got = self._replies.get(nonce)
        if got is None or got[0] < time.monotonic() or got[1] != uid:
            return None
        return self._fds.pop(nonce, None)

    async def _one(self, dnode: Node, dpath: bytes, h: bytes,
                   found: list[control.Granted | None], i: int,
                   files: dict[int, tuple[Callable[[str], int | None], str]] | None
                   ) -> None:
        tiering = self.tree.tiering
        fan_name, name = h[:1].hex().encode(), hashing.block_filename(h).encode()
        fan = self.index.lookup(dnode.inode, fan_name)
        node = self.index.lookup(fan.inode, name) if fan is not None else None
        if node is not None and not node.tier:
            found[i] = control.Granted(control.GRANT_HOT)
            return
        if tiering is None or not tiering.reachable():
            return
        key = self.tree.tier_key(join(dpath, hashing.block_relpath(h).encode()))
        where = await tiering.locate(key, ask_presigned=False)
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
            # A directory tier's file, handed to the client as a descriptor (kvfs.handout).
            tiering.counters[t].grants += 1
            files[i] = (tiering.tiers[t].open_block, key)
            found[i] = control.Granted(control.GRANT_FD, t + 1, size or 0)
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


def _fitting(entries: list[control.Granted]) -> bytes:
    """The answer of the longest prefix of `entries` that fits one xattr (URLs carrying a
    session token are longer: the client takes a shorter answer as the prefix's end)."""
    while True:
        try:
            return control.pack_grant_reply(entries)
        except control.ControlError:
            entries = entries[:len(entries) * 3 // 4]
