"""Sessions: every lease belongs to one, and a session ends when its client closes it or
stops heartbeating. Ending a session releases its leases and frees its uncommitted pages
(BlockStore.end_session), so a crashed engine (kill -9) never strands pages.
"""
from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtier_client.errors import KVTierError, NotFound
from kvtier_client.ids import LeaseId, SessionId, short_session

from kvtier.server.pools import Pool

log = logging.getLogger(__name__)


@dataclass
class Session:
    session_id: SessionId
    namespace: str
    pool: Pool
    client_name: str
    last_seen: float = field(default_factory=time.monotonic)


class SessionManager:
    """Owns the session table and the reaper thread that expires silent sessions."""

    def __init__(self, timeout: float, on_release: Callable[[], None]) -> None:
        self.timeout = timeout
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

    def open(self, namespace: str, pool: Pool, client_name: str) -> Session:
        session = Session(SessionId(secrets.token_hex(16)), namespace, pool, client_name)
        with self._lock:
            self._sessions[session.session_id] = session
        log.info("session opened", extra={"session": short_session(session.session_id), "namespace": namespace, "client": client_name})
        return session

    def get(self, session_id: str) -> Session:
        """The live session with this id, marked as seen now."""
        with self._lock:
            session = self._sessions.get(SessionId(session_id))
            if session is None:
                raise NotFound(
                    "unknown session: it ended (closed, timed out, or the daemon restarted); register again"
                )
            session.last_seen = time.monotonic()
            return session

    def close(self, session_id: str, reason: str = "closed") -> int:
        """End a session; returns how many leases were released."""
        with self._lock:
            session = self._sessions.pop(SessionId(session_id), None)
        if session is None:
            raise NotFound("unknown session: it already ended; register again")
        released = session.pool.store.end_session(session.session_id)
        log.info("session ended", extra={"session": short_session(session_id), "reason": reason, "released_leases": released})
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
                self.close(session_id, reason)
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
                    self.close(session_id, "heartbeat timeout")
                except NotFound:
                    pass  # closed by its client meanwhile
