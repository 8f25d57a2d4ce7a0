"""A throwaway `kvtier serve` child process: for `kvtier demo` and the benchmarks that need
a real daemon. Private socket (in a short directory of its own: a Unix socket path holds
about 100 bytes), cache dir and arena prefix; none of the caller's KVTIER_* variables (the
child's defaults are its arguments); its log in a file for when something goes wrong.

`python_module` is how every `python -m kvtier...` child is started: with the installed
kvtier, never a `kvtier/` folder in the caller's working directory. The daemon child also
runs in its own socket directory, so that neither it nor the children it starts (the arena
keeper) see the caller's working directory.
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

#: Python >= 3.11 has -P: no working directory (nor script directory) on the child's sys.path.
SAFE_PATH = sys.version_info >= (3, 11)


def python_module(module: str, *args: str, safe_path: bool = SAFE_PATH) -> list[str]:
    """The argv of `python -m MODULE ARGS...` in this interpreter, for a child that must import
    the installed kvtier even when started from a directory holding a `kvtier/` folder (which
    `-m` would put first on sys.path): with -P on Python >= 3.11. Python 3.10 has no -P, so
    there (`safe_path` false) start the child with a cwd of its own, one without a `kvtier/`
    (Popen's cwd=, e.g. a fresh temporary or the cache directory), and give it absolute paths."""
    return [sys.executable, *(["-P"] if safe_path else []), "-m", module, *args]


class ChildDaemonError(RuntimeError):
    """The child did not start serving, or did not stop when asked."""


class ChildDaemon:
    def __init__(self, workdir: str | os.PathLike, *, host_size: str | int, disk_size: str | int,
                 arena_prefix: str, extra: Sequence[str] = (), safe_path: bool = SAFE_PATH) -> None:
        self.workdir = Path(workdir).absolute()  # absolute: the child runs in self.sockdir
        self.sockdir = tempfile.mkdtemp(prefix="kvtier-child-")
        self.socket = os.path.join(self.sockdir, "kvtier.sock")
        self.cache_dir = str(self.workdir / "cache")
        self.log_path = self.workdir / "daemon.log"
        args = python_module(
            "kvtier", "serve", "--socket", self.socket, "--cache-dir", self.cache_dir,
            "--host-size", str(host_size), "--disk-size", str(disk_size), "--arena-prefix", arena_prefix,
            "--log-format", "text", *extra, safe_path=safe_path,
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
        try:
            with open(self.log_path, "wb") as log:
                # cwd: the fresh socket directory, with no kvtier/ (what keeps a Python 3.10 child,
                # without -P, and the keeper the daemon starts, off the caller's directory).
                self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.sockdir)
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
