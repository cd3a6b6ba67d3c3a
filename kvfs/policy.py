"""Eviction policies (interim: plain LRU until the policy module lands)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator


class Policy:
    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, int] = OrderedDict()
        self._pinned: set[Hashable] = set()

    def insert(self, key, size: int, *, parent=None, now: float) -> None:
        self._order[key] = size
        self._order.move_to_end(key)

    def access(self, key, now: float) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key) -> None:
        self._order.pop(key, None)
        self._pinned.discard(key)

    def pin(self, key, pinned: bool) -> None:
        (self._pinned.add if pinned else self._pinned.discard)(key)

    def victims(self) -> Iterator:
        for key in list(self._order):
            if key not in self._pinned:
                yield key

    def admit(self, key, size: int, *, parent=None, now: float) -> bool:
        return True

    def __len__(self) -> int:
        return len(self._order)


POLICIES = ["lru"]


def policy_by_name(name: str) -> Policy:
    return Policy()
