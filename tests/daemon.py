"""Start a real `kvtier serve` process for a test and stop it afterwards.

Tests talk to it over its real Unix socket (or TCP); nothing here imports the server.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import socket as sockets
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

KVTIER = [sys.executable, "-m", "kvtier"]


@dataclass
class Daemon:
    proc: subprocess.Popen
    socket: Path
    cache_dir: Path
    arena_prefix: str
    log_path: Path
    args: list[str] = field(default_factory=list)

    @property
    def target(self) -> str:
        return f"unix://{self.socket}"

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        """Signal the daemon and wait for it; returns its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"daemon did not stop within {timeout}s after {sig!r}:\n{self.log()}")
        return self.proc.returncode


def keeper_socket(daemon: "Daemon") -> Path:
    """Where the daemon's arena keeper listens (kvtier.mechanism.keeper.keeper_path)."""
    tag = hashlib.sha256(str(daemon.socket).encode()).hexdigest()[:8]
    return daemon.cache_dir / f".kvtier-keeper-{tag}.sock"


def stop_keeper(daemon: "Daemon") -> bool:
    """End the arena keeper a daemon left running (after a kill, or a stop cut short),
    freeing the host memory it held; False when there was none."""
    with sockets.socket(sockets.AF_UNIX, sockets.SOCK_SEQPACKET) as sock:
        sock.settimeout(10)
        directory = os.open(daemon.cache_dir, os.O_PATH) if daemon.cache_dir.is_dir() else -1
        try:  # by the directory's descriptor: the full path may be too long for a socket address
            sock.connect(f"/proc/self/fd/{directory}/{keeper_socket(daemon).name}")
        except (FileNotFoundError, ConnectionRefusedError):
            return False
        finally:
            if directory >= 0:
                os.close(directory)
        sock.send(json.dumps({"op": "exit"}).encode())
        sock.recv(1)  # the keeper hangs up once everything is freed
    return True


def wait_serving(target: str, timeout: float = 30.0, credentials: grpc.ChannelCredentials | None = None, proc=None) -> None:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"daemon exited with {proc.returncode} before serving")
        channel = grpc.secure_channel(target, credentials) if credentials else grpc.insecure_channel(target)
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError as exc:
            last = exc
        finally:
            channel.close()
        time.sleep(0.1)
    raise AssertionError(f"daemon at {target} not SERVING after {timeout}s: {last}")


def start_daemon(tmp_path: Path, *extra_args: str, host_size: str = "16MiB", disk_size: str = "64MiB",
                 wait: bool = True, env: dict | None = None) -> Daemon:
    """Run `python -m kvtier serve` on a socket under tmp_path with its own cache dir and arena prefix."""
    sizes = ("--cache-dir", str(tmp_path / "cache"), "--host-size", host_size, "--disk-size", disk_size)
    return launch(tmp_path, *sizes, *extra_args, wait=wait, env=env)


def launch(tmp_path: Path, *args: str, wait: bool = True, env: dict | None = None) -> Daemon:
    """`kvtier serve` with exactly `args` plus a socket under tmp_path and a unique arena
    prefix, with no KVTIER_* variables of the caller's but those in `env`."""
    socket = tmp_path / "run" / "kvtier.sock"
    prefix = f"kvtier-test-{uuid.uuid4().hex[:8]}"
    log_path = tmp_path / f"daemon-{uuid.uuid4().hex[:6]}.log"
    full = [*KVTIER, "serve", "--socket", str(socket), "--arena-prefix", prefix, *args]
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    full_env.update(env or {})
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(full, stdout=log, stderr=subprocess.STDOUT, env=full_env)
    daemon = Daemon(proc, socket, tmp_path / "cache", prefix, log_path, full)
    if wait:
        try:
            wait_serving(daemon.target, proc=proc)
        except AssertionError as exc:
            daemon.stop(signal.SIGKILL)
            raise AssertionError(f"{exc}\n--- daemon log ---\n{daemon.log()}") from None
    return daemon


def stop_all(daemons: list[Daemon]) -> list[str]:
    """Stop every daemon (SIGTERM, then SIGKILL on timeout); return problems instead of raising
    at the first, so one bad daemon never leaves the others running. Keepers are checked
    once all are down: a restarted daemon shares its predecessor's keeper."""
    problems = []
    for d in daemons:
        try:
            code = d.stop()
        except AssertionError as exc:
            problems.append(str(exc))
            continue
        if code != 0:
            problems.append(f"daemon exited with {code} after SIGTERM:\n{d.log()}")
    for d in daemons:
        if stop_keeper(d):
            problems.append(f"daemon exited 0 but left its arena keeper (and host memory) behind:\n{d.log()}")
    return problems
