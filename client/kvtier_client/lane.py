"""The client's end of the fast lane (kvtier.server.lane; frames in kvtier_client.frames).

One `Lane` per session. Each calling thread gets its own connection, opened on its first
call with a HELLO (session id, key, token); so a thread's calls reach the daemon in the
order it makes them, a Release sent without waiting included, while threads do not wait
for each other. A thread that sent frames without replies and then calls over gRPC first
`sync`s (one round trip), so nothing it did is overtaken.
"""
from __future__ import annotations

import socket
import threading
from dataclasses import dataclass, field

from kvtier_client import frames, protocol
from kvtier_client.errors import KVTierError, Unavailable, from_status
from kvtier_client.frames import FrameError
from kvtier_client.seqpacket import connect


class LaneBroken(Exception):
    """The request never reached the daemon (the connection was refused or had ended): the
    caller may send it over gRPC instead. Carries the cause."""


class LaneLost(Unavailable):
    """The daemon ended the connection after the request was sent: whether it ran is unknown."""


@dataclass
class _Connection:
    sock: socket.socket
    seq: int = 0
    unanswered: int = 0  # frames sent with no reply asked for, not yet followed by a reply
    # Replies land here: recv() of a MAX_FRAME buffer would allocate (and map) it every call.
    buffer: bytearray = field(default_factory=lambda: bytearray(protocol.MAX_FRAME))


class Lane:
    def __init__(self, path: str, session_id: str, key: str, token: str | None, timeout: float) -> None:
        self.path = path
        self._hello = (session_id, key, token)
        self.timeout = timeout
        self._local = threading.local()
        self._open: list[_Connection] = []
        self._lock = threading.Lock()
        self._closed = False

    def connect(self) -> None:
        """Open this thread's connection now: raises LaneBroken when the lane cannot be used
        (no such socket, refused, HELLO refused), so the client knows at Register."""
        self._connection()

    def _connection(self) -> _Connection:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            return conn
        if self._closed:
            raise LaneBroken("the lane is closed")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, protocol.LANE_BUFFER_BYTES)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, protocol.LANE_BUFFER_BYTES)
            connect(sock, self.path, self.timeout)
            sock.send(frames.hello(0, *self._hello))
            op, status, _, body = frames.split(sock.recv(protocol.MAX_FRAME))
        except (OSError, FrameError) as exc:
            sock.close()
            raise LaneBroken(f"cannot open the fast lane at {self.path} ({exc})") from exc
        if status:
            sock.close()
            raise LaneBroken(f"the daemon refused the fast lane: {from_status(status, bytes(body).decode(errors='replace'))}")
        conn = _Connection(sock)
        with self._lock:
            self._open.append(conn)
        self._local.conn = conn
        return conn

    def _drop(self, conn: _Connection) -> None:
        """Forget this thread's connection (a later call opens a new one)."""
        self._local.conn = None
        with self._lock:
            if conn in self._open:
                self._open.remove(conn)
        conn.sock.close()

    def call(self, frame: bytes, *, timeout: float | None = None) -> memoryview:
        """Send a request and wait for its reply; returns the reply's body or raises the
        daemon's KVTierError."""
        answer = self.pipeline([frame], timeout=timeout)[0]
        if isinstance(answer, KVTierError):
            raise answer
        return answer

    def pipeline(self, requests: list[bytes], *, timeout: float | None = None) -> list[memoryview | KVTierError]:
        """Send several requests back to back, then read their replies: one round trip's
        wait for all. Each answer is the reply's body or the daemon's KVTierError for it."""
        conn = self._connection()  # this thread's own: no lock needed
        first = conn.seq + 1
        for frame in requests:
            conn.seq = (conn.seq + 1) & 0xFFFFFFFF
            self._send(conn, frames.with_seq(frame, conn.seq))
        conn.sock.settimeout(timeout or self.timeout)
        answers = [self._answer(conn, frame, (first + i) & 0xFFFFFFFF, timeout) for i, frame in enumerate(requests)]
        conn.unanswered = 0
        return answers

    def _answer(self, conn: _Connection, request: bytes, seq: int, timeout: float | None) -> memoryview | KVTierError:
        try:
            size = conn.sock.recv_into(conn.buffer)
        except socket.timeout:
            self._drop(conn)  # a late reply would be read as the next call's
            error = KVTierError(f"no reply on the fast lane within {timeout or self.timeout:g}s")
            error.code = "DEADLINE_EXCEEDED"
            raise error from None
        except OSError as exc:
            self._drop(conn)
            raise LaneLost(f"the daemon ended the fast lane during a call ({exc})") from exc
        if not size:
            self._drop(conn)
            raise LaneLost("the daemon closed the fast lane during a call (stopped or restarted?)")
        try:
            op, status, got, body = frames.split(bytes(conn.buffer[:size]))
        except FrameError as exc:
            self._drop(conn)
            raise KVTierError(f"the daemon sent a malformed lane frame ({exc}); daemon and client disagree") from exc
        if got != seq or op != request[1]:
            self._drop(conn)
            raise KVTierError(f"lane reply {got} ({op.name}) for request {seq}: daemon and client disagree")
        if status:
            return from_status(status, bytes(body).decode(errors="replace"))
        return body

    def send(self, frame: bytes) -> None:
        """Send a request that asks for no reply (a Release): returns once the kernel has it."""
        conn = self._connection()
        self._send(conn, frame)
        conn.unanswered += 1

    def _send(self, conn: _Connection, frame: bytes) -> None:
        try:
            conn.sock.send(frame)
        except OSError as exc:
            self._drop(conn)
            raise LaneBroken(f"the fast lane connection ended ({exc})") from exc

    def sync(self) -> None:
        """Wait until every frame this thread sent without a reply has been applied (one
        Heartbeat round trip, only if there are any)."""
        conn = getattr(self._local, "conn", None)
        if conn is not None and conn.unanswered:
            self.call(frames.heartbeat(0))

    def close(self) -> None:
        """Close every thread's connection (the daemon's threads for them end)."""
        with self._lock:
            self._closed = True
            open_, self._open = self._open, []
        for conn in open_:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.sock.close()

    def __repr__(self) -> str:
        return f"Lane({self.path!r})"

