"""Hostile bytes against a real daemon: every method path of the KVTier, Health and reflection
services gets hypothesis-made requests (each field valid or not: a live session id or junk,
cached keys or random bytes, a served layout or random numbers), their encodings cut or
with a byte flipped, raw random bytes, oversize messages, and streams of any of these.

Asserts: every call ends with a status docs/protocol.md lists; Stats stays consistent (per
tier, free + writing + cached == capacity); the pages committed before the run read back
unchanged; the daemon's anonymous memory (RssAnon, /proc/<pid>/status) grows by at most
RSS_GROWTH_LIMIT over the run, measured after a warm-up, though the run also sends hundreds
of large messages (256 KiB to 32 MiB, over the request limit or under it) from several
threads at once; SIGTERM still stops it, exit 0, within its drain timeout (plus 10 s of
margin).

Why it cannot be flaky: hypothesis runs derandomized (the same calls every run, no example
database); every call has a deadline far above its cost, so only a real hang fails it; the
daemon's memory is read after a warm-up that already made every kind of call (the large
ones too, from as many threads: gRPC's threads and the allocator's arenas exist), its pools
are all made before the run (max_pools reached: no arena or reader thread is made during
it), and its sessions never time out during it; the second reading comes after the heap
trimmer's delay (kvtier.server.heap). The RSS limit, 8 MiB, is far from both sides: the
leaks this test guards against kept ~20 KB per malformed call (~30 MiB over the default
run's ~1,600 malformed calls), and, with the large messages, 50 to 160 MiB (read up to the
old 16 MiB limit, kept by glibc's arenas); the fixed daemon's RssAnon moved by less than
3 MiB over the run when this was written.
"""
from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvtier_client.keys import ALGORITHMS, hash_fingerprint
from kvtier_client.proto.v1 import kvtier_pb2 as pb
from rpc import LAYOUT, PAGE_BYTES, Arena, Conn, keys, page

#: The status codes docs/protocol.md lists (UNIMPLEMENTED: a method the daemon does not have).
DOCUMENTED = frozenset({
    grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNIMPLEMENTED,
})
DRAIN_TIMEOUT_S = 2.0
HOST_SIZE = 16 << 20  # pages of up to 16 MiB (sent in pieces: no request is over REQUEST_LIMIT)
REQUEST_LIMIT = 4 << 20  # kvtier_client/protocol.py MAX_REQUEST_BYTES (pinned here: the documented limit)
#: Large messages of the run: under the request limit (read, then refused as undecodable) and over it.
LARGE_SIZES = (256 << 10, 1 << 20, 2 << 20, REQUEST_LIMIT - 64, REQUEST_LIMIT + 1, 5 << 20, 8 << 20, 16 << 20, 32 << 20)
LARGE_THREADS = 4
TRIM_WAIT_S = 2.0  # kvtier.server.heap.TRIM_DELAY_S, and a margin
RSS_GROWTH_LIMIT_KIB = 8 << 10
CALL_TIMEOUT_S = 10.0
#: A second layout, so both pools (--max-pools 2) exist before the run.
OTHER_LAYOUT = pb.PageLayout(layers=2, kv_heads=1, head_dim=48, block_tokens=16, dtype="float16", order="page_first")


@dataclass(frozen=True)
class Method:
    path: str
    request: type[Message]
    client_streaming: bool
    server_streaming: bool


def _methods() -> list[Method]:
    services = (
        pb.DESCRIPTOR.services_by_name["KVTier"],
        health_pb2.DESCRIPTOR.services_by_name["Health"],
        reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"],
    )
    return [
        Method(f"/{s.full_name}/{m.name}", GetMessageClass(m.input_type), m.client_streaming, m.server_streaming)
        for s in services
        for m in s.methods
    ]


METHODS = _methods()
UNKNOWN = Method("/kvtier.v1.KVTier/NoSuchMethod", pb.StatsRequest, False, False)
WATCH = "/grpc.health.v1.Health/Watch"


@dataclass(frozen=True)
class Known:
    """Valid values the strategies mix in, so that calls get past the first check."""

    strings: tuple[str, ...]
    blobs: tuple[bytes, ...]
    numbers: tuple[int, ...]
    layouts: tuple[pb.PageLayout, ...]


def _scalar(field: FieldDescriptor, known: Known) -> st.SearchStrategy:
    t = field.type
    if t == FieldDescriptor.TYPE_STRING:
        return st.one_of(st.sampled_from(known.strings), st.text(max_size=64), st.just("x" * 100_000))
    if t == FieldDescriptor.TYPE_BYTES:
        return st.one_of(st.sampled_from(known.blobs), st.binary(max_size=80))
    if t == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return st.floats(width=32)
    bits, signed = {
        FieldDescriptor.TYPE_UINT32: (32, False), FieldDescriptor.TYPE_FIXED32: (32, False),
        FieldDescriptor.TYPE_UINT64: (64, False), FieldDescriptor.TYPE_FIXED64: (64, False),
        FieldDescriptor.TYPE_INT64: (64, True), FieldDescriptor.TYPE_SINT64: (64, True),
    }.get(t, (32, True))  # int32, sint32, sfixed32, enum (open in proto3: any int32)
    low, high = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
    return st.one_of(st.sampled_from(known.numbers), st.integers(low, high))


def messages(descriptor: Descriptor, known: Known) -> st.SearchStrategy:
    """Messages of this type, each field set or not, to a known or a random value."""

    @st.composite
    def build(draw) -> Message:
        message = GetMessageClass(descriptor)()
        for field in descriptor.fields:
            if not draw(st.booleans()):
                continue
            value = messages(field.message_type, known) if field.message_type is not None else _scalar(field, known)
            target = getattr(message, field.name)
            if field.is_repeated and field.message_type is not None:
                for item in draw(st.lists(value, max_size=4)):
                    target.add().CopyFrom(item)
            elif field.is_repeated:
                target.extend(draw(st.lists(value, max_size=8)))
            elif field.message_type is not None:
                target.CopyFrom(draw(value))
            else:
                setattr(message, field.name, draw(value))
        return message

    if descriptor.full_name == pb.PageLayout.DESCRIPTOR.full_name:
        return st.one_of(st.sampled_from(known.layouts), build())
    return build()


def payloads(method: Method, known: Known) -> st.SearchStrategy[bytes]:
    """One request message on the wire: well formed, damaged, or noise."""
    encoded = messages(method.request.DESCRIPTOR, known).map(lambda m: m.SerializeToString())

    def flip(data: bytes, at: int, byte: int) -> bytes:
        return data[:at] + bytes([byte]) + data[at + 1:] if data else bytes([byte])

    return st.one_of(
        encoded,
        st.tuples(encoded, st.integers(0, 200), st.integers(0, 255)).map(lambda t: flip(t[0], t[1] % max(len(t[0]), 1), t[2])),
        st.tuples(encoded, st.integers(0, 200)).map(lambda t: t[0][: t[1]]),
        st.binary(max_size=256),
    )


def calls(known: Known) -> st.SearchStrategy[tuple[Method, list[bytes]]]:
    def for_method(method: Method) -> st.SearchStrategy:
        count = (0, 3) if method.client_streaming else (1, 1)
        return st.tuples(st.just(method), st.lists(payloads(method, known), min_size=count[0], max_size=count[1]))

    return st.sampled_from([*METHODS, UNKNOWN]).flatmap(for_method)


class Caller:
    """Sends raw bytes on any method path; returns the call's status code."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.channel = channel
        self._stubs: dict[str, Callable] = {}
        self.count = 0

    def _stub(self, method: Method) -> Callable:
        stub = self._stubs.get(method.path)
        if stub is None:
            make = {
                (False, False): self.channel.unary_unary, (False, True): self.channel.unary_stream,
                (True, False): self.channel.stream_unary, (True, True): self.channel.stream_stream,
            }[method.client_streaming, method.server_streaming]
            stub = self._stubs[method.path] = make(method.path, request_serializer=None, response_deserializer=None)
        return stub

    def __call__(self, method: Method, messages: list[bytes]) -> grpc.StatusCode:
        self.count += 1
        stub = self._stub(method)
        request = iter(messages) if method.client_streaming else messages[0]
        try:
            reply = stub(request, timeout=CALL_TIMEOUT_S)
            if method.path == WATCH:  # a watch of a served name never ends: its first answer will do
                next(reply)
                reply.cancel()
            elif method.server_streaming:
                for _ in reply:
                    pass
        except grpc.RpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK


def rss_anon_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("RssAnon:"))


def check_stats(conn: Conn) -> None:
    for pool in conn.state().pools:
        for t in pool.tiers:
            assert t.free_pages + t.writing_pages + t.cached_pages == t.capacity_pages, (pool.pool_id, t)


def oversize(caller: Caller) -> None:
    """Over the largest legal request (gRPC refuses it from its length prefix), a page too."""
    lookup = next(m for m in METHODS if m.path.endswith("/Lookup"))
    write = next(m for m in METHODS if m.path.endswith("/WritePages"))
    assert caller(lookup, [b"\n" + b"\xff" * (REQUEST_LIMIT + 1024)]) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert caller(lookup, [b"\xff" * (HOST_SIZE + 4096)]) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert caller(write, [b"\xff" * (HOST_SIZE + 4096)]) == grpc.StatusCode.RESOURCE_EXHAUSTED


def large_calls(target: str, rounds: int) -> int:
    """LARGE_THREADS threads, each on its own channel, send every LARGE_SIZES message to Lookup
    and WritePages `rounds` times: junk that does not decode (INVALID_ARGUMENT) or is over the
    limit (RESOURCE_EXHAUSTED; `oversize` checks that). Returns the calls made."""
    lookup = next(m for m in METHODS if m.path.endswith("/Lookup"))
    write = next(m for m in METHODS if m.path.endswith("/WritePages"))
    failures: list[str] = []

    def send() -> None:
        with grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
            caller = Caller(channel)
            for _ in range(rounds):
                for size in LARGE_SIZES:
                    for method in (lookup, write):
                        code = caller(method, [b"\xff" * size])
                        if code not in DOCUMENTED:
                            failures.append(f"{method.path} of {size} bytes: {code}")

    threads = [threading.Thread(target=send) for _ in range(LARGE_THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures[:5]
    return LARGE_THREADS * rounds * len(LARGE_SIZES) * 2


def fuzz(daemons, examples: int) -> None:
    daemon = daemons.start(
        "--max-pools", "2", "--session-timeout", "600s", "--drain-timeout", f"{DRAIN_TIMEOUT_S}s",
        host_size=f"{HOST_SIZE}B", disk_size="16MiB",
    )
    conn = Conn(daemon.target)
    try:
        # Pages with known bytes, to read back after the run; both pools made now.
        s = conn.session("fuzz")
        conn.register("fuzz", layout=OTHER_LAYOUT)
        committed = keys("fuzz", 8)
        lease = s.borrow(len(committed))
        arena = Arena.of(s)
        for i, slot in enumerate(lease.slots):
            arena.write(slot, page(f"fuzz-{i}"))
        s.commit(lease.lease_id, committed)
        known = Known(
            strings=(s.id, "", "fuzz", *ALGORITHMS, hash_fingerprint("xxh3-128"), "float16", "page_first",
                     "kvtier.v1.KVTier", "grpc.health.v1.Health", "kvtier_client/proto/v1/kvtier.proto"),
            blobs=(b"", *committed),
            numbers=(0, 1, 2, 3, 7, lease.lease_id, lease.lease_id + 1, PAGE_BYTES),
            layouts=(LAYOUT, OTHER_LAYOUT),
        )
        caller = Caller(conn.channel)
        seen: dict[grpc.StatusCode, int] = {}

        def batches(n: int) -> Callable[[], None]:
            @settings(max_examples=n, derandomize=True, database=None, deadline=None,
                      suppress_health_check=list(HealthCheck))
            @given(st.lists(calls(known), min_size=5, max_size=15))
            def run(batch: list[tuple[Method, list[bytes]]]) -> None:
                for method, messages in batch:
                    code = caller(method, messages)
                    seen[code] = seen.get(code, 0) + 1
                    assert code in DOCUMENTED, (method.path, code, messages[:1])
                check_stats(conn)

            return run

        # Warm-up: every kind of call once or more, then the run proper, large calls among them.
        oversize(caller)
        large_calls(daemon.target, rounds=1)
        for method in [*METHODS, UNKNOWN]:
            caller(method, [b"\xff\xff\xff"])
        batches(max(examples // 10, 20))()
        time.sleep(TRIM_WAIT_S)
        before = rss_anon_kib(daemon.proc.pid)
        warm_calls = caller.count
        large = 0
        for _ in range(4):
            batches(examples // 4)()
            large += large_calls(daemon.target, rounds=max(examples // 400, 1))
            oversize(caller)
        time.sleep(TRIM_WAIT_S)
        grown = rss_anon_kib(daemon.proc.pid) - before
        made = caller.count - warm_calls + large
        print(f"daemon RssAnon grew {grown} KiB over {made} calls ({large} large)")
        assert caller.count - warm_calls >= examples, "fewer calls than examples: hypothesis stopped early"
        assert grown <= RSS_GROWTH_LIMIT_KIB, f"daemon RSS grew {grown} KiB over {made} calls ({large} large)"
        assert grpc.StatusCode.INVALID_ARGUMENT in seen and grpc.StatusCode.OK in seen, seen

        reader = conn.session("fuzz")  # the run may have closed s: its id was one of the known strings
        read = reader.acquire(committed)
        assert read.ready == len(committed)
        for i, slot in enumerate(read.slots):
            assert arena.read(slot) == page(f"fuzz-{i}"), f"page {i} changed during the run"
        reader.release(read.lease_id)
        arena.close()
        assert daemon.proc.poll() is None, daemon.log()[-2000:]
    finally:
        conn.close()
    started = time.monotonic()
    assert daemon.stop(signal.SIGTERM, timeout=DRAIN_TIMEOUT_S + 10) == 0
    assert time.monotonic() - started < DRAIN_TIMEOUT_S + 10
    log = daemon.log()
    assert "Traceback" not in log and '"level": "error"' not in log, log[-2000:]


def test_hostile_calls_leave_the_daemon_whole(daemons):
    """~2,000 calls (250 batches of 5 to 15) and 288 large ones, after a warm-up of ~400;
    about 35 s on 2 cores (the soak below runs 2,000 batches)."""
    fuzz(daemons, examples=250)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_hostile_calls_soak(daemons):
    """~15,000 calls, 1,440 of them large; 5 to 8 minutes on 2 cores (past the suite's 300 s timeout)."""
    fuzz(daemons, examples=2000)
