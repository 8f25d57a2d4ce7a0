"""LMCache's server: `lmcache_server 127.0.0.1 PORT cpu` from LMCache's own venv, driven
through LMCache's storage API as its `lm://` remote backend does, by kvtier_bench/lmcache_driver.py
run with that venv's Python (LMCache pins numpy and protobuf versions kvtier cannot share a
venv with). The driver times put and get itself and checks the bytes it gets back.
"""
from __future__ import annotations

import json
import os
import select
import subprocess
from importlib import metadata
from pathlib import Path

from kvtier_bench.peers.base import SETUP_HINT, Context, Servers, Unavailable
from kvtier_bench.services import Service, free_port

#: The driver, a file run by the LMCache venv's Python (it imports nothing from kvtier).
DRIVER = Path(__file__).resolve().parents[1] / "lmcache_driver.py"


class LMCacheServer:
    """`lmcache_server 127.0.0.1 PORT cpu` (every page size's driver writes the same keys, so
    the server holds at most one size's pages)."""

    def __init__(self, servers: Servers, venv: Path) -> None:
        server = venv / "bin" / "lmcache_server"
        if not (venv / "bin" / "python").exists() or not server.exists():
            raise Unavailable(f"LMCache is not installed in {venv} ({SETUP_HINT})")
        workdir = servers.root / "lmcache"
        workdir.mkdir()
        self.port = free_port()
        self.service = Service("lmcache_server", [str(server), "127.0.0.1", str(self.port), "cpu"],
                               workdir / "server.log", env=dict(os.environ, LMCACHE_TRACK_USAGE="false"),
                               cwd=str(workdir))
        self.service.wait_port(self.port, timeout=120)

    def close(self) -> None:
        self.service.stop()


class LMCacheStore:
    """The driver in LMCache's venv `venv`, talking to the one LMCacheServer of the run."""

    def __init__(self, ctx: Context, venv: Path) -> None:
        python = venv / "bin" / "python"
        server = ctx.servers.get("lmcache", lambda servers: LMCacheServer(servers, venv))
        self.ctx = ctx
        workdir = ctx.workdir / "lmcache"
        workdir.mkdir()
        env = dict(os.environ, LMCACHE_TRACK_USAGE="false")
        port = server.port
        self.driver: subprocess.Popen | None = None
        try:
            args = {"host": "127.0.0.1", "port": port, "page_bytes": ctx.page_bytes, "pages": ctx.pages,
                    "batch": ctx.batch}
            self.driver_log = open(workdir / "driver.log", "wb")  # noqa: SIM115 - the driver's stderr while it lives
            self.driver = subprocess.Popen(
                [str(python), str(DRIVER), json.dumps(args)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.driver_log, env=env, cwd=str(workdir),
            )
            self._reply(timeout=180)  # {"ready": true, ...}
        except BaseException:
            self.close()
            raise

    def _reply(self, timeout: float = 600) -> dict:
        assert self.driver is not None and self.driver.stdout is not None
        ready, _, _ = select.select([self.driver.stdout], [], [], timeout)
        line = self.driver.stdout.readline() if ready else b""
        if not line:
            self.driver.kill()
            log = Path(self.driver_log.name).read_text(errors="replace").strip().splitlines()[-3:]
            raise RuntimeError(f"the LMCache driver stopped answering: {' | '.join(log) or 'no output'}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply

    def _command(self, command: str) -> float:
        assert self.driver is not None and self.driver.stdin is not None
        self.driver.stdin.write(f"{command}\n".encode())
        self.driver.stdin.flush()
        return self._reply()["seconds"]

    def prepare(self, rep: int) -> None:
        pass  # the driver writes the same keys every time; the server overwrites them

    #: Gets land in the driver's process, which checks the bytes itself.
    landing = None

    def put(self, rep: int) -> float:
        return self._command("put")

    def get(self, rep: int) -> float:
        return self._command("get")

    def close(self) -> None:
        if self.driver is not None and self.driver.poll() is None:
            try:
                self.driver.stdin.write(b"quit\n")
                self.driver.stdin.flush()
                self.driver.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.driver.kill()
                self.driver.wait()
        if hasattr(self, "driver_log"):
            self.driver_log.close()


def version(venv: Path) -> str | None:
    """The version of LMCache installed in `venv` (read from its metadata, nothing run)."""
    paths = [str(p) for p in venv.glob("lib/python*/site-packages")]
    found = next(iter(metadata.distributions(name="lmcache", path=paths)), None) if paths else None
    return found.version if found else None
