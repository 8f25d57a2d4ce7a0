"""A Unix SOCK_SEQPACKET listening socket for same-host clients, with the rules that keep a
slow or hostile peer from costing anyone else anything (the handoff socket and the fast lane
share it: kvtier.server.handoff, kvtier.server.lane).

One thread accepts every connection at once and waits for each one's first message under
that connection's own deadline (`first_message_s` from accept). It never blocks on a peer:
a peer that connects and says nothing delays no one and costs a descriptor until its
deadline. Connections are counted by the peer's uid (SO_PEERCRED) from accept to close;
past `per_uid` open ones of that uid, or `total` in all, a new one is refused at once, with
a message, so one uid cannot take another's place. A connection whose first message arrived
goes to its service's `serve` (which must not block); closing the `Connection` frees its place.
"""
from __future__ import annotations

import enum
import logging
import os
import selectors
import socket
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from kvtier.mechanism.keeper import peer_credentials
from kvtier.server.sessions import Process

log = logging.getLogger(__name__)

#: How long the accept thread stops accepting when the daemon is out of descriptors (EMFILE):
#: the waiting connection stays in the backlog, and the thread does not spin on it.
ACCEPT_PAUSE_S = 0.1


class Refusal(str, enum.Enum):
    """Why a connection was refused or dropped (the metric's `reason` label)."""

    UID_LIMIT = "uid_limit"  # its uid holds per_uid connections already
    TOTAL_LIMIT = "total_limit"  # the socket holds total connections already
    DEADLINE = "deadline"  # no first message within first_message_s


@dataclass(frozen=True)
class PeerLimits:
    """What one local socket allows: `first_message_s` from accept to a connection's first
    message; `per_uid` connections open at once per peer uid; four times that in all."""

    first_message_s: float = 1.0
    per_uid: int = 256

    @property
    def total(self) -> int:
        return 4 * self.per_uid


class Connection:
    """An accepted connection whose first message arrived (`first`; b"" for an empty one or
    an end of file), blocking, from `process`. `close` ends it and frees its uid's place."""

    def __init__(self, sock: socket.socket, process: Process, first: bytes, release: Callable[[int], None]) -> None:
        self.sock = sock
        self.process = process
        self.first = first
        self._release = release
        self._closed = False

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.sock.close()
            self._release(self.process.uid)

    def __enter__(self) -> "Connection":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class LocalService(Protocol):
    def serve(self, connection: Connection) -> None:
        """Start serving `connection` elsewhere (a thread, a pool); must not block."""

    def refusal(self, reason: Refusal, message: str) -> bytes:
        """The one message that tells a refused or dropped peer why, in the socket's protocol."""


class SeqpacketListener:
    """Binds `path` (replacing a stale file: the daemon holds the socket path's claim) with
    `mode`; `name` labels the thread and the refused-connection metric (`on_refused(name,
    reason)`); a first message is read up to `first_bytes`."""

    def __init__(self, path: str, mode: int, name: str, service: LocalService, limits: PeerLimits, *,
                 first_bytes: int, on_refused: Callable[[str, str], None], backlog: int = 1024) -> None:
        self.path = path
        self._mode = mode
        self._name = name
        self._service = service
        self._limits = limits
        self._first_bytes = first_bytes
        self._on_refused = on_refused
        self._backlog = backlog
        self._lock = threading.Lock()  # the counts: released from the services' threads
        self._open: Counter[int] = Counter()  # uid -> its connections open
        self._total = 0
        # The accept thread's own: connections waiting for a first message, and their
        # deadlines in accept order (all have the same timeout, so the first is the soonest).
        self._waiting: dict[socket.socket, Process] = {}
        self._deadlines: deque[tuple[float, socket.socket]] = deque()
        self._socket: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._starved = False  # accept failed for want of descriptors (logged once until it works again)

    def start(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        listener.bind(self.path)
        os.chmod(self.path, self._mode)
        listener.listen(self._backlog)
        listener.setblocking(False)
        self._socket = listener
        self._thread = threading.Thread(target=self._run, name=f"kvtier-{self._name}", daemon=True)
        self._thread.start()

    def stop(self) -> bool:
        """Stop accepting, drop the connections still silent, remove the socket file; False
        if it was not started."""
        if self._socket is None:
            return False
        self._stopping = True
        self._socket.shutdown(socket.SHUT_RDWR)  # wakes the select
        self._thread.join()
        self._socket = None
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        return True

    # -- the accept thread ------------------------------------------------------------
    def _run(self) -> None:
        resume_at = 0.0  # when accepting paused for want of descriptors: when to resume
        with selectors.DefaultSelector() as selector:
            selector.register(self._socket, selectors.EVENT_READ)
            try:
                while not self._stopping:
                    timeout = self._expire(selector)
                    if resume_at:
                        wait = resume_at - time.monotonic()
                        if wait <= 0:
                            selector.register(self._socket, selectors.EVENT_READ)
                            resume_at = 0.0
                        else:
                            timeout = wait if timeout is None else min(timeout, wait)
                    for key, _ in selector.select(timeout):
                        if key.fileobj is not self._socket:
                            self._receive(selector, key.fileobj)
                        elif not self._stopping and not self._accept(selector):
                            selector.unregister(self._socket)
                            resume_at = time.monotonic() + ACCEPT_PAUSE_S
            except Exception:
                log.exception("the accept thread failed: no new connections are served", extra={"socket": self.path})
            finally:
                for sock in list(self._waiting):
                    self._drop(selector, sock)
                self._socket.close()

    def _accept(self, selector: selectors.BaseSelector) -> bool:
        """Take every connection waiting in the backlog; False when out of descriptors."""
        while True:
            try:
                conn, _ = self._socket.accept()
            except BlockingIOError:
                return True
            except OSError as exc:
                if not self._starved:  # once per spell: it is retried every ACCEPT_PAUSE_S
                    log.warning("cannot accept connections; raise the daemon's open-file limit (LimitNOFILE)",
                                extra={"socket": self.path, "reason": str(exc)})
                self._starved = True
                return False
            self._starved = False
            try:
                conn.setblocking(False)
                process = Process(*peer_credentials(conn))
            except OSError as exc:  # the peer is gone already
                log.debug("a connection ended as it was accepted", extra={"socket": self.path, "reason": str(exc)})
                conn.close()
                continue
            refused = self._admit(process.uid)
            if refused is not None:
                self._refuse(conn, refused, process)
                conn.close()
                continue
            self._waiting[conn] = process
            self._deadlines.append((time.monotonic() + self._limits.first_message_s, conn))
            selector.register(conn, selectors.EVENT_READ)

    def _admit(self, uid: int) -> Refusal | None:
        with self._lock:
            if self._open[uid] >= self._limits.per_uid:
                return Refusal.UID_LIMIT
            if self._total >= self._limits.total:
                return Refusal.TOTAL_LIMIT
            self._open[uid] += 1
            self._total += 1
        return None

    def _release(self, uid: int) -> None:
        with self._lock:
            self._open[uid] -= 1
            if not self._open[uid]:
                del self._open[uid]
            self._total -= 1

    def _expire(self, selector: selectors.BaseSelector) -> float | None:
        """Drop the connections past their deadline; seconds to the next deadline (None: none)."""
        now = time.monotonic()
        while self._deadlines:
            deadline, sock = self._deadlines[0]
            if sock not in self._waiting:  # it spoke, or was dropped, in time
                self._deadlines.popleft()
            elif deadline <= now:
                self._deadlines.popleft()
                self._refuse(sock, Refusal.DEADLINE, self._waiting[sock])
                self._drop(selector, sock)
            else:
                return deadline - now
        return None

    def _receive(self, selector: selectors.BaseSelector, sock: socket.socket) -> None:
        try:
            first = sock.recv(self._first_bytes)
        except BlockingIOError:
            return
        except OSError:
            self._drop(selector, sock)
            return
        selector.unregister(sock)
        connection = Connection(sock, self._waiting.pop(sock), first, self._release)
        sock.setblocking(True)
        try:
            self._service.serve(connection)
        except Exception:
            log.exception("cannot serve a connection", extra={"socket": self.path})
            connection.close()

    def _drop(self, selector: selectors.BaseSelector, sock: socket.socket) -> None:
        selector.unregister(sock)
        process = self._waiting.pop(sock)
        sock.close()
        self._release(process.uid)

    def _refuse(self, sock: socket.socket, reason: Refusal, process: Process) -> None:
        """Tell the peer why (if its socket takes the message now), and count it."""
        limits = self._limits
        message = {
            Refusal.UID_LIMIT: f"uid {process.uid} has {limits.per_uid} connections open to {self.path} already "
                               "(local_connections_per_uid); close some, or ask the operator to raise the limit",
            Refusal.TOTAL_LIMIT: f"{self.path} has {limits.total} connections open already (4 x "
                                 "local_connections_per_uid); retry shortly",
            Refusal.DEADLINE: f"no request within {limits.first_message_s:g}s of connecting "
                              "(local_first_message_timeout); send it at once after connecting",
        }[reason]
        try:
            sock.send(self._service.refusal(reason, message))
        except OSError:
            pass  # gone, or not reading: it learns from the hang-up
        self._on_refused(self._name, reason.value)
        log.debug("local connection refused", extra={"socket": self.path, "reason": reason.value,
                                                      "pid": process.pid, "uid": process.uid})
