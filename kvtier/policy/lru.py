"""Least recently used: evict the block used longest ago."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from kvtier.policy.base import Ref


class LRUPolicy:
    name = "lru"

    def __init__(self, capacity: int = 0) -> None:
        # (Every policy is built from its tier's page count; recency needs none.)
        # Oldest first. An OrderedDict is a hash map threaded on a doubly linked list:
        # add, touch (move_to_end) and remove are O(1).
        self._order: OrderedDict[Ref, None] = OrderedDict()

    def add(self, ref: Ref, parent: Ref | None) -> None:
        self._order[ref] = None

    def touch(self, ref: Ref) -> None:
        self._order.move_to_end(ref)

    def remove(self, ref: Ref) -> None:
        del self._order[ref]

    def victims(self, n: int, protected: Callable[[Ref], bool]) -> list[Ref]:
        chosen: list[Ref] = []
        if n <= 0:
            return chosen
        for ref in self._order:
            if not protected(ref):
                chosen.append(ref)
                if len(chosen) == n:
                    break
        return chosen

    def __len__(self) -> int:
        return len(self._order)
