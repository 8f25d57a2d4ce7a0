"""SlotAllocator: constant-time alloc/free, crashes on misuse, recovery of used slots."""
from __future__ import annotations

import random
import time

import pytest

from kvtier.core.slots import SlotAllocator


def test_alloc_hands_out_every_slot_once_then_refuses():
    slots = SlotAllocator(5)
    got = [slots.alloc() for _ in range(5)]
    assert got == [0, 1, 2, 3, 4]
    assert slots.free_count == 0 and slots.free_slots() == []
    with pytest.raises(RuntimeError, match="slot allocator is empty"):
        slots.alloc()


def test_free_makes_a_slot_reusable_most_recent_first():
    slots = SlotAllocator(4)
    for _ in range(4):
        slots.alloc()
    slots.free(2)
    slots.free(0)
    assert slots.is_free(0) and slots.is_free(2) and not slots.is_free(1)
    assert slots.free_count == 2
    assert slots.alloc() == 0  # a stack: the slot freed last comes back first
    assert slots.alloc() == 2


def test_double_free_crashes_with_a_message():
    slots = SlotAllocator(3)
    s = slots.alloc()
    slots.free(s)
    with pytest.raises(RuntimeError, match=f"double free of slot {s}"):
        slots.free(s)
    with pytest.raises(RuntimeError, match="double free of slot 2"):
        slots.free(2)  # never allocated
    assert slots.free_count == 3  # the refused frees changed nothing


def test_used_slots_are_recovered():
    slots = SlotAllocator(6, used=[4, 1])
    assert slots.free_count == 4
    assert sorted(slots.free_slots()) == [0, 2, 3, 5]
    assert not slots.is_free(1) and not slots.is_free(4)
    assert sorted(slots.alloc() for _ in range(4)) == [0, 2, 3, 5]
    slots.free(4)
    assert slots.alloc() == 4


def test_recovering_a_slot_twice_or_out_of_range_crashes():
    with pytest.raises(RuntimeError, match="slot 2 is recovered twice"):
        SlotAllocator(4, used=[2, 2])
    with pytest.raises((IndexError, RuntimeError, ValueError)):
        SlotAllocator(4, used=[4])  # refused, never silently accepted
    with pytest.raises(ValueError, match="capacity must be >= 0"):
        SlotAllocator(-1)
    assert SlotAllocator(0).free_count == 0


def test_alloc_and_free_are_constant_time():
    # 40k operations on a million-slot tier: anything that scans the tier per call
    # (list.remove, a search for a free flag) would take minutes, not milliseconds.
    slots = SlotAllocator(1_000_000)
    rng = random.Random(3)
    held: list[int] = []
    start = time.perf_counter()
    for _ in range(20_000):
        held.append(slots.alloc())
    rng.shuffle(held)
    for slot in held:
        slots.free(slot)
    elapsed = time.perf_counter() - start
    assert slots.free_count == 1_000_000
    assert elapsed < 2.0, f"40k alloc/free took {elapsed:.2f}s on a 1M-slot tier"
