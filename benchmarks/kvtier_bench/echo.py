"""A bare gRPC echo server: the baseline for control-plane latency. Same transport (Unix
socket), same process setup (a separate Python process with a thread-pool server) as the
daemon, no work: whatever a kvtier RPC costs beyond this is kvtier's own.

    python -m kvtier_bench.echo /path/to/echo.sock
"""
from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent import futures

import grpc

METHOD = "/kvtier_bench.Echo/Echo"


def identity(data: bytes) -> bytes:
    return data


def serve_bytes(service: str, methods: dict[str, Callable[[bytes, grpc.ServicerContext], bytes]], address: str,
                options: Sequence[tuple[str, int]] = ()) -> None:
    """Serve unary methods on raw bytes (no protobuf) from a 32-thread pool, as the daemon
    does, until SIGTERM. Prints "serving" once listening. Shared by the benchmarks' baselines."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=32), options=list(options))
    handler = grpc.method_handlers_generic_handler(
        service, {name: grpc.unary_unary_rpc_method_handler(fn, identity, identity) for name, fn in methods.items()}
    )
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(address)
    server.start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print("serving", flush=True)
    stop.wait()
    server.stop(grace=0.5).wait()


def serve(socket_path: str) -> None:
    serve_bytes("kvtier_bench.Echo", {"Echo": lambda request, context: request}, f"unix:{socket_path}")


def echo_stub(channel: grpc.Channel):
    return channel.unary_unary(METHOD, request_serializer=identity, response_deserializer=identity)


if __name__ == "__main__":
    serve(sys.argv[1])
