"""Priority classes over any eviction policy: what clients' cache hints change in eviction.

The rule, one sentence: victims come from the lowest class first, and within a class in
the tier's own policy order (frecency, LRU, ...); a hard-pinned block is never proposed.

    COLD      a client said this prefix can go now (retain priority "cold")
    NORMAL    no hint: the policy alone decides
    HIGH      retained with priority "high": goes after every normal page
    SOFT_PIN  soft-pinned: goes last, after everything else in the tier
    HARD_PIN  hard-pinned: never a victim (the core applies it in host only; elsewhere a
              hard pin ranks as SOFT_PIN, kvtier.core.hints)

So a policy's order is kept wherever the hints are silent, and a hint moves a block
between whole classes rather than by a weight that a busy tier would wash out. The
prefix-aware policies still never propose a block whose descendant is cached in the tier:
a normal parent of a soft-pinned leaf waits for its leaf (pin whole prefixes).
"""
from __future__ import annotations

from collections.abc import Callable
from enum import IntEnum
from typing import Protocol

from kvtier.policy.base import EvictionPolicy, Ref


class Rank(IntEnum):
    COLD = 0
    NORMAL = 1
    HIGH = 2
    SOFT_PIN = 3
    HARD_PIN = 4


#: The classes victims are taken from, in order.
EVICTABLE = (Rank.COLD, Rank.NORMAL, Rank.HIGH, Rank.SOFT_PIN)


class Ranks(Protocol):
    """What Ranked asks of the hints: a ref's class in this tier, and how many refs (of any
    tier) are hinted into each class, so that an empty class costs nothing."""

    def rank(self, ref: Ref) -> Rank: ...

    def ranker(self) -> Callable[[Ref], Rank]:
        """`rank`, for one walk (the hints as they are now)."""

    def count(self, rank: Rank) -> int: ...


class Ranked:
    """A tier's eviction policy with priority classes (the rule above)."""

    def __init__(self, policy: EvictionPolicy, ranks: Ranks) -> None:
        self.policy = policy
        self.ranks = ranks
        self.name = policy.name

    def add(self, ref: Ref, parent: Ref | None) -> None:
        self.policy.add(ref, parent)

    def touch(self, ref: Ref) -> None:
        self.policy.touch(ref)

    def remove(self, ref: Ref) -> None:
        self.policy.remove(ref)

    def victims(self, n: int, protected: Callable[[Ref], bool]) -> list[Ref]:
        ranks = self.ranks
        if not any(ranks.count(r) for r in Rank if r is not Rank.NORMAL):
            return self.policy.victims(n, protected)
        rank_of, chosen, taken = ranks.ranker(), [], set()
        for cls in EVICTABLE:
            want = n - len(chosen)
            if want <= 0:
                break
            if cls is not Rank.NORMAL and not ranks.count(cls):
                continue  # nobody in this class
            # Lower classes stay in the call (their victims already chosen): a prefix-aware
            # policy must see them go to free their parents.
            got = self.policy.victims(len(chosen) + want, lambda ref, c=cls: protected(ref) or rank_of(ref) > c)
            new = [ref for ref in got if ref not in taken][:want]
            chosen += new
            taken.update(new)
        return chosen

    def __len__(self) -> int:
        return len(self.policy)
