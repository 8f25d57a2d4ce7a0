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
from collections.abc import Mapping
from dataclasses import replace

from kvtier_client.errors import CapacityError, FailedPrecondition, InvalidArgument, KVTierError, NotFound
from kvtier_client.ids import LeaseId, SessionId
from kvtier_client.layout import PageLayout
from kvtier_client.tiers import Tier

from kvtier.codecs import CodecChoice, codec_named
from kvtier.core.chunks import chunk_bytes_for
from kvtier.events import EventPublisher
from kvtier.core import BlockStore, ClusterWrite, LeaseKind, Quota, StoreUsage, clean_reserve
from kvtier.core.index import TierCounters
from kvtier.core.results import TierUsage
from kvtier.mechanism.bandwidth import Throughput, probe_disk_reads, probe_memcpy, with_decode
from kvtier.mechanism.cluster import ClusterStats, ClusterTier, ClusterWriter, FaultKind, RemoteStore, open_backend
from kvtier.mechanism.cluster.tier import LatencyObserver
from kvtier.mechanism.device import AnyDeviceArena, CopyEngine, DeviceNoSpace, open_device_arena, pin_host
from kvtier.mechanism.disk import DiskLayoutMismatch, DiskTier
from kvtier.mechanism.host import HostArena
from kvtier.mechanism.io import ClusterReader, DiskReader, IOStats, Observer, WriteBackThread
from kvtier.mechanism.keeper import KeeperClient, KeptFile
from kvtier.mechanism.mover import ClusterParts, arena_ports
from kvtier.mechanism.seal import Sealer
from kvtier.policy import POLICIES, make_admission
from kvtier.server.config import ClusterConfig, TiersConfig, read_toml
from kvtier.server.hint_keeper import HintKeeper
from kvtier.server.wire_guard import cut

log = logging.getLogger(__name__)


def cluster_parts(config: ClusterConfig, layout: PageLayout, host: HostArena, host_bytes: int,
                  max_queued_prefetch: int, throughput: Throughput, sealer: Sealer,
                  observer: LatencyObserver | None = None, codecs: CodecChoice | None = None) -> ClusterParts:
    """One pool's cluster tier: its stores (the default user, and one per namespace listed
    in the ACL file), its readers (their reads measure `throughput`: unmeasured until the
    first, no probe writes into a shared cluster) and, unless the node only reads, its
    writer."""
    def store(username: str | None = None, password: str | None = None) -> RemoteStore:
        return open_backend(config.url, username=username, password=password, tls_ca=config.tls_ca or None,
                            timeout=config.timeout)

    password = None
    if config.password_file:  # readable: checked when the configuration was loaded
        with open(config.password_file) as f:
            password = f.read().strip()
    per_namespace = {}
    if config.acl_file:
        for namespace, user in read_toml(config.acl_file, "cluster_acl_file").get("namespaces", {}).items():
            per_namespace[namespace] = store(str(user["username"]), str(user.get("password", "")) or None)
    tier = ClusterTier(store(password=password), layout=layout, prefix=config.prefix, namespace_stores=per_namespace,
                       observer=observer, sealer=sealer, codecs=codecs)
    reader = ClusterReader(tier, host, depth=2, max_queued_prefetch=max_queued_prefetch, throughput=throughput)
    writer = None
    if config.write is not ClusterWrite.OFF:
        writer = ClusterWriter(tier, host.view, checksum=host.checksum,
                               max_bytes=max(config.queue or host_bytes // 4, layout.page_bytes))
    return ClusterParts(tier, reader, writer)


class Pool:
    def __init__(
        self, layout: PageLayout, config: TiersConfig, observer: Observer | None = None, *,
        keeper: KeeperClient | None = None, kept: list[KeptFile] = (), cluster: ClusterConfig | None = None,
        cluster_observer: LatencyObserver | None = None, sealer: Sealer | None = None,
        codecs: CodecChoice | None = None,
    ) -> None:
        """`config`: the daemon's tiers section, its sizes per pool (`max_pools`,
        `warm_restart_window` and `seal_key_file` are the registry's). `observer` hears of
        every finished disk load (kind, seconds, bytes, ok): metrics. `keeper` holds the
        host memory for a successor; `kept` is what a crashed predecessor left there for
        this layout (adopted). `cluster` (with a url): a cluster tier below the others;
        `cluster_observer` hears the latency of its batches. `sealer` seals disk and
        cluster pages to their identity (unkeyed by default); `codecs` says how each
        namespace's disk and cluster pages are stored (identity by default)."""
        codecs = codecs or CodecChoice()
        host_pages = layout.pages_in(config.host_size, "host")
        disk_pages = layout.pages_in(config.disk_size, "disk") if config.disk_size else 0
        if disk_pages and not config.cache_dir:
            raise ValueError("a disk tier needs a directory: set cache_dir (or disk_size 0 for no disk tier)")
        self.layout = layout
        self.config = config
        self._closed = False
        self.host = HostArena(f"{config.arena_prefix}-{layout.layout_id}", layout, host_pages, keeper=keeper, kept=kept)
        #: Measured read bandwidth per tier, for engines deciding between loading and recomputing.
        self.bandwidth: dict[Tier, Throughput] = {Tier.HOST: Throughput(probe_memcpy)}
        self.disk: DiskTier | None = None
        self.reader: DiskReader | None = None
        self.device: AnyDeviceArena | None = None
        self.copies: CopyEngine | None = None
        self.write_back: WriteBackThread | None = None
        self.cluster: ClusterParts | None = None
        self.hints: HintKeeper | None = None
        self._unpin_host = None
        try:
            device_pages = 0
            if config.device_size:  # its page count follows from the GPU's allocation granularity
                self.device = open_device_arena(layout, config.device_size, config.gpu,
                                                name=f"{config.arena_prefix}-{layout.layout_id}")
                device_pages = self.device.pages
                self._unpin_host = pin_host(self.host, config.gpu)
                self.copies = CopyEngine(self.host, self.device)
                self.bandwidth[Tier.DEVICE] = self.copies.throughput
            if disk_pages:
                # As many index entries as the densest codec chosen can fill the chunks with.
                chunk = chunk_bytes_for(layout.slot_bytes)
                chunks = config.disk_size // chunk
                disk_pages = chunks // -(-codecs.densest(layout) // chunk)
                self.disk = DiskTier(
                    os.path.join(config.cache_dir, layout.layout_id), layout, disk_pages,
                    fsync=config.fsync, fsync_interval=config.fsync_interval, io_depth=config.io_depth,
                    sealer=sealer, chunks=chunks, codecs=codecs,
                )
                disk_dir, depth = self.disk.directory, config.io_depth
                decoding = codec_named(codecs.default, layout), min(depth, os.cpu_count() or 1)
                self.bandwidth[Tier.DISK] = Throughput(
                    lambda: with_decode(probe_disk_reads(disk_dir, layout.slot_bytes, depth), *decoding))
                self.reader = DiskReader(
                    self.disk, self.host, depth=config.io_depth, max_queued_prefetch=config.max_queued_prefetch,
                    observer=observer, throughput=self.bandwidth[Tier.DISK],
                )
            if cluster is not None and cluster.url:
                self.bandwidth[Tier.CLUSTER] = Throughput()
                self.cluster = cluster_parts(cluster, layout, self.host, config.host_size, config.max_queued_prefetch,
                                             self.bandwidth[Tier.CLUSTER], sealer or Sealer(), cluster_observer, codecs)
            self.store = BlockStore(
                layout,
                host_pages=host_pages,
                disk_pages=disk_pages,
                device_pages=device_pages,
                ports=arena_ports(self.host, self.disk, self.reader, self.copies, self.cluster),
                cluster_write=cluster.write if self.cluster is not None else ClusterWrite.OFF,
                policy=POLICIES[config.policy],
                admission=make_admission(config.disk_admission, host_pages, disk_pages, config.disk_admission_threshold)
                if disk_pages else None,
                write_through=config.write_through,
                prefetch_hold=config.prefetch_hold,
                recovered=self.disk.records() if self.disk else (),
                recovered_host=self.host.adopted,
                history_size=config.history_size,
            )
            hints_path = os.path.join(config.cache_dir, layout.layout_id, "hints.json") if config.cache_dir else None
            self.hints = HintKeeper(self.store, hints_path, name=f"kvtier-hints-{layout.layout_id}")
            if self.disk is not None:
                # Writes write-through pages and keeps a reserve of clean host pages, so a
                # borrow rarely waits for a disk write (kvtier.core.disk_writes).
                reserve, store = clean_reserve(host_pages), self.store
                self.write_back = WriteBackThread(lambda: store.write_back(reserve), store.wait_write_back,
                                                  store.wake_write_back, name=f"kvtier-write-back-{layout.layout_id}")
        except BaseException:
            self._close_tiers()
            raise

    @property
    def pool_id(self) -> str:
        return self.layout.layout_id

    def set_codecs(self, codecs: CodecChoice) -> None:
        """Write pages with these codecs from now on (pages already stored keep theirs)."""
        if self.disk is not None:
            self.disk.codecs = codecs
        if self.cluster is not None:
            self.cluster.tier.codecs = codecs

    def usage(self) -> StoreUsage:
        """The store's figures, with a row for the cluster tier when there is one: its pages
        are the cluster's own memory figures over what one page takes there (shared with
        every node and layout, so an estimate), its counters this node's."""
        usage = self.store.stats()
        if self.cluster is None:
            return usage
        s, value_bytes = self.cluster.tier.stats(), self.cluster.tier.value_bytes
        cached = s.memory.used // value_bytes if s.memory else 0
        capacity = max(s.memory.limit // value_bytes, cached) if s.memory else 0
        dropped = (FaultKind.CORRUPT, FaultKind.MISBOUND)  # values that failed verification, not faults of the store
        faults = sum(n for kind, n in s.faults.items() if kind not in dropped)
        counters = TierCounters(hits=s.found, bytes_in=s.bytes_written, io_errors=faults,
                                corrupt_pages=sum(s.faults[kind] for kind in dropped))
        used, limit = (s.memory.used, max(s.memory.limit, s.memory.used)) if s.memory else (0, 0)
        row = TierUsage(Tier.CLUSTER, capacity, capacity - cached, 0, cached, 0, 0, 0, counters, used, limit, limit - used)
        return replace(usage, tiers=(*usage.tiers, row))

    def misbound_pages(self) -> dict[Tier, int]:
        """Pages dropped by the lower tiers because their seal named another identity."""
        counts = {}
        if self.disk is not None:
            counts[Tier.DISK] = self.disk.misbound_pages
        if self.cluster is not None:
            counts[Tier.CLUSTER] = self.cluster.tier.stats().faults[FaultKind.MISBOUND]
        return counts

    # -- the byte slow path: page bytes over gRPC, for clients on another host ----------
    def read_pages(self, session: SessionId, lease_id: LeaseId) -> list[bytes]:
        """Copies of a read lease's pages, taken while the store holds the lease."""
        with self.store.lease_slots(session, lease_id, LeaseKind.READ) as slots:
            return [bytes(self.host.page(slot)) for slot in slots]

    def write_page(self, session: SessionId, lease_id: LeaseId, index: int, data: bytes, offset: int = 0) -> None:
        """Fill page `index` of a write lease from byte `offset` on (WritePages sends a page in
        pieces). The store holds the lease while the bytes are copied: a concurrent release
        can never leave us writing a freed slot."""
        if offset + len(data) > self.layout.page_bytes:
            raise InvalidArgument(f"page {index}: {len(data)} bytes at offset {offset} run past its {self.layout.page_bytes}")
        with self.store.lease_slots(session, lease_id, LeaseKind.WRITE) as slots:
            if not 0 <= index < len(slots):
                raise InvalidArgument(f"page index {index} outside the lease's {len(slots)} pages")
            self.host.page(slots[index])[offset:offset + len(data)] = memoryview(data)

    def close(self, deadline: float | None = None) -> None:
        """Save host-only pages to disk (in durable batches, none started after `deadline`),
        free the host arena, close the disk index. Returns whether the arena was kept.

        Disk pages stay for the next start. When the deadline cut the copy short, the host
        arena and its slot table stay with the keeper instead of being freed: the next
        daemon adopts them (warm restart), so a bounded stop loses nothing. A second call
        does nothing (a second persist would write through a closed index). The arena is
        freed even if saving fails.
        """
        if self._closed:
            return False
        self._closed = True
        keep_arena = False
        try:
            self.hints.close()  # its file written, and no hard pin's load started after this
            self._stop_write_back()  # its batch in flight is filed first
            self._stop_cluster_writes()
            self.store.stop_loads()
            if self.reader is not None:
                self.reader.close()  # loads in flight finish first
            if self.cluster is not None:
                self.cluster.reader.close()
            self.store.persist(deadline)
            keep_arena = deadline is not None and time.monotonic() >= deadline and self.store.unsaved() > 0
            if keep_arena:
                log.warning("stop deadline passed before every host page reached disk; keeping the host arena "
                            "for the next daemon to adopt", extra={"pool": self.pool_id, "unsaved": self.store.unsaved()})
        finally:
            self._close_tiers(keep_arena=keep_arena)
        return keep_arena

    def _stop_write_back(self) -> None:
        if self.write_back is not None:
            self.write_back.stop()
            self.write_back = None

    def _stop_cluster_writes(self) -> None:
        """Let the cluster writer finish what is queued (bounded by its timeouts): its
        pages are protected host slots, released as it reports."""
        if self.cluster is not None and self.cluster.writer is not None:
            self.cluster.writer.close()

    def _close_tiers(self, *, keep_arena: bool = False) -> None:
        if self.hints is not None:
            self.hints.close()
        self._stop_write_back()  # no write after the disk closes
        self._stop_cluster_writes()
        if self.cluster is not None:
            self.cluster.reader.close()
            self.cluster.tier.close()
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

    def __init__(self, tiers: TiersConfig, observer: Observer | None = None, keeper: KeeperClient | None = None,
                 cluster: ClusterConfig | None = None, cluster_observer: LatencyObserver | None = None,
                 events: EventPublisher | None = None) -> None:
        """`observer` hears of every pool's finished disk loads (metrics); `keeper` holds the
        pools' host memory across a crash (None: a crash loses the host tier); `cluster`
        gives every pool a cluster tier (`cluster_observer` hears its batches' latency);
        `events` is told what every pool stores and drops (KV events)."""
        self._tiers = tiers
        self._sealer = Sealer.from_file(tiers.seal_key_file)  # checked when the configuration was loaded
        self._cluster = cluster
        self._cluster_observer = cluster_observer
        self._events = events
        self._max_pools = tiers.max_pools
        self._observer = observer
        self._keeper = keeper
        self._kept: dict[str, list[KeptFile]] = {}  # a crashed predecessor's files, by layout id
        self._pools: dict[str, Pool] = {}
        self._quotas: Mapping[str, Quota] = {}  # namespace -> quota, for every pool (docs/configuration.md)
        self._codecs = CodecChoice(tiers.codec)  # the tokens file's codec keys: `set_codecs`
        self._lock = threading.Lock()

    def adopt_kept(self) -> int:
        """Rebuild the pools of every layout a crashed predecessor left host memory for, so
        its pages are cached again before any client registers (and nothing stays with the
        keeper unclaimed). Returns how many pools were rebuilt."""
        if self._keeper is None:
            return 0
        for file in self._keeper.take_all():
            layout_id = file.name.partition("/")[0]
            self._kept.setdefault(layout_id, []).append(file)
        rebuilt = 0
        for layout_id, files in list(self._kept.items()):
            layout = next((_kept_layout(f) for f in files if f.meta.get("kind") == "slots"), None)
            try:
                if layout is None or layout.layout_id != layout_id:
                    raise ValueError("no slot table of this layout")
                self.for_layout(layout)
                rebuilt += 1
            except (KVTierError, ValueError) as exc:
                log.warning("dropping host memory a previous daemon left", extra={"pool": layout_id, "reason": str(exc)})
                for file in self._kept.pop(layout_id, []):
                    self._keeper.drop(file.name)
                    os.close(file.fd)
        return rebuilt

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
                pool = Pool(layout, self._tiers, observer=self._observer, keeper=self._keeper,
                            kept=self._kept.pop(layout.layout_id, []), cluster=self._cluster,
                            cluster_observer=self._cluster_observer, sealer=self._sealer, codecs=self._codecs)
            except ValueError as exc:  # the client's layout does not fit the configured tiers
                raise InvalidArgument(str(exc)) from None
            except DiskLayoutMismatch as exc:  # the operator's to fix; the log says so too
                log.error("cannot create pool", extra={"pool": layout.layout_id, "reason": str(exc)})
                raise FailedPrecondition(f"daemon cannot serve this layout: {exc}") from None
            except DeviceNoSpace as exc:
                log.error("cannot create pool", extra={"pool": layout.layout_id, "reason": str(exc)})
                raise CapacityError(str(exc)) from None
            _apply_quotas(pool, self._quotas)
            pool.hints.restore()  # a previous daemon's hints with a TTL, within these quotas
            if self._events is not None:
                pool.store.events = self._events.sink(layout.block_tokens, pool.store.held)
            self._pools[layout.layout_id] = pool
            log.info("pool created", extra={"pool": layout.layout_id, "layout": repr(layout), "adopted_pages": len(pool.host.adopted)})
            return pool

    def _all(self) -> list[Pool]:
        with self._lock:
            return list(self._pools.values())

    def all_pools(self) -> list[Pool]:
        return self._all()

    def get(self, pool_id: str) -> Pool:
        with self._lock:
            pool = self._pools.get(pool_id)
        if pool is None:
            raise NotFound(f"no pool {cut(pool_id)!r}: `kvtier stats` lists the pools (one per registered layout)")
        return pool

    def set_quotas(self, quotas: Mapping[str, Quota]) -> list[str]:
        """Use these quotas in every pool, and in pools made later. Returns the ids of the
        pools that refused them (their guarantees do not fit): those keep their old quotas."""
        with self._lock:  # a pool made meanwhile gets the new quotas
            self._quotas = dict(quotas)
            return [pool.pool_id for pool in self._pools.values() if not _apply_quotas(pool, quotas)]

    def set_codecs(self, by_namespace: Mapping[str, str]) -> None:
        """Namespaces' own codecs (the tokens file's), in every pool and in pools made later."""
        with self._lock:
            self._codecs = CodecChoice(self._tiers.codec, dict(by_namespace))
            for pool in self._pools.values():
                pool.set_codecs(self._codecs)

    def snapshot(self) -> list[tuple[Pool, StoreUsage]]:
        return [(pool, pool.usage()) for pool in self._all()]

    def disk_snapshot(self) -> list[tuple[str, IOStats, int, int]]:
        """(pool id, reader stats, bytes read, bytes written) for each pool with a disk tier."""
        return [
            (pool.pool_id, pool.reader.stats(), pool.disk.bytes_read, pool.disk.bytes_written)
            for pool in self._all()
            if pool.reader is not None and pool.disk is not None
        ]

    def cluster_snapshot(self) -> list[tuple[str, ClusterStats, int]]:
        """(pool id, cluster tier counters, bytes queued for its writer) per pool with one."""
        return [
            (pool.pool_id, pool.cluster.tier.stats(), pool.cluster.writer.queued_bytes() if pool.cluster.writer else 0)
            for pool in self._all()
            if pool.cluster is not None
        ]

    def bandwidth_snapshot(self) -> list[tuple[str, Tier, float]]:
        """(pool id, tier, measured read bytes per second) for each pool and tier with a figure."""
        return [
            (pool.pool_id, tier, throughput.bytes_per_second)
            for pool in self._all()
            for tier, throughput in pool.bandwidth.items()
        ]

    def open_leases(self) -> int:
        """From the stores' lease tables alone: the drain polls this, and a full snapshot
        would also ask the cluster for its memory figures."""
        return sum(len(pool.store.leases) for pool in self._all())

    def close_all(self, deadline: float | None = None) -> None:
        """Close every pool; the keeper then frees everything, unless a pool kept its host
        memory for the next daemon (its stop was cut short)."""
        kept = [pool.close(deadline) for pool in self._all()]
        if self._keeper is not None:
            self._keeper.close(keep=any(kept))


def _apply_quotas(pool: Pool, quotas: Mapping[str, Quota]) -> bool:
    """Set a pool's quotas; False (logged) if its tiers cannot keep them."""
    try:
        pool.store.set_quotas(quotas)
    except ValueError as exc:
        log.error("quotas do not fit this pool; it keeps its previous ones", extra={"pool": pool.pool_id, "reason": str(exc)})
        return False
    return True


def _kept_layout(file: KeptFile) -> PageLayout | None:
    try:
        return PageLayout(**file.meta["layout"])
    except (KeyError, TypeError, ValueError):
        return None
