"""Prometheus metrics. Tier gauges and counters are read from the store at scrape time (one
source of truth, nothing to keep in sync); RPC latency is observed as calls finish.
Names: `kvtier_` prefix, base units, `_total` counters (docs/metrics.md lists them all).
"""
from __future__ import annotations

import logging
import platform
import socket
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import google.protobuf
import grpc
from kvtier_client.steering import Action, SteerResult
from kvtier_client.tiers import Tier
from prometheus_client import (
    CollectorRegistry, Counter, GCCollector, Gauge, Histogram, PlatformCollector, ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvtier.core import MissReason, StoreUsage
from kvtier.events import EventStats
from kvtier.mechanism.cluster import ClusterStats, FaultKind
from kvtier.mechanism.io import IOStats, LoadKind
from kvtier.server import lookup_metrics
from kvtier.server.pools import Pool

log = logging.getLogger(__name__)

# (pool, its stats) for each pool.
Snapshot = Callable[[], list[tuple[Pool, StoreUsage]]]
# (pool id, reader stats, bytes read, bytes written) for each pool with a disk tier.
DiskSnapshot = Callable[[], list[tuple[str, IOStats, int, int]]]
# (pool id, tier, measured read bytes per second) for each pool and tier with a figure.
BandwidthSnapshot = Callable[[], list[tuple[str, Tier, float]]]
# (pool id, cluster tier counters, bytes queued for its writer) for each pool with a cluster tier.
ClusterSnapshot = Callable[[], list[tuple[str, ClusterStats, int]]]

_LOAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)
_RPC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


class _StoreCollector:
    def __init__(self, snapshot: Snapshot, sessions: Callable[[], int]) -> None:
        self._snapshot = snapshot
        self._sessions = sessions

    def collect(self) -> Iterator[Metric]:
        snapshot = self._snapshot()
        pools = [(pool.pool_id, pool.layout.page_bytes, stats) for pool, stats in snapshot]
        sessions = self._sessions()
        labels = ["pool", "tier"]
        capacity = GaugeMetricFamily("kvtier_tier_capacity_pages", "Pages a tier can hold.", labels=labels)
        capacity_bytes = GaugeMetricFamily("kvtier_tier_capacity_bytes", "Bytes of KV a tier can hold.", labels=labels)
        stored = GaugeMetricFamily(
            "kvtier_tier_stored_bytes", "Disk and cluster: bytes the cached pages take as stored (their codecs' "
            "encodings); kvtier_tier_pages{state=cached} * page bytes over this is the codecs' gain.", labels=labels)
        room = GaugeMetricFamily("kvtier_tier_room_bytes", "Disk and cluster: the tier's room in bytes, of which free "
                                 "(state=free) or used (state=used).", labels=[*labels, "state"])
        pages = GaugeMetricFamily(
            "kvtier_tier_pages",
            "Pages of a tier by state: free + writing (borrowed) + cached = capacity; of the cached pages, pinned "
            "(read-leased), loading (bytes on their way) and held (prefetched, within the hold); the rest are idle.",
            labels=[*labels, "state"],
        )
        hits = CounterMetricFamily("kvtier_hits", "Looked-up blocks whose fastest copy was in this tier.", labels=labels)
        evictions = CounterMetricFamily("kvtier_evictions", "Copies removed from a tier to make room.", labels=labels)
        promotions = CounterMetricFamily("kvtier_promotions", "Copies made in a tier from a slower tier.", labels=labels)
        demotions = CounterMetricFamily("kvtier_demotions", "Copies made in a tier from a faster tier.", labels=labels)
        moved = CounterMetricFamily("kvtier_moved_bytes", "Bytes copied between tiers.", labels=["pool", "src", "dst"])
        corrupt = CounterMetricFamily("kvtier_corrupt_pages", "Pages dropped because they failed their checksum.", labels=labels)
        io_errors = CounterMetricFamily(
            "kvtier_io_errors", "Failed reads or writes of a tier (EIO, ENOSPC...): those pages were dropped or not copied.",
            labels=labels,
        )
        refused = CounterMetricFamily(
            "kvtier_admission_refused", "Host pages not written to a tier as they left host: its admission policy refused them.",
            labels=labels,
        )
        misbound = CounterMetricFamily(
            "kvtier_misbound_pages", "Of the corrupt pages, the intact ones sealed as another key's, namespace's or "
            "layout's (moved there), or with another seal_key_file: dropped, never served.", labels=labels,
        )
        for pool, _ in snapshot:
            for tier, count in pool.misbound_pages().items():
                misbound.add_metric([pool.pool_id, tier.label], count)
        leases = GaugeMetricFamily("kvtier_leases", "Open leases.", labels=["pool"])
        for pool_id, page_bytes, stats in pools:
            leases.add_metric([pool_id], stats.leases)
            for t in stats.tiers:
                lv = [pool_id, t.tier.label]
                capacity.add_metric(lv, t.capacity)
                capacity_bytes.add_metric(lv, t.capacity * page_bytes)
                if t.capacity_bytes:
                    stored.add_metric(lv, t.stored_bytes)
                    room.add_metric([*lv, "free"], t.free_bytes)
                    room.add_metric([*lv, "used"], t.capacity_bytes - t.free_bytes)
                for state, value in (("free", t.free), ("writing", t.writing), ("cached", t.cached), ("pinned", t.pinned),
                                     ("loading", t.loading), ("held", t.held)):
                    pages.add_metric([*lv, state], value)
                c = t.counters
                hits.add_metric(lv, c.hits)
                evictions.add_metric(lv, c.evictions)
                promotions.add_metric(lv, c.promotions)
                demotions.add_metric(lv, c.demotions)
                corrupt.add_metric(lv, c.corrupt_pages)
                io_errors.add_metric(lv, c.io_errors)
                if t.tier is Tier.DISK:
                    refused.add_metric(lv, c.refused)
                # Promotions arrive from the next slower tier, demotions from the next faster.
                if c.promotions:
                    moved.add_metric([pool_id, Tier(t.tier + 1).label, t.tier.label], c.promotions * page_bytes)
                if c.demotions:
                    moved.add_metric([pool_id, Tier(t.tier - 1).label, t.tier.label], c.demotions * page_bytes)
        arrivals = CounterMetricFamily(
            "kvtier_acquire_pages", "Pages asked for by Acquire, by whether they were ready on arrival or had to load.",
            labels=["pool", "on_arrival"],
        )
        for pool_id, _, stats in pools:
            arrivals.add_metric([pool_id, "ready"], stats.ready_on_arrival)
            arrivals.add_metric([pool_id, "loaded"], stats.acquired_pages - stats.ready_on_arrival)
        yield arrivals
        yield from lookup_metrics.pool_families([(pool_id, stats) for pool_id, _, stats in pools])
        session_gauge = GaugeMetricFamily("kvtier_sessions", "Open client sessions.")
        session_gauge.add_metric([], sessions)
        yield from (capacity, capacity_bytes, stored, room, pages, hits, evictions, promotions, demotions, moved, corrupt, misbound,
                    io_errors, refused, leases, session_gauge)


class _NamespaceCollector:
    """Each namespace's share of each pool: pages, quotas, hits, evictions, and misses by
    reason (the pool's misses are their sum)."""

    def __init__(self, snapshot: Snapshot) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        # kvtier_namespace, not namespace: Prometheus adds the Kubernetes namespace as `namespace`.
        labels = ["pool", "kvtier_namespace", "tier"]
        pages = GaugeMetricFamily(
            "kvtier_namespace_pages", "Pages a namespace holds in a tier (host: cached plus borrowed for writing).",
            labels=labels,
        )
        quotas = GaugeMetricFamily(
            "kvtier_namespace_quota_pages",
            "A namespace's quota in a tier: max (never more) or guaranteed (never evicted below it by other namespaces).",
            labels=[*labels, "kind"],
        )
        hits = CounterMetricFamily("kvtier_namespace_hits", "A namespace's looked-up blocks whose fastest copy was here.",
                                   labels=labels)
        evictions = CounterMetricFamily("kvtier_namespace_evictions", "A namespace's copies evicted from a tier.",
                                        labels=labels)
        misses = CounterMetricFamily(
            "kvtier_misses", f"Looked-up blocks not served, by reason: {', '.join(r.value for r in MissReason)}.",
            labels=["pool", "kvtier_namespace", "reason"],
        )
        hinted = GaugeMetricFamily(
            "kvtier_hinted_blocks", "A namespace's blocks under a client's cache-control hint, by class: hard and soft "
            "(pinned), high and cold (retained).", labels=["pool", "kvtier_namespace", "class"])
        expiry = GaugeMetricFamily(
            "kvtier_hint_next_expiry_seconds", "Seconds until a namespace's first hint with a TTL ends; 0: none has one.",
            labels=["pool", "kvtier_namespace"])
        hard = GaugeMetricFamily(
            "kvtier_hard_pinned_pages", "A namespace's hard-pinned blocks by where their host copy is: in_host (held), "
            "loading, waiting (no host copy yet: loaded as room appears).", labels=["pool", "kvtier_namespace", "state"])
        snapshot = self._snapshot()
        yield from lookup_metrics.namespace_families([(pool.pool_id, ns) for pool, stats in snapshot for ns in stats.namespaces])
        for pool, stats in snapshot:
            for ns in stats.namespaces:
                usage = pool.store.control.usage(ns.namespace)
                for kind in ("hard", "soft", "high", "cold"):
                    hinted.add_metric([pool.pool_id, ns.namespace, kind], getattr(usage, kind))
                expiry.add_metric([pool.pool_id, ns.namespace], usage.next_expiry_seconds)
                for state in ("in_host", "loading", "waiting"):
                    hard.add_metric([pool.pool_id, ns.namespace, state], getattr(usage, f"hard_{state}"))
                for reason, count in sorted(ns.misses.items()):
                    if count:
                        misses.add_metric([pool.pool_id, ns.namespace, reason], count)
                for t in ns.tiers:
                    lv = [pool.pool_id, ns.namespace, t.tier.label]
                    pages.add_metric(lv, t.pages)
                    hits.add_metric(lv, t.hits)
                    evictions.add_metric(lv, t.evictions)
                    for kind, value in (("max", t.max_pages), ("guaranteed", t.guaranteed_pages)):
                        if value:  # 0 = no quota
                            quotas.add_metric([*lv, kind], value)
        yield from (pages, quotas, hits, evictions, misses, hinted, expiry, hard)


class _MemoryCollector:
    """What long-running or hostile load could grow, beside its bound: the miss history of
    each pool, the namespaces admitted, and the trims that hand freed heap back."""

    def __init__(self, snapshot: Snapshot, namespaces: Callable[[], tuple[int, int]], trims: Callable[[], int]) -> None:
        self._snapshot = snapshot
        self._namespaces = namespaces
        self._trims = trims

    def collect(self) -> Iterator[Metric]:
        entries = GaugeMetricFamily("kvtier_history_entries", "Evicted blocks the miss history remembers, all namespaces "
                                    "together, and (kind max) the most it keeps (history_size).", labels=["pool", "kind"])
        size = GaugeMetricFamily("kvtier_history_bytes", "The miss history's estimated size.", labels=["pool"])
        for pool, stats in self._snapshot():
            entries.add_metric([pool.pool_id, "held"], stats.history_entries)
            entries.add_metric([pool.pool_id, "max"], stats.history_limit)
            size.add_metric([pool.pool_id], stats.history_bytes)
        admitted, limit = self._namespaces()
        namespaces = GaugeMetricFamily("kvtier_namespaces", "Namespaces admitted since the daemon started, and (kind max) "
                                       "the most admitted beyond those the tokens file names (max_namespaces).",
                                       labels=["kind"])
        namespaces.add_metric(["admitted"], admitted)
        namespaces.add_metric(["max"], limit)
        trims = CounterMetricFamily("kvtier_heap_trims", "malloc_trim calls after large requests (kvtier.server.heap).")
        trims.add_metric([], self._trims())
        yield from (entries, size, namespaces, trims)


class _DiskCollector:
    def __init__(self, snapshot: DiskSnapshot) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        read = CounterMetricFamily("kvtier_disk_read_bytes", "Bytes read from the disk tier.", labels=["pool"])
        written = CounterMetricFamily("kvtier_disk_written_bytes", "Bytes written to the disk tier.", labels=["pool"])
        queued = GaugeMetricFamily("kvtier_disk_queue_depth", "Disk loads waiting for a reader, by kind.", labels=["pool", "kind"])
        in_flight = GaugeMetricFamily("kvtier_disk_reads_in_flight", "Disk loads being read now.", labels=["pool"])
        failed = CounterMetricFamily("kvtier_disk_read_failed_batches", "Disk reads that raised instead of reading: "
                                     "their loads failed and their pages were dropped (the log has why).", labels=["pool"])
        for pool_id, io, bytes_read, bytes_written in self._snapshot():
            read.add_metric([pool_id], bytes_read)
            written.add_metric([pool_id], bytes_written)
            queued.add_metric([pool_id, "acquire"], io.queued_acquire)
            queued.add_metric([pool_id, "prefetch"], io.queued_prefetch)
            in_flight.add_metric([pool_id], io.in_flight)
            failed.add_metric([pool_id], io.failed_batches)
        yield from (read, written, queued, in_flight, failed)


class _ClusterCollector:
    def __init__(self, snapshot: ClusterSnapshot) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        def counter(name: str, text: str, extra: tuple[str, ...] = ()) -> CounterMetricFamily:
            return CounterMetricFamily(name, text, labels=["pool", *extra])

        looked_up = counter("kvtier_cluster_lookup_blocks", "Keys asked of the cluster tier after this node's tiers missed.")
        hits = counter("kvtier_cluster_hits", "Of those, found in the cluster (its hit prefix).")
        read_pages = counter("kvtier_cluster_read_pages", "Pages loaded from the cluster tier, checksums verified.")
        read_bytes = counter("kvtier_cluster_read_bytes", "Bytes loaded from the cluster tier.")
        read_misses = counter("kvtier_cluster_read_misses", "Pages asked of the cluster that it no longer held (evicted there).")
        written_pages = counter("kvtier_cluster_written_pages", "Committed pages written to the cluster tier.")
        written_bytes = counter("kvtier_cluster_written_bytes", "Bytes written to the cluster tier.")
        dropped = counter("kvtier_cluster_writes_dropped", "Committed pages not written: the writer's queue was full "
                                                            "or the cluster failing.")
        faults = counter("kvtier_cluster_faults", "Keys whose cluster call failed, by kind (unavailable, timeout, moved, "
                                                  "full, corrupt, misbound, other): each one a miss.", ("kind",))
        memory = GaugeMetricFamily("kvtier_cluster_memory_bytes", "The cluster's own memory figures summed over its "
                                   "primaries: used, and limit (maxmemory; 0 = none).", labels=["pool", "kind"])
        queued = GaugeMetricFamily("kvtier_cluster_write_queue_bytes", "Committed pages waiting for the cluster writer.",
                                   labels=["pool"])
        for pool_id, s, queue in self._snapshot():
            lv = [pool_id]
            for family, value in ((looked_up, s.looked_up), (hits, s.found), (read_pages, s.pages_read),
                                  (read_bytes, s.bytes_read), (read_misses, s.read_misses),
                                  (written_pages, s.pages_written), (written_bytes, s.bytes_written),
                                  (dropped, s.writes_dropped)):
                family.add_metric(lv, value)
            for kind in FaultKind:
                faults.add_metric([pool_id, kind.value], s.faults.get(kind, 0))
            if s.memory is not None:
                memory.add_metric([pool_id, "used"], s.memory.used)
                memory.add_metric([pool_id, "limit"], s.memory.limit)
            queued.add_metric(lv, queue)
        yield from (looked_up, hits, read_pages, read_bytes, read_misses, written_pages, written_bytes, dropped, faults,
                    memory, queued)


class _BandwidthCollector:
    def __init__(self, snapshot: BandwidthSnapshot) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        gauge = GaugeMetricFamily(
            "kvtier_tier_read_bytes_per_second",
            "Measured read bandwidth of a tier (probe at pool creation, then real reads): what load planners use.",
            labels=["pool", "tier"],
        )
        for pool_id, tier, value in self._snapshot():
            gauge.add_metric([pool_id, tier.name.lower()], value)
        yield gauge


class _EventsCollector:
    """The KV event publisher's counters (docs/events.md)."""

    def __init__(self, stats: Callable[[], EventStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        published = CounterMetricFamily(
            "kvtier_events_published", "Block events (a copy arriving in or leaving a tier) sent over ZMQ.")
        published.add_metric([], stats.published)
        reannounced = CounterMetricFamily(
            "kvtier_events_reannounced", "Block events sent over ZMQ to tell the whole state again (a subscriber or "
            "an engine joined, the events_reannounce timer, the host copies taken back at a stop).")
        reannounced.add_metric([], stats.reannounced)
        dropped = CounterMetricFamily(
            "kvtier_events_dropped",
            "Block events not delivered, by where: buffer (the publisher fell behind; lost for every consumer) or "
            "watcher (a WatchEvents stream read too slowly; lost for that stream).", labels=["where"])
        dropped.add_metric(["buffer"], stats.dropped)
        dropped.add_metric(["watcher"], stats.watcher_missed)
        watchers = GaugeMetricFamily("kvtier_events_watchers", "Open WatchEvents streams.")
        watchers.add_metric([], stats.watchers)
        yield from (published, reannounced, dropped, watchers)


class Metrics:
    """The daemon's registry: disk load and RPC latency as they happen, and (once `watch` is
    called) the store, namespace, disk and bandwidth collectors read at scrape time."""

    def __init__(self, version: str = "") -> None:
        # No `<name>_created` series: one per counter and histogram child, doubling the series
        # for a timestamp nobody queries (process-wide; the daemon owns its process).
        disable_created_metrics()
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # process_*: RSS, open fds, CPU seconds, start time
        PlatformCollector(registry=self.registry)  # python_info
        GCCollector(registry=self.registry)  # python_gc_*
        self.build_info = Gauge(
            "kvtier_build_info", "Always 1: the versions of kvtier and of what it runs on, as labels.",
            ["version", "python", "grpc", "protobuf"], registry=self.registry,
        )
        self.build_info.labels(version, platform.python_version(), grpc.__version__, google.protobuf.__version__).set(1)
        self.sessions_ended = Counter(
            "kvtier_sessions_ended", "Sessions ended, by reason: closed (CloseSession), timeout (missed heartbeats), "
            "shutdown (the daemon stopped).", ["reason"], registry=self.registry,
        )
        for reason in SESSION_END_REASONS:
            self.sessions_ended.labels(reason)
        self.register_rejected = Counter(
            "kvtier_register_rejected", "Register calls refused, by reason (docs/metrics.md).", ["reason"],
            registry=self.registry,
        )
        for reason in REGISTER_REJECT_REASONS.values():
            self.register_rejected.labels(reason)
        self.load_duration = Histogram(
            "kvtier_disk_load_duration_seconds",
            "Time from queueing a disk page load to the page being in host memory, by kind (acquire, prefetch) and result.",
            ["kind", "result"],
            buckets=_LOAD_BUCKETS,
            registry=self.registry,
        )
        self.rpc_duration = Histogram(
            "kvtier_rpc_duration_seconds",
            "Time to serve a call, by method, gRPC status code and transport (grpc, or lane: the same-host fast lane).",
            ["method", "code", "transport"],
            buckets=_RPC_BUCKETS,
            registry=self.registry,
        )
        self.cluster_duration = Histogram(
            "kvtier_cluster_op_duration_seconds",
            "Time of one batch against the cluster tier, by operation (exists, get, put, delete).",
            ["op"],
            buckets=_LOAD_BUCKETS,
            registry=self.registry,
        )
        self.reloads = Counter(
            "kvtier_reloads", "Re-readings of the tokens file (SIGHUP): ok, or error (the file was refused, or a "
            "pool refused its quotas).", ["result"], registry=self.registry,
        )
        for result in ("ok", "error"):
            self.reloads.labels(result)
        self.local_refused = Counter(
            "kvtier_local_connections_refused", "Connections to a local socket (handoff, lane) refused at once, or "
            "dropped for sending nothing in time, by reason: uid_limit, total_limit, deadline.", ["socket", "reason"],
            registry=self.registry,
        )
        self.steer_blocks = Counter(
            "kvtier_steer_blocks", "Blocks named by cache-control requests (Steer), by action and result: applied, "
            "missing (not cached here) or skipped (cached, left as they were).", ["action", "result"],
            registry=self.registry,
        )
        for action in Action:
            for result in ("applied", "missing", "skipped"):
                self.steer_blocks.labels(action.label, result)

    def watch(self, snapshot: Snapshot, sessions: Callable[[], int], disk_snapshot: DiskSnapshot,
              bandwidth_snapshot: BandwidthSnapshot, cluster_snapshot: ClusterSnapshot) -> None:
        """Read these at every scrape (the pool registry's snapshots and the session count).
        A second step because the pools report their loads to `observe_load`."""
        self.registry.register(_StoreCollector(snapshot, sessions))
        self.registry.register(_NamespaceCollector(snapshot))
        self.registry.register(_DiskCollector(disk_snapshot))
        self.registry.register(_BandwidthCollector(bandwidth_snapshot))
        self.registry.register(_ClusterCollector(cluster_snapshot))

    def watch_memory(self, snapshot: Snapshot, namespaces: Callable[[], tuple[int, int]], trims: Callable[[], int]) -> None:
        """Read the bounded structures' sizes at every scrape: `namespaces()` is (admitted,
        max_namespaces), `trims()` the heap trims so far."""
        self.registry.register(_MemoryCollector(snapshot, namespaces, trims))

    def watch_events(self, stats: Callable[[], EventStats]) -> None:
        """Read the KV event publisher's counters at every scrape (daemons with events on)."""
        self.registry.register(_EventsCollector(stats))

    def observe_load(self, kind: LoadKind, seconds: float, nbytes: int, ok: bool) -> None:
        """The pools' DiskReader observer."""
        self.load_duration.labels(kind.name.lower(), "ok" if ok else "corrupt").observe(seconds)

    def observe_cluster(self, op: str, seconds: float) -> None:
        """The pools' cluster tier observer."""
        self.cluster_duration.labels(op).observe(seconds)

    def session_ended(self, reason: str) -> None:
        """The session manager's observer."""
        self.sessions_ended.labels(reason).inc()

    def register_refused(self, code: str) -> None:
        """A Register call refused with this gRPC status code name."""
        self.register_rejected.labels(REGISTER_REJECT_REASONS.get(code, "other")).inc()

    def steered(self, action: Action, result: SteerResult) -> None:
        """A Steer request answered (either transport)."""
        for name, count in (("applied", result.applied), ("missing", result.missing), ("skipped", result.skipped)):
            if count:
                self.steer_blocks.labels(action.label, name).inc(count)

    def local_connection_refused(self, socket: str, reason: str) -> None:
        """A local socket's listener refused or dropped a connection (kvtier.server.listener)."""
        self.local_refused.labels(socket, reason).inc()

    def serve(self, host: str, port: int, ready: Callable[[], bool]) -> "MetricsServer":
        """Serve /metrics, /healthz and /readyz (`ready()`: whether the daemon serves now)
        on a thread; returns the server, whose `stop()` ends it."""
        server = MetricsServer(host, port, self.registry, ready)
        server.start()
        return server


#: kvtier_sessions_ended_total's reasons (sessions.SessionManager passes them).
SESSION_END_REASONS = ("closed", "timeout", "shutdown")
#: kvtier_register_rejected_total's reason for each status code Register refuses with.
REGISTER_REJECT_REASONS = {
    "UNAUTHENTICATED": "unauthenticated",  # no token, or one the tokens file does not hold
    "PERMISSION_DENIED": "permission_denied",  # the token does not grant the namespace
    "INVALID_ARGUMENT": "invalid_argument",  # a malformed namespace, layout or hash algorithm
    "FAILED_PRECONDITION": "failed_precondition",  # key hashing mismatch, or a layout the disk tier cannot take
    "RESOURCE_EXHAUSTED": "resource_exhausted",  # max_pools or max_namespaces reached, or no device memory for a new pool
    "UNAVAILABLE": "draining",  # the daemon is shutting down
}


class _Handler(BaseHTTPRequestHandler):
    server: "_HTTPServer"
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self._answer(body=True)

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def _answer(self, body: bool) -> None:
        path = urlsplit(self.path).path
        content_type = "text/plain; charset=utf-8"
        if path == "/metrics":
            encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
            try:
                status, payload = 200, encoder(self.server.registry)
            except Exception:  # a collector failed: say so rather than drop the connection
                log.exception("metrics scrape failed")
                status, payload, content_type = 500, b"scrape failed; the daemon log has the details\n", "text/plain"
        elif path == "/healthz":
            status, payload = 200, b"ok\n"
        elif path == "/readyz":
            ready = self.server.ready()
            status, payload = (200, b"ready\n") if ready else (503, b"not ready: starting or draining\n")
        else:
            status, payload = 404, b"not found: /metrics, /healthz, /readyz\n"
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if body:
            self.wfile.write(payload)

    def log_message(self, format: str, *args) -> None:  # scrapes every few seconds: not worth a log line
        pass


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True  # a stuck client never holds the daemon's exit

    def __init__(self, address, family: int, registry: CollectorRegistry, ready: Callable[[], bool]) -> None:
        self.address_family = family
        self.registry = registry
        self.ready = ready
        super().__init__(address, _Handler)


class MetricsServer:
    """The metrics port: `/metrics` (Prometheus exposition), `/healthz` (200 while the
    process answers HTTP: liveness), `/readyz` (200 while the daemon's gRPC health is SERVING,
    503 while it starts or drains: readiness); any other path 404. A threaded http.server
    (prometheus_client's own server answers the metrics on every path)."""

    def __init__(self, host: str, port: int, registry: CollectorRegistry, ready: Callable[[], bool]) -> None:
        family, _, _, _, address = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
        self._server = _HTTPServer(address[:2], family, registry, ready)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="kvtier-metrics", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
