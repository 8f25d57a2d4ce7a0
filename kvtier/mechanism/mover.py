"""Page movement between the device arena, the host arena and the disk tier, by slot
number. No decisions.

The core calls a `PageMover`; this is the one that moves real bytes. Trace replay uses one
that only keeps the books (kvtier.replay), which is why the core depends on the protocol.
Disk loads and promotions to the device are asynchronous (`on_done` reports the result);
disk stores and demotions from the device are synchronous batches.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from kvtier.mechanism.device import CopyEngine, Transfer
from kvtier.mechanism.disk import DiskRecord, DiskTier
from kvtier.mechanism.host import HostArena
from kvtier.mechanism.io import DiskReader, LoadJob


class PageMover(Protocol):
    def clear_host(self, slot: int) -> None:
        """Zero a host slot before it goes to a writer of another namespace."""

    def store(self, moves: Sequence[tuple[int, DiskRecord]]) -> list[DiskRecord]:
        """Copy host slots to the disk slots named in the records; return the stored records."""

    def load(self, job: LoadJob) -> None:
        """Start copying a disk page into a host slot; `job.on_done(job, ok)` reports the
        result, ok False if the page failed its checksum (drop it). May call back at once."""

    def prefetch_room(self) -> int:
        """How many prefetch loads can be queued now (back-pressure)."""

    def boost(self, job: LoadJob) -> None:
        """Run a queued prefetch load with Acquire priority."""

    def cancel(self, session: str | None, cancellable: Callable[[LoadJob], bool]) -> list[LoadJob]:
        """Withdraw a session's (None: every session's) queued loads that `cancellable`
        allows; returns them."""

    def forget(self, records: Iterable[DiskRecord]) -> None:
        """Remove disk pages from the persistent index."""

    def promote(self, pairs: Sequence[tuple[int, int]], on_done: Callable[[Transfer, bool], None]) -> Transfer:
        """Start copying (host slot, device slot) pairs; `on_done(transfer, ok)` when they land."""

    def marker(self) -> Transfer:
        """A transfer that completes after every promotion started so far."""

    def demote(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy (device slot, host slot) pairs and return when the bytes are in host memory."""


class ArenaMover:
    """Moves bytes between a HostArena and (optionally) a DiskTier with its DiskReader and a
    device arena with its CopyEngine."""

    def __init__(self, host: HostArena, disk: DiskTier | None, reader: DiskReader | None,
                 copies: CopyEngine | None = None) -> None:
        self.host = host
        self.disk = disk
        self.reader = reader
        self.copies = copies

    def clear_host(self, slot: int) -> None:
        self.host.clear(slot)

    def _disk(self) -> DiskTier:
        if self.disk is None:
            raise RuntimeError("no disk tier configured: the core must not move pages to disk")
        return self.disk

    def _reader(self) -> DiskReader:
        if self.reader is None:
            raise RuntimeError("no disk tier configured: the core must not load pages from disk")
        return self.reader

    def store(self, moves: Sequence[tuple[int, DiskRecord]]) -> list[DiskRecord]:
        return self._disk().write_pages([(record, self.host.view(slot)) for slot, record in moves])

    def load(self, job: LoadJob) -> None:
        self._reader().submit(job)

    def prefetch_room(self) -> int:
        return self.reader.prefetch_room() if self.reader is not None else 0

    def boost(self, job: LoadJob) -> None:
        self._reader().boost(job)

    def cancel(self, session: str | None, cancellable: Callable[[LoadJob], bool]) -> list[LoadJob]:
        return self.reader.cancel(session, cancellable) if self.reader is not None else []

    def forget(self, records: Iterable[DiskRecord]) -> None:
        self._disk().forget(records)

    def _copies(self) -> CopyEngine:
        if self.copies is None:
            raise RuntimeError("no device tier configured: the core must not move pages to a device")
        return self.copies

    def promote(self, pairs: Sequence[tuple[int, int]], on_done: Callable[[Transfer, bool], None]) -> Transfer:
        return self._copies().promote(pairs, on_done)

    def marker(self) -> Transfer:
        return self._copies().marker()

    def demote(self, pairs: Sequence[tuple[int, int]]) -> None:
        self._copies().demote(pairs)
