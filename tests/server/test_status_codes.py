"""Every status code of DESIGN.md "Errors", through the real socket of a real daemon, and
the rule that a bad request never changes state (Stats before == Stats after).

UNAUTHENTICATED and PERMISSION_DENIED are in test_auth_namespaces.py (a daemon with tokens)."""
from __future__ import annotations

import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvtier_client.proto.v1 import kvtier_pb2 as pb
from rpc import LAYOUT, expect_code, keys, register_request, run_kvtier, tier_stats, unchanged, wait_for

Code = grpc.StatusCode


@pytest.fixture(scope="module")
def shared(module_daemons):
    """One daemon for the tests that each leave it as they found it (256 host pages)."""
    return module_daemons.start("--session-timeout", "60s", host_size="1MiB", disk_size="4MiB")


@pytest.fixture
def conn(shared, connect):
    return connect(shared.target)


def bad_layout(**changes) -> pb.PageLayout:
    layout = pb.PageLayout()
    layout.CopyFrom(LAYOUT)
    for name, value in changes.items():
        setattr(layout, name, value)
    return layout


def test_invalid_argument(conn):
    s = conn.session("codes")
    cached = keys("invalid-cached", 2)
    s.put(cached)
    lease = s.borrow(2)
    call = conn.call
    with unchanged(conn):
        # Register: malformed layout, algorithm, namespace.
        for layout in (bad_layout(layers=0), bad_layout(head_dim=0), bad_layout(dtype="float64"), bad_layout(order="layer_first")):
            expect_code(Code.INVALID_ARGUMENT, call, "Register", register_request("codes", layout=layout))
        expect_code(Code.INVALID_ARGUMENT, call, "Register", register_request("codes", algorithm="md5", fingerprint="00"))
        expect_code(Code.INVALID_ARGUMENT, call, "Register", register_request(""))
        expect_code(Code.INVALID_ARGUMENT, call, "Register", register_request("n" * 256))
        # Keys must be 1 to 64 bytes: in Lookup, Commit, Acquire, Prefetch.
        for bad in (b"", b"k" * 65):
            expect_code(Code.INVALID_ARGUMENT, s.lookup, [cached[0], bad])
            expect_code(Code.INVALID_ARGUMENT, s.commit, lease.lease_id, [b"k" * 16, bad])
            expect_code(Code.INVALID_ARGUMENT, s.acquire, [cached[0], bad])
            expect_code(Code.INVALID_ARGUMENT, s.prefetch, [bad])
        expect_code(Code.INVALID_ARGUMENT, s.commit, lease.lease_id, keys("too-many", 3))  # lease holds 2 pages
        # Counts: zero, and more than the whole host tier.
        expect_code(Code.INVALID_ARGUMENT, s.borrow, 0)
        expect_code(Code.INVALID_ARGUMENT, s.borrow, s.reply.tiers[0].capacity_pages + 1)
        # Tiers: no device tier on a daemon without a GPU; disk is not a tier pages are lent from.
        message = expect_code(Code.INVALID_ARGUMENT, s.acquire, cached, pb.TIER_DEVICE)
        assert "TIER_HOST" in message
        expect_code(Code.INVALID_ARGUMENT, s.acquire, cached, pb.TIER_DISK)
        expect_code(Code.INVALID_ARGUMENT, s.prefetch, cached, pb.TIER_DEVICE)
        expect_code(Code.INVALID_ARGUMENT, s.acquire, [cached[0], cached[0]])
        expect_code(Code.INVALID_ARGUMENT, s.acquire, cached, wait=pb.WAIT_DEADLINE)  # no deadline_ms
    # The lease the bad commits named is intact: it still commits.
    assert s.commit(lease.lease_id, keys("invalid-later", 2)).committed == 2


def test_not_found(conn):
    s = conn.session("codes")
    cached = keys("nf-cached", 2)
    s.put(cached)
    unknown = "0" * 32
    with unchanged(conn):
        for method, request in (
            ("Lookup", pb.LookupRequest(session_id=unknown, keys=cached)),
            ("Borrow", pb.BorrowRequest(session_id=unknown, count=1)),
            ("Heartbeat", pb.HeartbeatRequest(session_id=unknown)),
            ("CloseSession", pb.CloseSessionRequest(session_id=unknown)),
            ("Acquire", pb.AcquireRequest(session_id=unknown, keys=cached)),
            ("AcquirePrefix", pb.AcquirePrefixRequest(session_id=unknown, keys=cached)),
            ("Release", pb.ReleaseRequest(session_id=unknown, lease_id=1)),
        ):
            message = expect_code(Code.NOT_FOUND, conn.call, method, request)
            assert "register again" in message
        expect_code(Code.NOT_FOUND, s.release, 10**12)  # a lease id never handed out
        # An uncached key after a cached one: nothing is pinned, nothing loaded.
        message = expect_code(Code.NOT_FOUND, s.acquire, [cached[0], keys("nf-missing", 1)[0], cached[1]])
        assert "key 1" in message


def test_failed_precondition(conn):
    s = conn.session("codes")
    other = conn.session("codes")
    cached = keys("fp-cached", 2)
    s.put(cached)
    released = s.borrow(1)
    s.release(released.lease_id)
    read = s.acquire(cached)
    write = s.borrow(2)
    with unchanged(conn):
        expect_code(Code.FAILED_PRECONDITION, s.release, released.lease_id)  # double release
        expect_code(Code.FAILED_PRECONDITION, s.commit, released.lease_id, keys("fp-late", 1))
        expect_code(Code.FAILED_PRECONDITION, s.commit, read.lease_id, keys("fp-read", 2))  # a read lease
        message = expect_code(Code.FAILED_PRECONDITION, other.release, write.lease_id)  # another session's lease
        assert "another session" in message
        expect_code(Code.FAILED_PRECONDITION, other.release, read.lease_id)
        expect_code(Code.FAILED_PRECONDITION, other.commit, write.lease_id, keys("fp-other", 2))
        message = expect_code(Code.FAILED_PRECONDITION, conn.call, "Register", register_request("codes", fingerprint="ab" * 16))
        assert "fingerprint" in message
        with pytest.raises(grpc.RpcError) as info:  # the slow path checks the lease kind too
            list(conn.stub.ReadPages(pb.ReadPagesRequest(session_id=s.id, lease_id=write.lease_id), timeout=10,
                                     metadata=(("kvtier-session-key", s.key),)))
        assert info.value.code() == Code.FAILED_PRECONDITION
    # Both leases survived the other session's attempts.
    s.release(read.lease_id)
    s.release(write.lease_id)


def test_resource_exhausted_never_hangs(conn):
    s = conn.session("codes")
    capacity = s.reply.tiers[0].capacity_pages
    pinned = keys("re-pinned", 4)
    s.put(pinned)
    read = s.acquire(pinned)  # cached but pinned: not evictable
    write = s.borrow(capacity - len(pinned))  # every other page
    state = conn.state()
    host = tier_stats(state, s.reply.pool_id)
    assert (host.free_pages, host.pinned_pages, host.writing_pages) == (0, len(pinned), capacity - len(pinned))
    with unchanged(conn):
        start = time.monotonic()
        message = expect_code(Code.RESOURCE_EXHAUSTED, s.call, "Borrow", pb.BorrowRequest(session_id=s.id, count=1), timeout=5)
        assert time.monotonic() - start < 5
        assert "release leases" in message
    s.release(read.lease_id)
    # Unpinned cached pages are evictable again: the same borrow now succeeds by evicting them.
    extra = s.borrow(len(pinned))
    s.release(extra.lease_id)
    s.release(write.lease_id)


def test_unavailable_while_draining(daemons, connect):
    d = daemons.start("--drain-timeout", "5s")
    conn = connect(d.target)
    s = conn.session("drain")
    cached = keys("drain", 2)
    s.put(cached)
    held = s.borrow(2)
    health = health_pb2_grpc.HealthStub(conn.channel)

    d.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.NOT_SERVING,
             5, "the daemon to report NOT_SERVING after SIGTERM")
    with unchanged(conn):
        for method, request in (
            ("Register", register_request("drain")),
            ("Borrow", pb.BorrowRequest(session_id=s.id, count=1)),
            ("Acquire", pb.AcquireRequest(session_id=s.id, keys=cached)),
            ("AcquirePrefix", pb.AcquirePrefixRequest(session_id=s.id, keys=cached)),
            ("Prefetch", pb.PrefetchRequest(session_id=s.id, keys=cached)),
        ):
            message = expect_code(Code.UNAVAILABLE, conn.call, method, request)
            assert "draining" in message
    # Reads and bookkeeping still work, so clients can finish and let go.
    assert s.lookup(cached).hit_blocks == 2
    assert s.heartbeat().leases == 1
    probe = run_kvtier("health-check", "--socket", str(d.socket))
    assert (probe.returncode, probe.stdout.strip()) == (1, "NOT_SERVING")
    assert d.proc.poll() is None, "the daemon must wait for the open lease (drain timeout 5s)"

    s.release(held.lease_id)
    released = time.monotonic()
    assert d.proc.wait(timeout=5) == 0
    assert time.monotonic() - released < 3, "the daemon should exit promptly once the last lease is released"
    assert not d.socket.exists()
