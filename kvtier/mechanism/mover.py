"""The core's ports (kvtier.core.ports) over real tiers, by slot number. No decisions.

    host    the HostArena itself
    disk    DiskPages: host slots <-> the disk tier's slab (stores synchronous, loads on
            the DiskReader's workers)
    remote  ClusterPages: what the cluster holds (a synchronous round trip), loads on the
            ClusterReader's workers, writes through the ClusterWriter
    device  DevicePages: promotions on the copy engine (asynchronous), demotions synchronous

A lower tier's codec (kvtier.codecs: how a page's bytes are encoded there) lives behind its
port: the disk tier encodes and seals what it writes, the cluster tier its values; the disk
port also gives the core the slab's chunks (`space`).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

from kvtier_client.ids import SessionId, Slot

from kvtier.core.chunks import DiskSpace
from kvtier.core.ports import LoadJob, Mechanism, PageRecord
from kvtier.mechanism.cluster import ClusterTier, ClusterWriter
from kvtier.mechanism.device import CopyEngine, Transfer
from kvtier.mechanism.disk import DiskTier
from kvtier.mechanism.host import HostArena
from kvtier.mechanism.io import ClusterReader, DiskReader, PageReader


class _Source:
    """A port's loads, on its reader's workers."""

    def __init__(self, reader: PageReader) -> None:
        self.reader = reader

    def load(self, job: LoadJob) -> None:
        self.reader.submit(job)

    def prefetch_room(self) -> int:
        return self.reader.prefetch_room()

    def boost(self, job: LoadJob) -> None:
        self.reader.boost(job)

    def cancel(self, session: SessionId | None, cancellable: Callable[[LoadJob], bool]) -> list[LoadJob]:
        return self.reader.cancel(session, cancellable)


class DiskPages(_Source):
    def __init__(self, host: HostArena, disk: DiskTier, reader: DiskReader) -> None:
        super().__init__(reader)
        self.host = host
        self.disk = disk

    @property
    def space(self) -> DiskSpace:
        return self.disk.space

    def store(self, moves: Sequence[tuple[Slot, PageRecord]]) -> list[PageRecord]:
        """Host pages to disk, each with the checksum it was published with (hashed once)."""
        host = self.host
        return self.disk.write_pages([(_with_checksum(record, host.checksum(slot), host.page_bytes), host.view(slot))
                                      for slot, record in moves])

    def forget(self, records: Iterable[PageRecord]) -> None:
        self.disk.forget(records)


class ClusterParts:
    """The cluster tier of one pool: the tier, its readers and its writer (None: no writes)."""

    def __init__(self, tier: ClusterTier, reader: ClusterReader, writer: ClusterWriter | None) -> None:
        self.tier = tier
        self.reader = reader
        self.writer = writer


class ClusterPages(_Source):
    def __init__(self, host: HostArena, cluster: ClusterParts) -> None:
        super().__init__(cluster.reader)
        self.host = host
        self.cluster = cluster

    def present(self, namespace: str, keys: Sequence[bytes]) -> int:
        return self.cluster.tier.present(namespace, keys)

    def write(self, namespace: str, pages: Sequence[tuple[bytes, Slot]],
              on_done: Callable[[list[bool]], None], *, copy: bool = False) -> bool:
        writer = self.cluster.writer
        if writer is None:
            return False
        if copy:
            pages = [(key, bytes(self.host.view(slot))) for key, slot in pages]
        return writer.offer(namespace, pages, on_done)


class DevicePages:
    def __init__(self, copies: CopyEngine) -> None:
        self.copies = copies

    def give(self, slots: Sequence[Slot], namespace: str) -> None:
        self.copies.device.give(slots, namespace)

    def promote(self, pairs: Sequence[tuple[Slot, Slot]], on_done: Callable[[Transfer, bool], None]) -> Transfer:
        return self.copies.promote(pairs, on_done)

    def marker(self) -> Transfer:
        return self.copies.marker()

    def demote(self, pairs: Sequence[tuple[Slot, Slot]]) -> None:
        self.copies.demote(pairs)


def arena_ports(host: HostArena, disk: DiskTier | None = None, reader: DiskReader | None = None,
                copies: CopyEngine | None = None, cluster: ClusterParts | None = None) -> Mechanism:
    """The ports of a pool's tiers: a disk port where it has a disk tier (with its reader),
    a device port where it has a copy engine, a remote port where it has a cluster tier."""
    return Mechanism(
        host,
        DiskPages(host, disk, reader) if disk is not None and reader is not None else None,
        ClusterPages(host, cluster) if cluster is not None else None,
        DevicePages(copies) if copies is not None else None,
    )


def _with_checksum(record: PageRecord, checksum: int | None, length: int) -> PageRecord:
    return record if checksum is None else replace(record, length=length, checksum=checksum)
