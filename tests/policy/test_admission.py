"""Disk admission (kvtier.policy.admission): `reuse` against a brute-force model, its
choices on traffic where one kind of page never comes back, and the store writing only
what it admits."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.policy import AdmitAll, ReuseAdmission, make_admission
from kvtier.policy.admission import CLASSES

#: Settled departures per class before the model test's admission decides (small, so the
#: short random sequences reach decisions).
MIN_SAMPLES = 3


def ref(i: int) -> tuple[str, bytes]:
    return ("ns", i.to_bytes(4, "little"))


class ReuseModel:
    """Recomputes the rates from the whole event log: a departure settles when `window`
    later departures have happened or its page leaves again; it counts as back if its page
    arrived in between; every max(`window`, 4 x MIN_SAMPLES) settlements the counts so far
    are halved."""

    def __init__(self, window: int, threshold: float, remembered: int) -> None:
        self.window, self.threshold, self.remembered = window, threshold, remembered
        self.log: list[tuple[str, bytes]] = []  # ("add" | "touch" | "remove", key)
        self.in_host: set = set()

    def event(self, kind, r):
        self.log.append((kind, r))

    def uses(self, r) -> int:
        """Uses now (r in host): this stay's uses plus those of its last stay if that
        departure is among the last `remembered` departures of pages not back since."""
        count, gone = 0, []  # gone: departures in order, (ref, count)
        counts: dict = {}
        for kind, x in self.log:
            if kind == "add":
                back = [c for g, c in gone if g == x]
                gone = [(g, c) for g, c in gone if g != x]
                counts[x] = (back[0] if back else 0) + 1
            elif kind == "touch":
                counts[x] += 1
            else:
                gone.append((x, counts.pop(x)))
                gone = gone[-self.remembered:]
        count = counts[r]
        return count

    def rates(self) -> tuple[list[float], list[float]]:
        counts: dict = {}
        gone: list = []
        departures: list = []  # [ref, class, back, settled]
        left, back_n = [0.0] * CLASSES, [0.0] * CLASSES
        settled_n = 0

        def settle(d):
            nonlocal settled_n, left, back_n
            d[3] = True
            left[d[1]] += 1
            back_n[d[1]] += d[2]
            settled_n += 1
            if settled_n % max(self.window, 4 * MIN_SAMPLES) == 0:
                left, back_n = [n / 2 for n in left], [n / 2 for n in back_n]

        for kind, x in self.log:
            if kind == "add":
                back = [c for g, c in gone if g == x]
                gone = [(g, c) for g, c in gone if g != x]
                counts[x] = (back[0] if back else 0) + 1
                for d in departures:
                    if d[0] == x and not d[3]:
                        d[2] = True
            elif kind == "touch":
                counts[x] += 1
            else:
                uses = counts.pop(x)
                gone.append((x, uses))
                gone = gone[-self.remembered:]
                for d in departures:
                    if d[0] == x and not d[3]:
                        settle(d)
                departures.append([x, min(uses, CLASSES) - 1, False, False])
                pending = [d for d in departures if not d[3]]
                if len(pending) > self.window:
                    settle(pending[0])
        return left, back_n

    def admit(self, r) -> bool:
        left, back = self.rates()
        cls = min(self.uses(r), CLASSES) - 1
        return left[cls] < MIN_SAMPLES or back[cls] >= self.threshold * left[cls]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "touch", "remove", "admit"]), st.integers(0, 12)), max_size=300),
       st.sampled_from([0.1, 0.3, 0.6]))
def test_reuse_matches_the_model(ops, threshold):
    # A 2-page host over an 8-page disk: every departure is sampled, windows of 8.
    admission = ReuseAdmission(host_pages=2, disk_pages=8, threshold=threshold, min_samples=MIN_SAMPLES)
    model = ReuseModel(window=8, threshold=threshold, remembered=8)
    host: set = set()
    decided = 0
    for kind, i in ops:
        r = ref(i)
        if kind == "add" and r not in host:
            host.add(r)
        elif kind in ("touch", "remove", "admit") and r in host:
            if kind == "remove":
                host.discard(r)
        else:
            continue
        if kind == "admit":
            assert admission.admit(r) == model.admit(r)
            decided += not model.admit(r)
            continue
        getattr(admission, kind)(*((r, None) if kind == "add" else (r,)))
        model.event(kind, r)
    left, back = model.rates()
    assert admission.return_rates == [b / n if n else None for b, n in zip(back, left)]


def drive(admission, rounds: int) -> None:
    """Hot pages 0..7 leave host and come back every round; one-off pages leave and never
    come back (each once in host, so all of class "used once" except the hot ones' first)."""
    one_off = 1000
    for _ in range(rounds):
        for i in range(8):
            admission.add(ref(i), None)
            admission.touch(ref(i))  # used twice per stay: class "twice" after the first round
        for i in range(8):
            admission.remove(ref(i))
        for _ in range(16):
            admission.add(ref(one_off), None)
            admission.remove(ref(one_off))
            one_off += 1


def test_reuse_refuses_pages_that_never_come_back_and_keeps_those_that_do():
    admission = ReuseAdmission(host_pages=64, disk_pages=256)
    admission.add(ref(999_999), None)
    assert admission.admit(ref(999_999))  # nothing measured yet: written, as before admission
    admission.remove(ref(999_999))
    drive(admission, rounds=100)
    once, twice, _ = admission.return_rates
    assert once < 0.1 and twice > 0.9
    admission.add(ref(5000), None)
    assert not admission.admit(ref(5000))  # used once: that kind rarely comes back
    admission.add(ref(3), None)
    assert admission.admit(ref(3))  # a hot page, back again: its kind does
    assert isinstance(make_admission("all", 64, 256), AdmitAll)
    with pytest.raises(ValueError, match="unknown disk admission 'lfu'; use one of all, reuse"):
        make_admission("lfu", 64, 256)
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        ReuseAdmission(64, 256, threshold=1.5)


def test_a_refused_kind_is_written_again_once_its_pages_come_back():
    admission = ReuseAdmission(host_pages=64, disk_pages=256)
    drive(admission, rounds=100)
    admission.add(ref(7000), None)
    assert not admission.admit(ref(7000))
    admission.remove(ref(7000))
    # The traffic changes: pages used once now come back (each returns after 100 others).
    for i in range(20000):
        admission.add(ref(10_000 + i), None)
        admission.remove(ref(10_000 + i))
        if i >= 100:
            admission.add(ref(10_000 + i - 100), None)
            admission.remove(ref(10_000 + i - 100))
    admission.add(ref(99_000), None)
    assert admission.admit(ref(99_000))


def test_the_model_sequences_reach_refusals():
    """The model test means something only if its sequences get refusals: one that must."""
    admission = ReuseAdmission(host_pages=2, disk_pages=8, threshold=0.6, min_samples=MIN_SAMPLES)
    for i in range(40):  # pages that leave and never come back
        admission.add(ref(i), None)
        admission.remove(ref(i))
    admission.add(ref(100), None)
    assert not admission.admit(ref(100))
