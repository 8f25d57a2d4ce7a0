"""The metrics port on a real daemon: /healthz, /readyz (ready only while gRPC health says
SERVING: 503 while draining), 404 for any other path, and what the scrape holds besides the
store's figures: build info, process and platform collectors, no `_created` series, the
session-end and Register-refusal counters."""
from __future__ import annotations

import signal
import sys
import urllib.error
import urllib.request

import grpc
import pytest
from kvtier_client.proto.v1 import kvtier_pb2 as pb
from rpc import LAYOUT, expect_code, free_port, register_request, samples, scrape, value, wait_for

import kvtier

TOKEN_A = "probe-token-a-1d2c3b4a5f6e7d8c"
TOKEN_B = "probe-token-b-0a9b8c7d6e5f4a3b"


def get(port: int, path: str, method: str = "GET") -> tuple[int, str]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_endpoints_and_paths(daemons):
    port = free_port()
    daemons.start("--metrics-port", str(port))
    assert get(port, "/healthz") == (200, "ok\n")
    assert get(port, "/readyz") == (200, "ready\n")
    status, text = get(port, "/metrics")
    assert status == 200 and "kvtier_sessions " in text
    assert get(port, "/metrics?x=1")[0] == 200
    for path in ("/", "/metric", "/metrics/", "/metrics/x", "/health", "/readyz/x", "/favicon.ico"):
        status, body = get(port, path)
        assert status == 404, path
        assert "kvtier" not in body, path  # no metrics on other paths
    assert get(port, "/healthz", method="HEAD") == (200, "")


def test_scrape_holds_build_and_process_info_and_no_created(daemons):
    port = free_port()
    daemons.start("--metrics-port", str(port))
    text, families = scrape(port)
    assert "_created" not in text
    (info,) = samples(families, "kvtier_build_info")
    assert info.value == 1
    assert info.labels["version"] == kvtier.__version__
    assert info.labels["python"] == ".".join(map(str, sys.version_info[:3]))
    assert info.labels["grpc"] == grpc.__version__ and info.labels["protobuf"]
    # The daemon's own process (a subprocess: not this test's), and the platform.
    assert value(families, "process_resident_memory_bytes") > 10 << 20
    assert value(families, "process_open_fds") > 3
    assert value(families, "process_cpu_seconds_total") > 0
    assert value(families, "process_start_time_seconds") > 0
    assert samples(families, "python_info")
    assert samples(families, "python_gc_collections_total")


def test_readyz_is_503_while_draining(daemons, connect):
    port = free_port()
    d = daemons.start("--metrics-port", str(port), "--drain-timeout", "30s")
    s = connect(d.target).session("probe")
    lease = s.borrow(2)  # held: the drain waits for it
    assert get(port, "/readyz")[0] == 200
    d.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: get(port, "/readyz")[0] == 503, 10, "/readyz to say 503 while draining")
    assert get(port, "/readyz")[1] == "not ready: starting or draining\n"
    assert get(port, "/healthz") == (200, "ok\n")  # alive: a liveness probe must not kill a draining daemon
    assert get(port, "/metrics")[0] == 200
    assert d.proc.poll() is None
    s.release(lease.lease_id)  # the last lease: the drain ends
    assert d.proc.wait(timeout=20) == 0
    with pytest.raises(OSError):
        get(port, "/healthz")


def test_sessions_ended_by_reason(daemons, connect):
    port = free_port()
    d = daemons.start("--metrics-port", str(port), "--session-timeout", "1s")

    def ended(reason: str) -> float:
        return value(scrape(port)[1], "kvtier_sessions_ended_total", reason=reason)

    assert (ended("closed"), ended("timeout"), ended("shutdown")) == (0, 0, 0)
    conn = connect(d.target)
    conn.session("a").close()
    assert ended("closed") == 1
    conn.register("b")  # never heartbeats
    wait_for(lambda: ended("timeout") == 1, 10, "a session to time out")
    assert ended("closed") == 1


def test_register_rejected_by_reason(daemons, connect, tmp_path):
    port = free_port()
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(f'[tokens]\n"{TOKEN_A}" = ["a"]\n"{TOKEN_B}" = ["b"]\n')
    d = daemons.start("--metrics-port", str(port), "--tokens-file", str(tokens))

    def rejected() -> dict[str, float]:
        return {s.labels["reason"]: s.value for s in samples(scrape(port)[1], "kvtier_register_rejected_total")}

    assert set(rejected().values()) == {0}
    anonymous, a = connect(d.target), connect(d.target, token=TOKEN_A)
    expect_code(grpc.StatusCode.UNAUTHENTICATED, anonymous.call, "Register", register_request("a"))
    expect_code(grpc.StatusCode.PERMISSION_DENIED, a.call, "Register", register_request("b"))
    expect_code(grpc.StatusCode.PERMISSION_DENIED, a.call, "Register", register_request("b"))
    bad = pb.PageLayout()
    bad.CopyFrom(LAYOUT)
    bad.dtype = "float7"
    expect_code(grpc.StatusCode.INVALID_ARGUMENT, a.call, "Register", register_request("a", layout=bad))
    expect_code(grpc.StatusCode.FAILED_PRECONDITION, a.call, "Register", register_request("a", fingerprint="0" * 32))
    assert a.register("a").session_id  # an accepted one counts nowhere
    counts = rejected()
    assert counts == {"unauthenticated": 1, "permission_denied": 2, "invalid_argument": 1, "failed_precondition": 1,
                      "resource_exhausted": 0, "draining": 0}


def test_readyz_follows_the_readiness_it_is_given():
    """The server on its own (what a daemon runs while it starts: 503 until gRPC health says
    SERVING), on an ephemeral port; stop() ends it and frees the port."""
    from prometheus_client import CollectorRegistry

    from kvtier.server.metrics import MetricsServer

    ready = [False]
    server = MetricsServer("127.0.0.1", 0, CollectorRegistry(), lambda: ready[0])
    server.start()
    try:
        assert get(server.port, "/readyz") == (503, "not ready: starting or draining\n")
        assert get(server.port, "/healthz") == (200, "ok\n")
        ready[0] = True
        assert get(server.port, "/readyz") == (200, "ready\n")
        assert get(server.port, "/metrics")[0] == 200
    finally:
        server.stop()
    with pytest.raises(OSError):
        get(server.port, "/healthz")
