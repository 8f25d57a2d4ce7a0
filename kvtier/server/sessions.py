"""Sessions: every lease belongs to one, and a session ends when its client closes it or
stops heartbeating. Ending a session releases its leases and frees its uncommitted pages
(BlockStore.end_session), so a crashed engine (kill -9) never strands pages.

A session id names a session; it does not prove anything. Every call that names one is
checked against the session's credentials (`SessionManager.get`): its secret key, which
a same-host client gets only by attaching the session over the handoff socket, from the
process the kernel names there (one process per session); the bearer token that opened
it, still granted by the tokens file; and over mutual TLS the same client certificate.
docs/security.md has the model.
"""
from __future__ import annotations

import hmac
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtier_client.errors import CapacityError, KVTierError, NotFound, PermissionDenied
from kvtier_client.ids import LeaseId, SessionId, short_session

from kvtier.events import EngineIdentity
from kvtier.server.pools import Pool

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Caller:
    """What a call shows of who makes it: its metadata and transport."""

    session_key: str
    token: str | None
    tls_identity: tuple[bytes, ...] | None  # the client certificate's names (mutual TLS)


@dataclass(frozen=True)
class Process:
    """A process as the kernel names it on a Unix socket (SO_PEERCRED)."""

    pid: int
    uid: int
    gid: int


@dataclass
class Session:
    session_id: SessionId
    namespace: str
    pool: Pool
    client_name: str
    token: str | None  # the bearer token that opened it: every call must carry it
    tls_identity: tuple[bytes, ...] | None  # the client certificate that opened it, if any
    local: bool  # registered over the Unix socket: its key is given only by attaching
    key: str = field(default_factory=lambda: secrets.token_hex(16), repr=False)
    process: Process | None = None  # bound when attached over the handoff socket
    engine: EngineIdentity | None = None  # the engine as routers name it, if it said (KV event topics)
    last_seen: float = field(default_factory=time.monotonic)

    @property
    def credential(self) -> tuple:
        """Whose session it is, for the per-credential bound: its token and certificate
        (without either, every session is everyone's: only the total bounds them)."""
        return self.token, self.tls_identity

    def admits(self, caller: Caller) -> bool:
        return (hmac.compare_digest(caller.session_key.encode(), self.key.encode())
                and caller.token == self.token and caller.tls_identity == self.tls_identity)


class SessionManager:
    """Owns the session table and the reaper thread that expires silent sessions."""

    def __init__(
        self, timeout: float, on_release: Callable[[], None], grants: Callable[[str | None, str], bool] = lambda t, n: True,
        on_end: Callable[[Session, str], None] = lambda session, reason: None, max_sessions: int = 1024,
    ) -> None:
        """`grants(token, namespace)`: whether the current tokens file still lets `token`
        use `namespace` (checked on every call, so a token removed by a reload stops at once).
        `on_end(session, reason)`: told of every session that ends, with why: `closed` (its client
        closed it), `timeout` (missed heartbeats), `shutdown` (the daemon stops).
        `max_sessions`: open at once, a quarter of them per credential (a client that
        heartbeats could otherwise hold any number)."""
        self.timeout = timeout
        self.max_sessions = max_sessions
        self.max_per_credential = max(1, max_sessions // 4)
        self._on_end = on_end
        self._grants = grants
        # Called after leases were released here rather than by a Release or Commit call
        # (a session ended, or a lease outlived its session): the drain gate listens.
        self._on_release = on_release
        self._sessions: dict[SessionId, Session] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap, name="kvtier-session-reaper", daemon=True)

    @property
    def heartbeat_interval(self) -> float:
        """Clients beat three times per timeout, so one lost beat never ends a session."""
        return self.timeout / 3

    def start(self) -> None:
        self._reaper.start()

    def open(self, namespace: str, pool: Pool, client_name: str, *, token: str | None = None,
             tls_identity: tuple[bytes, ...] | None = None, local: bool = True,
             engine: EngineIdentity | None = None) -> Session:
        session = Session(SessionId(secrets.token_hex(16)), namespace, pool, client_name, token, tls_identity, local,
                          engine=engine)
        with self._lock:
            self._check_room(session)
            self._sessions[session.session_id] = session
        log.info("session opened", extra={"session": short_session(session.session_id), "namespace": namespace, "client": client_name})
        return session

    def _check_room(self, session: Session) -> None:
        """Refuse a session past the bounds (RESOURCE_EXHAUSTED), naming them; the token is never shown."""
        if len(self._sessions) >= self.max_sessions:
            raise CapacityError(f"the daemon holds {len(self._sessions)} sessions (max_sessions); close unused "
                                "ones, or raise --max-sessions")
        if session.token is None and session.tls_identity is None:
            return
        mine = sum(1 for s in self._sessions.values() if s.credential == session.credential)
        if mine >= self.max_per_credential:
            raise CapacityError(f"this credential holds {mine} sessions, a quarter of max_sessions "
                                f"({self.max_sessions}); close unused ones, or raise --max-sessions")

    def get(self, session_id: str, caller: Caller) -> Session:
        """The live session with this id, if `caller` holds its credentials; marked as seen now."""
        with self._lock:
            session = self._sessions.get(SessionId(session_id))
            if session is None:
                raise NotFound(
                    "unknown session: it ended (closed, timed out, or the daemon restarted); register again"
                )
            self._check(session, caller)
            session.last_seen = time.monotonic()
            return session

    def still(self, session: Session) -> Session:
        """A session whose credentials were checked when it was bound (the lane's HELLO):
        raises as `get` would if it has ended or its token no longer grants its namespace;
        marked as seen now. No lock: a dict read is atomic, and a session that ends just
        after this check is caught by the store (its leases are gone)."""
        if self._sessions.get(session.session_id) is not session:
            raise NotFound("unknown session: it ended (closed, timed out, or the daemon restarted); register again")
        self._check_granted(session)
        session.last_seen = time.monotonic()
        return session

    def _check(self, session: Session, caller: Caller) -> None:
        if not session.admits(caller):
            raise PermissionDenied(
                f"session {short_session(session.session_id)} belongs to another client: a call must carry the "
                "session key its client received (same host: by attaching over the handoff socket) and the token "
                "and certificate that opened it; register a session of your own"
            )
        self._check_granted(session)

    def _check_granted(self, session: Session) -> None:
        if not self._grants(session.token, session.namespace):
            raise PermissionDenied(
                f"the token that opened this session no longer grants namespace {session.namespace!r} "
                "(the tokens file was reloaded); ask the operator, then register again"
            )

    def attach(self, session_id: str, process: Process, token: str | None) -> Session:
        """Bind a same-host session to the process attaching it (the first to attach); only
        that process may attach it again. Returns the session, whose key and memory the
        handoff then gives it."""
        with self._lock:
            session = self._sessions.get(SessionId(session_id))
            if session is None:
                raise NotFound("unknown session: it ended or was never opened; register again")
            if token != session.token or not self._grants(token, session.namespace):
                raise PermissionDenied("attach with the token that opened the session")
            if session.process is not None and session.process.pid != process.pid:
                raise PermissionDenied(
                    f"session {short_session(session.session_id)} is attached to another process; register your own"
                )
            if not session.local:
                raise PermissionDenied("a session opened over TCP cannot attach to same-host memory; register over the Unix socket")
            session.process = process
            session.last_seen = time.monotonic()
            log.info("session attached", extra={"session": short_session(session.session_id), "pid": process.pid,
                                                "uid": process.uid})
            return session

    def close(self, session_id: str, caller: Caller | None = None, reason: str = "closed") -> int:
        """End a session (`caller` must hold its credentials; None: the daemon itself ends
        it); returns how many leases were released."""
        with self._lock:
            session = self._sessions.get(SessionId(session_id))
            if session is not None and caller is not None:
                self._check(session, caller)
            self._sessions.pop(SessionId(session_id), None)
        if session is None:
            raise NotFound("unknown session: it already ended; register again")
        released = session.pool.store.end_session(session.session_id)
        log.info("session ended", extra={"session": short_session(session_id), "reason": reason, "released_leases": released})
        self._on_end(session, reason)
        self._on_release()
        return released

    def check_still_open(self, session: Session, lease_id: LeaseId) -> None:
        """A lease granted while its session was ending (a long Acquire wait, a crash in the
        middle of a Borrow) would outlive the session: release it and say so."""
        with self._lock:
            if session.session_id in self._sessions:
                return
        try:
            session.pool.store.release(session.session_id, lease_id)
        except KVTierError:
            pass  # end_session released it already
        self._on_release()
        raise NotFound("the session ended while this call ran; register again")

    def count(self) -> int:
        with self._lock:
            return len(self._sessions)

    def close_all(self, reason: str) -> None:
        with self._lock:
            ids = list(self._sessions)
        for session_id in ids:
            try:
                self.close(session_id, reason=reason)
            except NotFound:
                pass  # ended concurrently

    def stop(self) -> None:
        self._stop.set()
        if self._reaper.is_alive():
            self._reaper.join()

    def _reap(self) -> None:
        # Check four times per timeout: a dead client's leases go at most 1.25 timeouts
        # after its last heartbeat.
        while not self._stop.wait(self.timeout / 4):
            now = time.monotonic()
            with self._lock:
                expired = [s.session_id for s in self._sessions.values() if now - s.last_seen > self.timeout]
            for session_id in expired:
                try:
                    self.close(session_id, reason="timeout")  # missed heartbeats
                except NotFound:
                    pass  # closed by its client meanwhile
