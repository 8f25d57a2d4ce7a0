"""Mooncake Store: `mooncake_master` (with its HTTP metadata server) and `mooncake_client`
(its real client daemon) on loopback, reached through the Python store's dummy client over
shared memory, `batch` pages per call:

    zero-copy  batch_put_from / batch_get_into; the engine's buffers are allocated from the
               dummy client's registered pool (its zero-copy path)
    bytes      put_batch of numpy pages (Mooncake copies them) / get_batch, each reply
               copied into the engine's buffer
"""
from __future__ import annotations

import ctypes
import os
import shutil
import sys
from pathlib import Path

import numpy as np

from kvtier_bench.harness import MiB, batches, package_version
from kvtier_bench.peers.base import SETUP_HINT, Context, Servers, Unavailable, page_key
from kvtier_bench.services import Service, free_port


class MooncakeServers:
    """mooncake_master (with its HTTP metadata server) and mooncake_client, the real client daemon."""

    def __init__(self, servers: Servers) -> None:
        bindir = Path(sys.executable).parent
        master = shutil.which("mooncake_master", path=f"{bindir}:{os.environ.get('PATH', '')}")
        real = shutil.which("mooncake_client", path=f"{bindir}:{os.environ.get('PATH', '')}")
        if master is None or real is None:
            raise Unavailable(f"mooncake_master / mooncake_client not found ({SETUP_HINT})")
        workdir = servers.root / "mooncake"
        workdir.mkdir()
        rpc, http, client_port, admin = free_port(), free_port(), free_port(), free_port()
        self.master = Service("mooncake_master", [
            master, f"--rpc_port={rpc}", "--rpc_address=127.0.0.1", "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1", f"--http_metadata_server_port={http}",
            f"--metrics_port={admin}", "--logtostderr",
        ], workdir / "master.log", cwd=str(workdir))
        try:
            self.master.wait_port(rpc)
            self.master.wait_port(http)
            # Room for two repetitions' pages of both Mooncake rows, so that a removal that
            # lags behind never makes it evict (an evicted key's get returns empty bytes).
            segment = 4 * servers.max_bytes + 256 * MiB
            self.real = Service("mooncake_client", [
                real, "--host=127.0.0.1", f"--port={client_port}", f"--master_server_address=127.0.0.1:{rpc}",
                f"--metadata_server=http://127.0.0.1:{http}/metadata", f"--global_segment_size={segment}",
                "--protocol=tcp", "--logtostderr",
            ], workdir / "client.log", cwd=str(workdir))
            self.real.wait_port(client_port, timeout=60)
        except BaseException:
            self.close()
            raise
        self.address = f"127.0.0.1:{client_port}"

    def close(self) -> None:
        if hasattr(self, "real"):
            self.real.stop()
        self.master.stop()


class MooncakeStore:
    """Mooncake Store through a dummy client (shared memory with mooncake_client)."""

    def __init__(self, ctx: Context, zero_copy: bool) -> None:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise Unavailable(f"mooncake.store does not import ({exc}; {SETUP_HINT})") from None
        self.ctx, self.zero_copy = ctx, zero_copy
        servers = ctx.servers.get("mooncake", MooncakeServers)
        ring_bytes = ctx.ring * ctx.page_bytes
        self.store = MooncakeDistributedStore()
        pool = 2 * ring_bytes + 64 * MiB if zero_copy else 64 * MiB
        rc = self.store.setup_dummy(pool, 64 * MiB, servers.address)
        if rc != 0:
            raise RuntimeError(f"MooncakeDistributedStore.setup_dummy returned {rc}")
        self.tag = b"z" if zero_copy else b"b"
        if zero_copy:
            # The engine's buffers live in the pool the dummy client shares with mooncake_client.
            base = self.store.alloc_from_mem_pool(2 * ring_bytes)
            if not base:
                raise RuntimeError("alloc_from_mem_pool returned no memory")
            if self.store.register_buffer(base, 2 * ring_bytes) != 0:
                raise RuntimeError("register_buffer failed for the pool buffer")
            mem = np.ctypeslib.as_array((ctypes.c_uint8 * (2 * ring_bytes)).from_address(base))
            self.src = mem[:ring_bytes].reshape(ctx.ring, ctx.page_bytes)
            self.dst = mem[ring_bytes:].reshape(ctx.ring, ctx.page_bytes)
            np.copyto(self.src, ctx.engine)
            self.landing = self.dst  # where gets land: the engine's buffer in the pool

    def _keys(self, rep: int, start: int, n: int) -> list[str]:
        return [(self.tag + page_key(rep, i)).hex() for i in range(start, start + n)]

    def prepare(self, rep: int) -> None:
        self.store.remove_all(True)

    def put(self, rep: int) -> None:
        ring, pb = self.ctx.ring, self.ctx.page_bytes
        for start, n in batches(self.ctx.pages, self.ctx.batch):
            keys = self._keys(rep, start, n)
            if self.zero_copy:
                ptrs = [self.src[i % ring].ctypes.data for i in range(start, start + n)]
                codes = self.store.batch_put_from(keys, ptrs, [pb] * n)
                if any(code != 0 for code in codes):
                    raise RuntimeError(f"batch_put_from returned {codes}")
            else:
                code = self.store.put_batch(keys, [self.ctx.engine[i % ring] for i in range(start, start + n)])
                if code != 0:
                    raise RuntimeError(f"put_batch returned {code}")

    def get(self, rep: int) -> None:
        ring, pb = self.ctx.ring, self.ctx.page_bytes
        for start, n in batches(self.ctx.pages, self.ctx.batch):
            keys = self._keys(rep, start, n)
            if self.zero_copy:
                ptrs = [self.dst[i % ring].ctypes.data for i in range(start, start + n)]
                sizes = self.store.batch_get_into(keys, ptrs, [pb] * n)
                if any(size != pb for size in sizes):
                    raise RuntimeError(f"batch_get_into returned sizes {sizes} (an evicted key reads as empty)")
            else:
                for i, data in zip(range(start, start + n), self.store.get_batch(keys)):
                    if len(data) != pb:
                        raise RuntimeError(f"get_batch returned {len(data)} bytes for page {i} (evicted?)")
                    np.copyto(self.ctx.sink[i % ring], np.frombuffer(data, dtype=np.uint8))

    def close(self) -> None:
        try:
            self.store.remove_all(True)
        finally:
            self.store.close()


def version() -> str | None:
    return package_version("mooncake-transfer-engine-efa-non-cuda") or package_version("mooncake-transfer-engine")
