"""The handoff socket: where a same-host client attaches its session and receives its
namespace's host arena as a file descriptor, and the session key.

Register (gRPC) cannot say which process is calling; this socket can: the kernel gives
the connecting process's pid, uid and gid (SO_PEERCRED). The first process to attach a
session owns it (kvtier.server.sessions.SessionManager.attach), and only it gets the key
that every later call of the session must carry. The arena travels as an SCM_RIGHTS
descriptor of a memfd, so no path anywhere names it. Protocol: kvtier_client.handoff.
"""
from __future__ import annotations

import array
import json
import logging
import socket
import threading

from kvtier_client.errors import InvalidArgument, KVTierError
from kvtier_client.handoff import MESSAGE_BYTES

from kvtier.mechanism.keeper import peer_credentials
from kvtier.server.device_handoff import attach_device, map_device
from kvtier.server.listener import SeqpacketListener
from kvtier.server.sessions import Process, SessionManager

log = logging.getLogger(__name__)

#: A client that connects and says nothing is dropped after this long.
ATTACH_TIMEOUT_S = 5.0
#: Attaches served at once; more wait in the listen backlog.
MAX_ATTACHING = 16


def handoff_path(socket_path: str) -> str:
    return f"{socket_path}.handoff"


class Handoff:
    """The listening socket and its accept thread; one short-lived thread per attach."""

    def __init__(self, path: str, sessions: SessionManager, mode: int = 0o660) -> None:
        self.path = path
        self._sessions = sessions
        self._listener = SeqpacketListener(path, mode, "kvtier-handoff", self._accept, backlog=64)
        self._slots = threading.BoundedSemaphore(MAX_ATTACHING)

    def start(self) -> None:
        self._listener.start()

    def stop(self) -> None:
        self._listener.stop()

    def _accept(self, conn: socket.socket) -> None:
        self._slots.acquire()
        threading.Thread(target=self._serve, args=(conn,), name="kvtier-attach", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn:
                conn.settimeout(ATTACH_TIMEOUT_S)
                process = Process(*peer_credentials(conn))
                try:
                    reply, fds = self._attach(conn.recv(MESSAGE_BYTES), process)
                except KVTierError as exc:
                    reply, fds = {"ok": False, "code": exc.code, "message": str(exc)}, []
                data = json.dumps(reply).encode()
                if not fds:
                    conn.sendall(data)
                else:
                    conn.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        except OSError as exc:
            log.info("attach connection failed", extra={"reason": str(exc)})
        except Exception:
            log.exception("internal error while attaching a session")
        finally:
            self._slots.release()

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
