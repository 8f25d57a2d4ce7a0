"""The frecency policy (kvtier.policy.frecency) and its parts, each against a brute-force
model: the use counts that outlive an eviction, the shadow caches that choose the weight,
and the policy's order (rank = last use + weight x log2(uses), leaves only)."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from model_check import check_against_model, ops

from kvtier.policy import FrecencyPolicy
from kvtier.policy.frecency import bonus
from kvtier.policy.shadow import EPOCH_PASSES, SHADOW_PAGES, SWITCH_MARGIN, ShadowCaches
from kvtier.policy.uses import UseCounts


def ref(i: int) -> tuple[str, bytes]:
    return ("ns", bytes([i]))


def NOTHING_PINNED(r) -> bool:
    return False


# -- use counts ------------------------------------------------------------------
def test_use_counts_outlive_an_eviction_for_a_while():
    counts = UseCounts(remembered=2)
    assert [counts.used(ref(1)) for _ in range(3)] == [1, 2, 3]
    counts.used(ref(2))
    counts.left(ref(1))
    assert counts.used(ref(1)) == 4  # back: its count is remembered
    counts.left(ref(1))
    counts.left(ref(2))
    counts.used(ref(3))
    counts.left(ref(3))  # three left; only the last two are remembered
    assert counts.used(ref(1)) == 1 and counts.used(ref(2)) == 2 and counts.used(ref(3)) == 2
    assert len(counts) == 3


# -- shadow caches -----------------------------------------------------------------
class ShadowModel:
    """Each candidate weight's cache as a plain dict, its lowest rank dropped when over
    capacity; scores halved every epoch; the weight moves to the first of the highest
    scores when that beats the current weight's by more than the margin."""

    def __init__(self, capacity, weights):
        self.capacity, self.weights = capacity, weights
        self.ranks = [dict() for _ in weights]
        self.scores = [0.0] * len(weights)
        self.weight, self.seen = weights[0], 0

    def access(self, r, now, uses):
        for k, w in enumerate(self.weights):
            ranks = self.ranks[k]
            self.scores[k] += r in ranks
            ranks[r] = now + w * math.log2(uses)
            if len(ranks) > self.capacity:
                del ranks[min(ranks, key=lambda x: (ranks[x], x))]
        self.seen += 1
        if self.seen == EPOCH_PASSES * self.capacity:
            self.seen = 0
            best = self.scores.index(max(self.scores))
            if self.scores[best] > self.scores[self.weights.index(self.weight)] * (1 + SWITCH_MARGIN):
                self.weight = self.weights[best]
            self.scores = [s / 2 for s in self.scores]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 11), min_size=1, max_size=200))
def test_shadow_caches_match_the_model(stream):
    weights = [0.0, 3.0, 50.0]
    shadows, model = ShadowCaches(4, weights), ShadowModel(4, weights)
    uses: dict = {}
    for now, i in enumerate(stream, 1):
        uses[i] = uses.get(i, 0) + 1
        assert shadows.sampled(ref(i))  # a tier under SHADOW_PAGES pages samples everything
        shadows.access(ref(i), now, bonus(uses[i]))
        model.access(ref(i), now, uses[i])
        assert shadows.weight == model.weight
        assert list(shadows.scores.values()) == model.scores


def test_shadows_choose_frequency_when_a_scan_would_flush_the_hot_blocks():
    # Four hot blocks used again and again, each round followed by a scan of eight
    # one-off blocks: LRU (weight 0) loses the hot blocks to every scan, a frequency
    # bonus keeps them.
    shadows = ShadowCaches(6, [0.0, 8.0, 64.0])
    uses: dict = {}
    now, scanned = 0, 100
    for _ in range(40):
        for i in [1, 2, 3, 4] + list(range(scanned, scanned + 8)):
            now += 1
            uses[i] = uses.get(i, 0) + 1
            shadows.access(("ns", i.to_bytes(2, "little")), now, bonus(uses[i]))
        scanned += 8
    assert shadows.epochs > 0 and shadows.weight > 0


def test_shadows_sample_a_large_tier():
    shadows = ShadowCaches(SHADOW_PAGES * 16, [0.0, 1.0])  # a sixteenth of its refs
    sampled = sum(shadows.sampled(("ns", i.to_bytes(4, "little"))) for i in range(20000))
    assert 20000 / 16 * 0.8 < sampled < 20000 / 16 * 1.2


# -- the policy ------------------------------------------------------------------------
class FrecencyModel:
    """Recomputes every answer from the history: ticks of last use, use counts with the
    last `remembered` departures' counts kept, the weight the policy reports."""

    def __init__(self, remembered, weight):
        self.weight = weight  # () -> the weight the policy reports now
        self.clock = 0
        self.tick, self.uses, self.parent = {}, {}, {}
        self.departed: list = []  # (ref, count), oldest first
        self.remembered = remembered

    def add(self, r, parent):
        self.parent[r] = parent
        back = [c for d, c in self.departed if d == r]
        self.departed = [(d, c) for d, c in self.departed if d != r]
        self.uses[r] = back[0] if back else 0
        self.touch(r)

    def touch(self, r):
        self.clock += 1
        self.tick[r] = self.clock
        self.uses[r] += 1

    def remove(self, r):
        self.departed.append((r, self.uses.pop(r)))
        self.departed = self.departed[-self.remembered:] if self.remembered else []
        del self.tick[r], self.parent[r]

    @property
    def cached(self):
        return self.tick.keys()

    def victims(self, n, pinned):
        weight = self.weight()
        rank = {r: self.tick[r] + weight * math.log2(self.uses[r]) for r in self.tick}
        chosen: list = []
        while len(chosen) < n:
            leaves = [r for r in self.tick if r not in chosen and not pinned(r)
                      and all(c in chosen for c, p in self.parent.items() if p == r)]
            if not leaves:
                break
            chosen.append(min(leaves, key=lambda r: (rank[r], r)))
        return chosen


@pytest.mark.parametrize("weights", [(0.0,), (3.0,), (1000.0,), None], ids=["lru", "w3", "w1000", "tuned"])
@settings(max_examples=120, deadline=None)
@given(sequence=ops)
def test_frecency_matches_the_model(weights, sequence):
    """`None`: the default candidates on a 2-page tier, so the weight changes every few
    operations and the policy must re-rank everything it holds each time."""
    capacity = 2
    policy = FrecencyPolicy(capacity, weights)
    model = FrecencyModel(remembered=4 * capacity, weight=lambda: policy.weight)
    check_against_model(policy, model, sequence, prefix_aware=True)


def test_frecency_keeps_a_reused_chain_over_a_newer_one_off():
    p = FrecencyPolicy(64, weights=(10.0,))
    p.add(ref(1), None)
    p.add(ref(2), ref(1))
    for _ in range(3):  # the chain 1 -> 2 is used three more times
        p.touch(ref(1))
        p.touch(ref(2))
    p.add(ref(9), None)  # a one-off, used last
    # rank(2) = 8 + 10*log2(4) = 28 > rank(9) = 9: the one-off goes first, then the chain leaf-first.
    assert p.victims(3, NOTHING_PINNED) == [ref(9), ref(2), ref(1)]
    p.remove(ref(2))
    p.remove(ref(1))
    p.add(ref(1), None)  # back after an eviction: its five uses are remembered
    assert p.uses[ref(1)] == 5
