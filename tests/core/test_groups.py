"""kvtier.core.groups decides a group lookup's answer from what each group holds: checked
against the definition itself (the largest e for which every group holds every block it
needs), over every mix of modes and holdings hypothesis draws."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from kvtier_client.groups import GroupMode, needed_blocks
from kvtier_client.tiers import Tier

from kvtier.core.groups import GroupHoldings, match_groups
from kvtier.core.results import GroupPages, GroupsMatch

H, D = Tier.HOST, Tier.DISK


def test_the_module_docstrings_example():
    held = (H, None, H, H, H, None, H)
    full, window, state = (GroupHoldings(GroupMode.FULL, 0, held), GroupHoldings(GroupMode.WINDOW, 2, held),
                           GroupHoldings(GroupMode.STATE, 0, held))
    can = [[e for e, ok in enumerate(g.restorable()) if ok] for g in (full, window, state)]
    assert can == [[0, 1], [0, 1, 4, 5], [0, 1, 3, 4, 5, 7]]
    assert match_groups([full, window, state]) == GroupsMatch(1, (GroupPages(0, (H,)),) * 3)


def test_each_group_gets_its_trailing_blocks_in_their_tiers():
    match = match_groups([
        GroupHoldings(GroupMode.FULL, 0, (H, D, H, H)),
        GroupHoldings(GroupMode.WINDOW, 3, (None, D, D, H)),
        GroupHoldings(GroupMode.STATE, 0, (None, None, None, D)),
    ])
    assert match == GroupsMatch(4, (GroupPages(0, (H, D, H, H)), GroupPages(1, (D, D, H)), GroupPages(3, (D,))))


def test_no_blocks_no_prefix():
    assert match_groups([GroupHoldings(GroupMode.STATE, 0, ())]) == GroupsMatch(0, (GroupPages(0, ()),))


@st.composite
def groups(draw):
    length = draw(st.integers(0, 12))
    drawn = []
    for _ in range(draw(st.integers(1, 4))):
        mode = draw(st.sampled_from(GroupMode))
        window = draw(st.integers(1, 6)) if mode is GroupMode.WINDOW else 0
        tiers = tuple(draw(st.lists(st.sampled_from([H, D, None]), min_size=length, max_size=length)))
        drawn.append(GroupHoldings(mode, window, tiers))
    return drawn


@given(groups())
def test_the_answer_is_the_definition(drawn):
    def restores(group: GroupHoldings, end: int) -> bool:
        return all(group.tiers[i] is not None for i in needed_blocks(group.mode, group.window, end))

    length = len(drawn[0].tiers)
    expected = max(e for e in range(length + 1) if all(restores(g, e) for g in drawn))
    match = match_groups(drawn)
    assert match.hit_blocks == expected
    for group, pages in zip(drawn, match.groups):
        needed = needed_blocks(group.mode, group.window, expected)
        assert pages == GroupPages(needed.start, group.tiers[needed.start:needed.stop])
