"""Which device slots a client must map and which it must drop: its mappings compared with
its namespace's table. Pure bookkeeping (numpy, no CUDA): kvtier_client.device does what
the plan says.

The daemon writes one table per namespace (kvtier.mechanism.device_book); the client maps
it read-only. Layout, in little-endian uint64 words:

    word 0                  slots taken from the namespace so far (a client that saw this
                            number change drops what it lost)
    word TABLE_HEADER + s   the generation of the allocation backing slot s while the
                            namespace holds s; 0 while it does not

A generation names one physical allocation for the arena's life. A client maps slot s at
generation g only after the daemon handed it g's descriptor; when the table shows another
generation (or 0), the mapping is stale: the daemon let that memory go, and only this
process still holds it, with this namespace's own old bytes.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TABLE_HEADER = 1
#: Descriptors asked for in one handoff request (SCM_RIGHTS carries at most 253).
MAX_SLOTS_PER_REQUEST = 240


def table_bytes(pages: int) -> int:
    return (TABLE_HEADER + pages) * 8


@dataclass(frozen=True)
class MappingPlan:
    """What to do to match the table: unmap `drop` first, then map `fetch` (in batches of
    at most MAX_SLOTS_PER_REQUEST descriptors)."""

    drop: list[int]
    fetch: list[int]

    def batches(self) -> list[list[int]]:
        return [self.fetch[i : i + MAX_SLOTS_PER_REQUEST] for i in range(0, len(self.fetch), MAX_SLOTS_PER_REQUEST)]


class SlotMappings:
    """The generation this process has mapped at each slot (0: none)."""

    def __init__(self, pages: int) -> None:
        self.generations = np.zeros(pages, dtype=np.uint64)
        self.taken_seen = 0  # the table's word 0 at the last plan

    def current(self, table: np.ndarray, slot: int) -> bool:
        """Whether slot `slot` is mapped at the generation the table names, and nothing was
        taken from the namespace since the last plan (one read each: the hot path)."""
        mapped = self.generations[slot]
        return mapped != 0 and mapped == table[TABLE_HEADER + slot] and table[0] == self.taken_seen

    def plan(self, table: np.ndarray) -> MappingPlan:
        """Drop every mapping the table no longer names; fetch every slot the namespace holds
        at a generation not mapped here."""
        self.taken_seen = int(table[0])
        wanted = table[TABLE_HEADER:]
        stale = (self.generations != 0) & (self.generations != wanted)
        missing = (wanted != 0) & (self.generations != wanted)
        return MappingPlan(np.flatnonzero(stale).tolist(), np.flatnonzero(missing).tolist())

    def mapped(self, slot: int, generation: int) -> None:
        if generation == 0:
            raise ValueError(f"slot {slot}: generation 0 names no allocation")
        self.generations[slot] = generation

    def dropped(self, slot: int) -> None:
        self.generations[slot] = 0

    def held(self) -> list[int]:
        return np.flatnonzero(self.generations).tolist()
