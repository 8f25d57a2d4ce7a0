"""Frecency: recency and frequency in one rank, with the weight between them tuned online.

A block's rank is its last use plus a bonus for being used often:

    rank = tick of last use + weight x log2(uses)

(ticks count uses in this tier; uses are remembered across evictions, kvtier.policy.uses).
The leaf of lowest rank goes first, and only leaves are candidates, as in `prefix`: a
block whose descendants are cached here is never evicted, so no cached suffix is orphaned.

weight 0 is prefix-aware LRU; a large weight is close to LFU. The best weight depends on
the traffic (how long a conversation pauses between turns, how much is read once), so it
is not a constant: shadow caches (kvtier.policy.shadow, 128 refs each) replay a sample of
the accesses with weights from 0 to 32x the tier's capacity in ticks, and the policy takes
the weight whose shadow hit most in the last few epochs, re-ranking its blocks when it
changes.
It starts at weight 0, plain prefix-aware LRU, until the shadows have seen an epoch.
"""
from __future__ import annotations

import heapq
import math
import zlib
from collections.abc import Sequence

from kvtier.policy.base import Ref
from kvtier.policy.prefix import PrefixLRUPolicy
from kvtier.policy.shadow import ShadowCaches
from kvtier.policy.uses import UseCounts

#: The candidate weights, in multiples of the tier's capacity (in ticks).
WEIGHT_FACTORS = (0, 0.5, 1, 2, 4, 8, 16, 32)
#: Use counts of this many times the tier's capacity of departed blocks are remembered.
REMEMBERED_FACTOR = 4

_LOG2 = [0.0] + [math.log2(u) for u in range(1, 256)]


def bonus(uses: int) -> float:
    """What `uses` add to a rank, per unit of weight: log2(uses), 0 for one use."""
    return _LOG2[uses] if uses < 256 else math.log2(uses)


def frecency(now: int, uses: int, weight: float) -> float:
    return now + weight * bonus(uses)


class FrecencyPolicy(PrefixLRUPolicy):
    name = "frecency"

    def __init__(self, capacity: int, weights: Sequence[float] | None = None) -> None:
        """`weights`: the candidates (default: WEIGHT_FACTORS x capacity); one weight is
        a fixed policy."""
        super().__init__()
        self.uses = UseCounts(REMEMBERED_FACTOR * capacity)
        weights = [f * capacity for f in WEIGHT_FACTORS] if weights is None else weights
        self.shadows = ShadowCaches(capacity, weights)
        self._ticks: dict[Ref, int] = {}  # ref -> tick of last use

    @property
    def weight(self) -> float:
        return self.shadows.weight

    def _stamp(self, ref: Ref) -> None:
        # The daemon's hot path: prefix's stamp with the frecency formula written out.
        self._clock = now = self._clock + 1
        self._ticks[ref] = now
        uses = self.uses.used(ref)
        gain = _LOG2[uses] if uses < 256 else math.log2(uses)
        shadows = self.shadows
        if zlib.crc32(ref[1]) < shadows.threshold and shadows.access(ref, now, gain):
            self._rerank()
        rank = self._rank[ref] = now + shadows.weight * gain
        if not self._children.get(ref):
            heapq.heappush(self._leaves, (rank, ref))

    def _rerank(self) -> None:
        """The weight changed: rank every block by it (O(n), at most once an epoch)."""
        weight, uses, ticks = self.shadows.weight, self.uses, self._ticks
        for ref in self._rank:
            self._rank[ref] = frecency(ticks[ref], uses[ref], weight)
        self._compact()

    def remove(self, ref: Ref) -> None:
        super().remove(ref)
        del self._ticks[ref]
        self.uses.left(ref)
