"""Processes the benchmarks start and stop: a `kvtier serve` daemon, peer servers on
loopback.

Every process runs with its output in a log file under the benchmark's temporary
directory; a process that exits before it serves raises `ServiceError` with the end of
that log, so a peer that cannot start says why.
"""
from __future__ import annotations

import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path


class ServiceError(RuntimeError):
    """A benchmark process could not be started (the message says why)."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path: Path, lines: int = 6) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return "\n".join(text[-lines:])


class Service:
    """One subprocess with its output in `log`; `stop` ends it (SIGTERM, then SIGKILL)."""

    def __init__(self, name: str, argv: Sequence[str], log: Path, *, env: dict | None = None,
                 cwd: str | None = None) -> None:
        self.name = name
        self.argv = list(argv)
        self.log = log
        self.on_stop: list[Callable[[], None]] = []
        with open(log, "wb") as out:
            try:
                self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                             start_new_session=True)
            except OSError as exc:
                raise ServiceError(f"cannot run {self.argv[0]}: {exc}") from None

    def wait_until(self, ready: Callable[[], bool], timeout: float = 30.0, what: str = "ready") -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if self.proc.poll() is not None:
                self.stop()
                raise ServiceError(f"{self.name} exited with status {self.proc.returncode} before it was {what}: "
                                   f"{tail(self.log) or 'no output'}")
            if time.monotonic() > deadline:
                self.stop()
                raise ServiceError(f"{self.name} was not {what} after {timeout:.0f} s: {tail(self.log) or 'no output'}")
            time.sleep(0.05)

    def wait_port(self, port: int, timeout: float = 30.0) -> None:
        def listening() -> bool:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                return s.connect_ex(("127.0.0.1", port)) == 0

        self.wait_until(listening, timeout, f"listening on 127.0.0.1:{port}")

    def stop(self, timeout: float = 20.0) -> None:
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: the process and its children
            self.proc.wait()
        except ProcessLookupError:
            pass
        while self.on_stop:
            self.on_stop.pop()()

    def __enter__(self) -> Service:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


_DAEMONS = itertools.count()


def kvtier_daemon(workdir: Path, *, host_bytes: int, name: str = "kvtier", timeout: float = 30.0,
                  extra: Sequence[str] = ()) -> tuple[Service, str]:
    """`kvtier serve` on a Unix socket in `workdir` with a host tier of `host_bytes` per layout and
    no disk tier; returns the service and its target. Its arena is named kvtier-bench-<pid>-<n>-..."""
    workdir.mkdir(parents=True, exist_ok=True)
    # A Unix socket path holds at most 107 bytes: the socket goes in a short directory of its own.
    sockdir = tempfile.mkdtemp(prefix="kvtier-bench-")
    sock = Path(sockdir) / "kvtier.sock"
    argv = [
        sys.executable, "-m", "kvtier", "serve", "--socket", str(sock), "--cache-dir", str(workdir / "cache"),
        "--host-size", str(host_bytes), "--disk-size", "0", "--arena-prefix", f"kvtier-bench-{os.getpid()}-{next(_DAEMONS)}",
        "--log-level", "warning", "--log-format", "text", *extra,
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    try:
        service = Service(name, argv, workdir / f"{name}.log", env=env)
    except BaseException:
        shutil.rmtree(sockdir, ignore_errors=True)
        raise
    service.on_stop.append(lambda: shutil.rmtree(sockdir, ignore_errors=True))
    service.wait_until(sock.exists, timeout, f"serving on {sock}")
    return service, f"unix://{sock}"
