"""The daemon's life cycle: build the servicer's collaborators from the configuration, serve
gRPC (with health and reflection) and metrics, and drain on SIGTERM. `run(config)` is what
`kvtier serve` calls."""
from __future__ import annotations

import logging
import os
import signal
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from kvtier_client.proto.v1 import kvtier_pb2 as pb
from kvtier_client.proto.v1 import kvtier_pb2_grpc
from kvtier_client.protocol import MAX_MESSAGE_BYTES, MAX_REQUEST_BYTES

import kvtier
from kvtier.events import EventPublisher
from kvtier.mechanism.keeper import KeeperClient, keeper_path
from kvtier.server.auth import Authorizer
from kvtier.server.config import AuthMode, ConfigError, DaemonConfig
from kvtier.server.drain import DrainGate
from kvtier.server.explain import Explainer
from kvtier.server.handoff import Handoff, handoff_path
from kvtier.server.heap import Trimmer
from kvtier.server.lane import Lane, lane_path
from kvtier.server.listener import PeerLimits
from kvtier.server.metrics import Metrics, MetricsServer
from kvtier.server.namespaces import NamespaceGate
from kvtier.server.notify import Notifier
from kvtier.server.ops import HotOps
from kvtier.server.pools import PoolRegistry
from kvtier.server.service import KVTierService
from kvtier.server.sessions import Session, SessionManager
from kvtier.server.startup import preflight, tls_credentials
from kvtier.server.wire_guard import WireGuard

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVTier"].full_name
HEALTH_SERVICE_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
# The largest request of any method (gRPC refuses a larger one from its length prefix,
# unread) and the largest page the slow path carries (the kvtier client's gRPC message
# limit) are kvtier_client.protocol's MAX_REQUEST_BYTES and MAX_MESSAGE_BYTES: one number
# for the daemon and the client each.
#: A PageData's fields besides its bytes (a 32-character session id, lease id, index, tags).
PAGE_ENVELOPE_BYTES = 1 << 10
SERVER_STOP_GRACE_S = 1.0  # calls still running then are cancelled
SERVER_STOP_WAIT_S = 5.0


def reply_limit(config: DaemonConfig) -> int:
    """The largest reply: a ReadPages message is a whole page, and no page is larger than the
    host tier (a pool's host tier holds at least one)."""
    return max(MAX_REQUEST_BYTES, min(config.tiers.host_size, MAX_MESSAGE_BYTES) + PAGE_ENVELOPE_BYTES)


def open_keeper(config: DaemonConfig) -> KeeperClient | None:
    """The arena keeper this daemon hands its host memory to: the standalone one at
    `keeper_socket` (None if it does not answer: no warm restart), else one it spawns (or a
    crashed predecessor left), unless `warm_restart_window` is 0."""
    tiers, owner = config.tiers, config.listen.socket
    if tiers.keeper_socket:
        return KeeperClient.connect_external(os.path.abspath(tiers.keeper_socket), owner)
    if tiers.warm_restart_window > 0:
        return KeeperClient.connect_or_start(keeper_path(tiers.cache_dir, owner), tiers.warm_restart_window, owner)
    return None


class HealthService(health.HealthServicer):
    """grpc's health servicer, answering List too, and watching only the services the daemon
    reports on: grpc's Watch keeps an entry for every name ever asked for, which a caller
    could grow without bound."""

    def __init__(self, services: tuple[str, ...]) -> None:
        super().__init__()
        self.services = services

    def List(self, request, context) -> health_pb2.HealthListResponse:
        return health_pb2.HealthListResponse(
            statuses={name: self.Check(health_pb2.HealthCheckRequest(service=name), context) for name in self.services}
        )

    def Watch(self, request, context, send_response_callback=None):
        if request.service in self.services:
            return super().Watch(request, context, send_response_callback)
        unknown = health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
        if send_response_callback is None:
            return iter([unknown])
        send_response_callback(unknown)
        send_response_callback(None)  # ends the stream: the daemon never starts serving another service
        return None


class Daemon:
    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.metrics = Metrics(kvtier.__version__)
        self.notifier = Notifier()
        ev = config.events
        try:
            tenants = config.auth.mode is AuthMode.TOKENS
            self.events = EventPublisher.configured(ev, tenants=tenants) if ev.endpoint else None
        except ValueError as exc:
            raise ConfigError(f"events: {exc}") from None
        if self.events is not None:
            self.metrics.watch_events(self.events.stats)
        keeper = open_keeper(config)
        self.pools = PoolRegistry(config.tiers, observer=self.metrics.observe_load, keeper=keeper,
                                  cluster=config.cluster, cluster_observer=self.metrics.observe_cluster,
                                  events=self.events)
        self.drain = DrainGate(self.pools.open_leases)
        auth = Authorizer.from_config(config.auth)
        self.pools.set_quotas(auth.quotas)  # kept for the pools made later
        self.pools.set_codecs(auth.codecs)
        self.sessions = SessionManager(config.sessions.session_timeout, on_release=self.drain.lease_ended, grants=auth.grants,
                                       max_sessions=config.sessions.max_sessions,
                                       on_end=self._session_ended)
        local = PeerLimits(config.listen.local_first_message_timeout, config.listen.local_connections_per_uid)
        self.handoff = Handoff(handoff_path(config.listen.socket), self.sessions, self.metrics, local)
        ops = HotOps(self.sessions, self.drain)
        self.lane = Lane(lane_path(config.listen.socket), self.sessions, ops, self.metrics, local) if config.listen.lane else None
        self.metrics.watch(self.pools.snapshot, self.sessions.count, self.pools.disk_snapshot, self.pools.bandwidth_snapshot,
                           self.pools.cluster_snapshot)
        self.namespaces = NamespaceGate(config.auth.max_namespaces, auth.names)
        self.heap = Trimmer()  # glibc's malloc tuned from here on
        self.metrics.watch_memory(self.pools.snapshot, lambda: (self.namespaces.count(), self.namespaces.limit),
                                  lambda: self.heap.trims)
        self.service = KVTierService(
            sessions=self.sessions, pools=self.pools, auth=auth, drain=self.drain,
            metrics=self.metrics, version=kvtier.__version__, started=time.monotonic(), handoff_socket=self.handoff.path,
            explainer=Explainer(self.pools), ops=ops, lane_socket=self.lane.path if self.lane is not None else "",
            namespaces=self.namespaces,
            events=self.events,
        )
        self.health = HealthService(("", SERVICE_NAME))
        for name in self.health.services:  # HealthServicer starts as SERVING; we are not, until start() ends
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self._server: grpc.Server | None = None
        self._metrics_server: MetricsServer | None = None

    def _session_ended(self, session: Session, reason: str) -> None:
        self.metrics.session_ended(reason)
        if self.events is not None and session.engine is not None:
            self.events.engine_left(session.namespace, session.engine)

    # -- life cycle -----------------------------------------------------------
    def start(self) -> None:
        cfg = self.config
        listen = cfg.listen
        guard = WireGuard(MAX_REQUEST_BYTES, called=self.heap.called)
        if cfg.metrics.port:  # first: /healthz answers (and /readyz says 503) while the rest starts
            self._metrics_server = self.metrics.serve(cfg.metrics.host, cfg.metrics.port, ready=self.serving)
        adopted = self.pools.adopt_kept()  # a crashed predecessor's host pages, before anyone asks
        if adopted:
            log.info("host memory of a previous daemon adopted", extra={"pools": adopted})
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="kvtier-rpc"),
            interceptors=[guard],
            options=[
                # gRPC refuses a larger message from its length prefix, before reading it.
                ("grpc.max_receive_message_length", guard.limit),
                ("grpc.max_send_message_length", reply_limit(cfg)),
                # gRPC sets SO_REUSEPORT by default, which lets a second daemon bind the same TCP
                # port and silently take half of the connections (sessions it does not know).
                ("grpc.so_reuseport", 0),
            ],
        )
        kvtier_pb2_grpc.add_KVTierServicer_to_server(self.service, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, HEALTH_SERVICE_NAME, reflection.SERVICE_NAME), self._server
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
        self.handoff.start()
        if self.lane is not None:
            self.lane.start()
        self.sessions.start()
        for name in self.health.services:
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self.notifier.ready()  # systemd (Type=notify): units ordered After= this one start now
        log.info(
            "serving",
            extra={"socket": listen.socket, "lane": self.lane.path if self.lane is not None else None,
                   "tcp": listen.tcp or None, "auth": cfg.auth.mode.value,
                   "host_size": cfg.tiers.host_size, "disk_size": cfg.tiers.disk_size, "cache_dir": cfg.tiers.cache_dir,
                   "metrics_port": cfg.metrics.port or None, "pid": os.getpid()},
        )

    def serving(self) -> bool:
        """Whether gRPC health says SERVING (what /readyz answers)."""
        reply = self.health.Check(health_pb2.HealthCheckRequest(service=""), None)
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def reload(self) -> None:
        """SIGHUP: re-read the tokens file; new tokens apply to the next call, new quotas to
        every pool. A file that does not parse changes nothing. Sessions, leases and pages
        are untouched (a session whose token the new file drops is refused from its next call)."""
        self.notifier.reloading()
        try:
            self._reload()
        finally:
            self.notifier.ready()

    def _reload(self) -> None:
        try:
            table = self.service.auth.reload()
        except ConfigError as exc:
            self.metrics.reloads.labels("error").inc()
            log.error("reload failed; keeping the previous tokens and quotas", extra={"reason": str(exc)})
            return
        refused = self.pools.set_quotas(table.quotas)
        self.pools.set_codecs(table.codecs)
        self.metrics.reloads.labels("error" if refused else "ok").inc()
        if refused:
            log.error("reload partly failed: tokens and quotas applied, except the quotas of pools that cannot keep "
                      "them (they keep their previous ones; see the error above)", extra={"pools": refused})
        else:
            log.info("reloaded the tokens file", extra={"tokens": len(table.tokens), "quotas": len(table.quotas)})

    def drain_and_stop(self) -> None:
        """Stop taking new leases, wait (bounded) for open ones, then release everything."""
        self.drain.close()
        for name in self.health.services:
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.notifier.stopping()
        timeout = self.config.sessions.drain_timeout
        log.info("draining", extra={"leases": self.pools.open_leases(), "timeout_s": timeout})
        if not self.drain.wait_idle(timeout):
            log.warning("drain timed out; releasing the remaining leases", extra={"leases": self.pools.open_leases()})
        self.sessions.close_all("shutdown")
        if self.events is not None:
            self.events.end_watches()  # WatchEvents streams end now: the server need not wait for them
        if self._server is not None:
            # Bounded: a call gRPC never finishes must not keep the host pages from being saved.
            if not self._server.stop(grace=SERVER_STOP_GRACE_S).wait(SERVER_STOP_WAIT_S):
                log.warning("gRPC server did not stop in time; stopping anyway", extra={"waited_s": SERVER_STOP_WAIT_S})
        self.sessions.stop()
        self.handoff.stop()
        if self.lane is not None:
            self.lane.stop()
        # The copy of host-only pages to disk gets drain_timeout too; what it has not copied
        # by then stays in the host arena, which is then kept for the next daemon to adopt.
        self.pools.close_all(deadline=time.monotonic() + timeout)
        if self.events is not None:
            self.events.close()  # after the pools: their last disk writes are told
        if self._metrics_server is not None:
            self._metrics_server.stop()
        try:
            os.unlink(self.config.listen.socket)
        except FileNotFoundError:
            pass
        log.info("stopped")


def run(config: DaemonConfig) -> int:
    """Serve until SIGTERM or SIGINT, then drain; reload the tokens file on SIGHUP. Returns
    the exit code."""
    claims = preflight(config)  # this process's cache dir and socket, until it ends
    daemon = Daemon(config)
    # The kernel may hand SIGTERM to any thread (gRPC's among them), and a Python handler only
    # runs once the main thread wakes: an Event.wait() here would then sleep on. The signal's
    # number written to a pipe wakes the main thread whichever thread received it.
    signalled, wakeup = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
    os.set_blocking(signalled, True)
    signal.set_wakeup_fd(wakeup)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: None)  # installs the C handler that writes to the pipe
    daemon.start()
    while os.read(signalled, 1)[0] == signal.SIGHUP:
        daemon.reload()
    daemon.drain_and_stop()
    # Only now, with the pools closed and the socket file removed; if anything above raised,
    # the claims end with the process, after the OS has closed its files.
    claims.release()
    return 0
