"""A Unix SOCK_SEQPACKET listening socket with its accept thread: what the handoff socket and
the fast lane share (kvtier.server.handoff, kvtier.server.lane)."""
from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable


class SeqpacketListener:
    """Binds `path` (replacing a stale file: the daemon holds the socket path's claim) with
    `mode`, and hands every accepted connection to `on_connection` on the accept thread."""

    def __init__(self, path: str, mode: int, name: str, on_connection: Callable[[socket.socket], None],
                 backlog: int = 128) -> None:
        self.path = path
        self._mode = mode
        self._name = name
        self._on_connection = on_connection
        self._backlog = backlog
        self._socket: socket.socket | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        listener.bind(self.path)
        os.chmod(self.path, self._mode)
        listener.listen(self._backlog)
        self._socket = listener
        self._thread = threading.Thread(target=self._accept, name=self._name, daemon=True)
        self._thread.start()

    def stop(self) -> bool:
        """Stop accepting and remove the socket file; False if it was not started."""
        if self._socket is None:
            return False
        self._socket.shutdown(socket.SHUT_RDWR)  # wakes accept()
        self._socket.close()
        self._thread.join()
        self._socket = None
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        return True

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._socket.accept()
            except OSError:
                return  # stopped
            self._on_connection(conn)
