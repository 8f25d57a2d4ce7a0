"""Eviction policies on their own (no store): orders, the prefix rule, proposals that change nothing.

Each policy is also checked against a brute-force reference model over random operation
sequences: the model recomputes the answer from scratch at every call, the policy keeps
its O(1)/O(log n) bookkeeping.
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from model_check import check_against_model, ops

from kvtier.policy import POLICIES, FrecencyPolicy, LRUPolicy, PrefixLRUPolicy, make_policy


def r(name: str) -> tuple[str, bytes]:
    return ("ns", name.encode())


def NOTHING_PINNED(ref) -> bool:
    return False


def pinned_set(*names):
    refs = {r(n) for n in names}
    return lambda ref: ref in refs


def test_make_policy():
    assert isinstance(make_policy("lru", 8), LRUPolicy)
    assert isinstance(make_policy("prefix", 8), PrefixLRUPolicy)
    assert isinstance(make_policy("frecency", 8), FrecencyPolicy)
    assert set(POLICIES.builtin) == {"lru", "prefix", "frecency", "arc", "s3fifo", "tinylfu"}
    with pytest.raises(ValueError, match="unknown eviction policy 'fifo'; known: lru, prefix, frecency, arc, s3fifo, tinylfu"):
        make_policy("fifo", 8)


# -- LRU ----------------------------------------------------------------------
def test_lru_order_touch_remove():
    p = LRUPolicy()
    for name in "abcd":
        p.add(r(name), None)
    assert len(p) == 4
    assert p.victims(4, NOTHING_PINNED) == [r("a"), r("b"), r("c"), r("d")]
    p.touch(r("a"))
    p.touch(r("c"))
    assert p.victims(4, NOTHING_PINNED) == [r("b"), r("d"), r("a"), r("c")]
    assert p.victims(2, NOTHING_PINNED) == [r("b"), r("d")]
    p.remove(r("d"))
    assert p.victims(10, NOTHING_PINNED) == [r("b"), r("a"), r("c")]  # fewer than asked: all there is
    assert p.victims(0, NOTHING_PINNED) == [] and p.victims(-1, NOTHING_PINNED) == []
    assert len(p) == 3


def test_lru_ignores_parents_and_skips_pinned():
    p = LRUPolicy()
    p.add(r("root"), None)
    p.add(r("child"), r("root"))
    assert p.victims(1, NOTHING_PINNED) == [r("root")]  # orphans the child: LRU does not care
    assert p.victims(2, pinned_set("root")) == [r("child")]
    assert p.victims(2, pinned_set("root", "child")) == []


# -- prefix-aware LRU -----------------------------------------------------------
def chain(p, names, parent=None):
    prev = r(parent) if parent else None
    for name in names:
        p.add(r(name), prev)
        prev = r(name)


def test_prefix_takes_leaves_and_a_whole_cold_chain_deepest_first():
    p = PrefixLRUPolicy()
    chain(p, "abc")  # a -> b -> c, c used last
    p.touch(r("a"))  # the root is the most recently used, yet it has a cached child
    assert p.victims(1, NOTHING_PINNED) == [r("c")]
    assert p.victims(3, NOTHING_PINNED) == [r("c"), r("b"), r("a")]
    assert p.victims(2, NOTHING_PINNED) == [r("c"), r("b")]


def test_prefix_never_chooses_a_block_with_a_cached_child():
    p = PrefixLRUPolicy()
    chain(p, "abc")
    chain(p, "de", parent="a")  # a has two children: b and d
    assert len(p) == 5
    # Leaves are c and e; e was used last. a goes only after both branches.
    assert p.victims(5, NOTHING_PINNED) == [r("c"), r("b"), r("e"), r("d"), r("a")]
    # A pinned leaf holds its whole prefix in place.
    assert p.victims(5, pinned_set("c")) == [r("e"), r("d")]
    assert p.victims(5, pinned_set("b")) == [r("c"), r("e"), r("d")]
    # Removing for real frees the parent for later calls.
    p.remove(r("c"))
    assert p.victims(1, NOTHING_PINNED) == [r("b")]


def test_prefix_leaf_order_follows_last_use():
    p = PrefixLRUPolicy()
    for name in "xyz":
        p.add(r(name), None)
    p.touch(r("x"))
    assert p.victims(3, NOTHING_PINNED) == [r("y"), r("z"), r("x")]


def test_prefix_parent_outside_the_tier():
    # b is not in this tier (evicted, or on another tier): a and c are both leaves here.
    p = PrefixLRUPolicy()
    p.add(r("a"), None)
    p.add(r("c"), r("b"))
    assert p.victims(2, NOTHING_PINNED) == [r("a"), r("c")]
    # b arrives later (a promotion): it has a cached child, so it is not a leaf.
    p.add(r("b"), r("a"))
    assert p.victims(3, NOTHING_PINNED) == [r("c"), r("b"), r("a")]


def test_prefix_heap_is_compacted_after_many_touches():
    p = PrefixLRUPolicy()
    for name in "abc":
        p.add(r(name), None)
    for _ in range(3000):
        p.touch(r("a"))
    assert p.victims(3, NOTHING_PINNED) == [r("b"), r("c"), r("a")]
    assert len(p._leaves) <= 4 * len(p) + 1024


@pytest.mark.parametrize("name", ["lru", "prefix", "frecency", "arc", "s3fifo", "tinylfu"])
def test_victims_changes_nothing(name):
    p = make_policy(name, 8)
    chain(p, "abcd")
    chain(p, "ef", parent="b")
    p.touch(r("a"))
    first = p.victims(4, pinned_set("f"))
    assert first == p.victims(4, pinned_set("f"))
    assert p.victims(6, NOTHING_PINNED) == p.victims(6, NOTHING_PINNED)
    assert len(p) == 6
    # ...and the order after a real removal is what the earlier proposal implied.
    full = p.victims(6, NOTHING_PINNED)
    p.remove(full[0])
    assert p.victims(5, NOTHING_PINNED) == full[1:]


# -- reference models ------------------------------------------------------------
class Model:
    """Brute force: recompute every answer from the full state."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.clock = 0
        self.last_use: dict = {}
        self.parent: dict = {}

    def add(self, ref, parent):
        self.parent[ref] = parent
        self.touch(ref)

    def touch(self, ref):
        self.clock += 1
        self.last_use[ref] = self.clock

    def remove(self, ref):
        del self.last_use[ref]
        del self.parent[ref]

    @property
    def cached(self):
        return self.last_use.keys()

    def victims(self, n, pinned):
        chosen: list = []
        while len(chosen) < n:
            candidates = [
                ref
                for ref in self.last_use
                if ref not in chosen
                and not pinned(ref)
                and (
                    self.name == "lru"
                    or all(child in chosen for child, parent in self.parent.items() if parent == ref)
                )
            ]
            if not candidates:
                break
            chosen.append(min(candidates, key=self.last_use.__getitem__))
        return chosen


@pytest.mark.parametrize("name", ["lru", "prefix"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sequence=ops)
def test_policy_matches_reference_model(name, sequence):
    check_against_model(make_policy(name, 8), Model(name), sequence, prefix_aware=name == "prefix")
