"""The books of per-namespace device memory: which physical allocation backs each device
slot, which namespace holds it, which allocations have left the daemon, and the table each
namespace's clients read. Pure bookkeeping (no CUDA): kvtier.mechanism.device does what
these books say, with the CUDA driver's virtual memory calls.

Every device slot is backed by one physical allocation of its own (`stride` bytes, a
multiple of the GPU's allocation granularity), mapped at ``base + slot * stride`` in the
daemon's one flat virtual range. A slot is held by one namespace at a time (`give`), like a
host slot. An allocation whose file descriptor was handed to a client (`export`) has left
the daemon for good: no driver call can take a mapping back from another process. So when
a slot passes to another namespace:

    allocation never exported   kept; zeroed before the new holder's bytes go in
    allocation exported         released by the daemon; a fresh allocation (zeroed) backs
                                the slot from now on. The old holder's processes keep the
                                old memory (their own bytes, nobody else's) until they
                                unmap it, which the client does at its next device call

Generations name allocations: unique over the arena's life, never 0. Each namespace's
table (`TABLE_HEADER` words, then one word per slot) holds the generation of every slot
the namespace holds (0 elsewhere) and, in word 0, how many slots were taken from it; a
client compares its mappings with its table to know what to map and what to drop
(kvtier_client.device_plan).
"""
from __future__ import annotations

import fcntl
import functools
import mmap
import os
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from kvtier_client.device_plan import TABLE_HEADER, table_bytes

_F_ADD_SEALS = 1033
_F_SEAL_SHRINK, _F_SEAL_GROW, _F_SEAL_FUTURE_WRITE = 0x0002, 0x0004, 0x0010


@dataclass
class Allocation:
    """One physical allocation as the books know it."""

    generation: int
    exported: bool = False  # its descriptor went to a client: it never backs another namespace's slot


@dataclass(frozen=True)
class Handover:
    """What giving `slot` to `namespace` takes, planned before anything changes (the new
    memory must exist before the old is let go, so that a failure changes nothing)."""

    slot: int
    previous: str | None
    namespace: str
    fresh: bool  # the slot needs a new physical allocation (the current one was exported)


class DeviceBook:
    """Holders, allocations and exports of one device arena's slots."""

    def __init__(self, pages: int) -> None:
        if pages <= 0:
            raise ValueError(f"a device arena needs at least one page, got {pages}")
        self.pages = pages
        self.holder: list[str | None] = [None] * pages
        self.allocation = [Allocation(generation=slot + 1) for slot in range(pages)]
        self._next = pages + 1

    def plan(self, slot: int, namespace: str) -> Handover | None:
        """What giving `slot` to `namespace` takes; None when it holds the slot already."""
        previous = self.holder[slot]
        if previous == namespace:
            return None
        return Handover(slot, previous, namespace, fresh=self.allocation[slot].exported)

    def apply(self, handover: Handover) -> Allocation:
        """Record a handover the mechanism carried out; returns the slot's allocation now."""
        if self.holder[handover.slot] != handover.previous:
            raise RuntimeError(f"device slot {handover.slot} changed holder between plan and apply")
        if handover.fresh:
            self.allocation[handover.slot] = Allocation(self._next)
            self._next += 1
        self.holder[handover.slot] = handover.namespace
        return self.allocation[handover.slot]

    def export(self, namespace: str, slots: Iterable[int]) -> list[tuple[int, Allocation]]:
        """The slots among `slots` that `namespace` holds, with their allocations, now marked
        exported; the others are left out (a client asks only for its own)."""
        out = []
        for slot in dict.fromkeys(slots):
            if 0 <= slot < self.pages and self.holder[slot] == namespace:
                allocation = self.allocation[slot]
                allocation.exported = True
                out.append((slot, allocation))
        return out

    def held(self, namespace: str) -> list[int]:
        return [slot for slot, holder in enumerate(self.holder) if holder == namespace]


class NamespaceTables:
    """One table file per namespace (a sealed memfd): the daemon writes it, the namespace's
    clients map it read-only (they cannot map it writable: F_SEAL_FUTURE_WRITE)."""

    def __init__(self, name: str, book: DeviceBook) -> None:
        self._name = name
        self._book = book
        self._tables: dict[str, tuple[int, mmap.mmap, np.ndarray]] = {}

    def fd(self, namespace: str) -> int:
        """The namespace's table file, made on first use from the books (the caller must not
        close it)."""
        if namespace not in self._tables:
            self._tables[namespace] = self._make(namespace)
        return self._tables[namespace][0]

    def _make(self, namespace: str) -> tuple[int, mmap.mmap, np.ndarray]:
        size = table_bytes(self._book.pages)
        fd = os.memfd_create(f"{self._name}-device", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            table = np.frombuffer(mm, dtype=np.uint64)
            for slot in self._book.held(namespace):
                table[TABLE_HEADER + slot] = self._book.allocation[slot].generation
            fcntl.fcntl(fd, _F_ADD_SEALS, _F_SEAL_SHRINK | _F_SEAL_GROW | _future_write())
        except BaseException:
            os.close(fd)
            raise
        return fd, mm, table

    def handed_over(self, handover: Handover, allocation: Allocation) -> None:
        """A slot changed holder: out of the previous holder's table (its taken count up),
        into the new holder's. Tables not made yet are built from the books when they are."""
        previous = self._tables.get(handover.previous) if handover.previous is not None else None
        if previous is not None:
            table = previous[2]
            table[TABLE_HEADER + handover.slot] = 0
            table[0] += 1
        current = self._tables.get(handover.namespace)
        if current is not None:
            current[2][TABLE_HEADER + handover.slot] = allocation.generation

    def close(self) -> None:
        while self._tables:
            _, (fd, mm, table) = self._tables.popitem()
            del table  # the last view of the mapping: it can close now
            mm.close()
            os.close(fd)


@functools.cache
def _future_write() -> int:
    """F_SEAL_FUTURE_WRITE where the kernel has it (5.1+), else nothing: then a client could
    map its own table writable, and mislead only itself."""
    probe = os.memfd_create("kvtier-seal-probe", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        fcntl.fcntl(probe, _F_ADD_SEALS, _F_SEAL_FUTURE_WRITE)
        return _F_SEAL_FUTURE_WRITE
    except OSError:
        return 0
    finally:
        os.close(probe)
