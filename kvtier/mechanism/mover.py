"""Page movement between the host arena and the disk tier, by slot number. No decisions.

The core calls a `PageMover`; this is the one that moves real bytes. Trace replay uses one
that only keeps the books (kvtier.replay), which is why the core depends on the protocol.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from kvtier.mechanism.disk import DiskRecord, DiskTier
from kvtier.mechanism.host import HostArena


class PageMover(Protocol):
    def clear_host(self, slot: int) -> None:
        """Zero a host slot before it goes to a writer of another namespace."""

    def store(self, moves: Sequence[tuple[int, DiskRecord]]) -> list[DiskRecord]:
        """Copy host slots to the disk slots named in the records; return the stored records."""

    def load(self, record: DiskRecord, host_slot: int) -> bool:
        """Copy a disk page into a host slot; False if it failed its checksum (drop it)."""

    def forget(self, records: Iterable[DiskRecord]) -> None:
        """Remove disk pages from the persistent index."""


class ArenaMover:
    """Moves bytes between a HostArena and (optionally) a DiskTier."""

    def __init__(self, host: HostArena, disk: DiskTier | None) -> None:
        self.host = host
        self.disk = disk

    def clear_host(self, slot: int) -> None:
        self.host.clear(slot)

    def _disk(self) -> DiskTier:
        if self.disk is None:
            raise RuntimeError("no disk tier configured: the core must not move pages to disk")
        return self.disk

    def store(self, moves: Sequence[tuple[int, DiskRecord]]) -> list[DiskRecord]:
        return self._disk().write_pages([(record, self.host.view(slot)) for slot, record in moves])

    def load(self, record: DiskRecord, host_slot: int) -> bool:
        return self._disk().read_page(record, self.host.view(host_slot))

    def forget(self, records: Iterable[DiskRecord]) -> None:
        self._disk().forget(records)
