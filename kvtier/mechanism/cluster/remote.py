"""The cluster seam: what a backend must provide for the cluster tier to keep pages on a
store that every node shares, and how it says a call failed.

A backend (`ClusterBackend`) is a kind of store, named by the scheme of its URL
(`cluster = "<scheme>://..."`; kvtier.mechanism.cluster.backends). It reads its URLs and
opens a `RemoteStore`: a connection to one store, which keeps opaque values under opaque
keys. That is all a backend knows. What a value holds (the header with its format
version, layout, checksum, seal and codec id, and the page as its codec encoded it) is
the tier's (kvtier.mechanism.cluster.values), so every backend stores the same values,
verified the same way.

Every call is a batch of keys, answered key by key: a store spends one round trip per
node it has to ask, whatever the number of keys. A per-key result that is a RemoteFault
fails that key only: the rest of the batch stands, so a node that is down costs only the
pages it held. A store never raises from a batch call, and never blocks past the timeout
it was opened with: every fault is a miss to the tier, never an error to a client.

A value is two byte strings, head and body, written together and read back together (a
reader never sees one without the other): the body goes out as the caller's buffer, never
copied to put the head before it (at 2 MiB that copy costs as much as a third of the
network time).
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
    MOVED = "moved"  # the key's data moved between the store's nodes (rebalancing, failover) and retries ran out
    FULL = "full"  # the store refused a write for want of memory
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


#: (head, body) as stored and as fetched: the tier's header and the encoded page.
Value = tuple[bytes, "bytes | memoryview"]


@dataclass(frozen=True)
class RemoteMemory:
    """The store's own memory figures, over all its nodes. `limit` 0: none set."""

    used: int
    limit: int


@dataclass(frozen=True)
class StoreSettings:
    """What the daemon's options tell every backend (`cluster_*`, docs/configuration.md).
    Anything only one backend needs belongs in its URL (its query, for instance)."""

    username: str | None = None  # overrides the URL's (a per-namespace user: cluster_acl_file)
    password: str | None = None  # overrides the URL's (cluster_password_file)
    tls_ca: str | None = None  # PEM CA of the store's certificates, for a TLS scheme
    timeout: float = 1.0  # seconds: no store operation may block longer


class RemoteStore(Protocol):
    """One connection to a store, made by `ClusterBackend.open`. Called from several
    threads at once (the tier's readers and its writer): it must be thread-safe. It
    connects on first use and again after a failure, never in `open`: a store that is down
    when the daemon starts is a miss now and a hit later."""

    def exists(self, keys: Sequence[bytes]) -> list[bool | RemoteFault]:
        """Whether each key holds a value."""

    def get(self, keys: Sequence[bytes]) -> list[Value | None | RemoteFault]:
        """Each key's value as it was put, None if absent (or only half there)."""

    def put(self, items: Sequence[tuple[bytes, Value]]) -> list[bool | RemoteFault]:
        """Store each (key, value), head and body together, replacing any value the key
        held; True when stored. The store may drop values later (to make room): that is a
        miss, not a fault."""

    def delete(self, keys: Sequence[bytes]) -> list[bool | RemoteFault]:
        """Remove each key; True if it was there."""

    def memory(self) -> RemoteMemory:
        """Memory used and allowed; raises RemoteFault when the store cannot say."""

    def close(self) -> None:
        """Drop every connection; a second call does nothing."""


class ClusterBackend(Protocol):
    """A kind of store, registered under the schemes of its URLs (built in: redis://,
    rediss://, valkey://, valkeys://; from outside kvtier: an entry point in the group
    `kvtier.cluster_backends` named by its scheme, docs/tiers.md "Adding a cluster
    backend")."""

    def check(self, url: str) -> None:
        """Refuse (ValueError) a URL this backend cannot use, without connecting: at
        configuration time. The message says what is wrong and never repeats a password."""

    def open(self, url: str, settings: StoreSettings) -> RemoteStore:
        """A store for `url`, connecting lazily (never here); `settings` override what
        the URL says of the user and password."""
