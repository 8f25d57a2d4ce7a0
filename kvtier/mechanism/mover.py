"""Page movement between the device arena, the host arena and the disk tier, by slot
number. No decisions.

`ArenaMover` implements the core's `PageMover` port (kvtier.core.ports) with real bytes.
Disk and cluster loads, cluster writes and promotions to the device are asynchronous
(`on_done` reports the result); disk stores and demotions from the device are synchronous
batches; asking the cluster which keys it holds is a synchronous round trip.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

from kvtier_client.ids import SessionId, Slot
from kvtier_client.tiers import Tier

from kvtier.core.ports import PageRecord, LoadJob
from kvtier.mechanism.cluster import ClusterTier, ClusterWriter
from kvtier.mechanism.device import CopyEngine, Transfer
from kvtier.mechanism.disk import DiskTier
from kvtier.mechanism.host import HostArena
from kvtier.mechanism.io import ClusterReader, DiskReader, PageReader


class ClusterParts:
    """The cluster tier of one pool: the tier, its readers and its writer (None: no writes)."""

    def __init__(self, tier: ClusterTier, reader: ClusterReader, writer: ClusterWriter | None) -> None:
        self.tier = tier
        self.reader = reader
        self.writer = writer


class ArenaMover:
    """The core's PageMover: bytes between a HostArena and, where configured, a DiskTier
    (with its DiskReader), a device arena (with its CopyEngine) and a cluster tier."""

    def __init__(self, host: HostArena, disk: DiskTier | None, reader: DiskReader | None,
                 copies: CopyEngine | None = None, cluster: ClusterParts | None = None) -> None:
        self.host = host
        self.disk = disk
        self.reader = reader
        self.copies = copies
        self.cluster = cluster

    def give_host(self, slot: Slot, namespace: str) -> None:
        self.host.give(slot, namespace)

    def _disk(self) -> DiskTier:
        if self.disk is None:
            raise RuntimeError("no disk tier configured: the core must not move pages to disk")
        return self.disk

    def populate_host(self, slots: Sequence[Slot], namespace: str) -> None:
        self.host.populate(slots, namespace)

    def stage_host(self, records: Sequence[PageRecord]) -> list[PageRecord]:
        return self.host.stage(records)

    def publish_host(self, records: Sequence[PageRecord]) -> None:
        self.host.publish(records)

    def unpublish_host(self, slots: Sequence[Slot]) -> None:
        self.host.unpublish(slots)

    def store(self, moves: Sequence[tuple[Slot, PageRecord]]) -> list[PageRecord]:
        """Host pages to disk, each with the checksum it was published with (hashed once)."""
        host = self.host
        return self._disk().write_pages([(_with_checksum(record, host.checksum(slot), host.page_bytes), host.view(slot))
                                         for slot, record in moves])

    def _source(self, source: Tier) -> PageReader | None:
        if source is Tier.CLUSTER:
            return self.cluster.reader if self.cluster is not None else None
        return self.reader

    def _reader_of(self, source: Tier) -> PageReader:
        reader = self._source(source)
        if reader is None:
            raise RuntimeError(f"no {source.label} tier configured: the core must not load pages from it")
        return reader

    def load(self, job: LoadJob) -> None:
        self._reader_of(job.source).submit(job)

    def prefetch_room(self, source: Tier = Tier.DISK) -> int:
        reader = self._source(source)
        return reader.prefetch_room() if reader is not None else 0

    def boost(self, job: LoadJob) -> None:
        self._reader_of(job.source).boost(job)

    def cancel(self, session: SessionId | None, cancellable: Callable[[LoadJob], bool]) -> list[LoadJob]:
        readers = [r for r in (self._source(Tier.DISK), self._source(Tier.CLUSTER)) if r is not None]
        return [job for reader in readers for job in reader.cancel(session, cancellable)]

    def remote_present(self, namespace: str, keys: Sequence[bytes]) -> int:
        return self.cluster.tier.present(namespace, keys) if self.cluster is not None else 0

    def remote_write(self, namespace: str, pages: Sequence[tuple[bytes, Slot]],
                     on_done: Callable[[list[bool]], None], *, copy: bool = False) -> bool:
        writer = self.cluster.writer if self.cluster is not None else None
        if writer is None:
            return False
        if copy:
            pages = [(key, bytes(self.host.view(slot))) for key, slot in pages]
        return writer.offer(namespace, pages, on_done)

    def forget(self, records: Iterable[PageRecord]) -> None:
        self._disk().forget(records)

    def _copies(self) -> CopyEngine:
        if self.copies is None:
            raise RuntimeError("no device tier configured: the core must not move pages to a device")
        return self.copies

    def give_device(self, slots: Sequence[Slot], namespace: str) -> None:
        self._copies().device.give(slots, namespace)

    def promote(self, pairs: Sequence[tuple[Slot, Slot]], on_done: Callable[[Transfer, bool], None]) -> Transfer:
        return self._copies().promote(pairs, on_done)

    def marker(self) -> Transfer:
        return self._copies().marker()

    def demote(self, pairs: Sequence[tuple[Slot, Slot]]) -> None:
        self._copies().demote(pairs)


def _with_checksum(record: PageRecord, checksum: int | None, length: int) -> PageRecord:
    return record if checksum is None else replace(record, length=length, checksum=checksum)
