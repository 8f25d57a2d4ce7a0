"""Attaching a session over the daemon's handoff socket: the client side.

A same-host client registers over gRPC, then connects to the handoff socket the daemon
named (SOCK_SEQPACKET) and asks for its session. The kernel tells the daemon which
process is asking (SO_PEERCRED); the daemon binds the session to it and answers with the
session key and, as an SCM_RIGHTS descriptor, its namespace's host arena. Nothing else
can get either: a session id read from a log is of no use to another process.

    client -> {"session_id", "token"}
    daemon -> {"ok": true, "session_key", "arena_bytes"} + the arena's descriptor
              {"ok": false, "code", "message"}                 (a KVTierError code)
"""
from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass

from kvtier_client.errors import ERRORS_BY_CODE, KVTierError, Unavailable

MESSAGE_BYTES = 64 * 1024


@dataclass(frozen=True)
class Attachment:
    """What attaching gave: the key every call of the session carries, and the arena (the
    caller owns the descriptor)."""

    session_key: str
    arena_fd: int
    arena_bytes: int


def attach(path: str, session_id: str, token: str | None, *, timeout: float = 10.0) -> Attachment:
    """Attach `session_id` to this process; raises the daemon's KVTierError on refusal."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
            sock.sendall(json.dumps({"session_id": session_id, "token": token}).encode())
            data, fds, _, _ = socket.recv_fds(sock, MESSAGE_BYTES, 1)
        except OSError as exc:
            raise Unavailable(f"cannot attach the session at the daemon's handoff socket {path} ({exc})") from exc
    try:
        reply = json.loads(data) if data else {"ok": False, "code": "UNAVAILABLE", "message": "the daemon hung up"}
        if not reply.get("ok"):
            error = ERRORS_BY_CODE.get(reply.get("code"), KVTierError)(f"attach refused: {reply.get('message')}")
            raise error
        if len(fds) != 1:
            raise KVTierError("the daemon's attach answer carried no arena descriptor; daemon and client disagree")
        return Attachment(reply["session_key"], fds.pop(), int(reply["arena_bytes"]))
    finally:
        for fd in fds:
            os.close(fd)
