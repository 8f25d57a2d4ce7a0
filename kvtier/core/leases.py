"""Leases and the sessions that hold them: the table, nothing else. What a lease holds
(pins, writing slots) is the index's; ending one is the store's to orchestrate.

Lease ids are never reused within a store, so an id below the next one that is no longer
in the table was released or committed: a double release says so instead of NOT_FOUND.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from kvtier_client.errors import FailedPrecondition, NotFound
from kvtier_client.ids import LeaseId, SessionId, Slot
from kvtier_client.tiers import Tier

from kvtier.core.ports import Transfer
from kvtier.policy import Ref


class LeaseKind(Enum):
    WRITE = "write"
    READ = "read"


@dataclass
class LeaseRecord:
    lease_id: LeaseId
    session: SessionId
    namespace: str
    kind: LeaseKind
    tier: Tier
    slots: list[Slot]
    refs: list[Ref] = field(default_factory=list)  # read leases: the pinned blocks
    transfer: Transfer | None = None  # device read leases: the copy the engine must wait for


class LeaseTable:
    def __init__(self) -> None:
        self.leases: dict[LeaseId, LeaseRecord] = {}
        self.sessions: dict[SessionId, set[LeaseId]] = {}  # only sessions holding leases
        self._next = 1

    def open(self, session: SessionId, namespace: str, kind: LeaseKind, tier: Tier, slots, refs=()) -> LeaseRecord:
        lease = LeaseRecord(LeaseId(self._next), session, namespace, kind, tier, list(slots), list(refs))
        self._next += 1
        self.leases[lease.lease_id] = lease
        self.sessions.setdefault(session, set()).add(lease.lease_id)
        return lease

    def close(self, lease: LeaseRecord) -> None:
        del self.leases[lease.lease_id]
        ids = self.sessions[lease.session]
        ids.discard(lease.lease_id)
        if not ids:
            del self.sessions[lease.session]

    def get(self, session: SessionId, lease_id: LeaseId, kind: LeaseKind | None) -> LeaseRecord:
        """The session's lease `lease_id` (a write lease if `kind` is WRITE), or the error
        that says what the caller got wrong."""
        lease = self.leases.get(lease_id)
        if lease is None:
            if isinstance(lease_id, int) and 0 < lease_id < self._next:
                raise FailedPrecondition(f"lease {lease_id} has already been released or committed")
            raise NotFound(f"no lease {lease_id!r}; use the id that borrow or acquire returned")
        if lease.session != session:
            raise FailedPrecondition(f"lease {lease_id} belongs to another session; release it from its own session")
        if kind is LeaseKind.WRITE and lease.kind is not LeaseKind.WRITE:
            raise FailedPrecondition(
                f"lease {lease_id} is a read lease; only pages leased by borrow can be committed"
            )
        return lease

    def of_session(self, session: SessionId) -> list[LeaseRecord]:
        return [self.leases[lease_id] for lease_id in self.sessions.get(session, ())]
