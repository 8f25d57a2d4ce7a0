"""The longest prefix every KV cache group of a hybrid model can restore (LookupGroups),
from what each group's pool holds of each of its blocks.

A group can restore the first e blocks when it holds the trailing
`kvtier_client.groups.needed_blocks(mode, window, e)` of them: all of them (FULL), the
last n (WINDOW), or the last one (STATE). So for each e it is enough to know how many
consecutive blocks ending at block e - 1 the group holds (`run`): it can restore e iff
run >= the number of blocks it needs. For blocks 0..6:

    held        x   .   x   x   x   .   x
    run         1   0   1   2   3   0   1
    FULL        restores e = 1 only
    WINDOW(2)   restores e in 1, 4, 5        (e = 3: run 1 at block 2, it needs 2)
    STATE       restores e in 1, 3, 4, 5, 7

Every group restores e = 0 (nothing). The answer is the largest e all groups restore (here
1); each group then needs its trailing blocks of it, in the tiers its pool holds them.

Counting (each group in its own pool, with its own keys; `BlockStore.count_group`): the
blocks a group needs for the answer are hits, in the tier each is in; every block after
the answer is a miss, with its reason as a Lookup counts one (cached beyond the prefix,
evicted, never stored). A block before a group's window or state is neither: the group
does not need it for this prompt, and a sliding-window group whose early pages were
evicted lost nothing. The first `known` blocks (the engine's own) are neither either: they
count as engine blocks. So lookup_blocks = hits + misses, and the hit rates of `kvtier
stats` add up as for Lookup; one FULL group counts exactly as a Lookup of its keys.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvtier_client.groups import GroupMode, needed_blocks
from kvtier_client.tiers import Tier

from kvtier.core.results import GroupPages, GroupsMatch


@dataclass(frozen=True)
class GroupHoldings:
    """One group as its pool holds it: what it needs, and the fastest tier of each
    block's page (None: not cached)."""

    mode: GroupMode
    window: int
    tiers: tuple[Tier | None, ...]

    def restorable(self) -> list[bool]:
        """[e]: whether this group can restore the first e blocks, for e = 0..len(tiers)."""
        can = [True]
        run = 0
        for end, tier in enumerate(self.tiers, start=1):
            run = run + 1 if tier is not None else 0
            can.append(run >= len(needed_blocks(self.mode, self.window, end)))
        return can


def match_groups(groups: Sequence[GroupHoldings]) -> GroupsMatch:
    """The longest prefix every group restores, and the blocks each needs for it. The
    groups give as many blocks each (checked by the caller: kvtier_client.groups.check_lengths)."""
    can = [group.restorable() for group in groups]
    hit = next(end for end in range(len(can[0]) - 1, -1, -1) if all(c[end] for c in can))
    pages = []
    for group in groups:
        needed = needed_blocks(group.mode, group.window, hit)
        tiers = tuple(group.tiers[needed.start:needed.stop])
        assert None not in tiers, "a group was matched at a prefix it cannot restore"
        pages.append(GroupPages(needed.start, tiers))
    return GroupsMatch(hit, tuple(pages))
