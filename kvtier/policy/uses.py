"""How many times each block was used, remembered for a while after it leaves the tier.

On chat traffic a block's use count predicts its next use: on the Mooncake conversation
trace a block used once is used again with probability 0.24, one used twice 0.42, three
times 0.50. A block often leaves a small tier between two uses, so a count forgotten at
eviction is lost exactly when it matters: ranking by counts that restart at every return
reaches a 0.16 hit rate there, by counts remembered across returns 0.18.

Counts of blocks in the tier are exact; those of the last `remembered` blocks to leave are
kept first-in first-out (by hash of the reference, to keep the memory small), so memory is
bounded by the tier plus `remembered` entries.
"""
from __future__ import annotations

from collections import OrderedDict

from kvtier.policy.base import Ref


class UseCounts:
    def __init__(self, remembered: int) -> None:
        self._counts: dict[Ref, int] = {}  # blocks in the tier
        self._gone: OrderedDict[int, int] = OrderedDict()  # hash(ref) -> count, oldest first
        self._remembered = remembered

    def used(self, ref: Ref) -> int:
        """Count one more use of `ref` (in the tier now) and return its count."""
        count = self._counts.get(ref)
        if count is None:
            count = self._gone.pop(hash(ref), 0)
        count += 1
        self._counts[ref] = count
        return count

    def __getitem__(self, ref: Ref) -> int:
        return self._counts[ref]

    def left(self, ref: Ref) -> None:
        """`ref` left the tier: remember its count among the most recent leavers."""
        count = self._counts.pop(ref)
        if self._remembered:
            self._gone[hash(ref)] = count
            if len(self._gone) > self._remembered:
                self._gone.popitem(last=False)

    def __len__(self) -> int:
        """Blocks whose count is kept: in the tier or remembered."""
        return len(self._counts) + len(self._gone)
