"""What the cluster tier needs from a distributed store, and how a store says it failed.

Every call is a batch: one network round trip per store node, whatever the number of
keys. A per-key result that is an exception (RemoteFault) fails that key only: the rest
of the batch stands, so a dead shard costs only the pages it held.

A value is two parts, a small header and the page, stored and fetched together
atomically: the page goes out as the caller's buffer, never copied to prepend the header
(at 2 MiB that copy costs as much as a third of the network time).
"""
from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class FaultKind(str, enum.Enum):
    """Why a remote call (or one key of it) failed; the metric label."""

    UNAVAILABLE = "unavailable"  # no connection: the store is down, not started, or unreachable
    TIMEOUT = "timeout"  # a node did not answer in time
    MOVED = "moved"  # the slot map changed under us (resharding, failover) and retries ran out
    FULL = "full"  # the store refused a write: maxmemory with a noeviction policy
    CORRUPT = "corrupt"  # a value failed its header or checksum (dropped, never served)
    MISBOUND = "misbound"  # an intact value sealed as another key's, namespace's or secret's (dropped, never served)
    VERSION = "version"  # a value in a format this kvtier does not read: another kvtier's (never served, left there)
    OTHER = "other"  # anything else the store answered with an error

    def __str__(self) -> str:
        return self.value


class RemoteFault(Exception):
    """A store call, or one key of it, failed; `kind` says how."""

    def __init__(self, kind: FaultKind, detail: str) -> None:
        super().__init__(f"{kind.value}: {detail}")
        self.kind = kind
        self.detail = detail


#: (header, page) as stored and as fetched.
Value = tuple[bytes, "bytes | memoryview"]


@dataclass(frozen=True)
class RemoteMemory:
    """The store's own memory figures, summed over its primaries. `limit` 0: none set."""

    used: int
    limit: int




class RemoteStore(Protocol):
    def exists(self, keys: Sequence[bytes]) -> list[bool | RemoteFault]:
        """Whether each key holds a value."""

    def get(self, keys: Sequence[bytes]) -> list[Value | None | RemoteFault]:
        """Each key's value, None if absent (or not a value of ours: a part missing)."""

    def put(self, items: Sequence[tuple[bytes, Value]]) -> list[bool | RemoteFault]:
        """Store each (key, value), both parts at once; True when stored."""

    def delete(self, keys: Sequence[bytes]) -> list[bool | RemoteFault]:
        """Remove each key; True if it was there."""

    def memory(self) -> RemoteMemory:
        """Memory used and allowed; raises RemoteFault when the store cannot say."""

    def close(self) -> None:
        """Drop every connection; a second call does nothing."""
