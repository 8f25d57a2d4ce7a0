"""A throwaway `kvtier serve` child process: for `kvtier demo` and the benchmarks that need
a real daemon. Private socket (in a short directory of its own: a Unix socket path holds
about 100 bytes), cache dir and arena prefix; none of the caller's KVTIER_* variables (the
child's defaults are its arguments); its log in a file for when something goes wrong.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


class ChildDaemonError(RuntimeError):
    """The child did not start serving, or did not stop when asked."""


class ChildDaemon:
    def __init__(self, workdir: str | os.PathLike, *, host_size: str | int, disk_size: str | int,
                 arena_prefix: str, extra: Sequence[str] = ()) -> None:
        self.workdir = Path(workdir)
        self.sockdir = tempfile.mkdtemp(prefix="kvtier-child-")
        self.socket = os.path.join(self.sockdir, "kvtier.sock")
        self.cache_dir = str(self.workdir / "cache")
        self.log_path = self.workdir / "daemon.log"
        args = [
            sys.executable, "-m", "kvtier", "serve", "--socket", self.socket, "--cache-dir", self.cache_dir,
            "--host-size", str(host_size), "--disk-size", str(disk_size), "--arena-prefix", arena_prefix,
            "--log-format", "text", *extra,
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
        try:
            with open(self.log_path, "wb") as log:
                self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
        except BaseException:
            shutil.rmtree(self.sockdir, ignore_errors=True)
            raise

    @property
    def target(self) -> str:
        return f"unix://{self.socket}"

    def log_tail(self, lines: int = 20) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_serving(self, timeout: float = 30.0) -> None:
        """Block until gRPC health says SERVING; fail at once if the process exits."""
        deadline = time.monotonic() + timeout
        channel = grpc.insecure_channel(self.target)
        try:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                if self.proc.poll() is not None:
                    raise ChildDaemonError(f"daemon exited with code {self.proc.returncode} before serving:\n{self.log_tail()}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ChildDaemonError(f"daemon not serving after {timeout:g}s:\n{self.log_tail()}")
                try:
                    # wait_for_ready: block on the connection instead of spinning on refusals.
                    reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=min(0.5, remaining), wait_for_ready=True)
                except grpc.RpcError as exc:
                    if exc.code() not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):
                        raise
                    continue
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                try:
                    self.proc.wait(0.1)  # up but not yet serving; doubles as the exit check
                except subprocess.TimeoutExpired:
                    pass
        finally:
            channel.close()

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM and wait (SIGKILL and ChildDaemonError if it does not stop in time);
        returns the exit code. Removes the socket directory either way."""
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
                    raise ChildDaemonError(f"daemon ignored SIGTERM for {timeout:g}s and was killed:\n{self.log_tail()}") from None
            return self.proc.returncode
        finally:
            shutil.rmtree(self.sockdir, ignore_errors=True)
