"""The arena keeper: a small process that holds the daemon's memory file descriptors
(memfds: the host arenas, one per namespace and layout, and their slot tables) so that
they outlive a daemon crash, and hands them to the next daemon (warm restart).

A memfd has no path: it lives while some process holds a descriptor. The daemon gives
each one to the keeper as it creates it (`keep`), and takes them all back when it starts
(`take_all`). A clean stop ends the keeper (`close(keep=False)`); a crash leaves it
holding the arenas for `linger` seconds, waiting for a successor, then it exits and the
memory is freed. So no file system path names a tenant's memory, and a crash still keeps
the host tier.

    daemon --- SOCK_SEQPACKET, <cache_dir>/.kvtier-keeper-<id>.sock (mode 0600, peer uid
               checked; in the daemon's private directory, never the socket volume) --- keeper
      {"op": "keep", "name", "meta"} + fd      hold it (replacing one of that name)
      {"op": "drop", "name"}                   close it
      {"op": "list"}  -> one {"name", "meta"} + fd per entry, then {"end": true}
      {"op": "exit"}                           close all and exit

The keeper serves one daemon at a time. Like the daemon, it trusts its own uid and root:
a process of the daemon's user can take every namespace's memory (docs/security.md).
"""
from __future__ import annotations

import array
import hashlib
import json
import logging
import os
import select
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

_MESSAGE_BYTES = 64 * 1024
#: How long a starting daemon waits for a keeper it spawned to listen.
_START_TIMEOUT = 10.0


def keeper_path(cache_dir: str, socket_path: str) -> str:
    """The keeper of the daemon serving `socket_path`: in its cache directory, which engines
    never see (unlike the socket's directory, often a volume shared with them)."""
    tag = hashlib.sha256(socket_path.encode()).hexdigest()[:8]
    return os.path.join(cache_dir, f".kvtier-keeper-{tag}.sock")


@contextmanager
def socket_address(path: str) -> Iterator[str]:
    """A name for `path` that fits a Unix socket address (107 bytes) however deep its
    directory: /proc/self/fd/<the directory's descriptor>/<file name>."""
    directory = os.open(os.path.dirname(path) or ".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{directory}/{os.path.basename(path)}"
    finally:
        os.close(directory)


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket, from the kernel."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", raw)


def _send(sock: socket.socket, message: dict, fd: int | None = None) -> None:
    data = json.dumps(message).encode()
    if fd is None:
        sock.sendmsg([data])
    else:
        sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])


def _receive(sock: socket.socket) -> tuple[dict | None, int | None]:
    """One message and the descriptor it carries (None: none); (None, None) at end of stream."""
    data, fds, _, _ = socket.recv_fds(sock, _MESSAGE_BYTES, 1)
    if not data:
        for fd in fds:
            os.close(fd)
        return None, None
    return json.loads(data), (fds[0] if fds else None)


@dataclass
class KeptFile:
    """A descriptor the keeper held for us, with what the daemon said it was."""

    name: str
    meta: dict
    fd: int


class KeeperClient:
    """The daemon's connection to its keeper (one per daemon)."""

    def __init__(self, sock: socket.socket, process: subprocess.Popen | None) -> None:
        self._sock = sock
        self._process = process  # ours to reap when we spawned it

    @classmethod
    def connect_or_start(cls, path: str, linger: float) -> "KeeperClient":
        """Connect to the keeper left by a previous daemon of this socket path, or start one.
        The caller holds the socket's claim (kvtier.server.startup), so no other daemon
        competes for it."""
        found = cls.connect(path)
        if found is not None:
            log.info("arena keeper found: a previous daemon's host arenas may be adopted", extra={"keeper": path})
            return found
        try:
            os.unlink(path)  # a dead keeper's socket file
        except FileNotFoundError:
            pass
        process = subprocess.Popen(
            [sys.executable, "-m", "kvtier.mechanism.keeper", path, repr(float(linger))],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True, close_fds=True,
        )
        deadline = time.monotonic() + _START_TIMEOUT
        while time.monotonic() < deadline:
            sock = cls._connect(path)
            if sock is not None:
                return cls(sock, process)
            if process.poll() is not None:
                break
            time.sleep(0.01)
        process.kill()
        process.wait()
        raise RuntimeError(f"arena keeper did not start at {path} (exit code {process.returncode}); see its stderr")

    @classmethod
    def connect(cls, path: str) -> "KeeperClient | None":
        """The keeper listening at `path`, or None when there is none."""
        sock = cls._connect(path)
        return cls(sock, None) if sock is not None else None

    @staticmethod
    def _connect(path: str) -> socket.socket | None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            with socket_address(path) as address:
                sock.connect(address)
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
            return None
        _, uid, _ = peer_credentials(sock)
        if uid not in (os.getuid(), 0):
            sock.close()
            raise RuntimeError(f"{path} is served by uid {uid}, not by us: refusing to hand it memory")
        return sock

    def take_all(self) -> list[KeptFile]:
        """Every descriptor the keeper holds (duplicates: it keeps holding them)."""
        _send(self._sock, {"op": "list"})
        kept = []
        while True:
            message, fd = _receive(self._sock)
            if message is None:
                raise RuntimeError("arena keeper closed the connection while listing")
            if message.get("end"):
                return kept
            kept.append(KeptFile(message["name"], message["meta"], fd))

    def keep(self, name: str, fd: int, meta: dict) -> None:
        _send(self._sock, {"op": "keep", "name": name, "meta": meta}, fd)

    def drop(self, name: str) -> None:
        _send(self._sock, {"op": "drop", "name": name})

    def close(self, *, keep: bool) -> None:
        """keep=False: the keeper frees everything and exits; keep=True: it holds the arenas
        for the next daemon (a stop cut short), as after a crash."""
        try:
            if not keep:
                _send(self._sock, {"op": "exit"})
                self._sock.recv(1)  # the keeper closes its end once everything is freed
        except OSError:
            pass  # it is gone already
        self._sock.close()
        if self._process is not None and not keep:
            self._process.wait(timeout=_START_TIMEOUT)


# -- the keeper process ---------------------------------------------------------------
@dataclass
class _Keeper:
    path: str
    linger: float
    files: dict[str, tuple[dict, int]] = field(default_factory=dict)

    def serve(self) -> None:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        old = os.umask(0o177)
        try:
            with socket_address(self.path) as address:
                listener.bind(address)  # mode 0600: only our uid (and root) may connect
        finally:
            os.umask(old)
        listener.listen(1)
        served = False
        try:
            while True:
                if served and not self.files:
                    return  # the daemon went, leaving nothing to keep
                ready, _, _ = select.select([listener], [], [], self.linger if served else _START_TIMEOUT)
                if not ready:
                    log.warning("no daemon came back for %.0f s: freeing %d kept files", self.linger, len(self.files))
                    return
                conn, _ = listener.accept()
                with conn:
                    _, uid, _ = peer_credentials(conn)
                    if uid not in (os.getuid(), 0):
                        continue
                    served = True
                    if self._serve_daemon(conn):
                        return
        finally:
            for _, fd in self.files.values():
                os.close(fd)
            self.files.clear()
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            listener.close()

    def _serve_daemon(self, conn: socket.socket) -> bool:
        """Serve one daemon until it disconnects (False) or says exit (True)."""
        while True:
            try:
                message, fd = _receive(conn)
            except (OSError, ValueError):
                return False
            if message is None:
                return False
            op = message.get("op")
            if op == "keep" and fd is not None:
                old = self.files.pop(message["name"], None)
                if old is not None:
                    os.close(old[1])
                self.files[message["name"]] = (message.get("meta", {}), fd)
            elif op == "drop":
                old = self.files.pop(message["name"], None)
                if old is not None:
                    os.close(old[1])
            elif op == "list":
                for name, (meta, kept) in self.files.items():
                    _send(conn, {"name": name, "meta": meta}, kept)
                _send(conn, {"end": True})
            elif op == "exit":
                for _, kept in self.files.values():
                    os.close(kept)
                self.files.clear()
                return True
            elif fd is not None:
                os.close(fd)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m kvtier.mechanism.keeper SOCKET_PATH LINGER_SECONDS", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="kvtier keeper: %(message)s")
    _Keeper(argv[0], float(argv[1])).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
