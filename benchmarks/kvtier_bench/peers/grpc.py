"""A bare page store over plain gRPC: the peers benchmark's "KV bytes through gRPC" row
(GrpcStore: one unary call per page, `batch` in flight, each reply copied into the engine's buffer).

Same process setup as kvtier's daemon and the echo server (a separate Python process, a
thread-pool gRPC server), on TCP loopback. Put carries a key and a page's bytes and the
server keeps them in a dict; Get sends the key and gets the bytes back; Clear forgets
everything. Messages are raw bytes (no protobuf), so what this costs is gRPC itself.

    python -m kvtier_bench.peers.grpc PORT
"""
from __future__ import annotations

import struct
import sys

import grpc
import numpy as np

from kvtier_bench.echo import identity, serve_bytes
from kvtier_bench.harness import batches, package_version
from kvtier_bench.peers.base import Context, page_key
from kvtier_bench.services import Service, free_port

SERVICE = "kvtier_bench.PageStore"
MAX_MESSAGE = 64 << 20
OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE), ("grpc.max_receive_message_length", MAX_MESSAGE)]


def serve(port: int) -> None:
    pages: dict[bytes, bytes] = {}

    def put(request: bytes, context) -> bytes:
        (key_len,) = struct.unpack_from("<H", request)
        pages[request[2 : 2 + key_len]] = request[2 + key_len :]
        return b""

    def get(request: bytes, context) -> bytes:
        data = pages.get(request)
        if data is None:
            context.abort(grpc.StatusCode.NOT_FOUND, "no such page")
        return data

    def clear(request: bytes, context) -> bytes:
        pages.clear()
        return b""

    serve_bytes(SERVICE, {"Put": put, "Get": get, "Clear": clear}, f"127.0.0.1:{port}", OPTIONS)


class PageStoreClient:
    """Put / Get / Clear on a running page store; `put_many` and `get_many` keep a batch in flight."""

    def __init__(self, port: int) -> None:
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=OPTIONS)
        grpc.channel_ready_future(self.channel).result(timeout=30)
        call = lambda name: self.channel.unary_unary(
            f"/{SERVICE}/{name}", request_serializer=identity, response_deserializer=identity
        )
        self._put, self._get, self._clear = call("Put"), call("Get"), call("Clear")

    def put_many(self, keys: list[bytes], pages: list) -> None:
        calls = [self._put.future(b"".join((struct.pack("<H", len(k)), k, memoryview(p).cast("B"))))
                 for k, p in zip(keys, pages)]
        for c in calls:
            c.result()

    def get_many(self, keys: list[bytes]) -> list[bytes]:
        calls = [self._get.future(k) for k in keys]
        return [c.result() for c in calls]

    def clear(self) -> None:
        self._clear(b"")

    def close(self) -> None:
        self.channel.close()


class GrpcStore:
    """The page store below in a subprocess on TCP loopback; `batch` unary calls in flight."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        workdir = ctx.workdir / "grpc"
        workdir.mkdir()
        port = free_port()
        self.service = Service("grpc page store", [sys.executable, "-m", "kvtier_bench.peers.grpc", str(port)],
                               workdir / "server.log")
        try:
            self.service.wait_port(port)
            self.client = PageStoreClient(port)
        except BaseException:
            self.service.stop()
            raise

    def prepare(self, rep: int) -> None:
        self.client.clear()

    def put(self, rep: int) -> None:
        engine, ring = self.ctx.engine, self.ctx.ring
        for start, n in batches(self.ctx.pages, self.ctx.batch):
            self.client.put_many([page_key(rep, i) for i in range(start, start + n)],
                                 [engine[i % ring] for i in range(start, start + n)])

    def get(self, rep: int) -> None:
        sink, ring = self.ctx.sink, self.ctx.ring
        for start, n in batches(self.ctx.pages, self.ctx.batch):
            pages = self.client.get_many([page_key(rep, i) for i in range(start, start + n)])
            for i, data in zip(range(start, start + n), pages):
                np.copyto(sink[i % ring], np.frombuffer(data, dtype=np.uint8))

    def close(self) -> None:
        try:
            self.client.close()
        finally:
            self.service.stop()


def version() -> str | None:
    return f"grpcio {package_version('grpcio')}"


if __name__ == "__main__":
    serve(int(sys.argv[1]))
