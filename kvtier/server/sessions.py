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

from kvtier_client.errors import NotFound

from kvtier.pool import Pool

log = logging.getLogger(__name__)


@dataclass
class Session:
    session_id: str
    namespace: str
    pool: Pool
    client_name: str
    last_seen: float = field(default_factory=time.monotonic)


class SessionManager:
    """Owns the session table and the reaper thread that expires silent sessions."""

    def __init__(self, timeout: float, on_end: Callable[[Session, int, str], None]) -> None:
        self.timeout = timeout
        self._on_end = on_end  # (session, released leases, reason): for metrics and drain
        self._sessions: dict[str, Session] = {}
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
        session = Session(secrets.token_hex(16), namespace, pool, client_name)
        with self._lock:
            self._sessions[session.session_id] = session
        log.info("session opened", extra={"session": session.session_id[:8], "namespace": namespace, "client": client_name})
        return session

    def get(self, session_id: str) -> Session:
        """The live session with this id, marked as seen now."""
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                raise NotFound(
                    "unknown session: it ended (closed, timed out, or the daemon restarted); register again"
                )
            session.last_seen = time.monotonic()
            return session

    def close(self, session_id: str, reason: str = "closed") -> int:
        """End a session; returns how many leases were released."""
        with self._lock:
            session = self._sessions.pop(session_id, None)
        if session is None:
            raise NotFound("unknown session: it already ended; register again")
        released = session.pool.store.end_session(session.session_id)
        log.info("session ended", extra={"session": session_id[:8], "reason": reason, "released_leases": released})
        self._on_end(session, released, reason)
        return released

    def is_open(self, session_id: str) -> bool:
        with self._lock:
            return session_id in self._sessions

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
