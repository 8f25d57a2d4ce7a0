"""Small helpers for talking to a real daemon with the generated stubs (no client SDK).

The end-to-end tests under tests/server start `kvtier serve` as a subprocess
(tests/daemon.py) and use these to register, compare state and check status codes.
"""
from __future__ import annotations

import hashlib
import mmap
import os
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from daemon import KVTIER, Daemon, launch  # tests/daemon.py (tests/ is on sys.path via its conftest)
from kvtier_client.keys import hash_fingerprint
from kvtier_client.proto.v1 import kvtier_pb2 as pb
from kvtier_client.proto.v1 import kvtier_pb2_grpc
from kvtier_client.handoff import attach
from prometheus_client.parser import text_string_to_metric_families

#: 3072-byte pages in 4096-byte slots: 1 MiB of host tier holds 256 pages.
LAYOUT = pb.PageLayout(layers=1, kv_heads=1, head_dim=48, block_tokens=16, dtype="float16", order="page_first")
PAGE_BYTES = 3072
SLOT_BYTES = 4096

#: Every unary call gets a deadline: a daemon that hangs fails the test instead of stalling it.
TIMEOUT = 10.0


def keys(tag: str, n: int) -> list[bytes]:
    """n distinct 16-byte block keys (any opaque bytes will do for the daemon)."""
    return [hashlib.sha256(f"{tag}:{i}".encode()).digest()[:16] for i in range(n)]


def register_request(namespace: str = "ns", *, layout: pb.PageLayout = LAYOUT, algorithm: str = "xxh3-128",
                     fingerprint: str | None = None, name: str = "e2e-test") -> pb.RegisterRequest:
    return pb.RegisterRequest(
        namespace=namespace, layout=layout, hash_algorithm=algorithm,
        hash_fingerprint=hash_fingerprint(algorithm) if fingerprint is None else fingerprint, client_name=name,
    )


class Conn:
    """A channel and a stub to one daemon; every call carries the bearer token, if any, and a deadline.

    Sessions opened with `register` are attached (over the handoff socket, as a same-host
    client must before its first call) and closed by `close`, so a shared daemon sees no
    stray ones.
    """

    def __init__(self, target: str, *, token: str | None = None, credentials: grpc.ChannelCredentials | None = None,
                 options: tuple = ()) -> None:
        self.channel = grpc.secure_channel(target, credentials, options) if credentials else grpc.insecure_channel(target, options)
        self.stub = kvtier_pb2_grpc.KVTierStub(self.channel)
        self.token = token
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.sessions: dict[str, str] = {}  # session id -> key
        self.arena_fds: dict[str, int] = {}  # session id -> the host arena's descriptor

    def call(self, method: str, request, timeout: float = TIMEOUT, key: str = ""):
        """`key`: the key of the session the request names (sent as kvtier-session-key)."""
        metadata = (*self.metadata, ("kvtier-session-key", key)) if key else self.metadata
        return getattr(self.stub, method)(request, timeout=timeout, metadata=metadata or None)

    def register(self, namespace: str = "ns", **kwargs) -> pb.RegisterResponse:
        """Register, then attach the session (over TCP, the reply carries the key)."""
        reply = self.call("Register", register_request(namespace, **kwargs))
        key = reply.session_key
        if reply.handoff_socket:
            attachment = attach(reply.handoff_socket, reply.session_id, self.token)
            key = attachment.session_key
            self.arena_fds[reply.session_id] = attachment.arena_fd
        self.sessions[reply.session_id] = key
        return reply

    def session(self, namespace: str = "ns", **kwargs) -> "Session":
        return Session(self, self.register(namespace, **kwargs))

    def state(self) -> pb.StatsResponse:
        """Stats without the clock: two snapshots are equal iff no state changed in between."""
        reply = self.call("Stats", pb.StatsRequest())
        reply.ClearField("uptime_seconds")
        return reply

    def close(self) -> None:
        """Close the sessions this connection opened, then the channel; safe to call twice."""
        sessions, self.sessions = self.sessions, {}
        for session_id, key in sessions.items():
            try:
                self.call("CloseSession", pb.CloseSessionRequest(session_id=session_id), key=key)
            except grpc.RpcError:
                pass  # ended already (timed out, closed by the test, or the daemon is gone)
        fds, self.arena_fds = self.arena_fds, {}
        for fd in fds.values():
            os.close(fd)
        self.channel.close()


class Session:
    """One registered session: thin wrappers that fill in the session id."""

    def __init__(self, conn: Conn, reply: pb.RegisterResponse) -> None:
        self.conn = conn
        self.reply = reply
        self.id = reply.session_id
        self.key = conn.sessions[reply.session_id]

    @property
    def arena_fd(self) -> int:
        return self.conn.arena_fds[self.id]

    def call(self, method: str, request, **kwargs):
        return self.conn.call(method, request, key=self.key, **kwargs)

    def borrow(self, count: int) -> pb.BorrowResponse:
        return self.call("Borrow", pb.BorrowRequest(session_id=self.id, count=count))

    def commit(self, lease_id: int, keys: list[bytes], parent: bytes = b"") -> pb.CommitResponse:
        return self.call("Commit", pb.CommitRequest(session_id=self.id, lease_id=lease_id, keys=keys, parent=parent))

    def put(self, keys: list[bytes]) -> pb.BorrowResponse:
        """Borrow len(keys) pages and commit them under keys; returns the borrow reply."""
        lease = self.borrow(len(keys))
        self.commit(lease.lease_id, keys)
        return lease

    def lookup(self, keys: list[bytes]) -> pb.LookupResponse:
        return self.call("Lookup", pb.LookupRequest(session_id=self.id, keys=keys))

    def acquire(self, keys: list[bytes], tier: int = pb.TIER_HOST, **kwargs) -> pb.AcquireResponse:
        return self.call("Acquire", pb.AcquireRequest(session_id=self.id, keys=keys, tier=tier, **kwargs))

    def release(self, lease_id: int) -> pb.ReleaseResponse:
        return self.call("Release", pb.ReleaseRequest(session_id=self.id, lease_id=lease_id))

    def prefetch(self, keys: list[bytes], tier: int = pb.TIER_HOST) -> pb.PrefetchResponse:
        return self.call("Prefetch", pb.PrefetchRequest(session_id=self.id, keys=keys, tier=tier))

    def heartbeat(self) -> pb.HeartbeatResponse:
        return self.call("Heartbeat", pb.HeartbeatRequest(session_id=self.id))

    def close(self) -> pb.CloseSessionResponse:
        return self.call("CloseSession", pb.CloseSessionRequest(session_id=self.id))


def expect_code(code: grpc.StatusCode, call: Callable, *args, **kwargs) -> str:
    """Run call(*args) and check that it fails with `code`; returns the status message,
    which must say something (what was wrong and what to do)."""
    with pytest.raises(grpc.RpcError) as info:
        call(*args, **kwargs)
    assert info.value.code() == code, f"expected {code.name}, got {info.value.code().name}: {info.value.details()}"
    details = info.value.details()
    assert details and len(details) > 20, f"{code.name} without a useful message: {details!r}"
    return details


@contextmanager
def unchanged(conn: Conn) -> Iterator[None]:
    """Assert that the block of code leaves the daemon's Stats (clock aside) as it found them."""
    before = conn.state()
    yield
    after = conn.state()
    assert after == before, f"state changed:\n--- before\n{before}\n--- after\n{after}"


def pool_stats(state: pb.StatsResponse, pool_id: str) -> pb.PoolStats:
    return next(p for p in state.pools if p.pool_id == pool_id)


def tier_stats(state: pb.StatsResponse, pool_id: str, tier: int = pb.TIER_HOST) -> pb.TierStats:
    return next(t for t in pool_stats(state, pool_id).tiers if t.tier == tier)


def wait_for(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.05):
    """Poll until predicate() is truthy; returns its value, or fails after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def in_dev_shm(prefix: str) -> list[str]:
    """Files in /dev/shm with a daemon's arena prefix in their name: there must be none."""
    return sorted(name for name in os.listdir("/dev/shm") if prefix in name)


class Arena:
    """A host arena mapped the way a same-host engine maps it: from the descriptor the
    daemon handed over when the session attached."""

    def __init__(self, fd: int, size: int, *, slot_bytes: int = SLOT_BYTES, page_bytes: int = PAGE_BYTES) -> None:
        self.slot_bytes = slot_bytes
        self.page_bytes = page_bytes
        self.mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)

    @classmethod
    def of(cls, session: Session) -> "Arena":
        reply = session.reply
        return cls(session.arena_fd, reply.host_arena_bytes, slot_bytes=reply.slot_bytes, page_bytes=reply.page_bytes)

    def write(self, slot: int, data: bytes) -> None:
        self.mm[slot * self.slot_bytes : slot * self.slot_bytes + len(data)] = data

    def read(self, slot: int, n: int | None = None) -> bytes:
        n = self.page_bytes if n is None else n
        return self.mm[slot * self.slot_bytes : slot * self.slot_bytes + n]

    def close(self) -> None:
        self.mm.close()


def page(tag: str, size: int = PAGE_BYTES) -> bytes:
    """`size` bytes (PAGE_BYTES by default) of content that differs per tag."""
    seed = hashlib.sha256(tag.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


# -- the Prometheus endpoint (--metrics-port) ------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> tuple[str, dict]:
    """The raw text and {family name: family}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return text, {f.name: f for f in text_string_to_metric_families(text)}


def samples(families: dict, sample_name: str, **labels) -> list:
    return [s for f in families.values() for s in f.samples
            if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items())]


def value(families: dict, sample_name: str, **labels) -> float:
    found = samples(families, sample_name, **labels)
    assert len(found) == 1, f"{sample_name}{labels}: {found}"
    return found[0].value


def serve(tmp_path: Path, *args: str, env: dict[str, str] | None = None, wait: bool = True) -> Daemon:
    """`kvtier serve` with exactly `args` plus --socket and --arena-prefix: for tests that must
    leave out the sizes and cache dir tests/daemon.py's start_daemon always passes (config precedence)."""
    return launch(tmp_path, *args, env=env, wait=wait)


def run_kvtier(*args: str, timeout: float = 30.0, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run `python -m kvtier ARGS` to completion, capturing text output."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    full_env.update(env or {})
    return subprocess.run([*KVTIER, *args], capture_output=True, text=True, timeout=timeout, env=full_env)

