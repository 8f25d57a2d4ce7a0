"""Page movement between the device arena, the host arena and the disk tier, by slot
number. No decisions.

`ArenaMover` implements the core's `PageMover` port (kvtier.core.ports) with real bytes.
Disk loads and promotions to the device are asynchronous (`on_done` reports the result);
disk stores and demotions from the device are synchronous batches.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from kvtier_client.ids import SessionId, Slot

from kvtier.core.ports import PageRecord, LoadJob
from kvtier.mechanism.device import CopyEngine, Transfer
from kvtier.mechanism.disk import DiskTier
from kvtier.mechanism.host import HostArena
from kvtier.mechanism.io import DiskReader


class ArenaMover:
    """The core's PageMover: bytes between a HostArena and, where configured, a DiskTier
    (with its DiskReader) and a device arena (with its CopyEngine)."""

    def __init__(self, host: HostArena, disk: DiskTier | None, reader: DiskReader | None,
                 copies: CopyEngine | None = None) -> None:
        self.host = host
        self.disk = disk
        self.reader = reader
        self.copies = copies

    def give_host(self, slot: Slot, namespace: str) -> None:
        self.host.give(slot, namespace)

    def _disk(self) -> DiskTier:
        if self.disk is None:
            raise RuntimeError("no disk tier configured: the core must not move pages to disk")
        return self.disk

    def _reader(self) -> DiskReader:
        if self.reader is None:
            raise RuntimeError("no disk tier configured: the core must not load pages from disk")
        return self.reader

    def publish_host(self, records: Sequence[PageRecord]) -> None:
        self.host.publish(records)

    def unpublish_host(self, slots: Sequence[Slot]) -> None:
        self.host.unpublish(slots)

    def store(self, moves: Sequence[tuple[Slot, PageRecord]]) -> list[PageRecord]:
        return self._disk().write_pages([(record, self.host.view(slot)) for slot, record in moves])

    def load(self, job: LoadJob) -> None:
        self._reader().submit(job)

    def prefetch_room(self) -> int:
        return self.reader.prefetch_room() if self.reader is not None else 0

    def boost(self, job: LoadJob) -> None:
        self._reader().boost(job)

    def cancel(self, session: SessionId | None, cancellable: Callable[[LoadJob], bool]) -> list[LoadJob]:
        return self.reader.cancel(session, cancellable) if self.reader is not None else []

    def forget(self, records: Iterable[PageRecord]) -> None:
        self._disk().forget(records)

    def _copies(self) -> CopyEngine:
        if self.copies is None:
            raise RuntimeError("no device tier configured: the core must not move pages to a device")
        return self.copies

    def promote(self, pairs: Sequence[tuple[Slot, Slot]], on_done: Callable[[Transfer, bool], None]) -> Transfer:
        return self._copies().promote(pairs, on_done)

    def marker(self) -> Transfer:
        return self._copies().marker()

    def demote(self, pairs: Sequence[tuple[Slot, Slot]]) -> None:
        self._copies().demote(pairs)
