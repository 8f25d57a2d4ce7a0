"""Sessions end three ways, and each releases everything the session held: the client is
killed (kill -9, no goodbye), the client closes it, or the client stops heartbeating."""
from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time

import grpc
from rpc import expect_code, keys, tier_stats, wait_for

# A real engine-like client: registers, heartbeats in a thread, holds a read lease on 4
# committed pages and a write lease on 8 uncommitted ones, says so, then sleeps until killed.
CLIENT = textwrap.dedent(
    """
    import json, sys, threading, time
    import grpc
    from kvtier_client.handoff import attach
    from kvtier_client.keys import hash_fingerprint
    from kvtier_client.proto.v1 import kvtier_pb2 as pb, kvtier_pb2_grpc

    stub = kvtier_pb2_grpc.KVTierStub(grpc.insecure_channel(sys.argv[1]))
    layout = pb.PageLayout(layers=1, kv_heads=1, head_dim=48, block_tokens=16, dtype="float16")
    reg = stub.Register(pb.RegisterRequest(namespace="crash", layout=layout, hash_algorithm="xxh3-128",
                                           hash_fingerprint=hash_fingerprint("xxh3-128"), client_name="doomed"), timeout=10)
    sid = reg.session_id
    key = (("kvtier-session-key", attach(reg.handoff_socket, sid, None).session_key),)

    def beat():
        while True:
            stub.Heartbeat(pb.HeartbeatRequest(session_id=sid), timeout=10, metadata=key)
            time.sleep(reg.heartbeat_interval_ms / 1000)

    threading.Thread(target=beat, daemon=True).start()
    keys = [bytes([i + 1]) * 16 for i in range(4)]
    written = stub.Borrow(pb.BorrowRequest(session_id=sid, count=4), timeout=10, metadata=key)
    stub.Commit(pb.CommitRequest(session_id=sid, lease_id=written.lease_id, keys=keys), timeout=10, metadata=key)
    stub.Acquire(pb.AcquireRequest(session_id=sid, keys=keys, tier=pb.TIER_HOST), timeout=10, metadata=key)
    stub.Borrow(pb.BorrowRequest(session_id=sid, count=8), timeout=10, metadata=key)
    print(json.dumps({"session": sid, "pool": reg.pool_id}), flush=True)
    print("ready", flush=True)
    time.sleep(600)
    """
)


def read_lines(proc: subprocess.Popen, n: int, timeout: float) -> list[str]:
    """The first n lines the process prints, or fail after `timeout` seconds."""
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    got = []
    deadline = time.monotonic() + timeout
    while len(got) < n:
        try:
            got.append(lines.get(timeout=max(0.0, deadline - time.monotonic())).strip())
        except queue.Empty:
            raise AssertionError(f"client printed {got} within {timeout}s; stderr: {proc.stderr.read() if proc.poll() is not None else ''}")
    return got


def test_killed_client_leases_are_released(daemons, connect):
    d = daemons.start()  # the default session timeout (3s)
    conn = connect(d.target)
    client = daemons.child(subprocess.Popen([sys.executable, "-c", CLIENT, d.target], stdout=subprocess.PIPE,
                                            stderr=subprocess.PIPE, text=True))
    info, ready = read_lines(client, 2, timeout=30)
    assert ready == "ready"
    pool = json.loads(info)["pool"]
    state = conn.state()
    host = tier_stats(state, pool)
    assert (state.sessions, state.leases, host.writing_pages, host.pinned_pages, host.cached_pages) == (1, 2, 8, 4, 4)

    client.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    client.wait()

    def released():
        s = conn.state()
        t = tier_stats(s, pool)
        return s if (s.sessions, s.leases, t.writing_pages, t.pinned_pages) == (0, 0, 0, 0) else None

    state = wait_for(released, 10, "the dead client's leases to be released")
    assert time.monotonic() - killed < 5, "leases of a killed client must go within the session timeout"
    host = tier_stats(state, pool)
    # Committed pages stay cached; the 8 it never committed are free again.
    assert host.cached_pages == 4
    assert host.free_pages == host.capacity_pages - 4


def test_close_session_releases_at_once(daemons, connect):
    d = daemons.start()
    conn = connect(d.target)
    s = conn.session("close")
    cached = keys("close", 3)
    s.put(cached)
    s.acquire(cached)
    s.borrow(5)
    assert conn.state().leases == 2

    assert s.close().released_leases == 2
    state = conn.state()  # no waiting: CloseSession has already released everything
    host = tier_stats(state, s.reply.pool_id)
    assert (state.sessions, state.leases, host.writing_pages, host.pinned_pages) == (0, 0, 0, 0)
    assert host.free_pages == host.capacity_pages - 3
    expect_code(grpc.StatusCode.NOT_FOUND, s.heartbeat)
    expect_code(grpc.StatusCode.NOT_FOUND, s.close)


def test_silent_session_times_out(daemons, connect):
    d = daemons.start("--session-timeout", "1s")
    conn = connect(d.target)
    silent = conn.session("quiet")
    alive = conn.session("chatty")
    assert (silent.reply.session_timeout_ms, silent.reply.heartbeat_interval_ms) == (1000, 333)
    silent.borrow(4)
    kept = alive.borrow(2)

    # `alive` heartbeats at the advertised interval for 2.5 timeouts; `silent` says nothing.
    start = time.monotonic()
    while time.monotonic() - start < 2.5:
        assert alive.heartbeat().leases == 1
        time.sleep(alive.reply.heartbeat_interval_ms / 1000)

    state = wait_for(lambda: (s := conn.state()).sessions == 1 and s, 2, "the silent session to end")
    assert state.leases == 1
    assert tier_stats(state, silent.reply.pool_id).writing_pages == 2
    message = expect_code(grpc.StatusCode.NOT_FOUND, silent.heartbeat)
    assert "register again" in message
    alive.release(kept.lease_id)
