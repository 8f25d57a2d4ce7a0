"""The hot calls, once for both transports: the gRPC servicer (kvtier.server.service) and
the fast lane (kvtier.server.lane) decode their requests, call these, and encode the
results. What a call checks (drain, session, wait policy, tier) and in which order lives
here only, so the two transports cannot answer the same request differently; the rules
themselves (the wait policy, the tiers pages are lent from, a prefetch's tier, priority and
hold, a steer's fields) are kvtier_client.protocol's, the very functions the client checks
a request with before sending it, applied through `protocol.checked` (INVALID_ARGUMENT).
Token ids per block are checked by the core (the same protocol function), which keeps them.

Each takes `session`, the transport's way to resolve the session the call names (gRPC:
SessionManager.get with the call's credentials; the lane: SessionManager.still), called
after the drain check: a draining daemon answers UNAVAILABLE to anyone. Each returns the
core's typed result; errors are KVTierErrors, which each transport maps to its status code.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier_client import protocol
from kvtier_client.ids import LeaseId
from kvtier_client.protocol import Steer, checked
from kvtier_client.steering import Action, SteerResult
from kvtier_client.tiers import Tier
from kvtier_client.wire import tier_to_proto

from kvtier.core.results import CommitOutcome, PrefixMatch, ReadGrant, WriteGrant
from kvtier.server.drain import DrainGate
from kvtier.server.pools import Pool
from kvtier.server.sessions import Session, SessionManager


def tier_of(value: int, pool: Pool) -> Tier:
    """A requested tier (proto numbering) as the tier pages are lent from in `pool`."""
    return checked(protocol.lent_tier, value, has_device=pool.device is not None)


def wait_timeout(wait: int, deadline_ms: int) -> float | None:
    """The wait policy as the core's timeout: None = all, 0 = none, t = deadline."""
    return checked(protocol.wait_timeout, wait, deadline_ms)


def steer_of(action: int, mode: int, ttl: float, priority: int, tier: int) -> Steer:
    """A Steer request's numbers (either transport) as the Steer they ask for."""
    return checked(protocol.read_steer, action, mode, ttl, priority, tier)


def grant_fields(grant: ReadGrant) -> dict[str, object]:
    """A read grant as both transports' replies carry it (AcquireResponse, the lane's
    frames.Grant: the same field names), its tier as the proto numbers it."""
    return {"lease_id": grant.lease_id, "tier": tier_to_proto(grant.tier), "slots": grant.slots,
            "ready": grant.ready, "promoted": grant.promoted,
            "ready_event": grant.transfer.ipc_handle if grant.transfer is not None else b""}


Resolve = Callable[[], Session]


@dataclass(frozen=True, eq=False)
class HotOps:
    sessions: SessionManager
    drain: DrainGate

    def heartbeat(self, session: Resolve) -> int:
        s = session()
        return s.pool.store.session_leases(s.session_id)

    def lookup(self, session: Resolve, keys: list[bytes], known: int = 0) -> PrefixMatch:
        """`known`: leading keys the engine holds already (counted apart, not as hits)."""
        s = session()
        return s.pool.store.lookup(s.namespace, keys, checked(protocol.check_known, known, len(keys)))

    def borrow(self, session: Resolve, count: int) -> WriteGrant:
        self.drain.check_open()
        s = session()
        grant = s.pool.store.borrow(s.session_id, s.namespace, count)
        self.sessions.check_still_open(s, grant.lease_id)
        return grant

    def commit(self, session: Resolve, lease_id: int, keys: list[bytes], parent: bytes | None,
               token_ids: Sequence[int] = (), checksums: Sequence[int] = ()) -> CommitOutcome:
        """`token_ids`: the blocks' token ids, flat (block_tokens per key), or none;
        `checksums`: each page's xxh3-64 as the client wrote it, or none."""
        s = session()
        tokens = token_ids if len(token_ids) else None  # checked and split per key by the core
        outcome = s.pool.store.commit(s.session_id, LeaseId(lease_id), keys, parent or None, tokens,
                                      list(checksums) if len(checksums) else None)
        self.drain.lease_ended()
        return outcome

    def acquire(self, session: Resolve, keys: list[bytes], tier: int, wait: int, deadline_ms: int) -> ReadGrant:
        self.drain.check_open()
        s = session()
        lent_from = tier_of(tier, s.pool)
        grant = s.pool.store.acquire(s.session_id, s.namespace, keys, lent_from, wait_timeout(wait, deadline_ms))
        self.sessions.check_still_open(s, grant.lease_id)
        return grant

    def acquire_prefix(self, session: Resolve, keys: list[bytes], tier: int, wait: int,
                       deadline_ms: int) -> tuple[PrefixMatch, ReadGrant | None]:
        """Lookup, then acquire of the longest cached prefix, in one call (no lease when
        nothing is cached)."""
        self.drain.check_open()
        s = session()
        lent_from = tier_of(tier, s.pool)
        match, grant = s.pool.store.acquire_prefix(s.session_id, s.namespace, keys, lent_from,
                                                   wait_timeout(wait, deadline_ms))
        if grant is not None:
            self.sessions.check_still_open(s, grant.lease_id)
        return match, grant

    def release(self, session: Resolve, lease_id: int) -> None:
        s = session()
        s.pool.store.release(s.session_id, LeaseId(lease_id))
        self.drain.lease_ended()

    def prefetch(self, session: Resolve, keys: list[bytes], tier: int, priority: int, hold: float = 0.0) -> int:
        self.drain.check_open()
        s = session()
        into = checked(protocol.read_prefetch, tier, priority, hold)
        # Only schedules loads (the disk reads run on the pool's I/O workers): returns at once.
        return s.pool.store.prefetch(s.session_id, s.namespace, keys, into, priority, hold)

    def steer(self, session: Resolve, steer: Steer, keys: list[bytes]) -> SteerResult:
        """A cache-control hint on `keys`, in the session's namespace and pool only. Pins and
        retains without a TTL belong to the session (they end with it)."""
        self.drain.check_open()
        s = session()
        control, action = s.pool.store.control, steer.action
        if action is Action.PIN:
            return control.pin(s.session_id, s.namespace, keys, steer.mode, steer.ttl)
        if action is Action.RETAIN:
            return control.retain(s.session_id, s.namespace, keys, steer.priority, steer.ttl)
        if action is Action.UNPIN:
            return control.unpin(s.namespace, keys)
        if action is Action.DEMOTE:
            return control.demote(s.namespace, keys, steer.tier)
        return control.drop(s.namespace, keys)
