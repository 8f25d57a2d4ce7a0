"""The gRPC servicer: thin. Each method resolves the session, calls the core, and turns the
result into a reply; core errors become status codes in one place (`_rpc`)."""
from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator, Mapping

import grpc
from kvtier_client.errors import InvalidArgument, KVTierError, Unavailable
from kvtier_client.proto.v1 import kvtier_pb2 as pb
from kvtier_client.proto.v1 import kvtier_pb2_grpc
from kvtier_client.tiers import Tier
from kvtier_client.wire import layout_to_proto, tier_to_proto

from kvtier.core import LeaseKind, StoreUsage
from kvtier.mechanism.bandwidth import Throughput

log = logging.getLogger(__name__)


def _rpc(method: Callable | None = None, *, name: str | None = None) -> Callable:
    """Time the call, map KVTierError to its status code, log anything unexpected.
    `name` labels the metric when the method is a helper of a streaming RPC."""
    if method is None:
        return functools.partial(_rpc, name=name)
    name = name or method.__name__

    @functools.wraps(method)
    def wrapper(self: "KVTierService", request, context: grpc.ServicerContext):
        start = time.perf_counter()
        code = "OK"
        try:
            return method(self, request, context)
        except KVTierError as exc:
            code = exc.code
            context.abort(getattr(grpc.StatusCode, exc.code), str(exc))
        except Exception:
            if context.code() is not None:  # already aborted by the method
                raise
            code = "INTERNAL"
            log.exception("internal error in %s", name)
            context.abort(grpc.StatusCode.INTERNAL, f"internal error in {name}; the daemon log has the details")
        finally:
            self.daemon.metrics.rpc_duration.labels(name, code).observe(time.perf_counter() - start)

    return wrapper


def _tier_from_pb(value: int, pool) -> Tier:
    if value in (pb.TIER_UNSPECIFIED, pb.TIER_HOST):
        return Tier.HOST
    if value == pb.TIER_DEVICE:
        if pool.device is None:
            raise InvalidArgument("this daemon has no device tier (no GPU, or device_size 0); use TIER_HOST")
        return Tier.DEVICE
    raise InvalidArgument(f"pages can be acquired into host (or device on GPU daemons), not tier {value}")


def _wait_timeout(request: pb.AcquireRequest) -> float | None:
    """The wait policy as the core's timeout: None = all, 0 = none, t = deadline."""
    if request.wait == pb.WAIT_NONE:
        return 0.0
    if request.wait == pb.WAIT_DEADLINE:
        if request.deadline_ms == 0:
            raise InvalidArgument("WAIT_DEADLINE needs deadline_ms > 0")
        return request.deadline_ms / 1000
    if request.wait in (pb.WAIT_ALL, pb.WAIT_POLICY_UNSPECIFIED):
        return None
    raise InvalidArgument(f"unknown wait policy {request.wait}; use WAIT_NONE, WAIT_ALL or WAIT_DEADLINE")


def tier_stats_pb(stats: StoreUsage, bandwidth: Mapping[Tier, Throughput]) -> list[pb.TierStats]:
    return [
        pb.TierStats(
            tier=tier_to_proto(t.tier), capacity_pages=t.capacity, free_pages=t.free, writing_pages=t.writing,
            cached_pages=t.cached, pinned_pages=t.pinned, hits=t.counters.hits, evictions=t.counters.evictions,
            promotions=t.counters.promotions, demotions=t.counters.demotions, bytes_in=t.counters.bytes_in,
            corrupt_pages=t.counters.corrupt_pages,
            read_bytes_per_second=bandwidth[t.tier].bytes_per_second if t.tier in bandwidth else 0.0,
        )
        for t in stats.tiers
    ]


class KVTierService(kvtier_pb2_grpc.KVTierServicer):
    def __init__(self, daemon) -> None:  # kvtier.server.daemon.Daemon (not imported: it imports us)
        self.daemon = daemon

    def _open(self):
        """Refuse work that would take new pages while the daemon drains."""
        if self.daemon.draining:
            raise Unavailable("daemon is draining for shutdown; retry with backoff against its successor")

    @_rpc
    def Register(self, request: pb.RegisterRequest, context) -> pb.RegisterResponse:
        self._open()
        session = self.daemon.register(request, context.invocation_metadata())
        pool = session.pool
        tiers = [pb.TierInfo(tier=tier_to_proto(t.tier), capacity_pages=t.capacity) for t in pool.store.stats().tiers]
        return pb.RegisterResponse(
            session_id=session.session_id,
            page_bytes=pool.layout.page_bytes,
            slot_bytes=pool.layout.slot_bytes,
            tiers=tiers,
            host_arena=pool.host.name,
            host_arena_bytes=pool.host.size,
            device_ipc_handle=pool.device.ipc_handle if pool.device is not None else b"",
            device_arena_bytes=pool.device.size if pool.device is not None else 0,
            device_pci_bus_id=pool.device.pci_bus_id if pool.device is not None else "",
            heartbeat_interval_ms=int(self.daemon.sessions.heartbeat_interval * 1000),
            session_timeout_ms=int(self.daemon.sessions.timeout * 1000),
            pool_id=pool.layout.layout_id,
        )

    @_rpc
    def Heartbeat(self, request, context) -> pb.HeartbeatResponse:
        session = self.daemon.sessions.get(request.session_id)
        return pb.HeartbeatResponse(leases=session.pool.store.session_leases(session.session_id))

    @_rpc
    def CloseSession(self, request, context) -> pb.CloseSessionResponse:
        return pb.CloseSessionResponse(released_leases=self.daemon.sessions.close(request.session_id))

    @_rpc
    def Lookup(self, request, context) -> pb.LookupResponse:
        s = self.daemon.sessions.get(request.session_id)
        result = s.pool.store.lookup(s.namespace, list(request.keys))
        return pb.LookupResponse(hit_blocks=result.hit_blocks, tiers=[tier_to_proto(t) for t in result.tiers])

    @_rpc
    def Borrow(self, request, context) -> pb.BorrowResponse:
        self._open()
        s = self.daemon.sessions.get(request.session_id)
        lease = s.pool.store.borrow(s.session_id, s.namespace, request.count)
        self.daemon.check_still_open(s, lease.lease_id)
        return pb.BorrowResponse(lease_id=lease.lease_id, tier=tier_to_proto(lease.tier), slots=lease.slots)

    @_rpc
    def Commit(self, request, context) -> pb.CommitResponse:
        s = self.daemon.sessions.get(request.session_id)
        result = s.pool.store.commit(s.session_id, request.lease_id, list(request.keys), request.parent or None)
        self.daemon.lease_ended()
        return pb.CommitResponse(committed=result.committed, duplicates=result.duplicates)

    @_rpc
    def Acquire(self, request, context) -> pb.AcquireResponse:
        self._open()
        s = self.daemon.sessions.get(request.session_id)
        tier = _tier_from_pb(request.tier, s.pool)
        lease = s.pool.store.acquire(s.session_id, s.namespace, list(request.keys), tier, _wait_timeout(request))
        self.daemon.check_still_open(s, lease.lease_id)
        return pb.AcquireResponse(
            lease_id=lease.lease_id, tier=tier_to_proto(lease.tier), slots=lease.slots,
            ready=lease.ready, promoted=lease.promoted,
            ready_event=lease.transfer.ipc_handle if lease.transfer is not None else b"",
        )

    @_rpc
    def Release(self, request, context) -> pb.ReleaseResponse:
        s = self.daemon.sessions.get(request.session_id)
        s.pool.store.release(s.session_id, request.lease_id)
        self.daemon.lease_ended()
        return pb.ReleaseResponse()

    @_rpc
    def Prefetch(self, request, context) -> pb.PrefetchResponse:
        self._open()
        s = self.daemon.sessions.get(request.session_id)
        tier = _tier_from_pb(request.tier, s.pool)
        # Only schedules loads (the disk reads run on the pool's I/O workers): returns at once.
        accepted = s.pool.store.prefetch(s.session_id, s.namespace, list(request.keys), tier, request.priority)
        return pb.PrefetchResponse(accepted=accepted)

    @_rpc
    def Stats(self, request, context) -> pb.StatsResponse:
        self.daemon.authenticate_any(context.invocation_metadata())
        pools, sessions = self.daemon.snapshot()
        reply = pb.StatsResponse(version=self.daemon.version, sessions=sessions, uptime_seconds=self.daemon.uptime())
        for pool_id, stats in pools:
            pool = self.daemon.pools[pool_id]
            layout = pool.layout
            reply.leases += stats.leases
            reply.pools.append(
                pb.PoolStats(
                    pool_id=pool_id,
                    layout=layout_to_proto(layout),
                    page_bytes=layout.page_bytes, tiers=tier_stats_pb(stats, pool.bandwidth),
                    lookup_blocks=stats.lookup_blocks, miss_blocks=stats.miss_blocks,
                )
            )
        return reply

    # -- slow path: page bytes over gRPC for clients on another host -------------
    def ReadPages(self, request, context) -> Iterator[pb.PageData]:
        pages = self._read_pages(request, context)
        yield from pages

    @_rpc(name="ReadPages")
    def _read_pages(self, request, context) -> list[pb.PageData]:
        s = self.daemon.sessions.get(request.session_id)
        # Copy out while the store holds the lease still; the stream is sent after.
        with s.pool.store.lease_slots(s.session_id, request.lease_id, LeaseKind.READ) as slots:
            return [pb.PageData(index=i, data=bytes(s.pool.host.page(slot))) for i, slot in enumerate(slots)]

    def WritePages(self, request_iterator, context) -> pb.WritePagesResponse:
        return self._write_pages(request_iterator, context)

    @_rpc(name="WritePages")
    def _write_pages(self, request_iterator, context) -> pb.WritePagesResponse:
        first = next(request_iterator, None)
        if first is None:
            raise InvalidArgument("WritePages got no messages; send session_id and lease_id first")
        s = self.daemon.sessions.get(first.session_id)
        page_bytes = s.pool.layout.page_bytes
        written = 0
        message = first
        while message is not None:
            if len(message.data) != page_bytes:
                raise InvalidArgument(f"page {message.index} has {len(message.data)} bytes, a page has {page_bytes}")
            # Hold the lease per page: a concurrent release can never leave us writing a freed slot.
            with s.pool.store.lease_slots(s.session_id, first.lease_id, LeaseKind.WRITE) as slots:
                if not 0 <= message.index < len(slots):
                    raise InvalidArgument(f"page index {message.index} outside the lease's {len(slots)} pages")
                s.pool.host.page(slots[message.index])[:] = memoryview(message.data)
            written += 1
            message = next(request_iterator, None)
        return pb.WritePagesResponse(pages=written)
