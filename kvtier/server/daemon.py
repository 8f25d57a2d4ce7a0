"""The daemon: pools per layout, sessions, auth, the gRPC server, metrics, and a drain on
SIGTERM. `run(config)` is what `kvtier serve` calls."""
from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import stat
import threading
import time
from collections.abc import Sequence
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from kvtier_client.errors import (
    CapacityError,
    FailedPrecondition,
    InvalidArgument,
    KVTierError,
    NotFound,
    PermissionDenied,
    Unauthenticated,
)
from kvtier_client.keys import ALGORITHMS, hash_fingerprint
from kvtier_client.layout import PageLayout
from kvtier_client.proto.v1 import kvtier_pb2 as pb
from kvtier_client.proto.v1 import kvtier_pb2_grpc
from kvtier_client.wire import layout_from_proto

import kvtier
from kvtier.core import StoreUsage, check_namespace
from kvtier.mechanism.disk import DiskLayoutMismatch
from kvtier.mechanism.host import ArenaInUse, ArenaNoSpace
from kvtier.mechanism.device import DeviceNoSpace, cuda_device_count
from kvtier.pool import Pool, PoolConfig
from kvtier.server.config import ConfigError, DaemonConfig, load_tokens
from kvtier.server.metrics import Metrics
from kvtier.server.service import KVTierService
from kvtier.server.sessions import Session, SessionManager

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVTier"].full_name
MAX_MESSAGE_BYTES = 256 << 20  # the slow path streams whole pages


class Daemon:
    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.version = kvtier.__version__
        self.tokens = load_tokens(config.tokens_file) if config.auth == "tokens" else None
        self.pools: dict[str, Pool] = {}
        self._pools_lock = threading.Lock()
        self.sessions = SessionManager(config.session_timeout, self._session_ended)
        self.metrics = Metrics(
            self.snapshot, lambda pool_id: self.pools[pool_id].layout.page_bytes, self.disk_snapshot, self.bandwidth_snapshot
        )
        self.health = health.HealthServicer()
        for name in ("", SERVICE_NAME):  # HealthServicer starts as SERVING; we are not, until start() ends
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.draining = False
        self._idle = threading.Condition()
        self._started = time.monotonic()
        self._server: grpc.Server | None = None
        self._metrics_server = None

    # -- called by the servicer -------------------------------------------------
    def register(self, request: pb.RegisterRequest, metadata: Sequence) -> Session:
        check_namespace(request.namespace)
        self._authorize(request.namespace, metadata)  # before anything else is checked or revealed
        if request.hash_algorithm not in ALGORITHMS:
            raise InvalidArgument(f"unknown hash_algorithm {request.hash_algorithm!r}; use one of {', '.join(ALGORITHMS)}")
        expected = hash_fingerprint(request.hash_algorithm)
        if request.hash_fingerprint != expected:
            raise FailedPrecondition(
                f"block-key fingerprint mismatch for {request.hash_algorithm}: client sent {request.hash_fingerprint!r}, "
                f"daemon computes {expected}; the client's key hashing differs from docs/block-keys.md, upgrade or fix it"
            )
        try:
            layout = layout_from_proto(request.layout)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        pool = self._pool_for(layout)
        return self.sessions.open(request.namespace, pool, request.client_name or "unnamed")

    def _token(self, metadata: Sequence) -> str | None:
        for key, value in metadata:
            if key == "authorization" and value.startswith("Bearer "):
                return value[len("Bearer ") :]
        return None

    def _authorize(self, namespace: str, metadata: Sequence) -> None:
        if self.tokens is None:
            return
        token = self._token(metadata)
        if token is None or token not in self.tokens:
            raise Unauthenticated("missing or unknown token: send 'authorization: Bearer <token>' with a token the daemon is configured with")
        allowed = self.tokens[token]
        if "*" not in allowed and namespace not in allowed:
            raise PermissionDenied(f"this token may not use namespace {namespace!r}; ask the operator to grant it")

    def authenticate_any(self, metadata: Sequence) -> None:
        """Stats shows counts only, but still needs a valid token when tokens are on."""
        if self.tokens is not None and self._token(metadata) not in self.tokens:
            raise Unauthenticated("missing or unknown token: send 'authorization: Bearer <token>'")

    def _pool_for(self, layout: PageLayout) -> Pool:
        with self._pools_lock:
            pool = self.pools.get(layout.layout_id)
            if pool is not None:
                return pool
            if len(self.pools) >= self.config.max_pools:
                raise CapacityError(
                    f"daemon already serves {len(self.pools)} page layouts (max_pools); "
                    "use an existing layout or raise max_pools"
                )
            pool_config = PoolConfig(
                host_bytes=self.config.host_size,
                disk_bytes=self.config.disk_size,
                disk_dir=self.config.cache_dir,
                device_bytes=self.config.device_size,
                gpu=self.config.gpu,
                policy=self.config.policy,
                write_through=self.config.write_through,
                fsync=self.config.fsync,
                fsync_interval=self.config.fsync_interval,
                io_depth=self.config.io_depth,
                max_queued_prefetch=self.config.max_queued_prefetch,
                prefetch_hold=self.config.prefetch_hold,
                arena_prefix=self.config.arena_prefix,
            )
            try:
                pool = Pool(layout, pool_config, observer=self.metrics.observe_load)
            except ValueError as exc:  # the client's layout does not fit the configured tiers
                raise InvalidArgument(str(exc)) from None
            except (ArenaInUse, DiskLayoutMismatch) as exc:  # the operator's to fix; the log says so too
                log.error("cannot create pool", extra={"pool": layout.layout_id, "reason": str(exc)})
                raise FailedPrecondition(f"daemon cannot serve this layout: {exc}") from None
            except (ArenaNoSpace, DeviceNoSpace) as exc:
                log.error("cannot create pool", extra={"pool": layout.layout_id, "reason": str(exc)})
                raise CapacityError(str(exc)) from None
            self.pools[layout.layout_id] = pool
            log.info("pool created", extra={"pool": layout.layout_id, "layout": repr(layout), "host_arena": pool.host.name})
            return pool

    def lease_ended(self) -> None:
        with self._idle:
            self._idle.notify_all()

    def _session_ended(self, session: Session, released: int, reason: str) -> None:
        self.lease_ended()

    def snapshot(self) -> tuple[list[tuple[str, StoreUsage]], int]:
        with self._pools_lock:
            pools = list(self.pools.items())
        return [(pool_id, pool.store.stats()) for pool_id, pool in pools], self.sessions.count()

    def disk_snapshot(self) -> list:
        with self._pools_lock:
            pools = list(self.pools.items())
        return [
            (pool_id, pool.reader.stats(), pool.disk.bytes_read, pool.disk.bytes_written)
            for pool_id, pool in pools
            if pool.reader is not None and pool.disk is not None
        ]

    def bandwidth_snapshot(self) -> list:
        with self._pools_lock:
            pools = list(self.pools.items())
        return [
            (pool_id, tier, throughput.bytes_per_second)
            for pool_id, pool in pools
            for tier, throughput in pool.bandwidth.items()
        ]

    def check_still_open(self, session: Session, lease_id: int) -> None:
        """A lease granted while its session was ending (a long Acquire wait, a crash in the
        middle of a Borrow) would outlive the session: release it and say so."""
        if self.sessions.is_open(session.session_id):
            return
        try:
            session.pool.store.release(session.session_id, lease_id)
        except KVTierError:
            pass  # end_session released it already
        self.lease_ended()
        raise NotFound("the session ended while this call ran; register again")

    def uptime(self) -> float:
        return time.monotonic() - self._started

    def _leases(self) -> int:
        return sum(len(pool.store.leases) for pool in list(self.pools.values()))

    # -- life cycle -----------------------------------------------------------
    def start(self) -> None:
        cfg = self.config
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="kvtier-rpc"),
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                # gRPC sets SO_REUSEPORT by default, which lets a second daemon bind the same TCP
                # port and silently take half of the connections (sessions it does not know).
                ("grpc.so_reuseport", 0),
            ],
        )
        kvtier_pb2_grpc.add_KVTierServicer_to_server(KVTierService(self), self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), self._server
        )
        self._server.add_insecure_port(f"unix:{cfg.socket}")
        if cfg.tcp:
            if cfg.tls_cert:
                self._server.add_secure_port(cfg.tcp, _tls_credentials(cfg))
            else:
                log.warning("serving plaintext TCP (--insecure)", extra={"address": cfg.tcp})
                self._server.add_insecure_port(cfg.tcp)
        self._server.start()
        os.chmod(cfg.socket, 0o660)
        self.sessions.start()
        if cfg.metrics_port:
            self._metrics_server, _ = self.metrics.serve(cfg.metrics_host, cfg.metrics_port)
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "serving",
            extra={"socket": cfg.socket, "tcp": cfg.tcp or None, "auth": cfg.auth, "host_size": cfg.host_size,
                   "disk_size": cfg.disk_size, "cache_dir": cfg.cache_dir, "metrics_port": cfg.metrics_port or None,
                   "pid": os.getpid()},
        )

    def drain_and_stop(self) -> None:
        """Stop taking new leases, wait (bounded) for open ones, then release everything."""
        self.draining = True
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        log.info("draining", extra={"leases": self._leases(), "timeout_s": self.config.drain_timeout})
        with self._idle:
            drained = self._idle.wait_for(lambda: self._leases() == 0, timeout=self.config.drain_timeout)
        if not drained:
            log.warning("drain timed out; releasing the remaining leases", extra={"leases": self._leases()})
        self.sessions.close_all("daemon shutdown")
        if self._server is not None:
            self._server.stop(grace=1.0).wait()
        self.sessions.stop()
        for pool in self.pools.values():
            pool.close()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
        try:
            os.unlink(self.config.socket)
        except FileNotFoundError:
            pass
        log.info("stopped")


def _tls_credentials(cfg: DaemonConfig) -> grpc.ServerCredentials:
    def read(path: str) -> bytes:
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as exc:
            raise ConfigError(f"cannot read {path}: {exc.strerror}") from None

    client_ca = read(cfg.tls_client_ca) if cfg.tls_client_ca else None
    return grpc.ssl_server_credentials(
        [(read(cfg.tls_key), read(cfg.tls_cert))], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


def _check_device(cfg: DaemonConfig) -> None:
    count = cuda_device_count()
    if not count:
        raise ConfigError(
            "device_size needs a CUDA GPU and CuPy (pip install 'kvtier[gpu]'); none found: "
            "set device_size 0 for host and disk tiers only"
        )
    import cupy

    if cfg.gpu >= count:
        raise ConfigError(f"gpu {cfg.gpu} does not exist: this machine has {count} CUDA device(s) (0..{count - 1})")
    with cupy.cuda.Device(cfg.gpu):
        free, _ = cupy.cuda.runtime.memGetInfo()
    if cfg.device_size > free:
        raise ConfigError(f"device_size {cfg.device_size >> 20} MiB exceeds the free memory of GPU {cfg.gpu} ({free >> 20} MiB)")


def preflight(cfg: DaemonConfig) -> None:
    """Refuse a configuration that cannot work, with a one-line reason (ConfigError)."""
    if cfg.tls_cert:
        _tls_credentials(cfg)  # unreadable files fail now, not at bind time
    try:
        os.makedirs(cfg.cache_dir, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cache_dir {cfg.cache_dir}: cannot create it ({exc.strerror})") from None
    if not os.access(cfg.cache_dir, os.W_OK | os.X_OK):
        raise ConfigError(f"cache_dir {cfg.cache_dir} is not writable by this user; choose another with --cache-dir")
    shm = shutil.disk_usage("/dev/shm")
    if cfg.host_size > shm.free:
        raise ConfigError(
            f"host_size {cfg.host_size >> 20} MiB exceeds the free shared memory in /dev/shm ({shm.free >> 20} MiB); "
            "lower --host-size or enlarge /dev/shm"
        )
    available = _mem_available()
    if available is not None and cfg.host_size > available:
        raise ConfigError(f"host_size {cfg.host_size >> 20} MiB exceeds available RAM ({available >> 20} MiB); lower --host-size")
    if cfg.disk_size:
        free = shutil.disk_usage(cfg.cache_dir).free + _existing_slabs(cfg.cache_dir)
        if cfg.disk_size > free:
            raise ConfigError(
                f"disk_size {cfg.disk_size >> 20} MiB exceeds the free space under {cfg.cache_dir} ({free >> 20} MiB); "
                "lower --disk-size or choose another --cache-dir"
            )
    if cfg.device_size:
        _check_device(cfg)
    if cfg.tcp:
        _check_port(cfg.tcp, "tcp")
    if cfg.metrics_port:
        _check_port(f"{cfg.metrics_host}:{cfg.metrics_port}", "metrics_port")
    _claim_socket(cfg.socket)


def _check_port(address: str, key: str) -> None:
    """Refuse a TCP address this daemon cannot listen on (in use, not local, unresolvable)."""
    host, _, port = address.rpartition(":")
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(
            host.strip("[]") or None, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the real listener does
            probe.bind(sockaddr)
    except OSError as exc:
        raise ConfigError(
            f"{key}: cannot listen on {address} ({exc.strerror or exc}); stop what holds it or choose another port"
        ) from None


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _existing_slabs(cache_dir: str) -> int:
    """Space our own slab files already take: reusing them needs no new space."""
    total = 0
    for entry in os.scandir(cache_dir):
        slab = os.path.join(entry.path, "slab.bin")
        if entry.is_dir() and os.path.exists(slab):
            total += os.path.getsize(slab)
    return total


_SUN_PATH_MAX = 108  # sizeof(sockaddr_un.sun_path) on Linux, terminating NUL included


def _claim_socket(path: str) -> None:
    """Create the socket's directory; replace a stale socket file, refuse a live daemon's."""
    if len(os.fsencode(path)) >= _SUN_PATH_MAX:
        raise ConfigError(
            f"socket path {path} is {len(os.fsencode(path))} bytes; Unix sockets allow at most {_SUN_PATH_MAX - 1}: "
            "choose a shorter --socket"
        )
    directory = os.path.dirname(path)
    try:
        os.makedirs(directory, mode=0o770, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"socket directory {directory}: cannot create it ({exc.strerror})") from None
    if not os.path.lexists(path):
        return
    if not stat.S_ISSOCK(os.lstat(path).st_mode):
        raise ConfigError(f"{path} exists and is not a socket; remove it or choose another --socket")
    channel = grpc.insecure_channel(f"unix:{path}")
    try:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
    except grpc.RpcError:
        log.info("replacing stale socket", extra={"socket": path})
        os.unlink(path)
        return
    finally:
        channel.close()
    raise ConfigError(f"another kvtier daemon is serving {path}; stop it first or choose another --socket")


def run(config: DaemonConfig) -> int:
    """Serve until SIGTERM or SIGINT, then drain. Returns the exit code."""
    preflight(config)
    daemon = Daemon(config)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    daemon.start()
    stop.wait()
    daemon.drain_and_stop()
    return 0
