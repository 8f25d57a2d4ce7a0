"""Prefix-aware LRU: least recently used among blocks with no cached descendant in this tier.

A block whose child is cached in the tier is never chosen, so a cached suffix is never
orphaned from its prefix (a suffix without its prefix can never be hit: lookups match
prefixes). Choosing a leaf can make its parent a leaf; `victims` accounts for that within
one call, so a cold branch can go in one batch, deepest block first.

Only leaves are candidates, so they live in a min-heap keyed by their rank (here the tick
of last use; `FrecencyPolicy` ranks by more). Entries are invalidated lazily (a touch
pushes a fresh entry; a stale one is skipped when popped), which keeps every operation
O(log n) instead of scanning past the many inner blocks of a prefix tree on each eviction.
"""
from __future__ import annotations

import heapq
from collections.abc import Callable

from kvtier.policy.base import Ref


class PrefixLRUPolicy:
    name = "prefix"

    def __init__(self, capacity: int = 0) -> None:
        # (Every policy is built from its tier's page count; recency needs none.)
        self._clock = 0
        # refs cached in this tier -> rank (lowest goes first): the tick of last use here
        self._rank: dict[Ref, float] = {}
        self._parent: dict[Ref, Ref | None] = {}
        # parent ref -> number of its children cached in this tier (the parent itself
        # may or may not be in this tier).
        self._children: dict[Ref, int] = {}
        self._leaves: list[tuple[float, Ref]] = []  # (rank, ref), possibly stale

    def _stamp(self, ref: Ref) -> None:
        """`ref` was used just now: rank it (subclasses rank by more than the tick)."""
        self._clock += 1
        rank = self._rank[ref] = self._clock
        if not self._children.get(ref):
            heapq.heappush(self._leaves, (rank, ref))

    def add(self, ref: Ref, parent: Ref | None) -> None:
        if parent is not None and self._children.get(ref) and self._descends_from(parent, ref):
            # Clients name parents, so two blocks can name each other (a -> b, then b -> a).
            # Such a loop has no leaf and could never be evicted: drop the edge that closes it.
            parent = None
        self._parent[ref] = parent
        if parent is not None:
            self._children[parent] = self._children.get(parent, 0) + 1
        self._stamp(ref)

    def touch(self, ref: Ref) -> None:
        self._stamp(ref)

    def _descends_from(self, ref: Ref, ancestor: Ref) -> bool:
        """Is `ancestor` on ref's parent chain in this tier? Only asked when a block that
        already has children arrives, so the common commit of a fresh leaf walks nothing."""
        seen: set[Ref] = set()
        while ref is not None and ref in self._parent and ref not in seen:
            if ref == ancestor:
                return True
            seen.add(ref)
            ref = self._parent[ref]
        return ref == ancestor

    def remove(self, ref: Ref) -> None:
        del self._rank[ref]
        parent = self._parent.pop(ref)
        if parent is None:
            return
        left = self._children[parent] - 1
        if left:
            self._children[parent] = left
            return
        del self._children[parent]
        if parent in self._rank:  # the parent is now a leaf here
            heapq.heappush(self._leaves, (self._rank[parent], parent))

    def victims(self, n: int, protected: Callable[[Ref], bool]) -> list[Ref]:
        leaves, ranks, children = self._leaves, self._rank, self._children
        while leaves:  # stale entries on top name nothing: dropping them changes nothing
            rank, ref = leaves[0]
            if ranks.get(ref) == rank and not children.get(ref):
                break
            heapq.heappop(leaves)
        if n == 1 and leaves and not protected(leaves[0][1]):  # the common eviction: peek
            return [leaves[0][1]]
        chosen: list[Ref] = []
        keep: list[tuple[float, Ref]] = []  # valid leaf entries popped here, pushed back at the end
        seen: set[Ref] = set()
        gone: dict[Ref, int] = {}  # children of a ref chosen in this call
        while len(chosen) < n and self._leaves:
            entry = heapq.heappop(self._leaves)
            rank, ref = entry
            if ref in seen or self._rank.get(ref) != rank:
                continue  # stale: touched since, or gone
            if self._children.get(ref, 0) - gone.get(ref, 0):
                continue  # not a leaf any more; pushed again when its last child leaves
            seen.add(ref)
            keep.append(entry)
            if protected(ref):
                continue
            chosen.append(ref)
            parent = self._parent[ref]
            if parent is not None and parent in self._rank:
                gone[parent] = gone.get(parent, 0) + 1
                if self._children[parent] == gone[parent]:
                    heapq.heappush(self._leaves, (self._rank[parent], parent))
        for entry in keep:
            heapq.heappush(self._leaves, entry)
        if len(self._leaves) > 4 * len(self._rank) + 1024:
            self._compact()
        return chosen

    def _compact(self) -> None:
        """Rebuild the heap from the ranks: drops stale entries so the heap stays
        proportional to the tier, and takes changed ranks."""
        self._leaves = [(t, r) for r, t in self._rank.items() if not self._children.get(r)]
        heapq.heapify(self._leaves)

    def __len__(self) -> int:
        return len(self._rank)
