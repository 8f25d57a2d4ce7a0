"""Priority classes (kvtier.policy.classes) against a model of the rule: victims come from
the lowest class first, in the wrapped policy's own order within a class; a hard pin is
never proposed. The model is the wrapped policy's full order, stably sorted by class.
For a prefix-aware policy (frecency) the order within a class can depend on what else is
skipped, so there the model checks the rule itself: no class is touched while a lower
one still has a candidate."""
from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.policy import FrecencyPolicy, LRUPolicy
from kvtier.policy.classes import EVICTABLE, Rank, Ranked

from tests.policy.model_check import FOREST, ref


class Table:
    """Classes by ref, as the core's hint table gives them."""

    def __init__(self, ranks: dict) -> None:
        self.ranks = ranks

    def rank(self, r) -> Rank:
        return self.ranks.get(r, Rank.NORMAL)

    def ranker(self):
        return self.rank

    def count(self, rank: Rank) -> int:
        return Counter(self.ranks.values())[rank]


sequences = st.lists(st.tuples(st.integers(0, 23), st.sampled_from(list(Rank))), max_size=40)


def _fill(policy, uses: list[int]) -> set:
    cached = set()
    for i in uses:
        r = ref(i)
        if r in cached:
            policy.touch(r)
        else:
            parent = FOREST[i]
            policy.add(r, ref(parent) if parent is not None and ref(parent) in cached else None)
            cached.add(r)
    return cached


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 23), min_size=1, max_size=60), sequences, st.integers(1, 26),
       st.frozensets(st.integers(0, 23), max_size=4))
def test_lru_with_classes_is_its_order_sorted_by_class(uses, hints, n, leased):
    inner, table = LRUPolicy(24), Table({ref(i): r for i, r in hints})
    _fill(inner, uses)
    ranked = Ranked(inner, table)
    protected = {ref(i) for i in leased}
    order = inner.victims(len(inner), lambda r: r in protected)
    model = sorted((r for r in order if table.rank(r) is not Rank.HARD_PIN), key=table.rank)[:n]
    assert ranked.victims(n, lambda r: r in protected) == model


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 23), min_size=1, max_size=60), sequences, st.integers(1, 26))
def test_frecency_with_classes_empties_a_class_before_the_next(uses, hints, n):
    inner, table = FrecencyPolicy(24), Table({ref(i): r for i, r in hints})
    _fill(inner, uses)
    chosen = Ranked(inner, table).victims(n, lambda r: False)
    assert len(set(chosen)) == len(chosen) and all(table.rank(r) is not Rank.HARD_PIN for r in chosen)
    if not chosen:
        return
    top = max(table.rank(r) for r in chosen)
    for cls in EVICTABLE[: EVICTABLE.index(top)]:  # every lower class is exhausted
        left = inner.victims(1, lambda r, c=cls: r in chosen or table.rank(r) is not c)
        assert not left, f"{cls.name} still had {left} while {top.name} pages went"
    if len(chosen) < n:  # fewer than asked: nothing evictable is left at all
        assert not inner.victims(1, lambda r: r in chosen or table.rank(r) is Rank.HARD_PIN)


def test_without_hints_the_policy_alone_decides():
    inner = FrecencyPolicy(24)
    _fill(inner, [0, 1, 2, 1, 3, 4, 1])
    assert Ranked(inner, Table({})).victims(3, lambda r: False) == inner.victims(3, lambda r: False)
