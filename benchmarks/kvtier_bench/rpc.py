"""Control-plane benchmark: latency of batched kvtier RPCs over the Unix socket against a
bare gRPC echo call measured in the same run, and pages per second through batched calls.

Both servers are real subprocesses (`kvtier serve`, `kvtier_bench.echo`); the client uses the
generated stubs directly so the figures are the daemon's cost, not the SDK's.
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

import grpc
from kvtier_client.handoff import attach
from kvtier_client.keys import block_keys, hash_fingerprint
from kvtier_client.proto.v1 import kvtier_pb2 as pb
from kvtier_client.proto.v1 import kvtier_pb2_grpc

from kvtier_bench.echo import echo_stub

LAYOUT = pb.PageLayout(layers=4, kv_heads=2, head_dim=64, block_tokens=16, dtype="float16")  # 32 KiB pages


@dataclass(frozen=True)
class Latency:
    name: str
    median_us: float
    p99_us: float
    baseline_median_us: float
    baseline_p99_us: float

    @property
    def median_ratio(self) -> float:
        return self.median_us / self.baseline_median_us


def _percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered) * 1e6, ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e6


def _time(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def _wait_socket(path: str, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"server for {path} did not start (exit code {proc.poll()})")
        time.sleep(0.05)


def run_rpc_bench(iterations: int = 500, keys_per_call: int = 64) -> dict:
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-rpc-") as tmp:
        sock = os.path.join(tmp, "kvtier.sock")
        echo_sock = os.path.join(tmp, "echo.sock")
        daemon = subprocess.Popen(
            [sys.executable, "-m", "kvtier", "serve", "--socket", sock, "--cache-dir", os.path.join(tmp, "cache"),
             "--host-size", "64MiB", "--disk-size", "0", "--arena-prefix", f"kvtier-bench-{os.getpid()}",
             "--log-level", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        echo = subprocess.Popen([sys.executable, "-m", "kvtier_bench.echo", echo_sock], stdout=subprocess.DEVNULL)
        try:
            _wait_socket(sock, daemon)
            _wait_socket(echo_sock, echo)
            return _measure(sock, echo_sock, iterations, keys_per_call)
        finally:
            for proc in (daemon, echo):
                proc.terminate()
                proc.wait(30)


def _measure(sock: str, echo_sock: str, iterations: int, n: int) -> dict:
    channel = grpc.insecure_channel(f"unix:{sock}")
    echo_channel = grpc.insecure_channel(f"unix:{echo_sock}")
    grpc.channel_ready_future(channel).result(timeout=30)
    grpc.channel_ready_future(echo_channel).result(timeout=30)
    stub = kvtier_pb2_grpc.KVTierStub(channel)
    echo = echo_stub(echo_channel)
    reg = stub.Register(pb.RegisterRequest(namespace="bench", layout=LAYOUT, hash_algorithm="xxh3-128",
                                           hash_fingerprint=hash_fingerprint("xxh3-128"), client_name="bench-rpc"))
    sid = reg.session_id
    attachment = attach(reg.handoff_socket, sid, None)  # the session key; the arena is not needed here
    os.close(attachment.arena_fd)
    key = (("kvtier-session-key", attachment.session_key),)
    beating = threading.Event()

    def heartbeat() -> None:
        while not beating.wait(reg.heartbeat_interval_ms / 1000):
            stub.Heartbeat(pb.HeartbeatRequest(session_id=sid), metadata=key)

    threading.Thread(target=heartbeat, daemon=True).start()
    try:
        keys = block_keys(list(range(n * LAYOUT.block_tokens)), LAYOUT.block_tokens)
        lease = stub.Borrow(pb.BorrowRequest(session_id=sid, count=n), metadata=key)
        stub.Commit(pb.CommitRequest(session_id=sid, lease_id=lease.lease_id, keys=keys), metadata=key)
        lookup_req = pb.LookupRequest(session_id=sid, keys=keys)
        payload = lookup_req.SerializeToString()  # the echo carries the same bytes

        for _ in range(50):  # warm up both paths
            stub.Lookup(lookup_req, metadata=key)
            echo(payload)
        echo_samples = _time(lambda: echo(payload), iterations)
        lookup_samples = _time(lambda: stub.Lookup(lookup_req, metadata=key), iterations)

        def acquire_release() -> None:
            got = stub.Acquire(pb.AcquireRequest(session_id=sid, keys=keys), metadata=key)
            stub.Release(pb.ReleaseRequest(session_id=sid, lease_id=got.lease_id), metadata=key)

        acq_samples = _time(acquire_release, iterations)
        echo2_samples = _time(lambda: (echo(payload), echo(payload)), iterations)

        # Batched page operations: borrow + commit of n fresh pages, then acquire + release.
        rounds = max(10, iterations // 10)
        start = time.perf_counter()
        for r in range(rounds):
            fresh = block_keys(list(range(n * LAYOUT.block_tokens)), LAYOUT.block_tokens, salt=f"r{r}".encode())
            lease = stub.Borrow(pb.BorrowRequest(session_id=sid, count=n), metadata=key)
            stub.Commit(pb.CommitRequest(session_id=sid, lease_id=lease.lease_id, keys=fresh), metadata=key)
            got = stub.Acquire(pb.AcquireRequest(session_id=sid, keys=fresh), metadata=key)
            stub.Release(pb.ReleaseRequest(session_id=sid, lease_id=got.lease_id), metadata=key)
        elapsed = time.perf_counter() - start
        page_ops = rounds * n * 4 / elapsed  # each page borrowed, committed, acquired, released
        echo_calls = 4 * rounds
        start = time.perf_counter()
        for _ in range(echo_calls):
            echo(payload)
        echo_rate = echo_calls / (time.perf_counter() - start)
    finally:
        beating.set()
        stub.CloseSession(pb.CloseSessionRequest(session_id=sid), metadata=key)
        channel.close()
        echo_channel.close()

    lk = Latency(f"Lookup ({n} keys)", *_percentiles(lookup_samples), *_percentiles(echo_samples))
    ar = Latency(f"Acquire+Release ({n} pages)", *_percentiles(acq_samples), *_percentiles(echo2_samples))
    return {
        "latency": [vars(lk) | {"median_ratio": lk.median_ratio, "baseline": "1 echo call"},
                    vars(ar) | {"median_ratio": ar.median_ratio, "baseline": "2 echo calls"}],
        "page_ops_per_s": page_ops,
        "rpc_per_s": page_ops / n,
        "echo_calls_per_s": echo_rate,
        "iterations": iterations,
        "keys_per_call": n,
    }


def render_rpc(result: dict) -> str:
    lines = [f"{'call':<28}{'median us':>11}{'p99 us':>9}{'echo median':>13}{'echo p99':>10}{'ratio':>7}"]
    for row in result["latency"]:
        lines.append(
            f"{row['name']:<28}{row['median_us']:>11.0f}{row['p99_us']:>9.0f}{row['baseline_median_us']:>13.0f}"
            f"{row['baseline_p99_us']:>10.0f}{row['median_ratio']:>7.2f}   (baseline: {row['baseline']})"
        )
    lines.append(
        f"batched page operations: {result['page_ops_per_s']:,.0f} pages/s "
        f"({result['rpc_per_s'] :,.0f} RPCs/s of {result['keys_per_call']} pages) vs {result['echo_calls_per_s']:,.0f} echo calls/s"
    )
    return "\n".join(lines)
