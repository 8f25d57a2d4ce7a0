"""The hot calls of one session, over one of two transports: `LanePath` (the same-host fast
lane, binary frames on a Unix socket) or `GrpcPath` (everyone else, and the lane's
fallback). KVTierClient holds one per session and never asks which it has; both raise the
same KVTierErrors for the same refusals, and read grants with the same rule
(kvtier_client.protocol.read_grant).
"""
from __future__ import annotations

import logging
import struct
from array import array
from collections.abc import Callable, Sequence
from typing import Protocol

from kvtier_client import frames, protocol
from kvtier_client.frames import FrameError
from kvtier_client.connection import Connection
from kvtier_client.errors import BorrowAfterCommitError, KVTierError, from_status
from kvtier_client.keys import BlockKey
from kvtier_client.lane import Lane, LaneBroken
from kvtier_client.proto.v1 import kvtier_pb2 as pb
from kvtier_client.protocol import Granted, Steer
from kvtier_client.results import CommitResult, LookupResult
from kvtier_client.steering import SteerResult
from kvtier_client.tiers import Tier
from kvtier_client.wire import tier_to_proto, tiers_from_proto_bytes

log = logging.getLogger("kvtier_client")


class HotPath(Protocol):
    #: "lane" or "grpc": what the calls travel over.
    transport: str

    def heartbeat(self, timeout: float) -> int: ...
    def lookup(self, keys: Sequence[BlockKey], known: int = 0) -> LookupResult: ...
    def borrow(self, count: int) -> Granted: ...
    def commit(self, lease_id: int, keys: Sequence[BlockKey], parent: BlockKey | None,
               token_ids: array | None = None, checksums: array | None = None) -> CommitResult: ...
    def commit_and_borrow(self, lease_id: int, keys: Sequence[BlockKey], parent: BlockKey | None,
                          count: int, token_ids: array | None = None,
                          checksums: array | None = None) -> tuple[CommitResult, Granted]: ...
    def acquire(self, keys: Sequence[BlockKey], tier: Tier, wait: int, deadline_ms: int, timeout: float) -> Granted: ...
    def acquire_prefix(self, keys: Sequence[BlockKey], tier: Tier, wait: int, deadline_ms: int,
                       timeout: float) -> tuple[LookupResult, Granted | None]: ...
    def release(self, lease_id: int) -> None: ...
    def prefetch(self, keys: Sequence[BlockKey], tier: Tier, priority: int, hold: float) -> int: ...
    def steer(self, keys: Sequence[BlockKey], steer: Steer) -> SteerResult: ...
    def sync(self) -> None: ...
    def close(self) -> None: ...


def _granted(*fields) -> Granted:
    """The lease a Borrow or Acquire reply grants (protocol.read_grant); these always grant one."""
    grant = protocol.read_grant(*fields)
    if grant is None:
        raise KVTierError(f"the daemon answered with lease id {protocol.NO_LEASE} (none) where it grants a lease; "
                          "the daemon and this client disagree on the protocol: run matching versions")
    return grant


class GrpcPath:
    """The hot calls as gRPC calls (with the connection's retries)."""

    transport = "grpc"

    def __init__(self, conn: Connection, session_id: str, key: str) -> None:
        self._conn = conn
        self._session_id = session_id
        self._key = key

    def _call(self, method: str, request, **kwargs):
        return self._conn.unary(method, request, key=self._key, **kwargs)

    def heartbeat(self, timeout: float) -> int:
        return self._call("Heartbeat", pb.HeartbeatRequest(session_id=self._session_id), timeout=timeout,
                          retry=False).leases

    def lookup(self, keys: Sequence[BlockKey], known: int = 0) -> LookupResult:
        request = pb.LookupRequest(session_id=self._session_id, keys=list(keys), known=known)
        return LookupResult.from_proto(self._call("Lookup", request))

    def borrow(self, count: int) -> Granted:
        reply = self._call("Borrow", pb.BorrowRequest(session_id=self._session_id, count=count))
        return _granted(reply.lease_id, reply.tier, reply.slots)

    def commit(self, lease_id: int, keys: Sequence[BlockKey], parent: BlockKey | None,
               token_ids: array | None = None, checksums: array | None = None) -> CommitResult:
        request = pb.CommitRequest(session_id=self._session_id, lease_id=lease_id, keys=list(keys),
                                   token_ids=token_ids or (), checksums=checksums or ())
        if parent is not None:
            request.parent = parent
        reply = self._call("Commit", request)
        return CommitResult(reply.committed, tuple(reply.duplicates))

    def commit_and_borrow(self, lease_id: int, keys: Sequence[BlockKey], parent: BlockKey | None,
                          count: int, token_ids: array | None = None,
                          checksums: array | None = None) -> tuple[CommitResult, Granted]:
        result = self.commit(lease_id, keys, parent, token_ids, checksums)
        try:
            return result, self.borrow(count)
        except KVTierError as exc:
            raise BorrowAfterCommitError(result, exc) from exc

    def acquire(self, keys: Sequence[BlockKey], tier: Tier, wait: int, deadline_ms: int, timeout: float) -> Granted:
        reply = self._call(
            "Acquire",
            pb.AcquireRequest(session_id=self._session_id, keys=list(keys), tier=tier_to_proto(tier), wait=wait,
                              deadline_ms=deadline_ms),
            timeout=timeout,
        )
        return _granted(reply.lease_id, reply.tier, reply.slots, reply.ready, reply.promoted, reply.ready_event)

    def acquire_prefix(self, keys: Sequence[BlockKey], tier: Tier, wait: int, deadline_ms: int,
                       timeout: float) -> tuple[LookupResult, Granted | None]:
        """One AcquirePrefix call: the daemon looks up and acquires under one lock."""
        request = pb.AcquirePrefixRequest(session_id=self._session_id, keys=list(keys), tier=tier_to_proto(tier),
                                          wait=wait, deadline_ms=deadline_ms)
        try:
            reply = self._call("AcquirePrefix", request, timeout=timeout)
        except KVTierError as exc:
            if exc.code != "UNIMPLEMENTED":
                raise
            raise from_status("UNIMPLEMENTED", (
                f"the daemon does not know AcquirePrefix (it predates it: {exc}); upgrade the daemon, or call "
                "lookup and then acquire the hit keys")) from exc
        lease = reply.lease  # unset when nothing is cached: lease_id then reads NO_LEASE
        return LookupResult.from_proto(reply.lookup), protocol.read_grant(
            lease.lease_id, lease.tier, lease.slots, lease.ready, lease.promoted, lease.ready_event)

    def release(self, lease_id: int) -> None:
        self._call("Release", pb.ReleaseRequest(session_id=self._session_id, lease_id=lease_id))

    def prefetch(self, keys: Sequence[BlockKey], tier: Tier, priority: int, hold: float) -> int:
        return self._call("Prefetch", pb.PrefetchRequest(session_id=self._session_id, keys=list(keys),
                                                         tier=tier_to_proto(tier), priority=priority,
                                                         hold_seconds=hold)).accepted

    def steer(self, keys: Sequence[BlockKey], steer: Steer) -> SteerResult:
        action, mode, ttl, priority, tier = steer.wire()
        request = pb.SteerRequest(session_id=self._session_id, action=action, keys=list(keys), pin_mode=mode,
                                  ttl_seconds=ttl, priority=priority, tier=tier)
        try:
            reply = self._call("Steer", request)
        except KVTierError as exc:
            if exc.code != "UNIMPLEMENTED":
                raise
            raise from_status("UNIMPLEMENTED", f"the daemon does not know Steer (it predates cache control: {exc}); "
                                               "upgrade the daemon") from exc
        return SteerResult(reply.applied, reply.missing, reply.skipped, reply.note)

    def sync(self) -> None:
        """Nothing to wait for: every gRPC call is answered."""

    def close(self) -> None:
        """The connection is the client's: nothing of the session's own to close."""


class LanePath:
    """The hot calls as lane frames. A request too large for one frame, or sent when this
    thread's connection cannot be opened, goes over gRPC (`fallback`) instead."""

    transport = "lane"

    def __init__(self, lane: Lane, fallback: GrpcPath) -> None:
        self._lane = lane
        self._grpc = fallback

    @staticmethod
    def _encode(encode: Callable[[], bytes]) -> bytes | None:
        """The frame, or None when it cannot go on the lane: over MAX_FRAME, or keys the lane
        cannot carry (gRPC then gives the daemon's own answer, INVALID_ARGUMENT for a bad key)."""
        try:
            frame = encode()
        except (FrameError, struct.error):  # struct: a count or id out of its field's range
            return None
        return frame if len(frame) <= protocol.MAX_FRAME else None

    def _call(self, encode: Callable[[], bytes], timeout: float | None = None) -> memoryview | None:
        """The reply body, or None when the request must go over gRPC."""
        frame = self._encode(encode)
        if frame is None:
            return None
        try:
            return self._lane.call(frame, timeout=timeout)
        except LaneBroken as exc:
            log.info("kvtier: a call went over gRPC: %s", exc)
            return None

    def heartbeat(self, timeout: float) -> int:
        body = self._call(lambda: frames.heartbeat(0), timeout)
        return self._grpc.heartbeat(timeout) if body is None else frames.read_u32(body)

    def lookup(self, keys: Sequence[BlockKey], known: int = 0) -> LookupResult:
        body = self._call(lambda: frames.lookup(0, keys, known))
        if body is None:
            return self._grpc.lookup(keys, known)
        return _lookup_result(body)[0]

    def borrow(self, count: int) -> Granted:
        body = self._call(lambda: frames.borrow(0, count))
        return self._grpc.borrow(count) if body is None else _lane_grant(frames.unpack_borrow(body))

    def commit(self, lease_id: int, keys: Sequence[BlockKey], parent: BlockKey | None,
               token_ids: array | None = None, checksums: array | None = None) -> CommitResult:
        body = self._call(lambda: frames.commit(0, lease_id, keys, parent, token_ids, checksums))
        if body is None:
            return self._grpc.commit(lease_id, keys, parent, token_ids, checksums)
        return CommitResult(*frames.unpack_commit(body))

    def commit_and_borrow(self, lease_id: int, keys: Sequence[BlockKey], parent: BlockKey | None,
                          count: int, token_ids: array | None = None,
                          checksums: array | None = None) -> tuple[CommitResult, Granted]:
        """Both frames sent back to back: one round trip. A Commit refused raises its error
        (the Borrow granted with it is released); a Borrow refused after a Commit that
        happened raises BorrowAfterCommitError, which carries the commit's result."""
        commit = self._encode(lambda: frames.commit(0, lease_id, keys, parent, token_ids, checksums))
        if commit is None:
            return self._grpc.commit_and_borrow(lease_id, keys, parent, count, token_ids, checksums)
        try:
            committed, granted = self._lane.pipeline([commit, frames.borrow(0, count)])
        except LaneBroken as exc:
            log.info("kvtier: a call went over gRPC: %s", exc)
            return self._grpc.commit_and_borrow(lease_id, keys, parent, count, token_ids, checksums)
        if isinstance(committed, KVTierError):
            if not isinstance(granted, KVTierError):
                self.release(frames.unpack_borrow(granted).lease_id)
            raise committed
        result = CommitResult(*frames.unpack_commit(committed))
        if isinstance(granted, KVTierError):
            raise BorrowAfterCommitError(result, granted)
        return result, _lane_grant(frames.unpack_borrow(granted))

    def acquire(self, keys: Sequence[BlockKey], tier: Tier, wait: int, deadline_ms: int, timeout: float) -> Granted:
        body = self._call(lambda: frames.acquire(0, keys, tier_to_proto(tier), wait, deadline_ms), timeout)
        if body is None:
            return self._grpc.acquire(keys, tier, wait, deadline_ms, timeout)
        return _lane_grant(frames.unpack_acquire(body))

    def acquire_prefix(self, keys: Sequence[BlockKey], tier: Tier, wait: int, deadline_ms: int,
                       timeout: float) -> tuple[LookupResult, Granted | None]:
        body = self._call(lambda: frames.acquire(0, keys, tier_to_proto(tier), wait, deadline_ms, prefix=True), timeout)
        if body is None:
            return self._grpc.acquire_prefix(keys, tier, wait, deadline_ms, timeout)
        found, at = _lookup_result(body)
        grant = frames.unpack_acquire(body, at)
        return found, protocol.read_grant(grant.lease_id, grant.tier, grant.slots, grant.ready, grant.promoted,
                                          grant.ready_event)

    def release(self, lease_id: int) -> None:
        """Sent without waiting: the daemon applies it before this thread's next frame."""
        try:
            self._lane.send(frames.release(0, lease_id, reply=False))
        except LaneBroken as exc:
            log.info("kvtier: a call went over gRPC: %s", exc)
            self._grpc.release(lease_id)

    def prefetch(self, keys: Sequence[BlockKey], tier: Tier, priority: int, hold: float) -> int:
        body = self._call(lambda: frames.prefetch(0, keys, tier_to_proto(tier), priority, hold))
        return self._grpc.prefetch(keys, tier, priority, hold) if body is None else frames.read_u32(body)

    def steer(self, keys: Sequence[BlockKey], steer: Steer) -> SteerResult:
        numbers = steer.wire()
        body = self._call(lambda: frames.steer(0, keys, *numbers))
        return self._grpc.steer(keys, steer) if body is None else SteerResult(*frames.unpack_steer(body))

    def sync(self) -> None:
        self._lane.sync()

    def close(self) -> None:
        self._lane.close()


def _lookup_result(body: memoryview) -> tuple[LookupResult, int]:
    hit, tiers, at = frames.unpack_lookup(body)
    return LookupResult(hit, tiers_from_proto_bytes(tiers)), at


def _lane_grant(grant: frames.Grant) -> Granted:
    return _granted(grant.lease_id, grant.tier, grant.slots, grant.ready, grant.promoted, grant.ready_event)
