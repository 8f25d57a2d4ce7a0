"""The disk's chunks (kvtier.core.chunks): sizes that cut a slot evenly, runs, and an
allocator that never hands a chunk out twice."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.core.chunks import ChunkAllocator, chunk_bytes_for, chunks_in, extent_of, size_of, split


@pytest.mark.parametrize(("slot_bytes", "chunk"), [(2 << 20, 32 << 10), (16 << 10, 4 << 10), (48 << 12, 4 << 10),
                                                    (7 * 4096, 4096), (4096, 4096), (128 * 4096, 8192)])
def test_chunks_are_4k_multiples_that_cut_a_slot_in_at_most_64(slot_bytes, chunk):
    assert chunk_bytes_for(slot_bytes) == chunk
    assert slot_bytes % chunk == 0 and chunk % 4096 == 0 and slot_bytes // chunk <= 64


def test_runs_join_consecutive_chunks_and_split_keeps_their_order():
    extent = extent_of([4, 5, 6, 9, 2, 3])
    assert extent == (4, 3, 9, 1, 2, 2) and size_of(extent) == 6
    assert chunks_in(extent) == [4, 5, 6, 9, 2, 3]
    assert split(extent, 4) == ((4, 3, 9, 1), (2, 2))
    assert split(extent, 6) == (extent, ())


@given(st.lists(st.tuples(st.booleans(), st.integers(1, 9)), max_size=60))
def test_the_allocator_hands_each_chunk_to_one_owner_and_takes_it_back(steps):
    chunks = ChunkAllocator(40)
    owned: list[tuple[int, ...]] = []
    for take, n in steps:
        if take and n <= chunks.free_count:
            owned.append(chunks.take(n))
            assert size_of(owned[-1]) == n
        elif owned:
            chunks.give(owned.pop(0))
        used = [c for extent in owned for c in chunks_in(extent)]
        assert len(used) == len(set(used))  # no chunk owned twice
        assert chunks.free_count == 40 - len(used) == len(chunks.free_chunks())
        assert not set(used) & set(chunks.free_chunks())


def test_misuse_is_a_crash_with_a_message():
    chunks = ChunkAllocator(8, used=[(0, 2)])
    assert chunks.free_count == 6 and chunks.take(2) == (2, 2)
    with pytest.raises(RuntimeError, match="double free"):
        chunks.give((5, 1))
    with pytest.raises(RuntimeError, match="make room first"):
        chunks.take(5)
    with pytest.raises(RuntimeError, match="recovered twice"):
        ChunkAllocator(8, used=[(0, 2), (1, 1)])
