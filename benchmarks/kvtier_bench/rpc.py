"""Control-plane benchmark: the latency of kvtier's hot calls over the fast lane and over gRPC,
against bare echo servers on the same transports, all measured in the same run.

Per call, 64 keys (pages) each by default, p50 and p99 over:

    lane         KVTierClient(lane=True), what an engine on the same host gets: binary frames
                 on the daemon's Unix SOCK_SEQPACKET socket (kvtier_client.lane)
    gRPC         KVTierClient(lane=False): every call over Python gRPC on the Unix socket
    gRPC stubs   the generated stubs on the same session, no SDK (Lookup, Acquire+Release):
                 the daemon's own gRPC cost
    raw echo     a SOCK_SEQPACKET echo server in its own Python process, one thread per
                 connection (as the lane), replaying the lane call's exact request and reply
                 sizes (kvtier_client.frames encoders), one-way sends included
    gRPC echo    a bare gRPC echo server (kvtier_bench.echo), one echo call per gRPC call
                 the gRPC path makes, carrying the Lookup request's bytes

The calls:

    Lookup            lookup(64 keys), all cached                      lane: 1 round trip
    Acquire+Release   acquire(64) then release                         lane: 1 round trip + 1 send
    Commit+Borrow     commit 64 fresh keys and borrow the next 64      lane: 2 frames, 1 round trip
                      (commit_and_borrow, an engine's steady state)     gRPC: 2 calls
    acquire_prefix    acquire_prefix(64 keys) then release             lane: 1 round trip + 1 send
                                                                        gRPC: AcquirePrefix + Release

Transports take turns in blocks of calls (lane, gRPC, stubs, raw echo, gRPC echo, lane, ...)
so that a noisy neighbour slows them alike. The servers are real subprocesses (`kvtier
serve`, `python -m kvtier_bench.echo`). The multi-client throughput table is
kvtier_bench.clients; `kvtier bench rpc` prints both.
"""
from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from kvtier_client import KVTierClient, frames
from kvtier_client.layout import PageLayout
from kvtier_client.proto.v1 import kvtier_pb2 as pb
from kvtier_client.proto.v1 import kvtier_pb2_grpc

from kvtier_bench.echo import SeqpacketEcho, echo_stub
from kvtier_bench.harness import progress_bar
from kvtier_bench.services import Service, kvtier_daemon

LAYOUT = PageLayout(layers=4, kv_heads=2, head_dim=64, block_tokens=16, dtype="float16")  # 32 KiB pages
NAMESPACE = "bench"
#: Calls per turn of one transport before the next takes over.
BLOCK = 50
#: Targets (issue 14): the lane's p50 against gRPC's and against the raw echo's, same call.
TARGET_LANE_OVER_GRPC = 0.1
TARGET_LANE_OVER_ECHO = 15.0
#: The gRPC stubs' p50 against the gRPC echo's (the daemon's own gRPC cost).
TARGET_STUBS_OVER_ECHO = 1.3
TRANSPORTS = ("lane", "grpc", "stubs", "echo", "grpc_echo")
TRANSPORT_LABELS = {"lane": "lane", "grpc": "gRPC", "stubs": "gRPC stubs", "echo": "raw echo", "grpc_echo": "gRPC echo"}


@dataclass(frozen=True)
class Latency:
    p50_us: float
    p99_us: float
    samples: int

    @classmethod
    def of(cls, samples: list[float]) -> Latency:
        ordered = sorted(samples)
        return cls(statistics.median(ordered) * 1e6, ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e6,
                   len(ordered))


@dataclass
class Call:
    """One hot call, timed over each transport that has it."""

    name: str
    label: str
    what: str  # how each transport makes it, one line
    run: dict[str, Callable[[], None]] = field(default_factory=dict)
    frames: str = ""  # the raw echo's exchange: request/reply sizes
    results: dict[str, Latency] = field(default_factory=dict)

    def ratio(self, over: str, under: str) -> float | None:
        a, b = self.results.get(over), self.results.get(under)
        return a.p50_us / b.p50_us if a and b else None

    def as_dict(self) -> dict:
        return {
            "name": self.name, "label": self.label, "what": self.what, "echo_frames": self.frames,
            **{t: vars(self.results[t]) for t in TRANSPORTS if t in self.results},
            "lane_over_grpc": self.ratio("lane", "grpc"),
            "lane_over_echo": self.ratio("lane", "echo"),
            "grpc_over_grpc_echo": self.ratio("grpc", "grpc_echo"),
            "stubs_over_grpc_echo": self.ratio("stubs", "grpc_echo"),
        }


def _fresh_keys(n: int, width: int = 16):
    """Keys nobody committed (random bytes of a real key's width), one list per call."""
    while True:
        raw = os.urandom(n * width)
        yield [raw[i : i + width] for i in range(0, len(raw), width)]


def _sizes(*messages: tuple[bytes, bytes | None]) -> list[bytes]:
    """The raw echo's messages for lane frames: (request, reply or None for no reply)."""
    return [SeqpacketEcho.message(len(req), len(rep) if rep is not None else 0) for req, rep in messages]


def _describe(messages: list[tuple[bytes, bytes | None]]) -> str:
    return " + ".join(f"{len(req)}B->{len(rep)}B" if rep is not None else f"{len(req)}B one-way" for req, rep in messages)


def _calls(lane: KVTierClient, slow: KVTierClient, stub, stub_meta, echo: SeqpacketEcho, grpc_echo, n: int) -> list[Call]:
    """The calls, each with a callable per transport, on `n` keys committed by both clients."""
    keys = lane.block_keys(list(range(n * LAYOUT.block_tokens)), salt=b"rpc-bench")
    assert len(keys) == n
    session = slow._current()  # the stubs call on the gRPC client's own session
    sid = session.session_id
    tiers = [pb.TIER_HOST] * n
    slots = list(range(n))
    grant = frames.Grant(1, pb.TIER_HOST, tuple(slots))
    payload = pb.LookupRequest(session_id=sid, keys=keys).SerializeToString()

    def echo_calls(k: int) -> Callable[[], None]:
        def run() -> None:
            for _ in range(k):
                grpc_echo(payload)

        return run

    def exchange(*rounds: list[bytes]) -> Callable[[], None]:
        def run() -> None:
            for messages in rounds:
                echo.exchange(messages)

        return run

    calls = []

    # Lookup
    m_lookup = [(frames.lookup(0, keys), frames.reply(frames.Op.LOOKUP, 0, frames.pack_lookup(n, bytes(tiers))))]
    lookup_req = pb.LookupRequest(session_id=sid, keys=keys)
    calls.append(Call("lookup", f"Lookup ({n} keys)", "lookup(keys), all cached", {
        "lane": lambda: lane.lookup(keys),
        "grpc": lambda: slow.lookup(keys),
        "stubs": lambda: stub.Lookup(lookup_req, metadata=stub_meta),
        "echo": exchange(_sizes(*m_lookup)),
        "grpc_echo": echo_calls(1),
    }, _describe(m_lookup)))

    # Acquire + Release
    m_acquire = (frames.acquire(0, keys, pb.TIER_HOST, pb.WAIT_ALL, 0),
                 frames.reply(frames.Op.ACQUIRE, 0, frames.pack_acquire(grant)))
    m_release = (frames.release(0, 1, reply=False), None)
    acquire_req = pb.AcquireRequest(session_id=sid, keys=keys)

    def stub_acquire_release() -> None:
        got = stub.Acquire(acquire_req, metadata=stub_meta)
        stub.Release(pb.ReleaseRequest(session_id=sid, lease_id=got.lease_id), metadata=stub_meta)

    calls.append(Call("acquire_release", f"Acquire+Release ({n} pages)", "acquire(keys), release(lease)", {
        "lane": lambda: lane.release(lane.acquire(keys)),
        "grpc": lambda: slow.release(slow.acquire(keys)),
        "stubs": stub_acquire_release,
        "echo": exchange(_sizes(m_acquire), _sizes(m_release)),
        "grpc_echo": echo_calls(2),
    }, _describe([m_acquire, m_release])))

    # acquire_prefix + Release
    m_prefix = (frames.acquire(0, keys, pb.TIER_HOST, pb.WAIT_ALL, 0, prefix=True),
                frames.reply(frames.Op.ACQUIRE_PREFIX, 0, frames.pack_lookup(n, bytes(tiers)) + frames.pack_acquire(grant)))

    def prefix(client: KVTierClient) -> Callable[[], None]:
        def run() -> None:
            found, lease = client.acquire_prefix(keys)
            client.release(lease)

        return run

    calls.append(Call("acquire_prefix", f"acquire_prefix ({n} pages)",
                      "acquire_prefix(keys), release(lease); gRPC: AcquirePrefix + Release", {
                          "lane": prefix(lane),
                          "grpc": prefix(slow),
                          "echo": exchange(_sizes(m_prefix), _sizes(m_release)),
                          "grpc_echo": echo_calls(2),
                      }, _describe([m_prefix, m_release])))

    # Commit + Borrow, the steady state of an engine writing blocks (fresh keys every call)
    m_commit = (frames.commit(0, 1, keys, None), frames.reply(frames.Op.COMMIT, 0, frames.pack_commit(n, ())))
    m_borrow = (frames.borrow(0, n), frames.reply(frames.Op.BORROW, 0, frames.pack_borrow(1, pb.TIER_HOST, slots)))

    def commit_borrow(client: KVTierClient) -> Callable[[], None]:
        fresh = _fresh_keys(n)
        state = {}

        def run() -> None:
            lease = state.get("lease") or client.borrow(n)
            state["lease"] = client.commit_and_borrow(lease, next(fresh), n)[1]

        return run

    calls.append(Call("commit_borrow", f"Commit+Borrow ({n} pages)",
                      "commit_and_borrow(lease, fresh keys, n): lane pipelines both frames; gRPC: Commit + Borrow", {
                          "lane": commit_borrow(lane),
                          "grpc": commit_borrow(slow),
                          "echo": exchange(_sizes(m_commit, m_borrow)),
                          "grpc_echo": echo_calls(2),
                      }, _describe([m_commit, m_borrow])))
    return calls


def _measure(call: Call, iterations: int, warmup: int = 20) -> None:
    """p50/p99 of each transport of `call`, the transports taking turns in blocks."""
    samples: dict[str, list[float]] = {t: [] for t in call.run}
    for fn in call.run.values():
        for _ in range(warmup):
            fn()
    clock = time.perf_counter
    done = 0
    while done < iterations:
        block = min(BLOCK, iterations - done)
        for transport, fn in call.run.items():
            out = samples[transport]
            for _ in range(block):
                start = clock()
                fn()
                out.append(clock() - start)
        done += block
    call.results = {t: Latency.of(s) for t, s in samples.items()}


def _start(argv: list[str], log: Path, ready: Path) -> Service:
    service = Service(log.stem, argv, log)
    service.wait_until(ready.exists, 30.0, f"serving on {ready}")
    return service


def run_rpc_bench(iterations: int = 1000, keys_per_call: int = 64, *,
                  progress: Callable[[str], None] = lambda message: None) -> dict:
    """The latency table: every call over every transport, `iterations` timed calls each."""
    if iterations <= 0 or keys_per_call <= 0:
        raise ValueError("iterations and keys per call must be positive")
    root = Path(tempfile.mkdtemp(prefix="kvtier-bench-rpc-"))
    services: list[Service] = []
    clients: list[KVTierClient] = []
    echo: SeqpacketEcho | None = None
    channels: list[grpc.Channel] = []
    try:
        daemon, target = kvtier_daemon(root / "daemon", host_bytes=64 << 20, name="kvtier-rpc")
        services.append(daemon)
        echo_sock, grpc_sock = root / "seq.sock", root / "grpc.sock"
        services.append(_start([sys.executable, "-m", "kvtier_bench.echo", "--seqpacket", str(echo_sock)],
                               root / "seq.log", echo_sock))
        services.append(_start([sys.executable, "-m", "kvtier_bench.echo", str(grpc_sock)], root / "grpc.log", grpc_sock))
        lane = KVTierClient(target, name="bench-rpc-lane")
        clients.append(lane)
        lane.register(NAMESPACE, LAYOUT)
        slow = KVTierClient(target, name="bench-rpc-grpc", lane=False)
        clients.append(slow)
        slow.register(NAMESPACE, LAYOUT)
        if lane.transport != "lane" or slow.transport != "grpc":
            raise RuntimeError(f"transports are {lane.transport} and {slow.transport}, not lane and grpc")
        channel = grpc.insecure_channel(target)
        echo_channel = grpc.insecure_channel(f"unix:{grpc_sock}")
        channels += [channel, echo_channel]
        for c in channels:
            grpc.channel_ready_future(c).result(timeout=30)
        stub = kvtier_pb2_grpc.KVTierStub(channel)
        stub_meta = (("kvtier-session-key", slow._current().key),)
        echo = SeqpacketEcho(str(echo_sock))
        keys = lane.block_keys(list(range(keys_per_call * LAYOUT.block_tokens)), salt=b"rpc-bench")
        with lane.borrow(keys_per_call) as w:
            w.commit(keys)
        calls = _calls(lane, slow, stub, stub_meta, echo, echo_stub(echo_channel), keys_per_call)
        with progress_bar(progress, "rpc latency", len(calls)) as advance:
            for call in calls:
                progress(f"rpc: {call.label}: {iterations} calls per transport ({', '.join(call.run)})")
                _measure(call, iterations)
                advance()
        transports = {"lane": lane.transport, "grpc": slow.transport}
    finally:
        if echo is not None:
            echo.close()
        for c in channels:
            c.close()
        for client in clients:
            try:
                client.close()
            except Exception:  # noqa: BLE001 - the figures are taken
                pass
        for service in reversed(services):
            service.stop()
        shutil.rmtree(root, ignore_errors=True)
    return {
        "iterations": iterations,
        "keys_per_call": keys_per_call,
        "page_bytes": LAYOUT.page_bytes,
        "transports": transports,
        "targets": {"lane_over_grpc": TARGET_LANE_OVER_GRPC, "lane_over_echo": TARGET_LANE_OVER_ECHO,
                    "stubs_over_grpc_echo": TARGET_STUBS_OVER_ECHO},
        "calls": [c.as_dict() for c in calls],
    }


def _ratio_cell(value: float | None, target: float | None = None) -> str:
    if value is None:
        return "-"
    mark = "" if target is None else (" ok" if value <= target else " MISS")
    return f"{value:.2f}{mark}"


def render_rpc(result: dict) -> str:
    """The latency table: p50/p99 per transport, then the ratios with their targets."""
    head = f"{'call':<30}" + "".join(f"{TRANSPORT_LABELS[t] + ' p50/p99 us':>24}" for t in TRANSPORTS)
    lines = [
        f"kvtier bench rpc: {result['iterations']} calls per call and transport, {result['keys_per_call']} keys "
        f"per call, {result['page_bytes'] // 1024} KiB pages, client transports {result['transports']}",
        "",
        head,
    ]
    for c in result["calls"]:
        cells = "".join(
            f"{(format(c[t]['p50_us'], '.0f') + ' / ' + format(c[t]['p99_us'], '.0f')) if t in c else '-':>24}"
            for t in TRANSPORTS)
        lines.append(f"{c['label']:<30}{cells}")
    t = result["targets"]
    lines += [
        "",
        f"{'call (p50 ratios)':<30}{'lane/gRPC':>16}{'lane/raw echo':>16}{'gRPC/gRPC echo':>16}{'stubs/gRPC echo':>17}",
        f"{'target':<30}{'<= ' + format(t['lane_over_grpc'], 'g'):>16}{'<= ' + format(t['lane_over_echo'], 'g'):>16}"
        f"{'-':>16}{'<= ' + format(t['stubs_over_grpc_echo'], 'g'):>17}",
    ]
    for c in result["calls"]:
        lines.append(f"{c['label']:<30}{_ratio_cell(c['lane_over_grpc'], t['lane_over_grpc']):>16}"
                     f"{_ratio_cell(c['lane_over_echo'], t['lane_over_echo']):>16}"
                     f"{_ratio_cell(c['grpc_over_grpc_echo']):>16}"
                     f"{_ratio_cell(c['stubs_over_grpc_echo'], t['stubs_over_grpc_echo']):>17}")
    lines += ["", "raw echo frames (request -> reply bytes, as the lane sends them):"]
    lines += [f"  {c['label']:<28}{c['echo_frames']}" for c in result["calls"]]
    lines.append("the targets apply to Lookup and Acquire+Release; the other calls are reported alike")
    return "\n".join(lines)


# -- the whole `kvtier bench rpc` ---------------------------------------------------------
def run_rpc(iterations: int = 1000, keys_per_call: int = 64, *, processes: tuple[int, ...] = (1, 2, 4, 8),
            seconds: float = 2.0, interference: bool = True, interference_iterations: int | None = None,
            directory: str | None = None, progress: Callable[[str], None] = lambda message: None) -> dict:
    """The latency table, the multi-client throughput table (no processes: none) and the
    interference figure, one daemon each, in one run."""
    from kvtier_bench.clients import run_clients_bench, run_interference

    out: dict = {"latency": run_rpc_bench(iterations, keys_per_call, progress=progress)}
    if processes:
        out["clients"] = run_clients_bench(processes, seconds=seconds, keys_per_call=keys_per_call, progress=progress)
    if interference:
        out["interference"] = run_interference(iterations=interference_iterations or iterations,
                                               keys_per_call=keys_per_call, directory=directory, progress=progress)
    return out


def render_all(result: dict) -> str:
    from kvtier_bench.clients import render_clients, render_interference

    parts = [render_rpc(result["latency"])]
    if "clients" in result:
        parts.append(render_clients(result["clients"]))
    if "interference" in result:
        parts.append(render_interference(result["interference"]))
    return "\n\n".join(parts)
