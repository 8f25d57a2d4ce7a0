"""Running a policy and its brute-force reference model side by side over one operation
sequence (the shared driver of the policies' model tests)."""
from __future__ import annotations

from hypothesis import strategies as st

#: A fixed forest of 24 blocks: block i's parent is a lower-numbered block or none, so the
#: parent of a block never changes, as with real prefix-chained keys.
FOREST = {i: (None if i % 7 == 0 else (i - 1 if i % 3 else i // 2)) for i in range(24)}

ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 23)),
        st.tuples(st.just("touch"), st.integers(0, 23)),
        st.tuples(st.just("remove"), st.integers(0, 23)),
        st.tuples(st.just("victims"), st.integers(0, 26), st.frozensets(st.integers(0, 23), max_size=6)),
    ),
    max_size=150,
)


def ref(i: int) -> tuple[str, bytes]:
    return ("ns", bytes([i]))


def check_against_model(policy, model, sequence, prefix_aware: bool) -> None:
    """Apply `sequence` to both; every proposal must equal the model's, change nothing, and
    (`prefix_aware`) never choose a block before all its cached children. The model has
    `cached` (refs), `parent` (ref -> parent), add/touch/remove and victims(n, pinned)."""
    for op in sequence:
        kind, i = op[0], op[1]
        tracked = ref(i) in model.cached
        if kind == "add" and not tracked:
            parent = None if FOREST[i] is None else ref(FOREST[i])
            policy.add(ref(i), parent)
            model.add(ref(i), parent)
        elif kind == "touch" and tracked:
            policy.touch(ref(i))
            model.touch(ref(i))
        elif kind == "remove" and tracked:
            policy.remove(ref(i))
            model.remove(ref(i))
        elif kind == "victims":
            pins = {ref(j) for j in op[2]}
            expected = model.victims(i, pins.__contains__)
            got = policy.victims(i, pins.__contains__)
            assert got == expected
            assert policy.victims(i, pins.__contains__) == expected  # a proposal changes nothing
            if prefix_aware:  # the rule itself: every chosen block's cached children were chosen before it
                for k, chosen in enumerate(got):
                    children = [c for c, p in model.parent.items() if p == chosen]
                    assert all(c in got[:k] for c in children)
        assert len(policy) == len(model.cached)
    everything = model.victims(len(model.cached), lambda r: False)
    assert policy.victims(len(model.cached), lambda r: False) == everything
    assert sorted(everything) == sorted(model.cached)  # with nothing pinned, all can go
