"""KVTierClient: an engine's handle on a kvtier daemon.

One client holds one session: one namespace and one page layout. The calls, in the
order an engine makes them:

    pool = client.register(namespace, layout)        # maps the host arena
    keys = client.block_keys(token_ids)
    hit  = client.lookup(keys)                        # longest cached prefix
    with client.acquire(hit.hit_keys(keys)) as r:     # hit: read pages in place
        ... r.pages / r.tensors() ...
    with client.borrow(len(miss)) as w:               # miss: write KV in place, publish it
        ... w.pages[i][...] = kv ...
        w.commit(miss_keys, parent=last_hit_key)

A daemon thread sends heartbeats. When the daemon is unreachable, calls retry with
bounded backoff (connection.Backoff); when it restarted and no longer knows the session,
the client registers again with the same namespace and layout and maps the new arena,
so the engine carries on. Leases of the lost session raise errors.DaemonRestarted.
"""
from __future__ import annotations

import logging
import os
import threading
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
from xxhash import xxh3_64_intdigest

from kvtier_client import keys as keys_mod
from kvtier_client.connection import Backoff, Connection, TLSConfig
from kvtier_client.device import DeviceArenaView, FetchSlots, NamespaceDeviceView
from kvtier_client.errors import (
    BorrowAfterCommitError, DaemonRestarted, FailedPrecondition, KVTierError, NotFound, PermissionDenied, Unavailable,
    from_status,
)
from kvtier_client.events import EventStream
from kvtier_client.groups import GroupLookup, GroupQuery, check_lengths
from kvtier_client.handoff import DeviceGrant, attach, fetch_device_slots
from kvtier_client.hotpath import GrpcPath, HotPath, LanePath
from kvtier_client.ids import SessionId, short_session
from kvtier_client.keys import BlockKey
from kvtier_client.lane import Lane, LaneBroken
from kvtier_client.layout import PageLayout
from kvtier_client.leases import Lease, ReadLease, WriteLease
from kvtier_client.proto.v1 import kvtier_pb2 as pb
from kvtier_client.protocol import (
    PAGE_PIECE_BYTES, Granted, Steer, Wait, check_known, check_lent_tier, check_prefetch, check_token_ids,
    wait_request,
)
from kvtier_client.results import CommitResult, Explanation, LookupResult, PoolInfo, Stats
from kvtier_client.steering import Action, PinMode, Priority, SteerResult
from kvtier_client.tiers import Tier
from kvtier_client.views import HostArenaView
from kvtier_client.wire import layout_to_proto

log = logging.getLogger("kvtier_client")

T = TypeVar("T")


def _wait_policy(tier: Tier, wait: Wait | None, deadline: float | None) -> tuple[int, int]:
    """(wait policy, deadline_ms) of an acquire, checked before anything is sent, by the
    rules the daemon checks them with (kvtier_client.protocol)."""
    check_lent_tier(tier)
    return wait_request(wait, deadline)


@dataclass(frozen=True)
class _Registration:
    """What register was asked for, kept to register again after a daemon restart."""

    namespace: str
    layout: PageLayout
    algorithm: str


_DEVICE_OPEN_LOCK = threading.Lock()


@dataclass
class _Session:
    """One registration's answer and this process's mapping of its arena. Replaced as a
    whole when the client re-registers; leases keep the one they were taken in."""

    info: PoolInfo
    key: str = field(repr=False)  # every call of the session carries it
    arena: HostArenaView | None
    path: HotPath  # the hot calls: the fast lane, or gRPC
    device: DeviceArenaView | NamespaceDeviceView | None = None  # opened on the first device lease
    device_grant: DeviceGrant | None = None  # memory per namespace: what attaching gave
    fetch_device: FetchSlots | None = None  # asks the daemon for this namespace's device slots

    @property
    def session_id(self) -> SessionId:
        return self.info.session_id

    @property
    def page_bytes(self) -> int:
        return self.info.page_bytes

    def device_arena(self) -> DeviceArenaView:
        with _DEVICE_OPEN_LOCK:  # one mapping per session, whichever thread asks first
            return self._open_device()

    def _open_device(self) -> DeviceArenaView | NamespaceDeviceView:
        if self.device is None:
            info = self.info
            if self.device_grant is not None and self.fetch_device is not None:
                grant, self.device_grant = self.device_grant, None  # the view owns its table now
                self.device = NamespaceDeviceView(grant, info.layout, self.fetch_device)
            else:
                self.device = DeviceArenaView(
                    info.device_ipc_handle, info.device_arena_bytes, info.device_pci_bus_id, info.layout, info.slot_bytes
                )
        return self.device

    def close(self) -> None:
        self.path.close()
        if self.arena is not None:
            self.arena.close()
        if self.device is not None:
            self.device.close()
        if self.device_grant is not None:
            os.close(self.device_grant.table_fd)
            self.device_grant = None


class KVTierClient:
    """A connection to one daemon and (after `register`) one session on it.

    `target` is "unix:///abs/path.sock" or "host:port" (TLS with `tls`, or plain with
    `insecure=True`). `token` is sent as a bearer token on every call. A client on another
    host passes `map_arena=False` and moves bytes with kvtier_client.remote.RemotePages.
    `on_reconnect(old, new)` is called (from the thread that noticed) after the client
    registered again, so an engine holding its own views of the old arena can rebuild them.
    A same-host client makes the hot calls over the daemon's fast lane (`transport` says
    which it uses); `lane=False` keeps every call on gRPC. `engine_endpoint` ("IP:PORT", the
    address routers send the engine's requests to; default $KVTIER_ENGINE_ENDPOINT) and
    `served_model` (default $KVTIER_SERVED_MODEL) name the engine in the daemon's KV event
    topics, so a node-wide daemon credits it with the namespace's pages (docs/events.md).
    Thread-safe: leases and calls may come from several engine threads; each thread's calls
    reach the daemon in the order it makes them.
    """

    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        tls: TLSConfig | None = None,
        insecure: bool = False,
        name: str | None = None,
        map_arena: bool = True,
        backoff: Backoff = Backoff(),
        timeout: float = 30.0,
        on_reconnect: Callable[[PoolInfo, PoolInfo], None] | None = None,
        lane: bool = True,
        engine_endpoint: str | None = None,
        served_model: str | None = None,
    ) -> None:
        self.name = name or f"kvtier-client pid {os.getpid()}"
        # The engine as routers name it, for KV event topics (docs/events.md, "Topics"):
        # a node-wide daemon credits each engine on its node with the namespace's pages.
        self.engine_endpoint = engine_endpoint or os.environ.get("KVTIER_ENGINE_ENDPOINT", "")
        self.served_model = served_model or os.environ.get("KVTIER_SERVED_MODEL", "")
        self.map_arena = map_arena
        self.on_reconnect = on_reconnect
        self.lane = lane
        self._conn = Connection(target, token=token, tls=tls, insecure=insecure, backoff=backoff, timeout=timeout)
        self._registration: _Registration | None = None
        self._session: _Session | None = None
        self._swap = threading.Lock()  # serialises re-registration
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._closed = False
        self.reconnects = 0  # sessions re-opened after the daemon lost ours

    # -- session ---------------------------------------------------------------
    @property
    def target(self) -> str:
        return self._conn.target

    @property
    def pool(self) -> PoolInfo:
        """The current session and pool (it changes when the client re-registers)."""
        return self._current().info

    @property
    def transport(self) -> str:
        """What the hot calls travel over: "lane" (the same-host fast lane) or "grpc"."""
        return self._current().path.transport

    @property
    def layout(self) -> PageLayout:
        return self.pool.layout

    @property
    def host_arena(self) -> HostArenaView | None:
        """This process's mapping of its namespace's host arena (None with map_arena=False);
        the client unmaps it at close."""
        return self._current().arena

    def register(self, namespace: str, layout: PageLayout, *, algorithm: str = keys_mod.DEFAULT_ALGORITHM) -> PoolInfo:
        """Open the session: one namespace, one layout, one block-key algorithm; map the arena."""
        self._check_open()
        if self._registration is not None:
            raise FailedPrecondition(
                f"this client is already registered for namespace {self._registration.namespace!r}; "
                "use one client per namespace and layout"
            )
        keys_mod.hash_fingerprint(algorithm)  # ValueError for an unknown algorithm, before any call
        registration = _Registration(namespace, layout, algorithm)
        session = self._open_session(registration)
        with self._swap:
            self._registration, self._session = registration, session
        self._heartbeat = threading.Thread(
            target=self._beat, name=f"kvtier-heartbeat-{short_session(session.session_id)}", daemon=True
        )
        self._heartbeat.start()
        return session.info

    def _open_session(self, registration: _Registration) -> _Session:
        reply = self._conn.unary(
            "Register",
            pb.RegisterRequest(
                namespace=registration.namespace,
                layout=layout_to_proto(registration.layout),
                hash_algorithm=registration.algorithm,
                hash_fingerprint=keys_mod.hash_fingerprint(registration.algorithm),
                client_name=self.name,
                engine_endpoint=self.engine_endpoint,
                served_model=self.served_model,
            ),
        )
        info = PoolInfo.from_proto(reply, registration.namespace, registration.layout, registration.algorithm)
        key = reply.session_key  # over TCP; a same-host session gets its key by attaching
        try:
            if info.heartbeat_interval <= 0:
                raise KVTierError(f"daemon sent heartbeat_interval_ms={reply.heartbeat_interval_ms}; it must be positive")
            if not info.handoff_socket:
                if self.map_arena:
                    raise KVTierError(
                        f"daemon at {self.target} lends no host memory to this client (it registered over TCP): a client "
                        "on another host must pass map_arena=False and use kvtier_client.remote.RemotePages"
                    )
                return _Session(info, key, None, GrpcPath(self._conn, info.session_id, key))
            attachment = attach(info.handoff_socket, info.session_id, self._conn.token, timeout=self._conn.timeout)
            key = attachment.session_key
            grant = attachment.device
            try:
                arena = self._map(info, attachment.arena_fd) if self.map_arena else None
                path = self._hot_path(info, key)
            except BaseException:
                if grant is not None:
                    os.close(grant.table_fd)
                raise
            finally:
                os.close(attachment.arena_fd)
        except BaseException:
            self._close_session(info.session_id, key)
            raise
        handoff, token, timeout = info.handoff_socket, self._conn.token, self._conn.timeout
        return _Session(info, key, arena, path, device_grant=grant, fetch_device=lambda slots: fetch_device_slots(
            handoff, info.session_id, token, slots, timeout=timeout))

    def _hot_path(self, info: PoolInfo, key: str) -> HotPath:
        """The fast lane when the daemon offers it and it opens; else gRPC."""
        grpc_path = GrpcPath(self._conn, info.session_id, key)
        if not (self.lane and info.lane_socket):
            return grpc_path
        lane = Lane(info.lane_socket, info.session_id, key, self._conn.token, self._conn.timeout)
        try:
            lane.connect()
        except LaneBroken as exc:
            log.warning("kvtier: the daemon's fast lane is unavailable, using gRPC for every call: %s", exc)
            return grpc_path
        return LanePath(lane, grpc_path)

    @staticmethod
    def _map(info: PoolInfo, fd: int) -> HostArenaView:
        try:
            return HostArenaView.from_fd(fd, info.host_arena_bytes, info.layout, info.page_bytes, info.slot_bytes)
        except (OSError, ValueError) as exc:
            raise KVTierError(f"cannot map the host arena the daemon handed over ({exc})") from exc

    def _current(self) -> _Session:
        session = self._session
        if session is None:
            raise FailedPrecondition("register a namespace and layout first")
        return session

    def _live(self) -> _Session:
        """The session for a new call: refuses a closed client."""
        self._check_open()
        return self._current()

    def _sync(self) -> None:
        """Before a gRPC call: what this thread sent on the lane without a reply is applied."""
        session = self._session
        if session is not None:
            session.path.sync()

    def _check_open(self) -> None:
        if self._closed:
            raise FailedPrecondition("this client is closed; create a new one")

    def is_current(self, session: _Session) -> bool:
        """Whether leases of `session` are still alive on the daemon's side: False after a
        daemon restart, and after close (which ended the session)."""
        return not self._closed and session is self._session

    def _session_gone(self, session: _Session) -> bool:
        """After a NOT_FOUND: was it the session that is unknown, or only a key or lease?
        Heartbeat answers NOT_FOUND for one thing only, an unknown session."""
        if not self.is_current(session):
            return True
        try:
            session.path.heartbeat(self._conn.timeout)
        except NotFound:
            return True
        return False

    def _reconnect(self, stale: _Session) -> _Session:
        """Register again for the same namespace and layout, once, however many threads noticed."""
        with self._swap:
            if self._session is not stale:
                return self._current()
            assert self._registration is not None
            fresh = self._open_session(self._registration)
            self._session = fresh
            self.reconnects += 1
        log.warning(
            "kvtier daemon at %s no longer knows session %s (restarted?); registered again as %s",
            self.target, short_session(stale.session_id), short_session(fresh.session_id),
        )
        stale.close()
        if self.on_reconnect is not None:
            try:
                self.on_reconnect(stale.info, fresh.info)
            except Exception:
                # The engine's callback may run on the heartbeat thread; letting it kill that
                # thread would silently end the new session too.
                log.exception("kvtier: on_reconnect callback failed")
        return fresh

    def _in_session(self, call: Callable[[_Session], T]) -> T:
        """Run a session-level call; if the daemon lost the session, register again and repeat it."""
        session = self._live()
        try:
            return call(session)
        except NotFound:
            if not self._session_gone(session):
                raise
        return call(self._reconnect(session))

    def _for_lease(self, lease: Lease, call: Callable[[_Session], T]) -> T:
        """Run a call on a lease; a lease of a lost session raises DaemonRestarted."""
        session = self._lease_session(lease)
        try:
            return call(session)
        except NotFound as exc:
            self._lease_not_found(lease, exc)
            raise

    def _lease_session(self, lease: Lease) -> _Session:
        """The session of a lease to call on; DaemonRestarted if the daemon no longer has it."""
        self._check_open()
        if not self.is_current(lease.session):
            raise self._restarted(lease)
        return lease.session

    def _lease_not_found(self, lease: Lease, exc: NotFound) -> None:
        """After a NOT_FOUND on a lease call: if the session is what the daemon lost, register
        again and raise DaemonRestarted; if only the lease or a key is unknown, return (the
        caller re-raises `exc`)."""
        if self._session_gone(lease.session):
            self._reconnect(lease.session)
            raise self._restarted(lease) from exc

    @staticmethod
    def _restarted(lease: Lease) -> DaemonRestarted:
        lease.ended = True
        return DaemonRestarted(
            f"lease {lease.lease_id} belonged to session {short_session(lease.session.session_id)}, which the daemon "
            "no longer knows: it restarted (or dropped the session after missed heartbeats) and the lease's pages "
            "are gone. The client has registered again; look the keys up again and recompute what is missing."
        )

    def _beat(self) -> None:
        """Heartbeat loop (daemon thread). A lost session is re-registered here too, so an idle
        engine finds the new arena already mapped."""
        while True:
            session = self._current()
            if self._stop.wait(session.info.heartbeat_interval):
                return
            session = self._current()
            try:
                session.path.heartbeat(max(session.info.heartbeat_interval, 1.0))
            except NotFound:
                if self._stop.is_set():
                    return
                try:
                    self._reconnect(session)
                except KVTierError as exc:
                    log.warning("kvtier: could not register again yet (the next beat or call retries): %s", exc)
            except Unavailable:
                pass  # down or restarting; the next beat or call finds it again
            except KVTierError as exc:
                if self._stop.is_set():
                    return
                log.warning("kvtier heartbeat for session %s failed: %s", short_session(session.session_id), exc)

    # -- keys and lookups ------------------------------------------------------
    def block_keys(
        self,
        token_ids: Sequence[int] | np.ndarray,
        *,
        salt: bytes = b"",
        extras: Sequence[Sequence[bytes]] | None = None,
        parent: BlockKey | None = None,
    ) -> list[BlockKey]:
        """Keys of every full block of `token_ids`, with the registered block size and algorithm."""
        info = self.pool
        return keys_mod.block_keys(
            token_ids, info.layout.block_tokens, salt=salt, extras=extras, algorithm=info.algorithm, parent=parent
        )

    def lookup(self, keys: Sequence[BlockKey], *, known: int = 0) -> LookupResult:
        """How many leading keys are cached, and the fastest tier of each. `known`: how many
        leading keys the engine holds in its own cache already (vLLM: its computed tokens
        over the block size). The answer is the same; the daemon counts those blocks as the
        engine's, not as its hits, so its hit rates say what kvtier found beyond the engine
        (docs/metrics.md). A daemon from before `known` is not sent it."""
        check_known(known, len(keys))  # ValueError, before anything is sent
        return self._in_session(lambda s: s.path.lookup(keys, known if s.info.lookup_known else 0))

    def lookup_groups(self, groups: Sequence[GroupQuery], *, known: int = 0) -> GroupLookup:
        """A hybrid model's lookup, in one call: the longest prefix (in blocks) for which
        every KV cache group holds what it needs to restore it (every block, a trailing
        window, or the state at the end: kvtier_client.groups), and which blocks each
        group needs for it, in which tier. Counts each group's hits and misses in its own
        pool.

        Each group names its pool by layout (None: this client's); the namespace is this
        client's for every group. A client holds one registration, so an engine registers
        one client per group layout and may call this on any of them; a layout nobody
        registered is NotFound. Over gRPC on either transport. `known`: as for `lookup`, the
        leading blocks the engine holds already (counted apart in every group's pool)."""
        check_known(known, check_lengths([len(group.keys) for group in groups]))  # ValueError, before sending
        queries = [group.to_proto() for group in groups]
        self._sync()

        def call(session: _Session) -> pb.LookupGroupsResponse:
            request = pb.LookupGroupsRequest(session_id=session.session_id, groups=queries, known=known)
            try:
                return self._conn.unary("LookupGroups", request, key=session.key)
            except KVTierError as exc:
                if exc.code != "UNIMPLEMENTED":
                    raise
                raise from_status("UNIMPLEMENTED", f"the daemon does not know LookupGroups (it predates it: {exc}); "
                                                   "upgrade the daemon") from exc

        return GroupLookup.from_proto(self._in_session(call))

    def prefetch(self, keys: Sequence[BlockKey], *, tier: Tier = Tier.HOST, priority: int = 0,
                 hold: float = 0.0) -> int:
        """Ask the daemon to move these pages up ahead of an acquire; returns how many it accepted.
        `hold`: the engine's deadline, in seconds (up to MAX_PREFETCH_HOLD): the pages, and those
        already in host, stay there until then (0: the daemon's prefetch_hold). ValueError,
        before anything is sent, for what the daemon would refuse (kvtier_client.protocol)."""
        check_prefetch(tier, priority, hold)
        return self._in_session(lambda s: s.path.prefetch(keys, tier, priority, hold))

    # -- cache control (docs/cache-control.md) ----------------------------------
    # Hints on this session's namespace and pool, counted per key: applied, missing (not
    # cached on this node), skipped (cached but left as they were: the note says why). A
    # hint with ttl 0 lasts until unpinned or until this client closes; with a TTL (at most
    # steering.MAX_TTL_SECONDS) it outlives the client.
    def pin(self, keys: Sequence[BlockKey], *, mode: PinMode = PinMode.SOFT, ttl: float = 0.0) -> SteerResult:
        """Keep these blocks: soft, evicted last in every tier; hard, never evicted from host
        (disk-only blocks are brought into host), charged to the namespace's guaranteed host
        pages and refused past them (CapacityError, FailedPrecondition without any)."""
        return self._steer(keys, Steer(Action.PIN, mode=mode, ttl=ttl))

    def unpin(self, keys: Sequence[BlockKey]) -> SteerResult:
        """Clear every hint (pin or retain) on these blocks: the eviction policy alone ranks them."""
        return self._steer(keys, Steer(Action.UNPIN))

    def retain(self, keys: Sequence[BlockKey], priority: Priority, *, ttl: float = 0.0) -> SteerResult:
        """Rank these blocks for eviction: cold (first), high (after unhinted ones); normal
        clears the hint, as unpin."""
        return self._steer(keys, Steer(Action.RETAIN, ttl=ttl, priority=priority))

    def demote(self, keys: Sequence[BlockKey], *, tier: Tier = Tier.DISK) -> SteerResult:
        """Move these blocks' pages below `tier` now: to host (off the device), or to disk
        (written there first, then off host). Leased or hard-pinned blocks are skipped."""
        return self._steer(keys, Steer(Action.DEMOTE, tier=tier))

    def drop(self, keys: Sequence[BlockKey]) -> SteerResult:
        """Forget these blocks in every tier of this node now (leased ones are skipped)."""
        return self._steer(keys, Steer(Action.DROP))

    def _steer(self, keys: Sequence[BlockKey], steer: Steer) -> SteerResult:
        steer.wire()  # ValueError for a bad request, before anything is sent
        return self._in_session(lambda s: s.path.steer(keys, steer))

    # -- leases ----------------------------------------------------------------
    def borrow(self, count: int) -> WriteLease:
        """A write lease on `count` free host pages. Use it in a `with` block (released on exit
        unless committed) or end it yourself with `commit` or `release`."""
        return self._in_session(lambda s: self._write_lease(s, s.path.borrow(count)))

    def _write_lease(self, session: _Session, grant: Granted) -> WriteLease:
        return WriteLease(self, session, grant.lease_id, grant.tier, grant.slots)

    def commit(self, lease: WriteLease, keys: Sequence[BlockKey], *, parent: BlockKey | None = None,
               token_ids: Sequence[int] | np.ndarray | None = None) -> CommitResult:
        """Publish a write lease's pages under `keys` (see WriteLease.commit). `token_ids`:
        the blocks' token ids, `block_tokens` per key in key order; the daemon only carries
        them in its KV events, for routers that match prompts by token (docs/events.md)."""
        ids = self._token_ids(keys, token_ids)
        result = self._for_lease(
            lease, lambda s: s.path.commit(lease.lease_id, keys, parent, ids, self._checksums(lease, len(keys))))
        lease.ended = True
        return result

    def commit_and_borrow(self, lease: WriteLease, keys: Sequence[BlockKey], count: int, *,
                          parent: BlockKey | None = None,
                          token_ids: Sequence[int] | np.ndarray | None = None) -> tuple[CommitResult, WriteLease]:
        """Commit `lease` and borrow `count` pages for the next block in one round trip (the
        fast lane sends both frames at once; over gRPC it is two calls). If the commit is
        refused, nothing is borrowed; if only the borrow is, BorrowAfterCommitError carries
        the commit's result. `token_ids` as for `commit`."""
        ids = self._token_ids(keys, token_ids)
        try:
            result, grant = self._for_lease(lease, lambda s: s.path.commit_and_borrow(
                lease.lease_id, keys, parent, count, ids, self._checksums(lease, len(keys))))
        except BorrowAfterCommitError:
            lease.ended = True
            raise
        lease.ended = True
        return result, self._write_lease(lease.session, grant)

    def _checksums(self, lease: WriteLease, count: int) -> array | None:
        """The xxh3-64 of the first `count` pages of a lease: those `WriteLease.write`
        hashed as it copied them, the others hashed here, in the mapping the engine wrote
        them through, so the daemon need not read them again. None without a mapping (the
        gRPC slow path) or with a daemon that predates them: the daemon hashes them."""
        arena = lease.session.arena
        if arena is None or lease.tier is not Tier.HOST or not isinstance(lease, WriteLease):
            return None  # (a read lease: the daemon refuses its commit)
        if not lease.session.info.commit_checksums:
            return None  # a daemon from before them: it hashes the pages itself
        known = lease.checksums  # hashed by WriteLease.write as it copied
        return array("Q", [known[i] if i in known else xxh3_64_intdigest(arena.raw(slot, writable=False))
                           for i, slot in enumerate(lease.slots[:count])])

    def _token_ids(self, keys: Sequence[BlockKey], token_ids: Sequence[int] | np.ndarray | None) -> array | None:
        """A commit's token ids as u32s, checked before anything is sent, by the rule the
        daemon checks them with (kvtier_client.protocol)."""
        return None if token_ids is None else check_token_ids(token_ids, len(keys), self.layout.block_tokens)

    def acquire(self, keys: Sequence[BlockKey], *, wait: Wait | None = None, deadline: float | None = None,
                tier: Tier = Tier.HOST) -> ReadLease:
        """A read lease pinning every key's page in `tier`, loading slower copies first.

        Every key must be cached (acquire `lookup(keys).hit_keys(keys)`, or use
        `acquire_prefix`), else NotFound. `wait` defaults to Wait.DEADLINE when a
        `deadline` (seconds) is given, else Wait.ALL; with NONE or DEADLINE only the first
        `lease.ready` pages are readable. `tier=Tier.DEVICE` (GPU daemons) lends pages in
        the daemon's HBM: the wait covers loads from disk, and the lease's tensors are
        readable once its copy event completes (docs/gpu.md). Use it in a `with` block, or
        call `release` yourself.
        """
        wait_value, deadline_ms = _wait_policy(tier, wait, deadline)
        key_list = list(keys)
        timeout = self._conn.timeout + deadline_ms / 1000
        return self._in_session(
            lambda s: self._read_lease(s, s.path.acquire(key_list, tier, wait_value, deadline_ms, timeout), key_list)
        )

    def acquire_prefix(self, keys: Sequence[BlockKey], *, wait: Wait | None = None, deadline: float | None = None,
                       tier: Tier = Tier.HOST) -> tuple[LookupResult, ReadLease | None]:
        """Lookup and acquire in one call: the longest cached prefix of `keys`, leased as
        `acquire` would lease it (None when nothing is cached). The daemon runs both under
        one lock, on the fast lane and over gRPC alike: nothing can be evicted between the
        two."""
        wait_value, deadline_ms = _wait_policy(tier, wait, deadline)
        key_list = list(keys)
        timeout = self._conn.timeout + deadline_ms / 1000

        def call(session: _Session) -> tuple[LookupResult, ReadLease | None]:
            found, grant = session.path.acquire_prefix(key_list, tier, wait_value, deadline_ms, timeout)
            if grant is None:
                return found, None
            return found, self._read_lease(session, grant, found.hit_keys(key_list))

        return self._in_session(call)

    def _read_lease(self, session: _Session, grant: Granted, keys: list[BlockKey]) -> ReadLease:
        return ReadLease(self, session, grant.lease_id, grant.tier, grant.slots, keys=keys, ready=grant.ready,
                         promoted=grant.promoted, ready_event=grant.ready_event)

    def release(self, lease: Lease) -> None:
        """End a lease: unpin a read lease's pages, free a write lease's uncommitted pages.
        On the fast lane this does not wait for the daemon: it applies the release before
        anything else this thread sends."""
        if lease.ended and self.is_current(lease.session):
            raise FailedPrecondition(f"lease {lease.lease_id} has already been released or committed")
        self._for_lease(lease, lambda s: s.path.release(lease.lease_id))
        lease.ended = True

    # -- page bytes over gRPC (for kvtier_client.remote.RemotePages) ------------
    def read_page_bytes(self, lease: ReadLease) -> Iterator[tuple[int, bytes]]:
        """(index, bytes) of each page of a read lease as the daemon streams it (ReadPages: the
        ready pages, in no promised order), for a client that does not map the host arena.
        Checks nothing about the pages (RemotePages does); a lease of a lost session raises
        DaemonRestarted, as every lease call does."""
        session = self._lease_session(lease)
        session.path.sync()
        request = pb.ReadPagesRequest(session_id=session.session_id, lease_id=lease.lease_id)
        try:
            for message in self._conn.server_stream("ReadPages", request, key=session.key):
                yield message.index, message.data
        except NotFound as exc:
            self._lease_not_found(lease, exc)
            raise

    def write_page_bytes(self, lease: WriteLease, pages: Sequence[bytes]) -> int:
        """Send pages[i] as page i of a write lease (WritePages: a client stream, a page in
        pieces of PAGE_PIECE_BYTES, resent whole on a retry); returns how many pages the daemon stored. The
        lease stays open: commit it afterwards."""

        def call(session: _Session) -> int:
            session.path.sync()

            def messages() -> Iterator[pb.PageData]:
                ids = {"session_id": session.session_id, "lease_id": lease.lease_id}  # on the first message
                for i, data in enumerate(pages):
                    for offset in range(0, max(len(data), 1), PAGE_PIECE_BYTES):
                        yield pb.PageData(index=i, offset=offset, data=data[offset:offset + PAGE_PIECE_BYTES], **ids)
                        ids = {}

            return self._conn.client_stream("WritePages", messages, key=session.key).pages

        return self._for_lease(lease, call)

    # -- daemon-wide -----------------------------------------------------------
    def stats(self) -> Stats:
        """Capacity, occupancy and counters of every pool, sessions and leases. Needs no session."""
        self._check_open()
        self._sync()
        return Stats.from_proto(self._conn.unary("Stats", pb.StatsRequest()))

    def watch_events(self, namespaces: Sequence[str] | None = None) -> EventStream:
        """Watch the daemon's KV events: blocks arriving in and leaving each tier, of
        `namespaces` (None: every namespace this client's token grants). Returns once the
        watch is in place; iterate the stream, `close()` it when done. Needs no session;
        the daemon must run with events on (--events), else FailedPrecondition."""
        self._check_open()
        self._sync()  # what this thread sent on the lane is applied before the watch starts
        request = pb.WatchEventsRequest(namespaces=list(namespaces or ()))
        return EventStream(self._conn.stub.WatchEvents(request, metadata=self._conn.metadata))

    # -- shutdown --------------------------------------------------------------
    def close(self) -> None:
        """End the session (the daemon releases its leases), stop heartbeats, unmap, disconnect."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._conn.stop_retrying()
        if self._heartbeat is not None:
            self._heartbeat.join()
        session = self._session
        try:
            if session is not None:
                session.path.close()  # this thread's releases were sent before; the close comes after them
                self._close_session(session.session_id, session.key)
        finally:
            self._conn.close()
            if session is not None:
                session.close()

    def _close_session(self, session_id: SessionId, key: str) -> None:
        try:
            self._conn.unary("CloseSession", pb.CloseSessionRequest(session_id=session_id), key=key, retry=False)
        except (NotFound, Unavailable, PermissionDenied):
            pass  # already gone; the daemon is down; or never attached (no key): it times the session out

    def __enter__(self) -> KVTierClient:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        session = self._session
        where = (
            f"session {short_session(session.session_id)} in {session.info.namespace!r}" if session else "not registered"
        )
        return f"KVTierClient({self.target!r}, {where})"

    # -- diagnosis -------------------------------------------------------------
    def explain(self, keys: Sequence[BlockKey]) -> Explanation:
        """Why each key is or is not cached for this session: cached, evicted (when, by which
        policy, whose pressure), dropped as corrupt, never stored, cached in another layout,
        or beyond the longest cached prefix. Changes nothing, counts nothing."""
        self._sync()
        reply = self._in_session(
            lambda s: self._conn.unary("Explain", pb.ExplainRequest(session_id=s.session_id, keys=list(keys),
                                                                    reads_dropped=True), key=s.key)
        )
        return Explanation.from_proto(reply)
