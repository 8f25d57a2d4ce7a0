"""Connecting to one of the daemon's local SOCK_SEQPACKET sockets (the handoff socket, the
fast lane) under a timeout that covers the connect itself."""
from __future__ import annotations

import socket
import struct


def connect(sock: socket.socket, path: str, timeout: float) -> None:
    """Connect `sock` to `path`, waiting up to `timeout` for room in the daemon's listen
    backlog, then leave `timeout` on the socket for what follows.

    A Unix connect under settimeout() is non-blocking and fails at once (EAGAIN) while the
    backlog is full, however briefly: a peer flooding the socket with connections would
    refuse everyone else. A blocking connect waits instead, bounded by SO_SNDTIMEO."""
    seconds = int(timeout)
    sock.settimeout(None)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", seconds, int((timeout - seconds) * 1e6)))
    try:
        sock.connect(path)
    except BlockingIOError:
        raise TimeoutError(f"the daemon's socket {path} accepted no connection within {timeout:g}s") from None
    sock.settimeout(timeout)  # non-blocking from here on: SO_SNDTIMEO no longer applies
