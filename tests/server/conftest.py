"""Fixtures for the end-to-end daemon tests: real `kvtier serve` subprocesses, stopped at
teardown even when a test fails, and real gRPC channels, closed at teardown."""
from __future__ import annotations

import signal
import subprocess
import tempfile
from pathlib import Path

import pytest
from daemon import Daemon, keeper_socket, start_daemon, stop_keeper
from event_subscriber import Sub
from rpc import Conn, serve


class Daemons:
    """Starts daemons under a base directory and stops all of them at teardown.

    A daemon that exits 0 on SIGTERM must have ended its arena keeper (freeing the host
    memory); the keeper of a daemon a test killed on purpose is ended quietly.
    """

    def __init__(self, base: Path) -> None:
        self.base = base
        self.started: list[Daemon] = []
        self.children: list[subprocess.Popen] = []

    def _dir(self, name: str) -> Path:
        path = self.base / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def start(self, *args: str, name: str = "d", host_size: str = "1MiB", disk_size: str = "4MiB",
              env: dict | None = None) -> Daemon:
        """tests/daemon.py's start_daemon under base/name (small tiers by default)."""
        daemon = start_daemon(self._dir(name), *args, host_size=host_size, disk_size=disk_size, env=env)
        self.started.append(daemon)
        return daemon

    def serve(self, *args: str, name: str = "d", env: dict | None = None) -> Daemon:
        """rpc.serve: exactly these flags (for config precedence)."""
        daemon = serve(self._dir(name), *args, env=env)
        self.started.append(daemon)
        return daemon

    def child(self, proc: subprocess.Popen) -> subprocess.Popen:
        """A helper process (a client) to kill at teardown."""
        self.children.append(proc)
        return proc

    def stop_all(self) -> None:
        errors = []
        for proc in self.children:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        codes = []
        for daemon in self.started:
            try:
                codes.append(daemon.stop(signal.SIGTERM))
            except AssertionError as exc:
                errors.append(str(exc))
                codes.append(None)
        # Only once all are down: a restarted daemon takes over a killed one's keeper.
        for daemon, code in zip(self.started, codes):
            if stop_keeper(daemon) and code == 0:
                errors.append(f"daemon exited 0 but left its arena keeper running at {keeper_socket(daemon)}")
        assert not errors, "\n".join(errors)


@pytest.fixture
def daemons(tmp_path: Path):
    started = Daemons(tmp_path)
    yield started
    started.stop_all()


@pytest.fixture(scope="module")
def module_daemons(tmp_path_factory: pytest.TempPathFactory):
    """For a daemon shared by the tests of one module (those that do not interfere)."""
    started = Daemons(tmp_path_factory.mktemp("m"))
    yield started
    started.stop_all()


@pytest.fixture
def connect():
    """connect(target, token=..., credentials=...) -> Conn; sessions closed and channels shut at teardown."""
    opened: list[Conn] = []

    def factory(target: str, **kwargs) -> Conn:
        conn = Conn(target, **kwargs)
        opened.append(conn)
        return conn

    yield factory
    for conn in reversed(opened):
        conn.close()


@pytest.fixture
def events_endpoint():
    """A ZMQ endpoint for a daemon's KV events to bind."""
    with tempfile.TemporaryDirectory(dir="/tmp") as directory:  # an ipc:// path must be short
        yield f"ipc://{directory}/events"


@pytest.fixture
def subs():
    """subs(Kind, endpoint) opens a Sub (or subclass); all are closed at teardown."""
    opened: list[Sub] = []

    def open_(kind: type[Sub], endpoint: str) -> Sub:
        opened.append(kind(endpoint))
        return opened[-1]

    yield open_
    for sub in opened:
        sub.close()
