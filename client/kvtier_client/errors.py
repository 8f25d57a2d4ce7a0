"""Typed errors shared by the daemon and the client.

Each carries the gRPC status code it travels as (DESIGN.md, "Errors"); the daemon raises
them from the core, the server turns them into status codes, and the client turns status
codes back into these classes. Every message says what was wrong and what to do.
"""
from __future__ import annotations


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
