"""The pool registry: one pool per registered page layout (pages of different layouts never
share an arena), each pool one layout's tiers wired to its block store.

This is the only place that builds mechanism objects for the core, and the one place where
the mechanism's failures to build a pool become the client's typed errors
(`PoolRegistry.for_layout`).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, fields

from kvtier_client.errors import CapacityError, FailedPrecondition, InvalidArgument
from kvtier_client.ids import LeaseId, SessionId
from kvtier_client.layout import PageLayout
from kvtier_client.tiers import Tier

from kvtier.core import BlockStore, LeaseKind, StoreUsage
from kvtier.mechanism.bandwidth import Throughput, probe_disk_reads, probe_memcpy
from kvtier.mechanism.device import CopyEngine, DeviceArena, DeviceNoSpace, pin_host
from kvtier.mechanism.disk import DiskLayoutMismatch, DiskTier, FsyncPolicy
from kvtier.mechanism.host import ArenaInUse, ArenaNoSpace, HostArena
from kvtier.mechanism.io import DiskReader, IOStats, Observer
from kvtier.mechanism.mover import ArenaMover
from kvtier.policy import POLICIES, PolicyName
from kvtier.server.config import TiersConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolConfig:
    """Capacities and behaviour of one layout's tiers."""

    host_bytes: int
    disk_bytes: int = 0
    disk_dir: str | None = None
    policy: PolicyName | str = PolicyName.LRU
    write_through: bool = False  # copy to disk at commit (True) or only when evicted from host (False)
    fsync: FsyncPolicy | str = FsyncPolicy.BATCH  # when page data and index reach stable storage
    fsync_interval: float = 1.0  # seconds, for fsync = interval
    io_depth: int = 8  # disk reads (and writes) in flight at once
    max_queued_prefetch: int = 1024  # prefetch loads waiting for the disk; more hints are dropped
    prefetch_hold: float = 10.0  # seconds a prefetched page is kept unless acquired
    arena_prefix: str = "kvtier"  # host arenas are /dev/shm/<prefix>-<layout id>
    device_bytes: int = 0  # HBM for the device tier; 0 = none (needs CUDA and CuPy otherwise)
    gpu: int = 0  # CUDA device index

    @classmethod
    def from_tiers(cls, tiers: TiersConfig) -> "PoolConfig":
        """The daemon's tiers section: the options of the same name, plus the four that are
        spelled per pool here (sizes in bytes, the disk tier's directory)."""
        renamed = {"host_bytes", "disk_bytes", "device_bytes", "disk_dir"}
        same = {f.name for f in fields(cls)} - renamed
        missing = same - {f.name for f in fields(TiersConfig)}
        if missing:  # a renamed field would otherwise fall back to its default unnoticed
            raise TypeError(f"TiersConfig has no {sorted(missing)} for PoolConfig; rename them in step")
        return cls(
            **{name: getattr(tiers, name) for name in same},
            host_bytes=tiers.host_size, disk_bytes=tiers.disk_size, device_bytes=tiers.device_size,
            disk_dir=tiers.cache_dir,
        )


class Pool:
    def __init__(self, layout: PageLayout, config: PoolConfig, observer: Observer | None = None) -> None:
        """`observer` hears of every finished disk load (kind, seconds, bytes, ok): metrics."""
        host_pages = layout.pages_in(config.host_bytes, "host")
        disk_pages = layout.pages_in(config.disk_bytes, "disk") if config.disk_bytes else 0
        device_pages = layout.pages_in(config.device_bytes, "device") if config.device_bytes else 0
        if disk_pages and not config.disk_dir:
            raise ValueError("a disk tier needs a directory: set disk_dir")
        self.layout = layout
        self.config = config
        self._closed = False
        self.host = HostArena(f"{config.arena_prefix}-{layout.layout_id}", layout, host_pages)
        #: Measured read bandwidth per tier, for engines deciding between loading and recomputing.
        self.bandwidth: dict[Tier, Throughput] = {Tier.HOST: Throughput(probe_memcpy)}
        self.disk: DiskTier | None = None
        self.reader: DiskReader | None = None
        self.device: DeviceArena | None = None
        self.copies: CopyEngine | None = None
        self._unpin_host = None
        try:
            if device_pages:
                self.device = DeviceArena(layout, device_pages, config.gpu)
                self._unpin_host = pin_host(self.host, config.gpu)
                self.copies = CopyEngine(self.host, self.device)
                self.bandwidth[Tier.DEVICE] = self.copies.throughput
            if disk_pages:
                self.disk = DiskTier(
                    os.path.join(config.disk_dir, layout.layout_id), layout, disk_pages,
                    fsync=config.fsync, fsync_interval=config.fsync_interval, io_depth=config.io_depth,
                )
                disk_dir, depth = self.disk.directory, config.io_depth
                self.bandwidth[Tier.DISK] = Throughput(lambda: probe_disk_reads(disk_dir, layout.slot_bytes, depth))
                self.reader = DiskReader(
                    self.disk, self.host, depth=config.io_depth, max_queued_prefetch=config.max_queued_prefetch,
                    observer=observer, throughput=self.bandwidth[Tier.DISK],
                )
            self.store = BlockStore(
                layout,
                host_pages=host_pages,
                disk_pages=disk_pages,
                device_pages=device_pages,
                mover=ArenaMover(self.host, self.disk, self.reader, self.copies),
                policy=POLICIES[PolicyName(config.policy)],
                write_through=config.write_through,
                prefetch_hold=config.prefetch_hold,
                recovered=self.disk.records() if self.disk else (),
                recovered_host=self.host.adopted,
                host_reused=self.host.reused,
            )
        except BaseException:
            self._close_tiers()
            raise

    @property
    def pool_id(self) -> str:
        return self.layout.layout_id

    # -- the byte slow path: page bytes over gRPC, for clients on another host ----------
    def read_pages(self, session: SessionId, lease_id: LeaseId) -> list[bytes]:
        """Copies of a read lease's pages, taken while the store holds the lease."""
        with self.store.lease_slots(session, lease_id, LeaseKind.READ) as slots:
            return [bytes(self.host.page(slot)) for slot in slots]

    def write_page(self, session: SessionId, lease_id: LeaseId, index: int, data: bytes) -> None:
        """Fill page `index` of a write lease. The store holds the lease while the bytes are
        copied: a concurrent release can never leave us writing a freed slot."""
        if len(data) != self.layout.page_bytes:
            raise InvalidArgument(f"page {index} has {len(data)} bytes, a page has {self.layout.page_bytes}")
        with self.store.lease_slots(session, lease_id, LeaseKind.WRITE) as slots:
            if not 0 <= index < len(slots):
                raise InvalidArgument(f"page index {index} outside the lease's {len(slots)} pages")
            self.host.page(slots[index])[:] = memoryview(data)

    def close(self, deadline: float | None = None) -> None:
        """Save host-only pages to disk (in durable batches, none started after `deadline`),
        remove the host arena, close the disk index.

        Disk pages stay for the next start. When the deadline cut the copy short, the host
        arena and its slot table are kept instead of removed: the next daemon adopts them
        (warm restart), so a bounded stop loses nothing. A second call does nothing (a
        second persist would write through a closed index). The arena is removed even if
        saving fails.
        """
        if self._closed:
            return
        self._closed = True
        keep_arena = False
        try:
            self.store.stop_loads()
            if self.reader is not None:
                self.reader.close()  # loads in flight finish first
            self.store.persist(deadline)
            keep_arena = deadline is not None and time.monotonic() >= deadline and self.store.unsaved() > 0
            if keep_arena:
                log.warning("stop deadline passed before every host page reached disk; keeping the host arena "
                            "for the next daemon to adopt", extra={"pool": self.pool_id, "unsaved": self.store.unsaved()})
        finally:
            self._close_tiers(keep_arena=keep_arena)

    def _close_tiers(self, *, keep_arena: bool = False) -> None:
        if self.copies is not None:
            self.copies.close()  # copies in flight land first
        if self._unpin_host is not None:
            self._unpin_host()
        if self.device is not None:
            self.device.close()
        if self.reader is not None:
            self.reader.close()
        if self.disk is not None:
            self.disk.close()
        self.host.close(keep=keep_arena)


class PoolRegistry:
    """The daemon's pools by layout id: made on a layout's first Register, up to max_pools,
    closed at shutdown. Snapshots for Stats and metrics hold each store's lock only while
    reading its counts, never the registry's lock."""

    def __init__(self, tiers: TiersConfig, observer: Observer | None = None) -> None:
        """`observer` hears of every pool's finished disk loads (metrics)."""
        self._config = PoolConfig.from_tiers(tiers)
        self._max_pools = tiers.max_pools
        self._observer = observer
        self._pools: dict[str, Pool] = {}
        self._lock = threading.Lock()

    def for_layout(self, layout: PageLayout) -> Pool:
        """The pool of `layout`, made now if it is new."""
        with self._lock:
            pool = self._pools.get(layout.layout_id)
            if pool is not None:
                return pool
            if len(self._pools) >= self._max_pools:
                raise CapacityError(
                    f"daemon already serves {len(self._pools)} page layouts (max_pools); "
                    "use an existing layout or raise max_pools"
                )
            try:
                pool = Pool(layout, self._config, observer=self._observer)
            except ValueError as exc:  # the client's layout does not fit the configured tiers
                raise InvalidArgument(str(exc)) from None
            except (ArenaInUse, DiskLayoutMismatch) as exc:  # the operator's to fix; the log says so too
                log.error("cannot create pool", extra={"pool": layout.layout_id, "reason": str(exc)})
                raise FailedPrecondition(f"daemon cannot serve this layout: {exc}") from None
            except (ArenaNoSpace, DeviceNoSpace) as exc:
                log.error("cannot create pool", extra={"pool": layout.layout_id, "reason": str(exc)})
                raise CapacityError(str(exc)) from None
            self._pools[layout.layout_id] = pool
            log.info("pool created", extra={"pool": layout.layout_id, "layout": repr(layout), "host_arena": pool.host.name})
            return pool

    def _all(self) -> list[Pool]:
        with self._lock:
            return list(self._pools.values())

    def snapshot(self) -> list[tuple[Pool, StoreUsage]]:
        return [(pool, pool.store.stats()) for pool in self._all()]

    def disk_snapshot(self) -> list[tuple[str, IOStats, int, int]]:
        """(pool id, reader stats, bytes read, bytes written) for each pool with a disk tier."""
        return [
            (pool.pool_id, pool.reader.stats(), pool.disk.bytes_read, pool.disk.bytes_written)
            for pool in self._all()
            if pool.reader is not None and pool.disk is not None
        ]

    def bandwidth_snapshot(self) -> list[tuple[str, Tier, float]]:
        """(pool id, tier, measured read bytes per second) for each pool and tier with a figure."""
        return [
            (pool.pool_id, tier, throughput.bytes_per_second)
            for pool in self._all()
            for tier, throughput in pool.bandwidth.items()
        ]

    def open_leases(self) -> int:
        return sum(usage.leases for _, usage in self.snapshot())

    def close_all(self, deadline: float | None = None) -> None:
        for pool in self._all():
            pool.close(deadline)
