"""ARC, the Adaptive Replacement Cache (Megiddo & Modha, "ARC: A Self-Tuning, Low Overhead
Replacement Cache", FAST 2003). A candidate for the adaptive policy.

Two LRU lists hold the cached refs: T1 those seen once recently, T2 those seen at least
twice. Two ghost lists hold refs only, recently evicted from each: B1 from T1, B2 from T2.
A ghost hit says that the list it left was too short, so the target size p of T1 moves
towards it: a ref added while in B1 grows p by max(1, |B2|/|B1|), one in B2 shrinks it by
max(1, |B1|/|B2|) (the paper's delta). Eviction (the paper's REPLACE) takes T1's LRU while
|T1| > p, else T2's LRU. Recency and frequency are balanced by p with no tuning knob, and
a one-off scan only churns T1: blocks used twice wait in T2.

The ghosts obey the paper's bounds, |T1| + |B1| <= c and |T1| + |T2| + |B1| + |B2| <= 2c,
so they hold at most 2c refs. Fitting the paper to this interface:

- The paper evicts inside the miss, after adapting p and with a tie break (take T1 when
  |T1| == p and the missed ref is in B2). Here `victims` is asked before `add` and does not
  know the incoming ref, so it uses the p of the last adaptation and no tie break: a ghost
  hit steers the eviction after the one that made room for it.
- The paper drops the ghosts' LRU entries before REPLACE; here `remove` puts the victim in
  its ghost list and `add` then trims the LRU ends to the bounds, which drops the same refs.
- A deleted block (a `remove` that was no eviction) becomes a ghost too.
- No prefix rule: like `lru`, ARC may evict a block whose child is cached in the tier.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from kvtier.policy.base import Ref


class ARCPolicy:
    name = "arc"

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"ARC needs a capacity of at least 1 block, not {capacity}")
        self._capacity = capacity
        self._p = 0.0  # target size of T1
        # Each list is LRU first; all operations are O(1) on an OrderedDict.
        self._t1: OrderedDict[Ref, None] = OrderedDict()
        self._t2: OrderedDict[Ref, None] = OrderedDict()
        self._b1: OrderedDict[Ref, None] = OrderedDict()
        self._b2: OrderedDict[Ref, None] = OrderedDict()

    def add(self, ref: Ref, parent: Ref | None) -> None:
        b1, b2 = self._b1, self._b2
        if ref in b1:  # evicted from T1 too early: give T1 more room
            self._p = min(float(self._capacity), self._p + max(1.0, len(b2) / len(b1)))
            del b1[ref]
            self._t2[ref] = None
        elif ref in b2:  # evicted from T2 too early: give T2 more room
            self._p = max(0.0, self._p - max(1.0, len(b1) / len(b2)))
            del b2[ref]
            self._t2[ref] = None
        else:
            self._t1[ref] = None
            c = self._capacity
            while b1 and len(self._t1) + len(b1) > c:
                b1.popitem(last=False)
            while b2 and len(self._t1) + len(self._t2) + len(b1) + len(b2) > 2 * c:
                b2.popitem(last=False)

    def touch(self, ref: Ref) -> None:
        if ref in self._t1:
            del self._t1[ref]
            self._t2[ref] = None
        else:
            self._t2.move_to_end(ref)

    def remove(self, ref: Ref) -> None:
        if ref in self._t1:
            del self._t1[ref]
            self._b1[ref] = None
        else:
            del self._t2[ref]
            self._b2[ref] = None

    def victims(self, n: int, protected: Callable[[Ref], bool]) -> list[Ref]:
        """REPLACE n times over the lists as they are: each choice from T1 shortens it."""
        chosen: list[Ref] = []
        if n <= 0:
            return chosen
        once = (ref for ref in self._t1 if not protected(ref))
        twice = (ref for ref in self._t2 if not protected(ref))
        a, b = next(once, None), next(twice, None)
        t1_size = len(self._t1)  # protected refs count: they stay in T1
        while len(chosen) < n and (a is not None or b is not None):
            if a is not None and (b is None or t1_size > self._p):
                chosen.append(a)
                t1_size -= 1
                a = next(once, None)
            else:
                chosen.append(b)
                b = next(twice, None)
        return chosen

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)
