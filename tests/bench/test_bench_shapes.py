"""The synthetic trace shapes of `kvtier bench trace --shape`: deterministic, prefix-chained,
and each with the property it is named for."""
from __future__ import annotations

from collections import Counter

import pytest

from kvtier_bench import shapes
from kvtier_bench.trace import infinite_hits
from kvtier.replay.mooncake import halfway, read_timed_trace

SMALL = 0.05


def _blocks(requests) -> list[int]:
    return [block for _, ids in requests for block in ids]


def _in_how_many_requests(requests) -> Counter:
    return Counter(block for _, ids in requests for block in set(ids))


@pytest.mark.parametrize("name", shapes.SHAPES)
def test_a_shape_is_the_same_for_a_seed_and_differs_for_another(name):
    assert shapes.generate(name, seed=3, scale=SMALL) == shapes.generate(name, seed=3, scale=SMALL)
    assert shapes.generate(name, seed=3, scale=SMALL) != shapes.generate(name, seed=4, scale=SMALL)


@pytest.mark.parametrize("name", shapes.SHAPES)
def test_ids_are_prefix_chained_and_times_in_order(name):
    requests = shapes.generate(name, seed=1, scale=SMALL)
    predecessor: dict[int, int | None] = {}
    for _, ids in requests:
        assert len(ids) == len(set(ids)), "a block appears twice in one request"
        for before, block in zip([None, *ids], ids):
            assert predecessor.setdefault(block, before) == before, f"block {block} follows two different blocks"
    times = [t for t, _ in requests]
    assert times == sorted(times) and times[0] >= 0 and all(type(t) is int for t in times)


@pytest.mark.parametrize("name", shapes.SHAPES)
def test_at_scale_one_a_shape_has_100k_to_150k_blocks_and_reuses_some(name):
    requests = shapes.generate(name)
    hits, blocks = infinite_hits([ids for _, ids in requests])
    assert 100_000 <= blocks <= 150_000
    assert 0.2 < hits / blocks < 0.95


def test_sessions_never_reuse_a_request_s_last_block():
    requests = shapes.sessions(seed=2, scale=SMALL)
    seen_in = _in_how_many_requests(requests)
    assert all(seen_in[ids[-1]] == 1 for _, ids in requests)
    assert sum(n > 1 for n in seen_in.values()) > 0.5 * len(seen_in), "the turns should resend most blocks"
    lengths = Counter(len(ids) for _, ids in requests)
    assert max(lengths) > 2 * min(lengths), "contexts should grow turn by turn"


def test_scan_documents_are_never_reused_and_are_a_third_to_a_half_of_the_blocks():
    requests = shapes.scan(seed=5, scale=0.2)
    seen_in = _in_how_many_requests(requests)
    one_off = [b for b in _blocks(requests) if b >= shapes.ONE_OFF_BASE]
    assert one_off and all(seen_in[b] == 1 for b in one_off)
    assert 0.3 <= len(one_off) / len(_blocks(requests)) <= 0.5
    hot = [b for b in seen_in if b < shapes.ONE_OFF_BASE]
    assert sum(seen_in[b] > 1 for b in hot) > 0.3 * len(hot), "the hot set should be reused"


def test_shift_halves_by_time_share_no_block():
    requests = shapes.shift(seed=6, scale=SMALL)
    middle = halfway([t for t, _ in requests])
    first, second = _blocks(requests[:middle]), _blocks(requests[middle:])
    assert not set(first) & set(second)
    assert 0.3 < len(first) / (len(first) + len(second)) < 0.7


def test_write_jsonl_reads_back_as_a_mooncake_trace(tmp_path):
    requests = shapes.zipf(seed=0, scale=0.01)
    path = tmp_path / "zipf.jsonl"
    shapes.write_jsonl(requests, path)
    assert list(read_timed_trace(str(path))) == requests


def test_an_unknown_shape_is_refused():
    with pytest.raises(ValueError, match="unknown trace shape"):
        shapes.generate("nope")
