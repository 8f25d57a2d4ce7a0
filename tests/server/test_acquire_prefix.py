"""AcquirePrefix is one contract on both transports: the same request over gRPC and over the
fast lane, against a real daemon, gets the same answer — a full hit, a partial hit, no hit
(no lease), and the same status code and message for a request either refuses. Frames are
built with kvtier_client.frames, raw, as in test_lane.py.
"""
from __future__ import annotations

import socket

import grpc
import pytest
from kvtier_client import frames
from kvtier_client.frames import Op
from kvtier_client.proto.v1 import kvtier_pb2 as pb
from rpc import Conn, expect_code, keys

_NAMES = {code.value[0]: code for code in grpc.StatusCode}


@pytest.fixture
def daemon(daemons):
    return daemons.start(host_size="1MiB", disk_size="0")


@pytest.fixture
def session(daemon):
    conn = Conn(daemon.target)
    try:
        yield conn.session("prefix")
    finally:
        conn.close()


@pytest.fixture
def lane(session):
    """A lane connection of the session (this process attached it, so its HELLO is taken)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(10)
    sock.connect(session.reply.lane_socket)
    sock.send(frames.hello(1, session.id, session.key, None))
    _, status, _, body = frames.split(sock.recv(frames.MAX_FRAME))
    assert status == 0, bytes(body).decode()
    with sock:
        yield sock


def over_grpc(session, request_keys, *, tier=pb.TIER_HOST, wait=pb.WAIT_ALL, deadline_ms=0):
    """(hit_blocks, tiers, the grant or None) of an AcquirePrefix call; the lease is released."""
    reply = session.call("AcquirePrefix", pb.AcquirePrefixRequest(
        session_id=session.id, keys=request_keys, tier=tier, wait=wait, deadline_ms=deadline_ms))
    grant = None
    if reply.HasField("lease"):
        lease = reply.lease
        assert lease.lease_id != 0
        grant = (lease.tier, tuple(lease.slots), lease.ready, lease.promoted, lease.ready_event)
        session.release(lease.lease_id)
    else:
        assert reply.lease.lease_id == 0  # unset reads as no lease, as on the lane
    return reply.lookup.hit_blocks, tuple(reply.lookup.tiers), grant


def over_lane(sock, session, request_keys, *, tier=pb.TIER_HOST, wait=pb.WAIT_ALL, deadline_ms=0):
    """The same over the lane: (hit_blocks, tiers, the grant or None), or (status code, message)
    when the daemon refused it."""
    sock.send(frames.acquire(3, request_keys, tier, wait, deadline_ms, prefix=True))
    op, status, seq, body = frames.split(sock.recv(frames.MAX_FRAME))
    assert (op, seq) == (Op.ACQUIRE_PREFIX, 3)
    if status:
        return _NAMES[status], bytes(body).decode()
    hit, tiers, at = frames.unpack_lookup(body)
    lease = frames.unpack_acquire(body, at)
    grant = None
    if lease.lease_id:
        grant = (lease.tier, lease.slots, lease.ready, lease.promoted, lease.ready_event)
        session.release(lease.lease_id)
    else:
        assert lease.slots == () and lease.ready == 0
    return hit, tuple(tiers), grant


def test_the_same_answers_over_grpc_and_the_lane(session, lane):
    cached = keys("prefix", 4)
    slots = tuple(session.put(cached).slots)
    host = pb.TIER_HOST
    for request_keys, expected in (
        (cached, (4, (host,) * 4, (host, slots, 4, 0, b""))),  # a full hit
        (cached[:2] + keys("missing", 3), (2, (host,) * 2, (host, slots[:2], 2, 0, b""))),  # a partial hit
        (keys("missing", 3), (0, (), None)),  # no hit: no lease, nothing to release
        (keys("missing", 1) + cached, (0, (), None)),  # cached keys after a miss are no prefix
    ):
        assert over_grpc(session, request_keys) == expected
        assert over_lane(lane, session, request_keys) == expected
    # Each lease was released: the session holds none.
    assert session.heartbeat().leases == 0


def test_the_wait_policies_answer_alike(session, lane):
    cached = keys("waits", 2)
    session.put(cached)
    for wait, deadline_ms in ((pb.WAIT_NONE, 0), (pb.WAIT_ALL, 0), (pb.WAIT_POLICY_UNSPECIFIED, 0),
                              (pb.WAIT_DEADLINE, 500)):
        answer = over_grpc(session, cached, wait=wait, deadline_ms=deadline_ms)
        assert answer[0] == 2 and answer[2][2] == 2  # in host already: ready at once, whatever the wait
        assert over_lane(lane, session, cached, wait=wait, deadline_ms=deadline_ms) == answer


@pytest.mark.parametrize(("fields", "says"), [
    ({"wait": pb.WAIT_DEADLINE, "deadline_ms": 0}, "WAIT_DEADLINE needs deadline_ms > 0"),
    ({"wait": 9}, "unknown wait policy 9; use WAIT_NONE, WAIT_ALL or WAIT_DEADLINE"),
    ({"tier": pb.TIER_DISK}, "pages are lent from host or device, not disk"),
    ({"tier": pb.TIER_DEVICE}, "use TIER_HOST"),  # no GPU here
], ids=["deadline without deadline_ms", "unknown wait", "disk tier", "no device tier"])
def test_a_refused_request_gets_the_same_code_and_message(session, lane, fields, says):
    cached = keys("refused", 2)
    session.put(cached)
    for request_keys in (cached, keys("refused-missing", 1)):  # checked before the lookup: hit or not
        message = expect_code(grpc.StatusCode.INVALID_ARGUMENT, over_grpc, session, request_keys, **fields)
        assert says in message
        assert over_lane(lane, session, request_keys, **fields) == (grpc.StatusCode.INVALID_ARGUMENT, message)
    assert session.heartbeat().leases == 0


def test_acquire_prefix_is_guarded_like_every_hot_call(session):
    """The session key is checked: another caller, without it or with a wrong one, is refused."""
    request = pb.AcquirePrefixRequest(session_id=session.id, keys=keys("guarded", 1))
    for key in ("", "0" * 32):
        message = expect_code(grpc.StatusCode.PERMISSION_DENIED, session.conn.call, "AcquirePrefix", request, key=key)
        assert session.id not in message
    expect_code(grpc.StatusCode.NOT_FOUND, session.conn.call, "AcquirePrefix",
                pb.AcquirePrefixRequest(session_id="0" * 32, keys=keys("guarded", 1)))
