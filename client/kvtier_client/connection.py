"""The gRPC connection to a daemon: channel, credentials, bearer token, error mapping, retries.

It knows nothing of sessions but their key: every call carries the token (and, for a call
that names a session, that session's key), every failure comes back as a
KVTierError subclass (kvtier_client.errors), and UNAVAILABLE -- the daemon starting,
draining, restarting or not yet listening -- is retried with bounded exponential backoff.
"""
from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import grpc

from kvtier_client.errors import Unavailable, from_rpc_error
from kvtier_client.proto.v1 import kvtier_pb2_grpc
from kvtier_client.protocol import MAX_MESSAGE_BYTES

T = TypeVar("T")

#: The metadata key a session's calls carry its key under (the daemon checks it on every call).
SESSION_KEY = "kvtier-session-key"


@dataclass(frozen=True)
class Backoff:
    """How long to keep retrying an unavailable daemon: delays grow from `initial` by
    `multiplier` up to `maximum` (each shortened by up to `jitter` of itself, so clients
    restarted together do not retry in lockstep); after `total` seconds the call raises
    Unavailable."""

    initial: float = 0.05
    maximum: float = 2.0
    multiplier: float = 2.0
    total: float = 30.0
    jitter: float = 0.2

    def __post_init__(self) -> None:
        if not 0 < self.initial <= self.maximum:
            raise ValueError(f"backoff needs 0 < initial <= maximum, got {self.initial} and {self.maximum}")
        if self.multiplier < 1 or self.total < 0 or not 0 <= self.jitter < 1:
            raise ValueError("backoff needs multiplier >= 1, total >= 0 and 0 <= jitter < 1")

    def delays(self) -> Iterator[float]:
        """Successive sleeps, without jitter; the sum is bounded by the caller's deadline."""
        delay = self.initial
        while True:
            yield delay
            delay = min(delay * self.multiplier, self.maximum)


@dataclass(frozen=True)
class TLSConfig:
    """TLS material for a TCP target, as PEM bytes. `root_certificates` verifies the daemon
    (None: the system roots); a certificate chain and private key together make it mutual
    TLS. `server_name` overrides the name checked against the daemon's certificate."""

    root_certificates: bytes | None = None
    certificate_chain: bytes | None = None
    private_key: bytes | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.certificate_chain is None) != (self.private_key is None):
            raise ValueError("mutual TLS needs both a client certificate chain and its private key")

    @classmethod
    def from_files(
        cls, ca: str | Path | None = None, cert: str | Path | None = None, key: str | Path | None = None,
        server_name: str | None = None,
    ) -> "TLSConfig":
        def read(path: str | Path | None) -> bytes | None:
            return Path(path).read_bytes() if path is not None else None

        return cls(read(ca), read(cert), read(key), server_name)


def is_unix_target(target: str) -> bool:
    return target.startswith("unix:")


def open_channel(target: str, *, tls: TLSConfig | None, insecure: bool, backoff: Backoff) -> grpc.Channel:
    """A channel to `target`: "unix:///abs/path.sock" (plain; the socket's file permissions
    guard it) or "host:port" (TLS unless `insecure`)."""
    # gRPC's own reconnect backoff grows to minutes by default; keep it within ours, so a
    # restarted daemon is found again as soon as our retry loop asks.
    reconnect_ms = max(1, int(backoff.maximum * 1000))
    options = [
        ("grpc.initial_reconnect_backoff_ms", max(1, int(backoff.initial * 1000))),
        ("grpc.min_reconnect_backoff_ms", max(1, int(backoff.initial * 1000))),
        ("grpc.max_reconnect_backoff_ms", reconnect_ms),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ]
    if is_unix_target(target):
        if tls is not None:
            raise ValueError("TLS applies to host:port targets; a unix socket is protected by its file permissions")
        return grpc.insecure_channel(target, options=options)
    if insecure:
        if tls is not None:
            raise ValueError("pass either tls or insecure=True, not both")
        return grpc.insecure_channel(target, options=options)
    tls = tls or TLSConfig()
    if tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    credentials = grpc.ssl_channel_credentials(tls.root_certificates, tls.private_key, tls.certificate_chain)
    return grpc.secure_channel(target, credentials, options=options)


class Connection:
    """One channel and stub; every call goes through `unary`, `server_stream` or `client_stream`."""

    def __init__(
        self, target: str, *, token: str | None = None, tls: TLSConfig | None = None, insecure: bool = False,
        backoff: Backoff = Backoff(), timeout: float = 30.0,
    ) -> None:
        self.target = target
        self.backoff = backoff
        self.timeout = timeout
        self.token = token
        self.metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        self._channel = open_channel(target, tls=tls, insecure=insecure, backoff=backoff)
        self.stub = kvtier_pb2_grpc.KVTierStub(self._channel)
        self._closed = threading.Event()

    @property
    def channel(self) -> grpc.Channel:
        """The channel, for a stub of another service on it (`kvtier health-check`'s Health)."""
        return self._channel

    def _metadata(self, key: str) -> tuple[tuple[str, str], ...]:
        return (*self.metadata, (SESSION_KEY, key)) if key else self.metadata

    def unary(self, method: str, request, *, key: str = "", timeout: float | None = None, retry: bool = True):
        """Call a unary RPC by name (`key`: the key of the session it names); retries
        UNAVAILABLE unless `retry` is False."""
        rpc = getattr(self.stub, method)
        metadata = self._metadata(key)
        return self._retrying(
            lambda: rpc(request, timeout=timeout or self.timeout, metadata=metadata), retry=retry, what=method
        )

    def server_stream(self, method: str, request, *, key: str = "") -> Iterator:
        """Yield a server stream's messages. Retries only until the first message arrives:
        after that a retry could repeat what the caller already consumed."""
        rpc = getattr(self.stub, method)
        metadata = self._metadata(key)

        def start():
            stream = rpc(request, timeout=self.timeout, metadata=metadata)
            return stream, next(stream, None)

        stream, first = self._retrying(start, retry=True, what=method)
        if first is None:
            return
        yield first
        try:
            yield from stream
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from exc

    def client_stream(self, method: str, requests: Callable[[], Iterable], *, key: str = "", retry: bool = True):
        """Send a client stream built by `requests()` (called again on each retry)."""
        rpc = getattr(self.stub, method)
        metadata = self._metadata(key)
        return self._retrying(
            lambda: rpc(iter(requests()), timeout=self.timeout, metadata=metadata), retry=retry, what=method
        )

    def _retrying(self, call: Callable[[], T], *, retry: bool, what: str) -> T:
        deadline = time.monotonic() + self.backoff.total
        delays = self.backoff.delays()
        while True:
            try:
                return call()
            except grpc.RpcError as exc:
                error = from_rpc_error(exc)
                if not (retry and isinstance(error, Unavailable)):
                    raise error from exc
                pause = next(delays) * (1 - random.uniform(0, self.backoff.jitter))
                if time.monotonic() + pause > deadline:
                    raise Unavailable(
                        f"{what}: daemon at {self.target} still unavailable after {self.backoff.total:g}s "
                        f"({error}); is `kvtier serve` running?"
                    ) from exc
                if self._closed.wait(pause):
                    raise Unavailable(f"{what}: client closed while waiting for the daemon") from exc

    def stop_retrying(self) -> None:
        """Make every retry loop, now and later, give up with Unavailable (the client is closing)."""
        self._closed.set()

    def close(self) -> None:
        self.stop_retrying()
        self._channel.close()
