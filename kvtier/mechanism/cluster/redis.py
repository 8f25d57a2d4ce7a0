"""The built-in cluster backend (`REDIS`, schemes redis, rediss, valkey, valkeys) and its
store, RedisClusterStore: a RemoteStore on Redis Cluster or Valkey Cluster (same
protocol), through redis-py's RedisCluster.

redis-py keeps the slot map, follows MOVED and ASK during resharding and failover, and
sends a pipeline as one batch per node. A value is a hash of two fields, `h` (header) and
`p` (page): HSET writes both at once and sends the page buffer as it is; HMGET reads both. What this adds: a connection made lazily and
again after a failure (a cluster that is down when the daemon starts is a miss now and
a hit later, never an error), at most one attempt per `retry_interval`, and every
redis-py exception mapped to a FaultKind.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry

from kvtier.mechanism.cluster.remote import FaultKind, RemoteFault, RemoteMemory, StoreSettings, Value

#: The URL schemes of a Redis or Valkey Cluster; the second of each pair is TLS.
SCHEMES = ("redis", "rediss", "valkey", "valkeys")


@dataclass(frozen=True)
class ClusterAddress:
    """Where the cluster is and how to log in: `redis://[user[:password]@]host:port,host:port`
    (`rediss://` for TLS). Any one reachable node is enough; redis-py learns the rest."""

    nodes: tuple[tuple[str, int], ...]
    tls: bool = False
    username: str | None = None
    password: str | None = None

    @classmethod
    def parse(cls, url: str) -> "ClusterAddress":
        scheme, sep, rest = url.partition("://")
        if not sep or scheme not in SCHEMES:
            raise ValueError(f"cluster address {url!r} must start with redis:// (or rediss:// for TLS)")
        credentials, at, hosts = rest.rpartition("@")
        nodes = []
        for part in hosts.rstrip("/").split(","):
            parsed = urlsplit("//" + part.strip())
            try:
                port = parsed.port
            except ValueError:
                port = None
            if not parsed.hostname or port is None:
                raise ValueError(f"cluster address {url!r}: {part!r} is not host:port")
            nodes.append((parsed.hostname, port))
        username = password = None
        if at:
            user, colon, secret = credentials.partition(":")
            username, password = (unquote(user) or None), (unquote(secret) if colon else None)
        return cls(tuple(nodes), scheme in ("rediss", "valkeys"), username, password)

    def __str__(self) -> str:  # never the password
        scheme = "rediss" if self.tls else "redis"
        user = f"{self.username}@" if self.username else ""
        return f"{scheme}://{user}" + ",".join(f"{h}:{p}" for h, p in self.nodes)


def fault_of(exc: BaseException) -> RemoteFault:
    """The FaultKind of a redis-py exception (order matters: subclasses first)."""
    if isinstance(exc, RemoteFault):
        return exc
    if isinstance(exc, redis.exceptions.TimeoutError):
        kind = FaultKind.TIMEOUT
    elif isinstance(exc, (redis.exceptions.AskError, redis.exceptions.TryAgainError, redis.exceptions.ClusterDownError,
                          redis.exceptions.SlotNotCoveredError)):
        kind = FaultKind.MOVED
    elif isinstance(exc, (redis.exceptions.ConnectionError, redis.exceptions.RedisClusterException)):
        kind = FaultKind.UNAVAILABLE
    elif isinstance(exc, redis.exceptions.OutOfMemoryError):
        kind = FaultKind.FULL
    else:
        kind = FaultKind.OTHER
    return RemoteFault(kind, f"{type(exc).__name__}: {exc}")


class RedisClusterStore:
    """Redis/Valkey Cluster as a RemoteStore. Thread-safe: redis-py's cluster client pools
    connections per node; each batch is one pipeline."""

    def __init__(self, url: str | ClusterAddress, *, username: str | None = None, password: str | None = None,
                 tls_ca: str | None = None, timeout: float = 1.0, retry_interval: float = 1.0,
                 connect: Callable[..., RedisCluster] = RedisCluster) -> None:
        """`username`/`password` override the address's; `timeout` bounds every socket
        operation; `retry_interval` spaces connection attempts while the cluster is down."""
        self.address = url if isinstance(url, ClusterAddress) else ClusterAddress.parse(url)
        self._username = username or self.address.username
        self._password = password if password is not None else self.address.password
        self._tls_ca = tls_ca
        self._timeout = timeout
        self._retry_interval = retry_interval
        self._connect = connect
        self._client: RedisCluster | None = None
        self._next_attempt = 0.0
        self._lock = threading.Lock()
        self._closed = False

    def _cluster(self) -> RedisCluster:
        with self._lock:
            if self._closed:
                raise RemoteFault(FaultKind.UNAVAILABLE, "the cluster store is closed")
            if self._client is not None:
                return self._client
            now = time.monotonic()
            if now < self._next_attempt:
                raise RemoteFault(FaultKind.UNAVAILABLE, f"no connection to {self.address}; retrying in "
                                                         f"{self._next_attempt - now:.1f} s")
            self._next_attempt = now + self._retry_interval
            options = dict(
                startup_nodes=[ClusterNode(h, p) for h, p in self.address.nodes],
                username=self._username, password=self._password,
                socket_timeout=self._timeout, socket_connect_timeout=self._timeout,
                require_full_coverage=False,  # a shard down costs its slots, not the cluster
                retry=Retry(NoBackoff(), 2),  # MOVED/ASK/failover: refresh the map and try again, twice
            )
            if self.address.tls:
                options.update(ssl=True, ssl_ca_certs=self._tls_ca)
            try:
                self._client = self._connect(**options)
            except Exception as exc:  # redis-py raises several kinds for "no cluster there"
                raise fault_of(exc) from None
            return self._client

    def _batch(self, add: Callable[[object, bytes], None], keys: Sequence) -> list:
        """Run one pipelined command per key; each key's result or its RemoteFault."""
        if not keys:
            return []
        try:
            pipe = self._cluster().pipeline()
            for key in keys:
                add(pipe, key)
            replies = pipe.execute(raise_on_error=False)
        except RemoteFault as fault:
            return [fault] * len(keys)
        except Exception as exc:  # the whole batch failed (every node it needed)
            self._forget_client_after(exc)
            return [fault_of(exc)] * len(keys)
        return [fault_of(r) if isinstance(r, BaseException) else r for r in replies]

    def _forget_client_after(self, exc: BaseException) -> None:
        """After a connection-level failure, build the client again next time: its slot map
        may name nodes that are gone."""
        if isinstance(exc, (redis.exceptions.ConnectionError, redis.exceptions.RedisClusterException)):
            with self._lock:
                client, self._client = self._client, None
            if client is not None:
                client.close()

    def exists(self, keys: Sequence[bytes]) -> list[bool | RemoteFault]:
        return [r if isinstance(r, RemoteFault) else bool(r) for r in self._batch(lambda p, k: p.exists(k), keys)]

    def get(self, keys: Sequence[bytes]) -> list[Value | None | RemoteFault]:
        replies = self._batch(lambda p, k: p.hmget(k, (b"h", b"p")), keys)
        return [r if isinstance(r, RemoteFault) else (tuple(r) if None not in r else None) for r in replies]

    def put(self, items: Sequence[tuple[bytes, Value]]) -> list[bool | RemoteFault]:
        replies = self._batch(lambda p, item: p.hset(item[0], mapping={b"h": item[1][0], b"p": item[1][1]}), items)
        return [r if isinstance(r, RemoteFault) else True for r in replies]

    def delete(self, keys: Sequence[bytes]) -> list[bool | RemoteFault]:
        return [r if isinstance(r, RemoteFault) else bool(r) for r in self._batch(lambda p, k: p.delete(k), keys)]

    def memory(self) -> RemoteMemory:
        try:
            infos = self._cluster().info("memory", target_nodes=RedisCluster.PRIMARIES)
        except RemoteFault:
            raise
        except Exception as exc:
            self._forget_client_after(exc)
            raise fault_of(exc) from None
        if "used_memory" in infos:  # one primary: redis-py returns its dict itself
            infos = {"": infos}
        used = sum(int(info.get("used_memory", 0)) for info in infos.values())
        limit = sum(int(info.get("maxmemory", 0)) for info in infos.values())
        return RemoteMemory(used, limit)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
        if client is not None:
            client.close()


class RedisBackend:
    """Redis or Valkey Cluster, as a ClusterBackend."""

    def check(self, url: str) -> None:
        ClusterAddress.parse(url)

    def open(self, url: str, settings: StoreSettings) -> RedisClusterStore:
        return RedisClusterStore(url, username=settings.username, password=settings.password,
                                 tls_ca=settings.tls_ca, timeout=settings.timeout)


REDIS = RedisBackend()
