"""The candidate policies for the adaptive policy (ARC, S3-FIFO, W-TinyLFU) on their own.

Hand-worked examples of what each design is for, the proposal contract shared with the
other policies (`victims` changes nothing, skips protected refs, and k victims are what k
successive single evictions take), and a check of each against a brute-force reference
model over random operation sequences: the models keep plain lists, copy them on every
proposal and replay the papers' eviction step by step on the copy.
"""
from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.policy.arc import ARCPolicy
from kvtier.policy.s3fifo import S3FIFOPolicy
from kvtier.policy.tinylfu import FrequencySketch, TinyLFUPolicy

CANDIDATES = {"arc": ARCPolicy, "s3fifo": S3FIFOPolicy, "tinylfu": TinyLFUPolicy}


def r(name) -> tuple[str, bytes]:
    return ("ns", str(name).encode())


def NOTHING_PINNED(ref) -> bool:
    return False


def pinned_set(*names):
    refs = {r(n) for n in names}
    return lambda ref: ref in refs


def cache(p, name, capacity):
    """What the core does on a miss: evict one block if the tier is full, then add."""
    if len(p) >= capacity:
        p.remove(p.victims(1, NOTHING_PINNED)[0])
    p.add(r(name), None)


def refs(*names):
    return [r(n) for n in names]


# -- hand-worked examples --------------------------------------------------------
def test_arc_resists_a_scan_and_adapts_on_a_ghost_hit():
    p = ARCPolicy(4)
    for name in "ab":
        cache(p, name, 4)
        p.touch(r(name))  # a and b are in T2
    for name in "cdef":  # a one-off scan: each evicts the oldest once-used block
        cache(p, name, 4)
    assert p.victims(4, NOTHING_PINNED) == refs("e", "f", "a", "b")  # LRU would have lost a and b
    cache(p, "c", 4)  # evicts e; c is a ghost in B1: p grows to 1 and c goes to T2
    assert len(p) == 4
    assert p.victims(4, NOTHING_PINNED) == refs("a", "b", "c", "f")  # |T1| == p: T2 goes first


def test_s3fifo_one_hit_wonders_leave_from_small_and_a_ghost_hit_goes_to_main():
    p = S3FIFOPolicy(10)  # small holds 1, main 9, the ghost 9
    for i in range(10):
        p.add(r(i), None)
    for i in range(5):
        p.touch(r(i))
    # 0-4 were used again: the eviction moves them to main; 5 is the first one-hit wonder.
    assert p.victims(3, NOTHING_PINNED) == refs(5, 6, 7)
    p.remove(r(5))  # the eviction happens: 0-4 move to main, 5 goes to the ghost
    # Small drains first; then main gives 0-4 a second chance each and takes 0.
    assert p.victims(5, NOTHING_PINNED) == refs(6, 7, 8, 9, 0)
    p.remove(r(6))
    p.add(r(5), None)  # a ghost hit: straight to main, behind 0-4
    p.add(r("x"), None)  # new: into small
    assert p.victims(5, NOTHING_PINNED) == refs(7, 8, 9, "x", 5)  # 5 has no hit since: no second chance
    assert len(p) == 10


def test_tinylfu_a_frequent_block_beats_a_new_one_in_the_duel():
    p = TinyLFUPolicy(100)  # window of 1 block
    p.add(r("hot"), None)
    for _ in range(3):
        p.touch(r("hot"))
    p.add(r("new"), None)  # pushes hot out of the window into probation
    # Window full: its LRU (new, seen once) duels probation's LRU (hot, seen 4 times).
    assert p.victims(1, NOTHING_PINNED) == refs("new")
    assert p.victims(2, NOTHING_PINNED) == refs("new", "hot")  # the window is below its size then
    # The sketch remembers blocks that left: hot, evicted and back, still wins.
    p.remove(r("hot"))
    p.remove(r("new"))
    p.add(r("hot"), None)
    p.add(r("other"), None)
    assert p.victims(1, NOTHING_PINNED) == refs("other")


def test_tinylfu_a_tie_evicts_the_newcomer():
    p = TinyLFUPolicy(100)
    p.add(r("a"), None)
    p.add(r("b"), None)  # a moves to probation
    assert p.victims(1, NOTHING_PINNED) == refs("b")  # both seen once: the candidate goes
    p.touch(r("b"))
    assert p.victims(1, NOTHING_PINNED) == refs("a")


def test_sketch_counts_without_undercounting_and_ages():
    sketch, other = FrequencySketch(8), FrequencySketch(8)
    assert sketch.cells(r("x")) == other.cells(r("x"))  # stable hashing: runs are reproducible
    counts = {i: i % 5 for i in range(30)}
    for i, count in counts.items():
        for _ in range(count):
            sketch.increment(sketch.cells(r(i)))
    assert all(sketch.estimate(sketch.cells(r(i))) >= count for i, count in counts.items())
    assert sketch.estimate(sketch.cells(r(4))) <= 15
    before = {i: sketch.estimate(sketch.cells(r(i))) for i in counts}
    while sketch._additions:  # up to the reset (every 10 x capacity increments)
        sketch.increment(sketch.cells(r("filler")))
    assert all(sketch.estimate(sketch.cells(r(i))) <= (count + 1) // 2 + 1 for i, count in before.items())


# -- the proposal contract ----------------------------------------------------------
def busy(name, capacity=8):
    """A policy after a little traffic: misses, hits, a deletion and evictions."""
    p = CANDIDATES[name](capacity)
    for i in [0, 1, 2, 3, 0, 4, 1, 5, 6, 0, 7, 8, 2, 9, 1, 10, 3, 11]:
        if r(i) in p.victims(len(p), NOTHING_PINNED):
            p.touch(r(i))
        else:
            cache(p, i, capacity)
    p.remove(p.victims(len(p), NOTHING_PINNED)[3])  # a deletion, not an eviction
    return p


@pytest.mark.parametrize("name", CANDIDATES)
def test_victims_changes_nothing(name):
    p = busy(name)
    size = len(p)
    first = p.victims(5, pinned_set(0))
    assert first == p.victims(5, pinned_set(0))
    everything = p.victims(size, NOTHING_PINNED)
    assert everything == p.victims(size, NOTHING_PINNED)
    assert len(p) == size and len(set(everything)) == size
    assert p.victims(0, NOTHING_PINNED) == [] and p.victims(-1, NOTHING_PINNED) == []


@pytest.mark.parametrize("name", CANDIDATES)
def test_victims_skip_protected_refs(name):
    p = busy(name)
    everything = p.victims(len(p), NOTHING_PINNED)
    pinned = {ref for k, ref in enumerate(everything) if k % 2 == 0}
    got = p.victims(len(p), pinned.__contains__)
    assert not pinned & set(got) and len(got) == len(everything) - len(pinned)
    assert p.victims(len(p), lambda ref: True) == []
    assert len(p) == len(everything)  # pinned refs stay cached


@pytest.mark.parametrize("name", CANDIDATES)
def test_k_victims_are_k_successive_evictions(name):
    p = busy(name)
    together = p.victims(5, pinned_set(1))
    one_by_one = []
    for _ in range(5):
        [victim] = p.victims(1, pinned_set(1))
        one_by_one.append(victim)
        p.remove(victim)
    assert together == one_by_one


@pytest.mark.parametrize("name", CANDIDATES)
def test_capacity_is_required(name):
    with pytest.raises(ValueError, match="capacity of at least 1"):
        CANDIDATES[name](0)


# -- reference models -------------------------------------------------------------
class ARCModel:
    """The paper's pseudocode (Fig. 4) on plain lists, LRU first, split at the interface:
    REPLACE runs in `victims` on copies, the ghost bookkeeping of a miss runs in `add`."""

    def __init__(self, c):
        self.c, self.p = c, 0.0
        self.T1, self.T2, self.B1, self.B2 = [], [], [], []

    def cached(self):
        return self.T1 + self.T2

    def add(self, x):
        if x in self.B1:  # case II
            delta = 1 if len(self.B1) >= len(self.B2) else len(self.B2) / len(self.B1)
            self.p = min(self.p + delta, self.c)
            self.B1.remove(x)
            self.T2.append(x)
        elif x in self.B2:  # case III
            delta = 1 if len(self.B2) >= len(self.B1) else len(self.B1) / len(self.B2)
            self.p = max(self.p - delta, 0)
            self.B2.remove(x)
            self.T2.append(x)
        else:  # case IV: REPLACE already ran (the core evicted); drop the ghost's LRU if over
            self.T1.append(x)
            if len(self.T1) + len(self.B1) > self.c and self.B1:
                del self.B1[0]
            elif len(self.T1) + len(self.T2) + len(self.B1) + len(self.B2) > 2 * self.c and self.B2:
                del self.B2[0]

    def touch(self, x):  # case I
        (self.T1 if x in self.T1 else self.T2).remove(x)
        self.T2.append(x)

    def remove(self, x):
        if x in self.T1:
            self.T1.remove(x)
            self.B1.append(x)
        else:
            self.T2.remove(x)
            self.B2.append(x)

    def victims(self, n, pinned):
        t1, t2, out = list(self.T1), list(self.T2), []
        while len(out) < n:
            free1 = [x for x in t1 if not pinned(x)]
            free2 = [x for x in t2 if not pinned(x)]
            if free1 and (len(t1) > self.p or not free2):
                out.append(free1[0])
                t1.remove(free1[0])
            elif free2:
                out.append(free2[0])
                t2.remove(free2[0])
            else:
                break
        return out


class S3FIFOModel:
    """Algorithm 1 of the paper on plain lists (oldest first), one victim per eviction.
    A proposal replays the evictions on copies and keeps the copy after each one; removing
    the next proposed victim adopts that copy (the eviction's moves happen then)."""

    def __init__(self, c):
        self.small_max, self.ghost_max = max(1, c // 10), max(1, c - max(1, c // 10))
        self.small, self.main, self.ghost, self.freq = [], [], [], {}
        self.plan = []  # (victim, (small, main, freq) after its eviction's moves)

    def cached(self):
        return self.small + self.main

    def add(self, x):
        self.plan = []
        if x in self.ghost:
            self.ghost.remove(x)
            self.main.append(x)
        else:
            self.small.append(x)
        self.freq[x] = 0

    def touch(self, x):
        self.plan = []
        self.freq[x] = min(3, self.freq[x] + 1)

    def remove(self, x):
        if self.plan and self.plan[0][0] == x:
            self.small, self.main, self.freq = self.plan.pop(0)[1]
        else:
            self.plan = []
        del self.freq[x]
        if x in self.small:
            self.small.remove(x)
            self.ghost.append(x)
            self.ghost = self.ghost[-self.ghost_max:]
        else:
            self.main.remove(x)

    @staticmethod
    def evict_small(small, main, freq, pinned):
        for x in list(small):
            if pinned(x):
                continue
            if freq[x] == 0:
                return x
            small.remove(x)
            main.append(x)
        return None

    @staticmethod
    def evict_main(main, freq, pinned):
        while True:
            free = [x for x in main if not pinned(x)]
            if not free:
                return None
            if freq[free[0]] == 0:
                return free[0]
            freq[free[0]] -= 1
            main.remove(free[0])
            main.append(free[0])

    def victims(self, n, pinned):
        small, main, freq = list(self.small), list(self.main), dict(self.freq)
        out, plan = [], []
        while len(out) < n:
            if len(small) >= self.small_max:
                x = self.evict_small(small, main, freq, pinned)
                x = x if x is not None else self.evict_main(main, freq, pinned)
            else:
                x = self.evict_main(main, freq, pinned)
                x = x if x is not None else self.evict_small(small, main, freq, pinned)
                x = x if x is not None else self.evict_main(main, freq, pinned)  # what small promoted
            if x is None:
                break
            plan.append((x, (list(small), list(main), dict(freq))))
            out.append(x)
            (small if x in small else main).remove(x)
        self.plan = plan
        return out


class TinyLFUModel:
    """W-TinyLFU on plain lists (LRU first) with its own hill climber; the frequency sketch
    (checked on its own above) is a second instance fed the same accesses."""

    def __init__(self, c, sample):
        self.c = c
        self.wmax = max(1, c - int(0.99 * c))
        self.qmax = int(0.8 * (c - self.wmax))
        self.W, self.P, self.Q = [], [], []
        self.sketch = FrequencySketch(c)
        self.sketch.sample_size = sample
        self.hits = self.misses = 0
        self.last, self.step = 0.0, -0.0625 * c

    def cached(self):
        return self.W + self.P + self.Q

    def freq(self, x):
        return self.sketch.estimate(self.sketch.cells(x))

    def add(self, x):
        self.sketch.increment(self.sketch.cells(x))
        self.W.append(x)
        while len(self.W) > self.wmax:
            self.P.append(self.W.pop(0))
        self.misses += 1
        self.climb()

    def touch(self, x):
        self.sketch.increment(self.sketch.cells(x))
        if x in self.W:
            self.W.remove(x)
            self.W.append(x)
        elif x in self.P:
            self.P.remove(x)
            self.Q.append(x)
        else:
            self.Q.remove(x)
            self.Q.append(x)
        self.demote()
        self.hits += 1
        self.climb()

    def demote(self):
        while len(self.Q) > self.qmax:
            self.P.append(self.Q.pop(0))

    def climb(self):
        total = self.hits + self.misses
        if total < self.sketch.sample_size:
            return
        rate = self.hits / total
        amount = self.step if rate >= self.last else -self.step
        if abs(rate - self.last) >= 0.05:
            self.step = 0.0625 * self.c if amount >= 0 else -0.0625 * self.c
        else:
            self.step = 0.98 * amount
        self.last, self.hits, self.misses = rate, 0, 0
        if int(amount) > 0:
            k = min(int(amount), self.qmax, len(self.P) + len(self.Q))
            for _ in range(k):
                self.W.append((self.P or self.Q).pop(0))
            self.wmax, self.qmax = self.wmax + k, self.qmax - k
        elif int(amount) < 0:
            k = min(-int(amount), self.wmax - 1, len(self.W))
            for _ in range(k):
                self.P.append(self.W.pop(0))
            self.wmax, self.qmax = self.wmax - k, self.qmax + k
        self.demote()

    def remove(self, x):
        for queue in (self.W, self.P, self.Q):
            if x in queue:
                queue.remove(x)

    def victims(self, n, pinned):
        W, M, out = list(self.W), self.P + self.Q, []
        while len(out) < n:
            w = [x for x in W if not pinned(x)]
            m = [x for x in M if not pinned(x)]
            if w and m:
                duel = len(W) >= self.wmax
                x = w[0] if duel and self.freq(w[0]) <= self.freq(m[0]) else m[0]
            elif w or m:
                x = (w or m)[0]
            else:
                break
            out.append(x)
            (W if x in W else M).remove(x)
        return out


# (policy, capacity, distinct refs): the refs outnumber the capacity, so evictions and
# ghost hits happen. TinyLFU's climber samples every 24 accesses instead of 10 x capacity.
SETUPS = {"arc": (5, 12), "s3fifo": (20, 30), "tinylfu": (16, 28)}


def make(name):
    capacity, _ = SETUPS[name]
    if name == "tinylfu":
        policy = TinyLFUPolicy(capacity)
        policy._sketch.sample_size = 24
        return policy, TinyLFUModel(capacity, 24)
    return CANDIDATES[name](capacity), {"arc": ARCModel, "s3fifo": S3FIFOModel}[name](capacity)


def operations(refs_count):
    i = st.integers(0, refs_count - 1)
    return st.lists(
        st.one_of(
            st.tuples(st.just("add"), i),
            st.tuples(st.just("add"), i),
            st.tuples(st.just("touch"), i),
            st.tuples(st.just("touch"), i),
            st.tuples(st.just("remove"), i),
            # Propose k victims with some refs pinned, then evict the first m of them.
            st.tuples(st.just("victims"), st.integers(0, 8), st.frozensets(i, max_size=4), st.integers(0, 3)),
        ),
        max_size=150,
    )


@pytest.mark.parametrize("name", CANDIDATES)
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_candidate_matches_reference_model(name, data):
    capacity, refs_count = SETUPS[name]
    sequence = data.draw(operations(refs_count))
    policy, model = make(name)
    ref = lambda i: ("ns", bytes([i]))  # noqa: E731
    for op in sequence:
        kind, i = op[0], op[1]
        cached = ref(i) in model.cached() if kind != "victims" else None
        if kind == "add" and not cached:
            if len(model.cached()) >= capacity:  # the core makes room first
                [victim] = model.victims(1, lambda x: False)
                assert policy.victims(1, lambda x: False) == [victim]
                policy.remove(victim)
                model.remove(victim)
            policy.add(ref(i), None)
            model.add(ref(i))
        elif kind == "touch" and cached:
            policy.touch(ref(i))
            model.touch(ref(i))
        elif kind == "remove" and cached:
            policy.remove(ref(i))
            model.remove(ref(i))
        elif kind == "victims":
            pins = {ref(j) for j in op[2]}
            expected = model.victims(i, pins.__contains__)
            assert policy.victims(i, pins.__contains__) == expected
            assert policy.victims(i, pins.__contains__) == expected  # a proposal changes nothing
            clone = copy.deepcopy(policy)  # k victims are k successive single evictions
            one_by_one = []
            while len(one_by_one) < i and (step := clone.victims(1, pins.__contains__)):
                one_by_one += step
                clone.remove(step[0])
            assert one_by_one == expected
            for victim in expected[: op[3]]:
                policy.remove(victim)
                model.remove(victim)
        assert len(policy) == len(model.cached())
    everything = model.victims(len(model.cached()), lambda x: False)
    assert policy.victims(len(policy), lambda x: False) == everything
    assert sorted(everything) == sorted(model.cached())
    if name == "tinylfu":
        assert (policy._window_max, policy._protected_max) == (model.wmax, model.qmax)
