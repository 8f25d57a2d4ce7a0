"""The handoff socket: where a same-host client attaches its session and receives its
namespace's host arena as a file descriptor, and the session key.

Register (gRPC) cannot say which process is calling; this socket can: the kernel gives
the connecting process's pid, uid and gid (SO_PEERCRED). The first process to attach a
session owns it (kvtier.server.sessions.SessionManager.attach), and only it gets the key
that every later call of the session must carry. The arena travels as an SCM_RIGHTS
descriptor of a memfd, so no path anywhere names it. Protocol: kvtier_client.handoff.

The listener (kvtier.server.listener) waits for every connection's request at once, each
under its own deadline, and limits connections per peer uid: a peer that connects and says
nothing delays no other attach. An attach whose request arrived runs on a small pool; it
waits on no peer (its reply is one message into a socket that has nothing queued).
"""
from __future__ import annotations

import array
import json
import logging
import socket
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from kvtier_client.errors import InvalidArgument, KVTierError
from kvtier_client.handoff import MESSAGE_BYTES

from kvtier.server.device_handoff import attach_device, map_device
from kvtier.server.listener import Connection, PeerLimits, Refusal, SeqpacketListener
from kvtier.server.metrics import Metrics
from kvtier.server.sessions import Process, SessionManager

log = logging.getLogger(__name__)

#: Attaches run at once (each is a session lookup and one reply: microseconds of work).
ATTACH_WORKERS = 4
#: A reply that cannot leave within this long is given up (only a peer that fills its
#: own socket could make it wait).
REPLY_TIMEOUT_S = 1.0


def handoff_path(socket_path: str) -> str:
    return f"{socket_path}.handoff"


class Handoff:
    """The listening socket and its accept thread, and the pool the attaches run on."""

    def __init__(self, path: str, sessions: SessionManager, metrics: Metrics, limits: PeerLimits = PeerLimits(),
                 mode: int = 0o660) -> None:
        self.path = path
        self._sessions = sessions
        self._listener = SeqpacketListener(path, mode, "handoff", self, limits, first_bytes=MESSAGE_BYTES,
                                           on_refused=metrics.local_connection_refused)
        self._workers = ThreadPoolExecutor(ATTACH_WORKERS, thread_name_prefix="kvtier-attach")

    def start(self) -> None:
        self._listener.start()

    def stop(self) -> None:
        self._listener.stop()
        self._workers.shutdown(wait=True)

    def serve(self, connection: Connection) -> None:
        self._workers.submit(self._serve, connection)

    def refusal(self, reason: Refusal, message: str) -> bytes:
        code = "DEADLINE_EXCEEDED" if reason is Refusal.DEADLINE else "UNAVAILABLE"
        return json.dumps({"ok": False, "code": code, "message": message}).encode()

    def _serve(self, connection: Connection) -> None:
        try:
            with connection:
                connection.sock.settimeout(REPLY_TIMEOUT_S)
                try:
                    reply, fds = self._attach(connection.first, connection.process)
                except KVTierError as exc:
                    reply, fds = {"ok": False, "code": exc.code, "message": str(exc)}, []
                _send(connection.sock, reply, fds)
        except OSError as exc:
            log.info("attach connection failed", extra={"reason": str(exc)})
        except Exception:
            log.exception("internal error while attaching a session")

    def _attach(self, data: bytes, process: Process) -> tuple[dict, list[int]]:
        """The reply and the descriptors it carries (owned by the arenas: never closed here)."""
        try:
            request = json.loads(data)
            session_id, token = request["session_id"], request.get("token")
            if not isinstance(session_id, str) or not (token is None or isinstance(token, str)):
                raise TypeError
        except (ValueError, TypeError, KeyError):
            raise InvalidArgument('an attach request is {"session_id": "...", "token": "..." or null}') from None
        session = self._sessions.attach(session_id, process, token)
        if "device_slots" in request:  # the attached process asks for its namespace's device memory
            return map_device(session.pool, session.namespace, request["device_slots"])
        host = session.pool.host
        device, device_fds = attach_device(session.pool, session.namespace)
        reply = {"ok": True, "session_key": session.key, "arena_bytes": host.size, **device}
        return reply, [host.file_for(session.namespace), *device_fds]


def _send(sock: socket.socket, reply: dict, fds: Sequence[int]) -> None:
    """The reply, with `fds` as SCM_RIGHTS descriptors (any number) when there are any."""
    data = json.dumps(reply).encode()
    if fds:
        sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sock.sendall(data)
