"""The gRPC servicer: thin. Each method resolves the session, calls the core (or one of its
typed collaborators: sessions, pools, auth, drain gate, metrics), and turns the result into a
reply; errors become status codes in one place (`_rpc`)."""
from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import grpc
from kvtier_client.errors import FailedPrecondition, InvalidArgument, KVTierError
from kvtier_client.ids import LeaseId
from kvtier_client.keys import ALGORITHMS, hash_fingerprint
from kvtier_client.layout import PageLayout
from kvtier_client.proto.v1 import kvtier_pb2 as pb
from kvtier_client.proto.v1 import kvtier_pb2_grpc
from kvtier_client.steering import PinUsage
from kvtier_client.tiers import Tier
from kvtier_client.wire import layout_to_proto, tier_to_proto

from kvtier.core import NamespaceUsage, StoreUsage, check_namespace
from kvtier.core.results import PrefixMatch, ReadGrant
from kvtier.events import EngineIdentity, Event, EventKind, EventPublisher, Watcher
from kvtier.events.watch import holder_of
from kvtier.mechanism.bandwidth import Throughput
from kvtier.server.auth import Authorizer
from kvtier.server.drain import DrainGate
from kvtier.server.explain import Explainer
from kvtier.server.groups import lookup_groups
from kvtier.server.metrics import Metrics
from kvtier.server.namespaces import NamespaceGate
from kvtier.server.ops import HotOps, grant_fields, steer_of
from kvtier.server.pieces import PieceOrder
from kvtier.server.pools import PoolRegistry
from kvtier.server.sessions import Caller, Session, SessionManager
from kvtier.server.wire_guard import cut, layout_of

log = logging.getLogger(__name__)


def _rpc(method: Callable | None = None, *, name: str | None = None) -> Callable:
    """Time the call, map KVTierError to its status code, log anything unexpected.
    `name` labels the metric when the method is a helper of a streaming RPC."""
    if method is None:
        return functools.partial(_rpc, name=name)
    name = name or method.__name__

    @functools.wraps(method)
    def wrapper(self: KVTierService, request, context: grpc.ServicerContext):
        start = time.perf_counter()
        code = "OK"
        try:
            return method(self, request, context)
        except KVTierError as exc:
            code = exc.code
            context.abort(getattr(grpc.StatusCode, exc.code), str(exc))
        except grpc.RpcError:
            # A stream's request iterator: the call ended under us (client cancelled, deadline,
            # a message gRPC refused as over its limit). Nobody to answer, nothing to log.
            code = "CANCELLED"
            raise
        except Exception:
            if context.code() is not None:  # already aborted (by the method, or the wire guard on a stream)
                code = context.code().name
                raise
            code = "INTERNAL"
            log.exception("internal error in %s", name)
            context.abort(grpc.StatusCode.INTERNAL, f"internal error in {name}; the daemon log has the details")
        finally:
            self.metrics.rpc_duration.labels(name, code, "grpc").observe(time.perf_counter() - start)

    return wrapper


def _engine(request: pb.RegisterRequest) -> EngineIdentity | None:
    """The engine the client says it serves for, named in the namespace's KV event topics."""
    if not request.engine_endpoint and not request.served_model:
        return None
    try:
        return EngineIdentity.parse(cut(request.engine_endpoint), cut(request.served_model))
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None


def _layout(request: pb.RegisterRequest) -> PageLayout:
    """The request's page layout, once its key hashing is known to match ours."""
    if request.hash_algorithm not in ALGORITHMS:
        raise InvalidArgument(f"unknown hash_algorithm {cut(request.hash_algorithm)!r}; use one of {', '.join(ALGORITHMS)}")
    expected = hash_fingerprint(request.hash_algorithm)
    if request.hash_fingerprint != expected:
        raise FailedPrecondition(
            f"block-key fingerprint mismatch for {request.hash_algorithm}: client sent {cut(request.hash_fingerprint)!r}, "
            f"daemon computes {expected}; the client's key hashing differs from docs/block-keys.md, upgrade or fix it"
        )
    return layout_of(request.layout)


def tier_stats_pb(stats: StoreUsage, bandwidth: Mapping[Tier, Throughput]) -> list[pb.TierStats]:
    return [
        pb.TierStats(
            tier=tier_to_proto(t.tier), capacity_pages=t.capacity, free_pages=t.free, writing_pages=t.writing,
            cached_pages=t.cached, pinned_pages=t.pinned, hits=t.counters.hits, evictions=t.counters.evictions,
            promotions=t.counters.promotions, demotions=t.counters.demotions, bytes_in=t.counters.bytes_in,
            corrupt_pages=t.counters.corrupt_pages,
            read_bytes_per_second=bandwidth[t.tier].bytes_per_second if t.tier in bandwidth else 0.0,
            loading_pages=t.loading, held_pages=t.held, io_errors=t.counters.io_errors,
            refused_pages=t.counters.refused, stored_bytes=t.stored_bytes, capacity_bytes=t.capacity_bytes,
            free_bytes=t.free_bytes, served_blocks=stats.served.get(t.tier, 0),
        )
        for t in stats.tiers
    ]


def hint_stats_pb(usage: PinUsage) -> pb.HintStats:
    return pb.HintStats(hard_pinned=usage.hard, soft_pinned=usage.soft, high=usage.high, cold=usage.cold,
                        next_expiry_seconds=usage.next_expiry_seconds, hard_pin_limit=usage.hard_limit,
                        hard_in_host=usage.hard_in_host, hard_loading=usage.hard_loading,
                        hard_waiting=usage.hard_waiting)


def namespace_stats_pb(usage: NamespaceUsage, hints: PinUsage) -> pb.NamespaceStats:
    return pb.NamespaceStats(
        namespace=usage.namespace,
        tiers=[
            pb.NamespaceTierStats(tier=tier_to_proto(t.tier), pages=t.pages, max_pages=t.max_pages,
                                  guaranteed_pages=t.guaranteed_pages, hits=t.hits, evictions=t.evictions,
                                  served_blocks=usage.served.get(t.tier, 0))
            for t in usage.tiers
        ],
        lookup_blocks=usage.lookup_blocks, miss_blocks=usage.miss_blocks, misses=usage.misses,
        engine_blocks=usage.engine_blocks,
        hints=hint_stats_pb(hints),
    )


#: The metadata key of the session key (docs/protocol.md, "Sessions").
SESSION_KEY = "kvtier-session-key"


def caller(context: grpc.ServicerContext, auth: Authorizer) -> Caller:
    """Who is calling, as far as the call shows: the session key and bearer token in its
    metadata, and the client certificate's names over mutual TLS."""
    metadata = context.invocation_metadata()
    key = next((value for name, value in metadata if name == SESSION_KEY), "")
    identities = context.peer_identities()  # None unless a client certificate was verified
    return Caller(key, auth.token_of(metadata), tuple(identities) if identities else None)


def is_local(context: grpc.ServicerContext) -> bool:
    """The call came over the Unix socket (same host)."""
    return context.peer().startswith("unix:")


@dataclass(frozen=True, eq=False, kw_only=True)
class KVTierService(kvtier_pb2_grpc.KVTierServicer):
    """The servicer and its typed collaborators; it keeps no state of its own."""

    sessions: SessionManager
    pools: PoolRegistry
    auth: Authorizer
    drain: DrainGate
    metrics: Metrics
    version: str
    started: float  # time.monotonic() at daemon start, for the uptime in Stats
    handoff_socket: str  # where same-host clients attach their sessions
    explainer: Explainer  # Explain, and the key hashings each namespace registered with
    ops: HotOps  # the hot calls, shared with the fast lane
    lane_socket: str  # where same-host clients run the hot calls ("" when the lane is off)
    namespaces: NamespaceGate  # how many namespaces Register admits
    events: EventPublisher | None = None  # KV events, for WatchEvents (None: the daemon publishes none)

    def _session(self, session_id: str, context) -> Session:
        """The session a call names, if the caller holds its credentials."""
        return self.sessions.get(session_id, caller(context, self.auth))

    def _resolver(self, session_id: str, context) -> Callable[[], Session]:
        """`_session`, for HotOps to call after its drain check."""
        return lambda: self._session(session_id, context)

    @_rpc
    def Register(self, request: pb.RegisterRequest, context) -> pb.RegisterResponse:
        try:
            return self._register(request, context)
        except KVTierError as exc:  # counted by reason (kvtier_register_rejected_total), then answered as ever
            self.metrics.register_refused(exc.code)
            raise

    def _register(self, request: pb.RegisterRequest, context) -> pb.RegisterResponse:
        self.drain.check_open()
        check_namespace(request.namespace)
        self.auth.authorize(request.namespace, context.invocation_metadata())  # before anything else is checked or revealed
        self.namespaces.admit(request.namespace)
        pool = self.pools.for_layout(_layout(request))
        who, local = caller(context, self.auth), is_local(context)
        engine = _engine(request)
        session = self.sessions.open(
            request.namespace, pool, cut(request.client_name) or "unnamed",  # free text, for logs
            token=who.token, tls_identity=who.tls_identity, local=local, engine=engine,
        )
        if engine is not None and self.events is not None:
            self.events.engine_joined(request.namespace, engine)
        self.explainer.saw_register(request.namespace, request.hash_algorithm, pool.layout)
        tiers = [pb.TierInfo(tier=tier_to_proto(t.tier), capacity_pages=t.capacity) for t in pool.store.stats().tiers]
        return pb.RegisterResponse(
            session_id=session.session_id,
            handoff_socket=self.handoff_socket if local else "",
            lane_socket=self.lane_socket if local else "",
            commit_checksums=True,
            lookup_known=True,
            session_key="" if local else session.key,  # same host: only the attaching process gets it
            page_bytes=pool.layout.page_bytes,
            slot_bytes=pool.layout.slot_bytes,
            tiers=tiers,
            host_arena_bytes=pool.host.size if local else 0,
            device_ipc_handle=pool.device.ipc_handle if pool.device is not None else b"",
            device_arena_bytes=pool.device.size if pool.device is not None else 0,
            device_pci_bus_id=pool.device.pci_bus_id if pool.device is not None else "",
            heartbeat_interval_ms=int(self.sessions.heartbeat_interval * 1000),
            session_timeout_ms=int(self.sessions.timeout * 1000),
            pool_id=pool.pool_id,
        )

    @_rpc
    def Heartbeat(self, request, context) -> pb.HeartbeatResponse:
        return pb.HeartbeatResponse(leases=self.ops.heartbeat(self._resolver(request.session_id, context)))

    @_rpc
    def CloseSession(self, request, context) -> pb.CloseSessionResponse:
        return pb.CloseSessionResponse(released_leases=self.sessions.close(request.session_id, caller(context, self.auth)))

    @_rpc
    def Lookup(self, request, context) -> pb.LookupResponse:
        return _lookup_pb(self.ops.lookup(self._resolver(request.session_id, context), list(request.keys), request.known))

    @_rpc
    def Borrow(self, request, context) -> pb.BorrowResponse:
        grant = self.ops.borrow(self._resolver(request.session_id, context), request.count)
        return pb.BorrowResponse(lease_id=grant.lease_id, tier=tier_to_proto(grant.tier), slots=grant.slots)

    @_rpc
    def Commit(self, request, context) -> pb.CommitResponse:
        result = self.ops.commit(self._resolver(request.session_id, context), request.lease_id, list(request.keys),
                                 request.parent or None, request.token_ids, request.checksums)
        return pb.CommitResponse(committed=result.committed, duplicates=result.duplicates)

    @_rpc
    def Acquire(self, request, context) -> pb.AcquireResponse:
        lease = self.ops.acquire(self._resolver(request.session_id, context), list(request.keys), request.tier, request.wait, request.deadline_ms)
        return _acquire_pb(lease)

    @_rpc
    def AcquirePrefix(self, request, context) -> pb.AcquirePrefixResponse:
        match, lease = self.ops.acquire_prefix(self._resolver(request.session_id, context), list(request.keys),
                                               request.tier, request.wait, request.deadline_ms)
        reply = pb.AcquirePrefixResponse(lookup=_lookup_pb(match))
        if lease is not None:  # nothing cached: `lease` stays unset (no lease to release)
            reply.lease.CopyFrom(_acquire_pb(lease))
        return reply

    @_rpc
    def LookupGroups(self, request, context) -> pb.LookupGroupsResponse:
        match = lookup_groups(self._session(request.session_id, context), self.pools, request.groups, request.known)
        return pb.LookupGroupsResponse(hit_blocks=match.hit_blocks, groups=[
            pb.GroupHit(first_block=g.first_block, tiers=[tier_to_proto(t) for t in g.tiers]) for g in match.groups])

    @_rpc
    def Release(self, request, context) -> pb.ReleaseResponse:
        self.ops.release(self._resolver(request.session_id, context), request.lease_id)
        return pb.ReleaseResponse()

    @_rpc
    def Prefetch(self, request, context) -> pb.PrefetchResponse:
        s = self._resolver(request.session_id, context)
        return pb.PrefetchResponse(accepted=self.ops.prefetch(s, list(request.keys), request.tier, request.priority,
                                                                  request.hold_seconds))

    @_rpc
    def Steer(self, request, context) -> pb.SteerResponse:
        steer = steer_of(request.action, request.pin_mode, request.ttl_seconds, request.priority, request.tier)
        result = self.ops.steer(self._resolver(request.session_id, context), steer, list(request.keys))
        self.metrics.steered(steer.action, result)
        return pb.SteerResponse(applied=result.applied, missing=result.missing, skipped=result.skipped, note=result.note)

    @_rpc
    def Stats(self, request, context) -> pb.StatsResponse:
        metadata = context.invocation_metadata()
        self.auth.authenticate_any(metadata)
        token = self.auth.token_of(metadata)  # each namespace shows only to a token that grants it
        pools = self.pools.snapshot()
        reply = pb.StatsResponse(version=self.version, sessions=self.sessions.count(),
                                 uptime_seconds=time.monotonic() - self.started,
                                 namespaces=self.namespaces.count(), max_namespaces=self.namespaces.limit)
        for pool, stats in pools:
            reply.leases += stats.leases
            reply.pools.append(
                pb.PoolStats(
                    pool_id=pool.pool_id,
                    layout=layout_to_proto(pool.layout),
                    page_bytes=pool.layout.page_bytes, tiers=tier_stats_pb(stats, pool.bandwidth),
                    lookup_blocks=stats.lookup_blocks, miss_blocks=stats.miss_blocks,
                    namespaces=[namespace_stats_pb(ns, pool.store.control.usage(ns.namespace))
                                for ns in stats.namespaces if self.auth.grants(token, ns.namespace)],
                    history_entries=stats.history_entries, history_limit=stats.history_limit,
                    history_bytes=stats.history_bytes, engine_blocks=stats.engine_blocks,
                )
            )
        return reply

    @_rpc
    def Explain(self, request, context) -> pb.ExplainResponse:
        if request.session_id:
            s = self._session(request.session_id, context)
            if request.namespace not in ("", s.namespace) or request.pool_id not in ("", s.pool.pool_id):
                raise InvalidArgument("with session_id, leave namespace and pool_id empty (the session names both)")
            return self.explainer.explain(s.namespace, list(request.keys), s.pool, request.reads_dropped)
        if not request.namespace:
            raise InvalidArgument("Explain needs session_id, or a namespace (with a token that grants it)")
        check_namespace(request.namespace)
        self.auth.authorize(request.namespace, context.invocation_metadata())
        pool = self.pools.get(request.pool_id) if request.pool_id else None
        return self.explainer.explain(request.namespace, list(request.keys), pool, request.reads_dropped)

    # -- slow path: page bytes over gRPC for clients on another host -------------
    def ReadPages(self, request, context) -> Iterator[pb.PageData]:
        pages = self._read_pages(request, context)
        yield from pages

    @_rpc(name="ReadPages")
    def _read_pages(self, request, context) -> list[pb.PageData]:
        s = self._session(request.session_id, context)
        # Copied out while the store holds the lease still; the stream is sent after.
        pages = s.pool.read_pages(s.session_id, LeaseId(request.lease_id))
        return [pb.PageData(index=i, data=data) for i, data in enumerate(pages)]

    def WritePages(self, request_iterator, context) -> pb.WritePagesResponse:
        return self._write_pages(request_iterator, context)

    @_rpc(name="WritePages")
    def _write_pages(self, request_iterator, context) -> pb.WritePagesResponse:
        first = next(request_iterator, None)
        if first is None:
            raise InvalidArgument("WritePages got no messages; send session_id and lease_id first")
        s = self._session(first.session_id, context)
        pieces = PieceOrder(s.pool.layout.page_bytes)
        message = first
        while message is not None:
            pieces.take(message.index, message.offset, len(message.data))
            s.pool.write_page(s.session_id, LeaseId(first.lease_id), message.index, message.data, message.offset)
            message = next(request_iterator, None)
        return pb.WritePagesResponse(pages=pieces.end())

    # -- KV events ---------------------------------------------------------------------
    def WatchEvents(self, request, context) -> Iterator[pb.WatchEventsResponse]:
        """The first response (no events) says the watch is in place; then one response per
        batch the publisher hands over, until the caller cancels or the daemon stops."""
        watcher = self._watch(request, context)
        if not context.add_callback(watcher.close):  # a cancelled call wakes the wait below
            watcher.close()  # it ended already
        try:
            yield pb.WatchEventsResponse(ts=time.time())
            while (batch := watcher.next()) is not None:
                events, missed = batch
                yield pb.WatchEventsResponse(ts=time.time(), events=[_event_pb(e) for e in events], missed=missed)
        finally:
            self.events.unwatch(watcher)

    @_rpc(name="WatchEvents")
    def _watch(self, request, context) -> Watcher:
        """A watcher of the namespaces asked for (every one the caller's token grants when
        none is named), re-checked against the token for every batch: a token a reload
        revokes stops its events at once."""
        if self.events is None:
            raise FailedPrecondition("this daemon publishes no KV events; start it with --events ENDPOINT "
                                     "(docs/events.md)")
        metadata = context.invocation_metadata()
        wanted = frozenset(request.namespaces)
        if wanted:
            for namespace in sorted(wanted):
                check_namespace(namespace)
                self.auth.authorize(namespace, metadata)
        else:
            self.auth.authenticate_any(metadata)
        token, grants = self.auth.token_of(metadata), self.auth.grants
        return self.events.watch(lambda ns: (not wanted or ns in wanted) and grants(token, ns), holder_of(token, wanted))


def _lookup_pb(match: PrefixMatch) -> pb.LookupResponse:
    return pb.LookupResponse(hit_blocks=match.hit_blocks, tiers=[tier_to_proto(t) for t in match.tiers])


def _acquire_pb(lease: ReadGrant) -> pb.AcquireResponse:
    return pb.AcquireResponse(**grant_fields(lease))


def _event_pb(event: Event) -> pb.KVEvent:
    return pb.KVEvent(
        kind=_EVENT_KINDS[event.kind], namespace=event.namespace,
        tier=tier_to_proto(event.tier) if event.tier is not None else pb.TIER_UNSPECIFIED,
        keys=event.keys, parent=event.parent or b"", token_ids=event.token_ids or (), block_size=event.block_size,
    )


_EVENT_KINDS = {EventKind.STORED: pb.KV_EVENT_STORED, EventKind.REMOVED: pb.KV_EVENT_REMOVED,
                EventKind.CLEARED: pb.KV_EVENT_CLEARED}
