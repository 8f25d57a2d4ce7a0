"""A bare gRPC echo server: the baseline for control-plane latency. Same transport (Unix
socket), same process setup (a separate Python process with a thread-pool server) as the
daemon, no work: whatever a kvtier RPC costs beyond this is kvtier's own.

    python -m kvtier.bench.echo /path/to/echo.sock
"""
from __future__ import annotations

import signal
import sys
import threading
from concurrent import futures

import grpc

METHOD = "/kvtier.bench.Echo/Echo"


def _identity(data: bytes) -> bytes:
    return data


def serve(socket_path: str) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
    handler = grpc.method_handlers_generic_handler(
        "kvtier.bench.Echo",
        {"Echo": grpc.unary_unary_rpc_method_handler(lambda request, context: request, _identity, _identity)},
    )
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"unix:{socket_path}")
    server.start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print("serving", flush=True)
    stop.wait()
    server.stop(grace=0.5).wait()


def echo_stub(channel: grpc.Channel):
    return channel.unary_unary(METHOD, request_serializer=_identity, response_deserializer=_identity)


if __name__ == "__main__":
    serve(sys.argv[1])
