"""The fast lane's faults, against a real daemon over its real lane socket: who may connect,
who may speak for a session, malformed and oversized frames, a client that dies with a
request unanswered, the order of a Release sent without reply, and the lane turned off.

Frames are built with kvtier_client.frames, raw, so the daemon sees exactly these bytes.
"""
from __future__ import annotations

import json
import select
import os
import socket
import stat
import struct
import subprocess
import sys
import textwrap
import time

import pytest
from kvtier_client import frames
from kvtier_client.frames import Op
from kvtier_client.proto.v1 import kvtier_pb2 as pb
from rpc import Conn, keys

NOT_FOUND, PERMISSION_DENIED, INVALID_ARGUMENT = 5, 7, 3


def lane_of(daemon) -> str:
    return f"{daemon.socket}.lane"


def connect(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(10)
    sock.connect(path)
    return sock


def ask(sock: socket.socket, frame: bytes) -> tuple[Op, int, int, bytes]:
    """Send one frame and read one reply: (op, status, seq, body)."""
    sock.send(frame)
    op, status, seq, body = frames.split(sock.recv(frames.MAX_FRAME))
    return op, status, seq, bytes(body)


def hello(sock: socket.socket, session, token: str | None = None) -> tuple[int, str]:
    _, status, _, body = ask(sock, frames.hello(1, session.id, session.key, token))
    return status, body.decode()


@pytest.fixture
def lane_daemon(daemons):
    return daemons.start("--session-timeout", "2s", host_size="1MiB", disk_size="0")


@pytest.fixture
def session(lane_daemon):
    conn = Conn(lane_daemon.target)
    try:
        reply_session = conn.session("lane")
        yield reply_session
    finally:
        conn.close()


def test_register_names_the_lane_and_its_socket_is_guarded_like_the_main_one(lane_daemon, session):
    assert session.reply.lane_socket == lane_of(lane_daemon)
    mode = os.stat(session.reply.lane_socket).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == stat.S_IMODE(os.stat(lane_daemon.socket).st_mode) == 0o660


def test_a_hello_from_the_attached_process_opens_the_lane_and_calls_run(session):
    with connect(session.reply.lane_socket) as sock:
        assert hello(sock, session) == (0, "")
        op, status, seq, body = ask(sock, frames.borrow(7, 2))
        assert (op, status, seq) == (Op.BORROW, 0, 7)
        grant = frames.unpack_borrow(memoryview(body))
        assert len(grant.slots) == 2
        _, status, _, body = ask(sock, frames.commit(8, grant.lease_id, keys("lane", 2), None))
        assert status == 0 and frames.unpack_commit(memoryview(body)) == (2, ())
        _, status, _, body = ask(sock, frames.lookup(9, keys("lane", 3)))
        assert status == 0 and frames.unpack_lookup(memoryview(body))[:2] == (2, bytes([pb.TIER_HOST, pb.TIER_HOST]))
    assert session.lookup(keys("lane", 2)).hit_blocks == 2  # the same session, seen over gRPC


def test_a_hello_with_a_wrong_key_or_token_or_session_is_refused(session):
    for frame, expected in (
        (frames.hello(1, session.id, "0" * 32, None), PERMISSION_DENIED),
        (frames.hello(1, session.id, session.key, "some-token"), PERMISSION_DENIED),
        (frames.hello(1, "0" * 32, session.key, None), NOT_FOUND),
    ):
        with connect(session.reply.lane_socket) as sock:
            _, status, _, body = ask(sock, frame)
            assert status == expected, body
            assert session.id not in body.decode()
            assert sock.recv(64) == b""  # and the daemon hangs up


OTHER_PROCESS = textwrap.dedent(
    """
    import json, socket, sys
    from kvtier_client import frames
    path, session_id, key = sys.argv[1:4]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(10)
    sock.connect(path)
    sock.send(frames.hello(1, session_id, key, None))
    op, status, seq, body = frames.split(sock.recv(frames.MAX_FRAME))
    print(json.dumps({"status": status, "message": bytes(body).decode()}))
    """
)


def test_another_process_with_the_session_key_is_refused(session):
    """Even holding the id and the key, a process other than the one that attached the
    session cannot speak for it on the lane (the kernel names the peer)."""
    out = subprocess.run([sys.executable, "-c", OTHER_PROCESS, session.reply.lane_socket, session.id, session.key],
                         capture_output=True, text=True, timeout=60, check=True)
    answer = json.loads(out.stdout)
    assert answer["status"] == PERMISSION_DENIED
    assert "attached to another process" in answer["message"]


def test_malformed_frames_are_answered_and_the_connection_goes_on(session):
    with connect(session.reply.lane_socket) as sock:
        assert hello(sock, session)[0] == 0
        cut_keys = frames.lookup(2, keys("m", 4))[:-5]
        for frame, what in (
            (b"\x01\x02", "at least 8 bytes"),
            (struct.pack("<BBHI", 9, Op.LOOKUP, 0, 3), "version 9"),
            (struct.pack("<BBHI", 1, 200, 0, 4), "unknown op"),
            (cut_keys, "cut short"),
            (frames.borrow(5, 1) + b"\0", "4-byte count"),
            (frames.lookup(5, keys("m", 2)) + b"\0", "after the end"),
            (frames.hello(6, session.id, session.key, None), "not a call"),
            (frames.header(Op.LOOKUP, 7) + b"\0" * (frames.MAX_FRAME + 1), "at most"),
        ):
            sock.send(frame)
            _, status, _, body = frames.split(sock.recv(frames.MAX_FRAME))
            assert status == INVALID_ARGUMENT, (what, bytes(body))
            assert what in bytes(body).decode(), (what, bytes(body))
        _, status, _, body = ask(sock, frames.lookup(8, keys("m", 1)))  # still serving
        assert status == 0 and frames.unpack_lookup(memoryview(body))[0] == 0


def test_an_oversized_frame_is_answered_with_its_own_op_and_seq(session):
    """Its header is in its first bytes: the reply names the request it refuses (it used to
    say op 0, seq 0, which a pipelining client cannot match to a request)."""
    with connect(session.reply.lane_socket) as sock:
        assert hello(sock, session)[0] == 0
        sock.send(frames.header(Op.LOOKUP, 77) + b"\0" * (frames.MAX_FRAME + 1))
        op, status, seq, body = frames.split(sock.recv(frames.MAX_FRAME))
        assert (op, status, seq) == (Op.LOOKUP, INVALID_ARGUMENT, 77)
        assert f"at most {frames.MAX_FRAME} bytes" in bytes(body).decode()
        assert ask(sock, frames.heartbeat(78))[:3] == (Op.HEARTBEAT, 0, 78)  # still serving


def test_a_zero_length_frame_is_answered_and_the_connection_goes_on(session):
    """A zero-length message reads like an end of file; the daemon tells them apart (the
    peer has not hung up) and answers it as a frame whose header does not decode."""
    with connect(session.reply.lane_socket) as sock:
        assert hello(sock, session)[0] == 0
        for _ in range(2):
            sock.send(b"")
            op, status, seq, body = frames.split(sock.recv(frames.MAX_FRAME))
            assert (op, status, seq) == (Op.MALFORMED, INVALID_ARGUMENT, 0)
            assert "at least 8 bytes, got 0" in bytes(body).decode()
        assert ask(sock, frames.heartbeat(3))[:3] == (Op.HEARTBEAT, 0, 3)


def test_a_release_without_reply_is_applied_before_the_next_frame(session):
    """The host tier (256 pages) is borrowed whole; a Release sent without waiting for an
    answer, then a Borrow of the same size on the same connection, must succeed."""
    with connect(session.reply.lane_socket) as sock:
        assert hello(sock, session)[0] == 0
        _, status, _, body = ask(sock, frames.borrow(1, 256))
        assert status == 0
        lease = frames.unpack_borrow(memoryview(body)).lease_id
        for round_ in range(20):
            sock.send(frames.release(2, lease, reply=False))
            _, status, _, body = ask(sock, frames.borrow(3, 256))
            assert status == 0, (round_, bytes(body))
            lease = frames.unpack_borrow(memoryview(body)).lease_id
        sock.send(frames.release(4, 999_999, reply=False))  # refused: logged, nothing sent back
        _, status, _, body = ask(sock, frames.heartbeat(5))
        assert status == 0 and frames.read_u32(memoryview(body)) == 1


DYING_CLIENT = textwrap.dedent(
    """
    import os, signal, sys
    from kvtier_client import KVTierClient, PageLayout, frames
    target, out = sys.argv[1], sys.argv[2]
    kv = KVTierClient(target)
    kv.register("dying", PageLayout(layers=1, kv_heads=1, head_dim=48, block_tokens=16))
    assert kv.transport == "lane", kv.transport
    lease = kv.borrow(8)
    sock = kv._current().path._lane._connection().sock
    sock.send(frames.borrow(99, 16))  # a request whose answer nobody will read
    with open(out, "w") as f:
        f.write("sent")
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_a_client_that_dies_with_a_request_unanswered_leaks_nothing(lane_daemon, tmp_path):
    marker = tmp_path / "sent"
    proc = subprocess.run([sys.executable, "-c", DYING_CLIENT, lane_daemon.target, str(marker)], timeout=60)
    assert proc.returncode == -9 and marker.read_text() == "sent"
    conn = Conn(lane_daemon.target)
    try:
        deadline = time.monotonic() + 15  # session timeout 2s: its leases go within 2.5s
        while conn.call("Stats", pb.StatsRequest()).leases and time.monotonic() < deadline:
            time.sleep(0.1)
        stats = conn.call("Stats", pb.StatsRequest())
        assert stats.leases == 0 and stats.sessions == 0
        host = next(t for t in stats.pools[0].tiers if t.tier == pb.TIER_HOST)
        assert host.free_pages == host.capacity_pages
        # And the daemon serves the next client on the lane as before.
        other = conn.session("after")
        with connect(other.reply.lane_socket) as sock:
            assert hello(sock, other)[0] == 0
            assert ask(sock, frames.borrow(1, 4))[1] == 0
    finally:
        conn.close()
    assert lane_daemon.proc.poll() is None


def test_no_lane_leaves_clients_on_grpc(daemons):
    from kvtier_client import KVTierClient, PageLayout

    daemon = daemons.start("--no-lane", disk_size="0")
    assert not os.path.exists(lane_of(daemon))
    with KVTierClient(daemon.target) as kv:
        info = kv.register("no-lane", PageLayout(layers=1, kv_heads=1, head_dim=48, block_tokens=16))
        assert info.lane_socket == "" and kv.transport == "grpc"
        with kv.borrow(1) as lease:
            lease.commit(keys("nl", 1))
        assert kv.lookup(keys("nl", 1)).hit_blocks == 1


def test_a_client_that_never_reads_its_replies_loses_the_connection(session):
    # Frames sent and replies never read: once the daemon's send buffer is full, its reply
    # waits at most SEND_TIMEOUT_S (5 s), then the daemon ends the connection (old code:
    # its thread waited for good, holding one of the uid's lane places).
    with connect(session.reply.lane_socket) as sock:
        assert hello(sock, session) == (0, "")
        sock.settimeout(0.2)
        sent = 0
        try:
            for seq in range(100_000):
                sock.send(frames.heartbeat(seq + 2))
                sent += 1
        except (TimeoutError, BlockingIOError):
            pass  # the daemon stopped reading: its replies fill its buffer
        assert sent < 100_000
        hung_up = select.poll()
        hung_up.register(sock, select.POLLHUP)
        deadline = time.monotonic() + 30
        while not hung_up.poll(100):
            assert time.monotonic() < deadline, "the daemon kept a connection whose client never reads"
