"""Typed errors shared by the daemon and the client.

Each carries the gRPC status code it travels as (DESIGN.md, "Errors"); the daemon raises
them from the core, the server turns them into status codes, and the client turns status
codes back into these classes. Every message says what was wrong and what to do.
"""
from __future__ import annotations

import grpc


class KVTierError(Exception):
    """Base of every kvtier error. `code` names the gRPC status code (grpc.StatusCode member)."""

    code = "UNKNOWN"


class InvalidArgument(KVTierError):
    """Malformed layout, key, count or id: the caller must fix the request."""

    code = "INVALID_ARGUMENT"


class NotFound(KVTierError):
    """Unknown namespace, session, lease or key."""

    code = "NOT_FOUND"


class FailedPrecondition(KVTierError):
    """The request is well formed but not valid now: double release, wrong session, commit of a page not leased."""

    code = "FAILED_PRECONDITION"


class CapacityError(KVTierError):
    """No page could be freed even after eviction. Expected under pressure; nothing was changed."""

    code = "RESOURCE_EXHAUSTED"


class Unauthenticated(KVTierError):
    code = "UNAUTHENTICATED"


class PermissionDenied(KVTierError):
    code = "PERMISSION_DENIED"


class Unavailable(KVTierError):
    """The daemon is starting, draining or unreachable; retry with backoff."""

    code = "UNAVAILABLE"


class DaemonRestarted(NotFound):
    """A lease outlived its session: the daemon restarted (or ended the session after missed
    heartbeats) since the lease was taken, so its pages are gone. The client has already
    re-registered; look up again and recompute what is missing. A NotFound, because the
    daemon no longer knows the lease."""


class BorrowAfterCommitError(KVTierError):
    """commit_and_borrow: the Commit happened (`committed`), the Borrow was refused (`error`,
    whose code this carries). The write lease has ended; borrow again when there is room."""

    def __init__(self, committed, error: KVTierError) -> None:
        super().__init__(f"committed {committed.committed} pages, then the borrow was refused: {error}")
        self.committed = committed
        self.error = error
        self.code = error.code


ERRORS_BY_CODE: dict[str, type[KVTierError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        FailedPrecondition,
        CapacityError,
        Unauthenticated,
        PermissionDenied,
        Unavailable,
    )
}


def from_rpc_error(exc: grpc.RpcError) -> KVTierError:
    """The KVTierError subclass for a failed call's status code, carrying the daemon's message."""
    if not isinstance(exc, grpc.Call):
        # An RpcError raised outside a call (rare: a channel closed under us) has no status.
        return KVTierError(str(exc) or "gRPC call failed without a status")
    status = exc.code()
    name = status.name if status is not None else "UNKNOWN"
    return from_status(name, exc.details() or f"daemon returned {name} without a message")


_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}


def from_status(status: int | str, message: str) -> KVTierError:
    """The KVTierError for a status code, by name or by number (the fast lane sends numbers).

    Codes without a class of their own (DEADLINE_EXCEEDED, INTERNAL, ...) become a plain
    KVTierError whose `code` names them, so callers can still tell them apart."""
    name = _NAMES.get(status, "UNKNOWN") if isinstance(status, int) else status
    cls = ERRORS_BY_CODE.get(name)
    if cls is not None:
        return cls(message)
    error = KVTierError(message)
    error.code = name
    return error
