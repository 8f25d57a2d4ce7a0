"""A pool: one page layout's tiers wired to its block store.

This is the only place that builds mechanism objects for the core; the daemon holds one
pool per registered layout (pages of different layouts never share an arena).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from kvtier_client.layout import PageLayout

from kvtier_client.tiers import Tier

from kvtier.core.store import BlockStore
from kvtier.mechanism.bandwidth import Throughput, probe_disk_reads, probe_memcpy
from kvtier.mechanism.device import CopyEngine, DeviceArena, pin_host
from kvtier.mechanism.disk import DiskTier, FsyncPolicy
from kvtier.mechanism.host import HostArena
from kvtier.mechanism.io import DiskReader, Observer
from kvtier.mechanism.mover import ArenaMover
from kvtier.policy import POLICIES, PolicyName


@dataclass(frozen=True)
class PoolConfig:
    """Capacities and behaviour of one layout's tiers."""

    host_bytes: int
    disk_bytes: int = 0
    disk_dir: str | None = None
    policy: str = "lru"
    write_through: bool = False  # copy to disk at commit (True) or only when evicted from host (False)
    fsync: FsyncPolicy | str = FsyncPolicy.BATCH  # when page data and index reach stable storage
    fsync_interval: float = 1.0  # seconds, for fsync = interval
    io_depth: int = 8  # disk reads (and writes) in flight at once
    max_queued_prefetch: int = 1024  # prefetch loads waiting for the disk; more hints are dropped
    prefetch_hold: float = 10.0  # seconds a prefetched page is kept unless acquired
    arena_prefix: str = "kvtier"  # host arenas are /dev/shm/<prefix>-<layout id>
    device_bytes: int = 0  # HBM for the device tier; 0 = none (needs CUDA and CuPy otherwise)
    gpu: int = 0  # CUDA device index


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
            )
        except BaseException:
            self._close_tiers()
            raise

    def close(self) -> None:
        """Save host-only pages to disk, remove the host arena, close the disk index.

        Disk pages stay for the next start; host residency does not survive a restart.
        A second call does nothing (a second persist would write through a closed index).
        The arena is removed even if saving fails.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self.store.stop_loads()
            if self.reader is not None:
                self.reader.close()  # loads in flight finish first
            self.store.persist()
        finally:
            self._close_tiers()

    def _close_tiers(self) -> None:
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
        self.host.close()
