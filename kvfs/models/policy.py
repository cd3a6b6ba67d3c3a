"""Eviction and admission policies for the hot tier.

A policy is a small in-memory object behind one interface (:class:`Policy`), so that the daemon
and the offline simulator (``kvfs.models.simulate``) drive the same code and policies can be
compared on the same trace. Keys are opaque hashables, sizes are bytes; a policy never touches
files.

Chains. A kvfs-native block names its parent block; block k is useless without blocks 0..k-1
(a prefix match stops at the first miss). Every policy here except ``lru`` is chain-aware: it
offers only *tails* as victims, blocks that no cached block extends, so a cached block always
has its whole prefix cached. When a tail goes its parent may become a tail. A block inserted
without a parent (another engine's file) is a chain of one. A block inserted before its parent
is linked when the parent arrives.

Protocol. ``insert`` when a file becomes cached (complete), ``access`` on a read hit,
``remove`` when it goes for any reason (evicted, unlinked, quarantined), ``pin`` for files that
must stay. ``victims()`` yields keys best victim first; the caller evicts as many as it needs,
calling ``remove`` for each, and skips keys it cannot evict now (open, being written). Removing
yielded keys during the iteration is fine, and so is removing them after it; a key skipped is
not yielded again by the same iteration. ``admit`` may advise not to cache a new block at all.
Nothing here is thread-safe: the daemon calls it from its event loop only.

Cost: one ``_Node`` (``__slots__``) per entry in a dict, linked into intrusive doubly linked
lists; every operation is O(1) amortized. A non-tail met at the old end of a list is parked
aside until its last child goes; it then rejoins the old end, in order, as the next victim.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from array import array
from bisect import bisect_left
from collections.abc import Callable, Hashable, Iterator

Key = Hashable


class Policy(ABC):
    """What the daemon and the simulator call. See the module docstring for the protocol."""

    name: str = ""

    @abstractmethod
    def insert(self, key: Key, size: int, *, parent: Key | None = None, now: float) -> None:
        """``key`` became cached; ``parent`` is its parent block's key if known, else None.

        Inserting a key that is already cached counts as an access.
        """

    @abstractmethod
    def access(self, key: Key, now: float) -> None:
        """A read hit on ``key``; unknown keys are ignored."""

    @abstractmethod
    def remove(self, key: Key) -> None:
        """``key`` is gone (evicted, unlinked, quarantined); unknown keys are ignored."""

    def forget(self, key: Key) -> None:
        """``key`` leaves the policy's memory but stays cached (the daemon's bound on
        entries): unlike `remove`, never counted as an eviction (no ghost, no learning)."""
        self.remove(key)

    @abstractmethod
    def pin(self, key: Key, pinned: bool) -> None:
        """Pinned keys are never victims; unknown keys are ignored."""

    @abstractmethod
    def victims(self) -> Iterator[Key]:
        """Keys in eviction order, best victim first; never a pinned key."""

    def admit(self, key: Key, size: int, *, parent: Key | None = None, now: float) -> bool:
        """False: better not cache this new block at all. No side effects."""
        return True

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...


class _Node:
    """One cached entry, linked into one ``_List`` (none while pinned)."""

    __slots__ = ("key", "size", "parent", "kids", "stamp", "prev", "next", "list", "freq")

    def __init__(self, key: Key, size: int) -> None:
        self.key = key
        self.size = size
        self.parent: object = None  # the parent's _Node; its key while the parent is unknown
        self.kids = 0  # cached nodes whose parent this is; 0: a tail
        self.stamp = 0  # order within a queue: larger is newer
        self.prev: _Node | _List = self
        self.next: _Node | _List = self
        self.list: _List | None = None
        self.freq = 0  # policy-specific counters and flags


class _List:
    """Intrusive doubly linked list; the list object is its own sentinel, ``next`` the oldest."""

    __slots__ = ("prev", "next", "bytes", "count", "queue")

    def __init__(self, queue: _Queue) -> None:
        self.prev: _Node | _List = self
        self.next: _Node | _List = self
        self.bytes = 0
        self.count = 0
        self.queue = queue

    def _link(self, node: _Node, after: _Node | _List) -> None:
        nxt = after.next
        node.prev, node.next = after, nxt
        after.next = nxt.prev = node
        node.list = self
        self.bytes += node.size
        self.count += 1

    def append(self, node: _Node) -> None:
        self._link(node, self.prev)

    def insert_sorted(self, node: _Node) -> None:
        """Insert in stamp order, searching from the newest end."""
        after = self.prev
        while after is not self and after.stamp > node.stamp:  # type: ignore[union-attr]
            after = after.prev
        self._link(node, after)

    def unlink(self, node: _Node) -> None:
        node.prev.next = node.next
        node.next.prev = node.prev
        node.prev = node.next = node
        node.list = None
        self.bytes -= node.size
        self.count -= 1


class _Queue:
    """One segment of a cache, in eviction order.

    ``order`` holds entries by stamp. ``parked`` holds non-tails met at the old end of
    ``order``; they are older than everything in ``order``, so one that becomes a tail goes to
    ``ready``, by stamp, ahead of ``order``. ``held`` holds tails that the running iteration
    yielded and the caller skipped; they return to ``ready`` when the iteration ends.
    """

    __slots__ = ("order", "parked", "ready", "held")

    def __init__(self) -> None:
        self.order = _List(self)
        self.parked = _List(self)
        self.ready = _List(self)
        self.held = _List(self)

    @property
    def bytes(self) -> int:
        return self.order.bytes + self.parked.bytes + self.ready.bytes + self.held.bytes

    @property
    def count(self) -> int:
        return self.order.count + self.parked.count + self.ready.count + self.held.count

    def first(self, rescue: Callable[[_Node], bool] | None = None) -> _Node | None:
        """The oldest tail, after ``rescue`` saw the nodes before it.

        ``rescue(node)`` True: the node was moved elsewhere (a second chance), look further.
        """
        for lst in (self.ready, self.order):
            node = lst.next
            while node is not lst:
                nxt = node.next
                if rescue is not None and rescue(node):  # type: ignore[arg-type]
                    pass
                elif node.kids:  # not a tail: park it until its last child goes
                    lst.unlink(node)  # type: ignore[arg-type]
                    self.parked.append(node)  # type: ignore[arg-type]
                else:
                    return node  # type: ignore[return-value]
                node = nxt
        return None

    def unpark(self, node: _Node) -> None:
        """``node`` lost its last child; a parked node rejoins the old end."""
        if node.list is self.parked:
            self.parked.unlink(node)
            self.ready.insert_sorted(node)

    def release(self) -> None:
        """Return held nodes to ``ready`` (in stamp order)."""
        held = self.held
        if held.count:
            nodes = []
            while held.next is not held:
                nodes.append(held.next)
                held.unlink(held.next)  # type: ignore[arg-type]
            for node in sorted(nodes, key=lambda n: n.stamp):
                self.ready.insert_sorted(node)  # type: ignore[arg-type]


class ChainPolicy(Policy):
    """Bookkeeping shared by the policies here: entries, chain links, pins, stamps, iteration.

    A subclass places nodes in its ``_Queue`` objects (``_place``, ``_hit``) and picks each
    victim among the queues' oldest tails (``_pick``).
    """

    chain_aware = True

    def __init__(self) -> None:
        self._nodes: dict[Key, _Node] = {}
        self._waiting: dict[Key, list[_Node]] = {}  # parent key -> children inserted before it
        self._queues: tuple[_Queue, ...] = ()
        self._clock = 0
        self._sizes: dict[int, int] = {}
        self.bytes = 0  # total size of the entries

    # -- what a subclass provides ---------------------------------------------------------

    @abstractmethod
    def _place(self, node: _Node, now: float) -> None:
        """Append a new or unpinned node to a queue (with ``_move``)."""

    @abstractmethod
    def _hit(self, node: _Node, now: float) -> None:
        """A read hit on a cached, unpinned node."""

    @abstractmethod
    def _pick(self) -> _Node | None:
        """The next victim, or None."""

    def _evicted(self, node: _Node, queue: _Queue) -> None:
        """``node`` left ``queue`` after ``victims()`` offered it: an eviction."""

    # -- helpers --------------------------------------------------------------------------

    def _move(self, node: _Node, queue: _Queue) -> None:
        """Make ``node`` the newest entry of ``queue``."""
        if node.list is not None:
            node.list.unlink(node)
        self._clock += 1
        node.stamp = self._clock
        queue.order.append(node)

    # -- the interface --------------------------------------------------------------------

    def insert(self, key: Key, size: int, *, parent: Key | None = None, now: float) -> None:
        if key in self._nodes:
            self.access(key, now)
            return
        # Sizes repeat (a namespace's blocks are all one size): share the int objects.
        size = self._sizes.setdefault(size, size) if len(self._sizes) < 256 else size
        node = self._nodes[key] = _Node(key, size)
        self.bytes += size
        if self.chain_aware:
            if parent is not None and parent != key:
                up = self._nodes.get(parent)
                if up is not None:
                    node.parent = up
                    up.kids += 1
                else:
                    node.parent = parent
                    self._waiting.setdefault(parent, []).append(node)
            waiting = self._waiting.pop(key, None)
            if waiting:
                for child in waiting:
                    child.parent = node
                node.kids = len(waiting)
        self._place(node, now)

    def access(self, key: Key, now: float) -> None:
        node = self._nodes.get(key)
        if node is not None and node.list is not None:
            node.freq &= ~_OFFERED
            self._hit(node, now)

    def forget(self, key: Key) -> None:
        node = self._nodes.get(key)
        if node is not None:
            node.freq &= ~_OFFERED  # so that remove does not take it for an eviction
        self.remove(key)

    def remove(self, key: Key) -> None:
        node = self._nodes.pop(key, None)
        if node is None:
            return
        self.bytes -= node.size
        queue = None
        if node.list is not None:
            queue = node.list.queue
            node.list.unlink(node)
        up, node.parent = node.parent, None
        if isinstance(up, _Node):
            up.kids -= 1
            if not up.kids and up.list is not None:
                up.list.queue.unpark(up)
        elif up is not None:
            waiting = self._waiting[up]
            waiting.remove(node)
            if not waiting:
                del self._waiting[up]
        if node.freq & _OFFERED and queue is not None:
            self._evicted(node, queue)

    def pin(self, key: Key, pinned: bool) -> None:
        node = self._nodes.get(key)
        if node is None or pinned == (node.list is None):
            return
        if pinned:
            node.list.unlink(node)  # type: ignore[union-attr]
        else:
            self._place(node, 0.0)

    def victims(self) -> Iterator[Key]:
        for q in self._queues:
            q.release()
        try:
            while (node := self._pick()) is not None:
                node.freq |= _OFFERED
                lst, stamp = node.list, node.stamp
                yield node.key
                if node.list is lst and node.stamp == stamp:  # skipped: out of the way
                    lst.unlink(node)  # type: ignore[union-attr]
                    lst.queue.held.append(node)  # type: ignore[union-attr]
        finally:
            for q in self._queues:
                q.release()

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, key: object) -> bool:
        return key in self._nodes


_OFFERED = 1 << 30  # a flag in _Node.freq: offered as a victim since the last access


class LRU(ChainPolicy):
    """Plain least-recently-used, blind to chains: a baseline, not for kvfs-native blocks."""

    name = "lru"
    chain_aware = False

    def __init__(self) -> None:
        super().__init__()
        self._queue = _Queue()
        self._queues = (self._queue,)

    def _place(self, node: _Node, now: float) -> None:
        self._move(node, self._queue)

    def _hit(self, node: _Node, now: float) -> None:
        self._move(node, self._queue)

    def _pick(self) -> _Node | None:
        return self._queue.first()


class ChainLRU(LRU):
    """Chain-aware LRU: the least recently used tail first (DESIGN.md, "Capacity")."""

    name = "chain-lru"
    chain_aware = True


class _Ghosts:
    """Keys of recent evictions, about the last ``limit`` of them (1 to 5/4 of it).

    Generations rather than one ordered FIFO, and 64-bit fingerprints (``hash``) rather than
    the keys, which would otherwise stay alive: the newest generation is a set of up to a
    quarter of ``limit``, the four before it sorted arrays, 8 bytes a ghost (each with a set
    of the ghosts it has given back). A fingerprint shared by two keys (odds about n^2/2^64)
    would merely count one block's eviction for the other.
    """

    __slots__ = ("new", "old")

    GENERATIONS = 4  # older ones, besides the newest

    def __init__(self) -> None:
        self.new: set[int] = set()
        self.old: list[tuple[array, set[int]]] = []  # newest first

    def add(self, key: Key, limit: int) -> None:
        self.new.add(hash(key))
        if self.GENERATIONS * len(self.new) >= limit:
            self.old.insert(0, (array("q", sorted(self.new)), set()))
            del self.old[self.GENERATIONS:]
            self.new = set()

    def pop(self, key: Key) -> bool:
        """Whether ``key`` was remembered; it is forgotten."""
        fp = hash(key)
        if fp in self.new:
            self.new.discard(fp)
            return True
        for fps, gone in self.old:
            i = bisect_left(fps, fp)
            if i < len(fps) and fps[i] == fp and fp not in gone:
                gone.add(fp)
                return True
        return False

    def __len__(self) -> int:
        return len(self.new) + sum(len(fps) - len(gone) for fps, gone in self.old)


class S3FIFO(ChainPolicy):
    """S3-FIFO (Yang et al., SOSP '23), chain-aware.

    New blocks enter a small FIFO (10 % of the bytes). At its head, a block read while there
    moves on to the main FIFO, one never read is evicted and leaves a ghost; a block whose
    ghost is remembered enters the main FIFO directly. At the head of the main FIFO a block
    read since it was last there is reinserted (a 2-bit counter, as in CLOCK), the others are
    evicted. Ghosts: about as many as the main FIFO holds blocks. Non-tails get their second
    chances too; those without one are parked until they become tails.
    """

    name = "s3fifo"
    small_share = 0.10

    def __init__(self) -> None:
        super().__init__()
        self._small = _Queue()
        self._main = _Queue()
        self._queues = (self._small, self._main)
        self._ghosts = _Ghosts()

    def _place(self, node: _Node, now: float) -> None:
        self._move(node, self._main if self._ghosts.pop(node.key) else self._small)

    def _hit(self, node: _Node, now: float) -> None:
        node.freq = min(node.freq + 1, 3)  # access() cleared the flags

    def _promote(self, node: _Node) -> bool:
        if node.freq & 3:
            node.freq = 0
            self._move(node, self._main)
            return True
        return False

    def _reinsert(self, node: _Node) -> bool:
        if node.freq & 3:
            node.freq = (node.freq & 3) - 1
            self._move(node, self._main)
            return True
        return False

    def _pick(self) -> _Node | None:
        # A pass that only gave second chances finds nothing; each pass spends one of every
        # counter it meets, so within four more every tail is a candidate again.
        for _ in range(5):
            if self._small.bytes >= self.small_share * self.bytes:
                node = self._small.first(self._promote) or self._main.first(self._reinsert)
            else:
                node = self._main.first(self._reinsert) or self._small.first(self._promote)
            if node is not None:
                return node
        return None

    def _evicted(self, node: _Node, queue: _Queue) -> None:
        if queue is self._small:
            self._ghosts.add(node.key, max(self._main.count, 1))


class KvfsPolicy(ChainPolicy):
    """The default: chain-aware LRU over two segments, with a learned bias against new blocks.

    Blocks not read since they were cached are in ``new``; blocks read since, and blocks cached
    again while a ghost of their eviction is remembered, are in ``reused``. Both are in
    recency order and share one clock. The victim is the older of the two segments' oldest
    tails, where a ``new`` block's age counts ``weight`` times: at weight 1 this is exactly
    chain-aware LRU; higher, blocks that were never reused (one-off tails, scans) go first
    and blocks that proved useful stay longer.

    The weight is learned, as ARC learns its target size: two small ghost lists remember the
    last ~5 % of each segment's evictions (of the number of entries); a block cached again
    that was evicted lately from ``new`` would have been a hit with a lower weight, one from
    ``reused`` with a higher one, and the weight moves 2 % that way, within [1, 64]. It starts
    at 1, so without evidence, or with keys that never recur (inode numbers of rewritten
    files), the policy is chain-aware LRU. The ghosts of the last ~2 x entries evictions
    admit a block cached again straight into ``reused``.
    """

    name = "kvfs"
    ghosts = 2.0  # admission ghosts, per entry
    margin = 0.05  # learning ghosts of each segment, per entry
    step = 0.02
    max_weight = 64.0

    def __init__(self) -> None:
        super().__init__()
        self._new = _Queue()
        self._reused = _Queue()
        self._queues = (self._new, self._reused)
        self.weight = 1.0
        self._ghosts = _Ghosts()
        self._lost_new = _Ghosts()
        self._lost_reused = _Ghosts()

    def _place(self, node: _Node, now: float) -> None:
        key = node.key
        early, late = self._lost_new.pop(key), self._lost_reused.pop(key)
        if early != late:
            factor = 1.0 - self.step if early else 1.0 + self.step
            self.weight = min(self.max_weight, max(1.0, self.weight * factor))
        if self._ghosts.pop(key) or node.freq & 1:  # (freq & 1: reused before it was pinned)
            self._hit(node, now)
        else:
            self._move(node, self._new)

    def _hit(self, node: _Node, now: float) -> None:
        node.freq = 1
        self._move(node, self._reused)

    def _pick(self) -> _Node | None:
        a, b = self._new.first(), self._reused.first()
        if a is None or b is None:
            return a or b
        clock = self._clock
        return a if (clock - a.stamp) * self.weight >= clock - b.stamp else b

    def _evicted(self, node: _Node, queue: _Queue) -> None:
        n = len(self._nodes) + 1
        self._ghosts.add(node.key, int(self.ghosts * n) + 2)
        lost = self._lost_new if queue is self._new else self._lost_reused
        lost.add(node.key, int(self.margin * n) + 2)


POLICIES = ["kvfs", "lru", "chain-lru", "s3fifo"]
DEFAULT_POLICY = "kvfs"
_CLASSES: dict[str, type[Policy]] = {c.name: c for c in (KvfsPolicy, LRU, ChainLRU, S3FIFO)}


def policy_by_name(name: str) -> Policy:
    """A new, empty policy of the named kind (one of ``POLICIES``)."""
    try:
        return _CLASSES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}") from None
