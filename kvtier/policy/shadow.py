"""Tuning one weight of a ranking online with miniature simulations.

Waldspurger et al., "Cache Modeling and Optimization using Miniature Simulations" (USENIX
ATC'17): a cache fed a hashed sample of the keys (rate R), with R times the capacity,
hits about as often as the full cache would. So a few small shadow caches, one per
candidate weight, fed the same sample, tell which weight would hit most on the traffic
seen lately, at a cost of (candidates x R) extra steps per access.

Each shadow holds sampled refs only (no pages), ranks them by `now + weight x bonus` (the
caller's bonus for the ref, e.g. log2 of its uses) and drops its lowest rank when over
capacity. Scores are hits, halved every epoch (four times the shadows' capacity in sampled
accesses), so the choice follows the traffic of the last few epochs. The sample is by a stable hash of the key, so a replay is repeatable.
"""
from __future__ import annotations

import heapq
import zlib
from collections.abc import Sequence

from kvtier.policy.base import Ref

#: Refs each shadow cache holds (at most the tier's capacity): the sample rate is this over
#: the tier's capacity, so the cost per access falls as the tier grows.
SHADOW_PAGES = 128
#: Another weight is taken only when its shadow beat the current one's by more than this
#: share of hits: closer than that is within the noise of a small sample.
SWITCH_MARGIN = 0.02
#: An epoch is this many times the shadows' capacity in sampled accesses.
EPOCH_PASSES = 4


class _Shadow:
    """One candidate weight's miniature cache: refs and ranks, no pages."""

    __slots__ = ("weight", "capacity", "ranks", "heap", "score")

    def __init__(self, weight: float, capacity: int) -> None:
        self.weight = weight
        self.capacity = capacity
        self.ranks: dict[Ref, float] = {}
        self.heap: list[tuple[float, Ref]] = []  # (rank, ref), possibly stale
        self.score = 0.0

    def access(self, ref: Ref, rank: float) -> None:
        ranks, heap = self.ranks, self.heap
        if ref in ranks:
            self.score += 1
        ranks[ref] = rank
        heapq.heappush(heap, (rank, ref))
        if len(ranks) > self.capacity:
            while True:
                old, victim = heapq.heappop(heap)
                if ranks.get(victim) == old:
                    del ranks[victim]
                    break
        if len(heap) > 4 * self.capacity + 64:
            self.heap = [(r, ref) for ref, r in ranks.items()]
            heapq.heapify(self.heap)


class ShadowCaches:
    """Shadow caches for `weights` of a tier of `capacity` pages; `weight` is the current
    best (initially the first)."""

    def __init__(self, capacity: int, weights: Sequence[float]) -> None:
        rate = min(1.0, SHADOW_PAGES / max(1, capacity))
        #: A ref is sampled when the CRC-32 of its key is below this.
        self.threshold = int(rate * 2**32)
        size = max(1, round(capacity * rate))
        self._shadows = [_Shadow(w, size) for w in weights]
        self._epoch = EPOCH_PASSES * size
        self._seen = 0
        self.weight = weights[0]
        #: Epochs ended so far (for stats and tests).
        self.epochs = 0

    def sampled(self, ref: Ref) -> bool:
        return zlib.crc32(ref[1]) < self.threshold

    def access(self, ref: Ref, now: int, bonus: float) -> bool:
        """Feed an access of a sampled ref to every shadow; True when the best weight
        changed (an epoch ended with another winner)."""
        for shadow in self._shadows:
            shadow.access(ref, now + shadow.weight * bonus)
        self._seen += 1
        if self._seen < self._epoch:
            return False
        self._seen = 0
        self.epochs += 1
        best = max(self._shadows, key=lambda s: s.score)  # ties: the first, the smaller weight
        current = next(s for s in self._shadows if s.weight == self.weight)
        if best.score <= current.score * (1 + SWITCH_MARGIN):
            best = current  # within the sample's noise: no reason to move
        for shadow in self._shadows:
            shadow.score /= 2
        changed, self.weight = best.weight != self.weight, best.weight
        return changed

    @property
    def scores(self) -> dict[float, float]:
        return {s.weight: s.score for s in self._shadows}
