"""The daemon's life cycle: build the servicer's collaborators from the configuration, serve
gRPC (with health and reflection) and metrics, and drain on SIGTERM. `run(config)` is what
`kvtier serve` calls."""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from kvtier_client.proto.v1 import kvtier_pb2 as pb
from kvtier_client.proto.v1 import kvtier_pb2_grpc

import kvtier
from kvtier.server.auth import Authorizer
from kvtier.server.config import DaemonConfig
from kvtier.server.drain import DrainGate
from kvtier.server.metrics import Metrics
from kvtier.server.pools import PoolRegistry
from kvtier.server.service import KVTierService
from kvtier.server.sessions import SessionManager
from kvtier.server.startup import preflight, tls_credentials

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVTier"].full_name
MAX_MESSAGE_BYTES = 256 << 20  # the slow path streams whole pages


class Daemon:
    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.metrics = Metrics()
        self.pools = PoolRegistry(config.tiers, observer=self.metrics.observe_load)
        self.drain = DrainGate(self.pools.open_leases)
        self.sessions = SessionManager(config.sessions.session_timeout, on_release=self.drain.lease_ended)
        self.metrics.watch(self.pools.snapshot, self.sessions.count, self.pools.disk_snapshot, self.pools.bandwidth_snapshot)
        self.service = KVTierService(
            sessions=self.sessions, pools=self.pools, auth=Authorizer.from_config(config.auth), drain=self.drain,
            metrics=self.metrics, version=kvtier.__version__, started=time.monotonic(),
        )
        self.health = health.HealthServicer()
        for name in ("", SERVICE_NAME):  # HealthServicer starts as SERVING; we are not, until start() ends
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self._server: grpc.Server | None = None
        self._metrics_server = None

    # -- life cycle -----------------------------------------------------------
    def start(self) -> None:
        cfg = self.config
        listen = cfg.listen
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
        kvtier_pb2_grpc.add_KVTierServicer_to_server(self.service, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), self._server
        )
        self._server.add_insecure_port(f"unix:{listen.socket}")
        if listen.tcp:
            if listen.tls_cert:
                self._server.add_secure_port(listen.tcp, tls_credentials(listen))
            else:
                log.warning("serving plaintext TCP (--insecure)", extra={"address": listen.tcp})
                self._server.add_insecure_port(listen.tcp)
        self._server.start()
        os.chmod(listen.socket, 0o660)
        self.sessions.start()
        if cfg.metrics.port:
            self._metrics_server, _ = self.metrics.serve(cfg.metrics.host, cfg.metrics.port)
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "serving",
            extra={"socket": listen.socket, "tcp": listen.tcp or None, "auth": cfg.auth.mode.value,
                   "host_size": cfg.tiers.host_size, "disk_size": cfg.tiers.disk_size, "cache_dir": cfg.tiers.cache_dir,
                   "metrics_port": cfg.metrics.port or None, "pid": os.getpid()},
        )

    def drain_and_stop(self) -> None:
        """Stop taking new leases, wait (bounded) for open ones, then release everything."""
        self.drain.close()
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        timeout = self.config.sessions.drain_timeout
        log.info("draining", extra={"leases": self.pools.open_leases(), "timeout_s": timeout})
        if not self.drain.wait_idle(timeout):
            log.warning("drain timed out; releasing the remaining leases", extra={"leases": self.pools.open_leases()})
        self.sessions.close_all("daemon shutdown")
        if self._server is not None:
            self._server.stop(grace=1.0).wait()
        self.sessions.stop()
        self.pools.close_all()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
        try:
            os.unlink(self.config.listen.socket)
        except FileNotFoundError:
            pass
        log.info("stopped")


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
