"""The bare servers the control-plane benchmark measures kvtier's calls against: the same
transports, the same process setup as the daemon, no work. Whatever a kvtier call costs
beyond these is kvtier's own.

    python -m kvtier_bench.echo /path/to/echo.sock              # gRPC echo (thread-pool server)
    python -m kvtier_bench.echo --seqpacket /path/to/echo.sock  # raw SOCK_SEQPACKET echo

The gRPC echo answers every call with its request's bytes. The SEQPACKET echo mirrors the
daemon's fast lane (kvtier.server.lane): a listening Unix SOCK_SEQPACKET socket, one thread
per connection, one message per frame; it answers each message with a message of the size
the request's first four bytes name (little-endian u32; 0: no answer, as a Release sent
without a reply), so a client replays a lane call's exact request and reply sizes.
"""
from __future__ import annotations

import os
import signal
import socket
import struct
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent import futures

import grpc

METHOD = "/kvtier_bench.Echo/Echo"
#: The largest message the SEQPACKET echo takes or sends (the lane's MAX_FRAME, with room).
SEQPACKET_MAX = 256 << 10
_U32 = struct.Struct("<I")


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


# -- the raw SOCK_SEQPACKET echo ---------------------------------------------------------
def _answer(conn: socket.socket) -> None:
    """One connection's thread: read a message, answer with as many bytes as it asks for."""
    buffer = bytearray(SEQPACKET_MAX)
    reply = bytes(SEQPACKET_MAX)
    view = memoryview(reply)
    with conn:
        try:
            while True:
                size = conn.recv_into(buffer)
                if size == 0:
                    return
                want = _U32.unpack_from(buffer)[0] if size >= 4 else 0
                if want:
                    conn.send(view[: min(want, SEQPACKET_MAX)])
        except OSError:
            return


def serve_seqpacket(socket_path: str) -> None:
    """The SEQPACKET echo until SIGTERM; prints "serving" once listening."""
    try:
        os.unlink(socket_path)
    except FileNotFoundError:
        pass
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    listener.bind(socket_path)
    listener.listen(128)

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):  # as the daemon's lane sets them
                conn.setsockopt(socket.SOL_SOCKET, option, 4 * (192 << 10))
            threading.Thread(target=_answer, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print("serving", flush=True)
    stop.wait()
    listener.close()
    try:
        os.unlink(socket_path)
    except FileNotFoundError:
        pass


class SeqpacketEcho:
    """A client of the SEQPACKET echo: replays frames of given sizes, round trips and one-way sends."""

    def __init__(self, path: str, timeout: float = 30.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):  # as kvtier_client.lane sets them
            self.sock.setsockopt(socket.SOL_SOCKET, option, 4 * (192 << 10))
        self.sock.settimeout(timeout)
        self.sock.connect(path)

    @staticmethod
    def message(request_bytes: int, reply_bytes: int) -> bytes:
        """A request of `request_bytes` asking for `reply_bytes` back (0: no reply)."""
        if request_bytes < 4:
            raise ValueError("an echo request is at least 4 bytes (the reply size)")
        return _U32.pack(reply_bytes) + bytes(request_bytes - 4)

    def exchange(self, messages: Sequence[bytes]) -> None:
        """Send every message back to back, then read one reply per message that asked for one:
        what the lane's pipeline does."""
        sock = self.sock
        for m in messages:
            sock.send(m)
        for m in messages:
            if m[:4] != b"\0\0\0\0":
                sock.recv(SEQPACKET_MAX)

    def close(self) -> None:
        self.sock.close()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--seqpacket"]:
        serve_seqpacket(sys.argv[2])
    else:
        serve(sys.argv[1])
