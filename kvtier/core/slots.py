"""O(1) slot allocation for one tier.

A stack of free slot numbers plus a byte per slot saying whether it is free. The flag
array turns a double free or a use of a free slot into an immediate crash with a message
(a broken invariant), instead of two owners silently sharing a page.
"""
from __future__ import annotations

from collections.abc import Iterable

from kvtier_client.ids import Slot


class SlotAllocator:
    def __init__(self, capacity: int, used: Iterable[int] = ()) -> None:
        """`used` names slots already holding data (a persisted tier being recovered)."""
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._is_free = bytearray(b"\x01") * capacity
        for slot in used:
            if not self._is_free[slot]:
                raise RuntimeError(f"slot {slot} is recovered twice")
            self._is_free[slot] = 0
        # Pop from the end: slot 0 is handed out first, which keeps a fresh arena's
        # used pages at its start (nicer to read in a debugger, nothing more).
        self._free = [s for s in range(capacity - 1, -1, -1) if self._is_free[s]]

    @property
    def free_count(self) -> int:
        return len(self._free)

    def alloc(self) -> Slot:
        """A free slot. The caller checked `free_count` first; an empty pool is a bug."""
        if not self._free:
            raise RuntimeError("slot allocator is empty: the caller must make room before allocating")
        slot = self._free.pop()
        self._is_free[slot] = 0
        return Slot(slot)

    def free(self, slot: Slot) -> None:
        if self._is_free[slot]:
            raise RuntimeError(f"double free of slot {slot}")
        self._is_free[slot] = 1
        self._free.append(slot)

    def is_free(self, slot: int) -> bool:
        return bool(self._is_free[slot])

    def free_slots(self) -> list[int]:
        return list(self._free)
