"""The hot calls, once for both transports: the gRPC servicer (kvtier.server.service) and
the fast lane (kvtier.server.lane) decode their requests, call these, and encode the
results. What a call checks (drain, session, wait policy, tier) and in which order lives
here only, so the two transports cannot answer the same request differently.

Each takes `session`, the transport's way to resolve the session the call names (gRPC:
SessionManager.get with the call's credentials; the lane: SessionManager.still), called
after the drain check: a draining daemon answers UNAVAILABLE to anyone. Each returns the
core's typed result; errors are KVTierErrors, which each transport maps to its status code.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier_client.errors import InvalidArgument
from kvtier_client.ids import LeaseId
from kvtier_client.proto.v1 import kvtier_pb2 as pb
from kvtier_client.tiers import Tier

from kvtier.core.results import CommitOutcome, PrefixMatch, ReadGrant, WriteGrant
from kvtier.server.drain import DrainGate
from kvtier.server.pools import Pool
from kvtier.server.sessions import Session, SessionManager


def tier_of(value: int, pool: Pool) -> Tier:
    """A requested tier (proto numbering) as the tier pages are lent from."""
    if value in (pb.TIER_UNSPECIFIED, pb.TIER_HOST):
        return Tier.HOST
    if value == pb.TIER_DEVICE:
        if pool.device is None:
            raise InvalidArgument("this daemon has no device tier (no GPU, or device_size 0); use TIER_HOST")
        return Tier.DEVICE
    raise InvalidArgument(f"pages can be acquired into host (or device on GPU daemons), not tier {value}")


def wait_timeout(wait: int, deadline_ms: int) -> float | None:
    """The wait policy as the core's timeout: None = all, 0 = none, t = deadline."""
    if wait == pb.WAIT_NONE:
        return 0.0
    if wait == pb.WAIT_DEADLINE:
        if deadline_ms == 0:
            raise InvalidArgument("WAIT_DEADLINE needs deadline_ms > 0")
        return deadline_ms / 1000
    if wait in (pb.WAIT_ALL, pb.WAIT_POLICY_UNSPECIFIED):
        return None
    raise InvalidArgument(f"unknown wait policy {wait}; use WAIT_NONE, WAIT_ALL or WAIT_DEADLINE")


def split_tokens(token_ids: Sequence[int], keys: int, block_tokens: int) -> list[tuple[int, ...]]:
    """A commit's flat token ids as one tuple per key (what the store keeps on each block)."""
    if len(token_ids) != keys * block_tokens:
        raise InvalidArgument(f"commit got {len(token_ids)} token ids for {keys} keys; pass {block_tokens} per key "
                              "(each block's tokens, in key order), or none")
    return [tuple(token_ids[i : i + block_tokens]) for i in range(0, len(token_ids), block_tokens)]


Resolve = Callable[[], Session]


@dataclass(frozen=True, eq=False)
class HotOps:
    sessions: SessionManager
    drain: DrainGate

    def heartbeat(self, session: Resolve) -> int:
        s = session()
        return s.pool.store.session_leases(s.session_id)

    def lookup(self, session: Resolve, keys: list[bytes]) -> PrefixMatch:
        s = session()
        return s.pool.store.lookup(s.namespace, keys)

    def borrow(self, session: Resolve, count: int) -> WriteGrant:
        self.drain.check_open()
        s = session()
        grant = s.pool.store.borrow(s.session_id, s.namespace, count)
        self.sessions.check_still_open(s, grant.lease_id)
        return grant

    def commit(self, session: Resolve, lease_id: int, keys: list[bytes], parent: bytes | None,
               token_ids: Sequence[int] = ()) -> CommitOutcome:
        """`token_ids`: the blocks' token ids, flat (block_tokens per key), or none."""
        s = session()
        tokens = split_tokens(token_ids, len(keys), s.pool.layout.block_tokens) if len(token_ids) else None
        outcome = s.pool.store.commit(s.session_id, LeaseId(lease_id), keys, parent or None, tokens)
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

    def prefetch(self, session: Resolve, keys: list[bytes], tier: int, priority: int) -> int:
        self.drain.check_open()
        s = session()
        # Only schedules loads (the disk reads run on the pool's I/O workers): returns at once.
        return s.pool.store.prefetch(s.session_id, s.namespace, keys, tier_of(tier, s.pool), priority)
