"""The arena keeper: a small process that holds the daemon's memory file descriptors
(memfds: the host arenas, one per namespace and layout, and their slot tables) so that
they outlive a daemon crash, and hands them to the next daemon (warm restart).

A memfd has no path: it lives while some process holds a descriptor. The daemon gives
each one to the keeper as it creates it (`keep`), and takes them all back when it starts
(`take_all`). A clean stop ends the keeper (`close(keep=False)`); a crash leaves it
holding the arenas for `linger` seconds, waiting for a successor, then it exits and the
memory is freed. So no file system path names a tenant's memory, and a crash still keeps
the host tier.

Where the daemon's container restarts on a crash (Kubernetes), a keeper it spawned dies
with it; there the keeper runs standalone in a container of its own (`kvtier keeper`,
kvtier.keeper_cli) and the daemon connects to it (`connect_external`, config
`keeper_socket`). A clean stop then frees what it keeps (`clear`) and leaves it running
for the next daemon.

    daemon --- SOCK_SEQPACKET, <cache_dir>/.kvtier-keeper-<id>.sock (mode 0600, peer uid
               checked; in the daemon's private directory, never the socket volume) --- keeper
    messages: kvtier.mechanism.keeper_wire

The keeper serves any number of peers without blocking on one, checks every message, and
never lets a peer that is not a daemon hold it (kvtier.mechanism.keeper_process); the
daemon's side waits for it at most `_ANSWER_TIMEOUT` and says what to do if it must.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import struct
import subprocess
import sys
import time
from dataclasses import dataclass

from kvtier.mechanism.keeper_process import main
from kvtier.mechanism.keeper_wire import (
    KeptFile, Op, close_all, parse_entry, peer_credentials, receive, send, socket_address,
)

__all__ = ["KeeperClient", "KeeperError", "KeeperGone", "KeeperStatus", "KeptFile", "keeper_path", "keeper_status",
           "peer_credentials", "socket_address"]

log = logging.getLogger(__name__)

#: How long the daemon waits for each message of its keeper's answer, and for room to send
#: (the keeper answers within milliseconds unless it is stopped or stuck).
_ANSWER_TIMEOUT = 3.0
#: How long a starting daemon waits for a keeper it spawned to listen, or for an external
#: one (its container may be starting too) before it starts without warm restart.
_START_TIMEOUT = 10.0


#: Python >= 3.11 has -P: no working directory on the keeper's sys.path.
_SAFE_PATH = sys.version_info >= (3, 11)


def _keeper_argv(path: str, linger: float) -> list[str]:
    """`python -m kvtier.mechanism.keeper`, importing the installed kvtier even when the
    daemon runs in a directory holding a `kvtier/` folder (which `-m` would put first on
    sys.path): -P where Python has it; on 3.10 the keeper runs in / instead."""
    module = ["-m", "kvtier.mechanism.keeper", os.path.abspath(path), repr(float(linger))]
    return [sys.executable, *(["-P"] if _SAFE_PATH else []), *module]


def keeper_path(cache_dir: str, socket_path: str) -> str:
    """The keeper of the daemon serving `socket_path`: in its cache directory, which engines
    never see (unlike the socket's directory, often a volume shared with them)."""
    tag = hashlib.sha256(socket_path.encode()).hexdigest()[:8]
    return os.path.join(cache_dir, f".kvtier-keeper-{tag}.sock")


class KeeperError(RuntimeError):
    """The keeper did not answer as it should; the text says what to do."""


class KeeperGone(KeeperError):
    """The keeper hung up before its listing ended: it was ending (its window ran out, or it
    was killed) as we connected."""


@dataclass(frozen=True)
class KeeperStatus:
    """What a keeper says to a probe."""

    files: int  # memory files it keeps
    held: bool  # a daemon holds it now


def keeper_status(path: str) -> KeeperStatus | None:
    """Ask the keeper at `path` how it is (`kvtier keeper --check`); None when none listens.
    KeeperError when it does not answer within `_ANSWER_TIMEOUT`, or answers nonsense."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(_ANSWER_TIMEOUT), 0))
        sock.settimeout(_ANSWER_TIMEOUT)
        try:
            with socket_address(path) as address:
                sock.connect(address)
            send(sock, {"op": Op.STATUS.value})
            data, fds, _ = receive(sock)
        except (FileNotFoundError, ConnectionRefusedError):
            return None
        except OSError as exc:  # silent past _ANSWER_TIMEOUT, or it hung up
            raise KeeperError(f"arena keeper at {path} did not answer: {exc or type(exc).__name__}") from None
        close_all(fds)
    try:
        answer = json.loads(data)
        return KeeperStatus(int(answer["files"]), bool(answer["held"]))
    except (ValueError, TypeError, KeyError):
        raise KeeperError(f"arena keeper at {path} answered {data[:80]!r}, not its status") from None


class KeeperClient:
    """The daemon's conversation with its keeper (one per daemon), opened by `connect`: it
    holds the keeper and has taken everything it kept."""

    def __init__(self, sock: socket.socket, path: str, kept: list[KeptFile]) -> None:
        self._sock: socket.socket | None = sock
        self._path = path
        self._kept = kept
        self._process: subprocess.Popen | None = None  # ours to reap when we spawned it
        self._external = False  # a standalone keeper: a clean stop clears it, never ends it

    @classmethod
    def connect_external(cls, path: str, owner: str) -> KeeperClient | None:
        """Hold the standalone keeper at `path` (`kvtier keeper`), waiting up to
        `_START_TIMEOUT` for it to listen; None, with a warning saying what to check, when
        it does not: the daemon then serves without warm restart."""
        deadline = time.monotonic() + _START_TIMEOUT
        while True:
            try:
                client = cls.connect(path, owner, external=True)
            except KeeperGone:
                client = None  # it was stopping as we connected: a restarted one may follow
            except KeeperError as exc:
                cls._warn_cold(path, str(exc))
                return None
            if client is not None:
                client._external = True
                log.info("arena keeper connected", extra={"keeper": path, "files": len(client._kept)})
                return client
            if time.monotonic() >= deadline:
                cls._warn_cold(path, f"nothing listens there after {_START_TIMEOUT:.0f} s")
                return None
            time.sleep(0.1)

    @staticmethod
    def _warn_cold(path: str, reason: str) -> None:
        log.warning("no arena keeper at keeper_socket: serving without warm restart (a crash of this daemon loses "
                    "the host tier). Check that the keeper runs and answers (`kvtier keeper --check --socket "
                    f"{path}`; in Kubernetes the kvtier-keeper container), that this container mounts its socket's "
                    "volume, and that both run as the same uid", extra={"keeper": path, "reason": reason})

    @classmethod
    def connect_or_start(cls, path: str, linger: float, owner: str = "") -> "KeeperClient":
        """Connect to the keeper left by a previous daemon of this socket path, or start one.
        The caller holds the socket's claim (kvtier.server.startup), so no other daemon
        competes for it."""
        try:
            found = cls.connect(path, owner)
        except KeeperGone:
            found = None  # it unlinks its own socket only, so a new one may take the path
        if found is not None:
            log.info("arena keeper found: a previous daemon's host arenas may be adopted", extra={"keeper": path})
            return found
        try:
            os.unlink(path)  # a dead keeper's socket file
        except FileNotFoundError:
            pass
        process = subprocess.Popen(
            _keeper_argv(path, linger), cwd=None if _SAFE_PATH else "/",
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True, close_fds=True,
        )
        deadline = time.monotonic() + _START_TIMEOUT
        while time.monotonic() < deadline:
            client = cls.connect(path, owner)
            if client is not None:
                client._process = process
                return client
            if process.poll() is not None:
                break
            time.sleep(0.01)
        process.kill()
        process.wait()
        raise KeeperError(f"arena keeper did not start at {path} (exit code {process.returncode}); see its stderr")

    @classmethod
    def connect(cls, path: str, owner: str = "", *, external: bool = False) -> "KeeperClient | None":
        """Hold the keeper listening at `path` as the daemon `owner` (its socket path) and
        take what it keeps; None when there is none. KeeperError when it is silent for
        `_ANSWER_TIMEOUT` (its text says what to do: `external`, about a standalone one)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        # A blocking Unix connect waits for room in the keeper's backlog at most this long.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(_ANSWER_TIMEOUT), 0))
        try:
            with socket_address(path) as address:
                sock.connect(address)
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
            return None
        except BlockingIOError:
            sock.close()
            raise KeeperError(f"arena keeper at {path} has no room for another connection after "
                              f"{_ANSWER_TIMEOUT:.0f} s: {cls._remedy(path, None, external)}") from None
        pid, uid, _ = peer_credentials(sock)
        if uid not in (os.getuid(), 0):
            sock.close()
            raise KeeperError(f"{path} is served by uid {uid}, not by us: refusing to hand it memory")
        kept: list[KeptFile] = []
        try:
            cls._hold(sock, path, pid, kept, {"op": Op.LIST.value, "hold": True, "owner": owner}, external)
        except BaseException:
            close_all([f.fd for f in kept])
            sock.close()
            raise
        return cls(sock, path, kept)

    @classmethod
    def _hold(cls, sock: socket.socket, path: str, pid: int, kept: list[KeptFile], ask: dict, external: bool) -> None:
        """Ask to hold the keeper and take its listing into `kept` (each message within
        `_ANSWER_TIMEOUT`: a long listing takes as long as it moves)."""
        sock.settimeout(_ANSWER_TIMEOUT)  # also for keeps and drops: a stopped keeper is let go after this
        try:
            send(sock, ask)
            while True:
                data, fds, _ = receive(sock)
                if not data and not fds:
                    raise KeeperGone(f"arena keeper at {path} (pid {pid}) hung up while listing: it was ending "
                                     "(its warm_restart_window ran out, or it was killed); start again")
                try:
                    entry = parse_entry(data, fds)
                except ValueError as exc:
                    close_all(fds)
                    raise KeeperError(f"arena keeper at {path} (pid {pid}) gave {exc}: {cls._remedy(path, pid, external)}") from None
                if entry is None:
                    return
                kept.append(entry)
        except TimeoutError:
            raise KeeperError(f"arena keeper at {path} (pid {pid}) did not answer within {_ANSWER_TIMEOUT:.0f} s "
                              f"(stopped or stuck?): {cls._remedy(path, pid, external)}") from None
        except OSError as exc:
            raise KeeperError(f"arena keeper at {path} (pid {pid}) failed: {exc}: {cls._remedy(path, pid, external)}") from None

    @staticmethod
    def _remedy(path: str, pid: int | None, external: bool) -> str:
        if external:
            return "restart the keeper (in Kubernetes, its kvtier-keeper container)"
        who = f"kill {pid}" if pid else f"kill the process serving {path}"
        return (f"end it ({who}: the previous daemon's host pages are then lost and this start is cold) and start "
                "again, or start with warm_restart_window = 0")

    def take_all(self) -> list[KeptFile]:
        """Every descriptor the keeper held when we connected (duplicates: it keeps holding
        them), now the caller's to close. Once: later calls return nothing."""
        kept, self._kept = self._kept, []
        return kept

    def keep(self, name: str, fd: int, meta: dict) -> None:
        self._tell({"op": Op.KEEP.value, "name": name, "meta": meta}, fd)

    def drop(self, name: str) -> None:
        self._tell({"op": Op.DROP.value, "name": name})

    def _tell(self, message: dict, fd: int | None = None) -> None:
        """Keeps and drops are not answered. A keeper gone (killed, ended, or it let us go)
        costs the warm restart, not the daemon: host memory works on without it."""
        sock = self._sock  # once: another thread may lose it meanwhile
        if sock is None:
            return
        try:
            send(sock, message, fd)
        except OSError as exc:
            log.warning("arena keeper lost: host pages will not survive a crash of this daemon",
                        extra={"keeper": self._path, "reason": str(exc) or type(exc).__name__})
            self._sock = None
            sock.close()

    def close(self, *, keep: bool) -> None:
        """keep=False: the keeper frees everything and exits (a standalone one stays, for
        the next daemon); keep=True: it holds the arenas for the next daemon (a stop cut
        short), as after a crash."""
        close_all([f.fd for f in self.take_all()])
        sock, self._sock = self._sock, None
        if sock is not None:
            try:
                if not keep:
                    send(sock, {"op": (Op.CLEAR if self._external else Op.EXIT).value})
                    sock.recv(1)  # the keeper hangs up once everything is freed
            except OSError:
                pass  # it is gone already
            sock.close()
        if self._process is None:
            return
        if keep or sock is None:
            self._process.poll()  # reaped if it has gone; else it holds on for a successor
            return
        try:
            self._process.wait(timeout=_START_TIMEOUT)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
