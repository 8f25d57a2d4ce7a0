"""Warm restart with a standalone arena keeper (`kvtier keeper`, as the kvtier-keeper
container of a Kubernetes pod runs it) and daemons using it through `--keeper-socket`: real
processes, real sockets. The keeper outlives every daemon: after a kill -9 the next daemon
adopts the host pages (bytes equal); after a clean stop it finds none (nothing stale); after
the window the keeper frees what it kept and waits on; a daemon of another socket never gets
another daemon's pages; with no keeper listening a daemon starts cold and says what to check.

Why these cannot be flaky: every kill is a SIGKILL the test sends and waits for; page checks
are exact (every page, its bytes); the one wait on the keeper's clock (its window) polls its
status for up to 10 s where the window is 1 s.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from daemon import wait_serving
from rpc import Arena, keys, page, wait_for

from kvtier.mechanism.keeper import KeeperStatus, keeper_path, keeper_status

KEEPER_CLI = [sys.executable, "-P", "-m", "kvtier.keeper_cli"]


class StandaloneKeeper:
    """`kvtier keeper` in a process of its own, as its sidecar container runs it."""

    def __init__(self, directory: Path, window: str) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / "keeper.sock"
        self.log_path = directory / "keeper.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([*KEEPER_CLI, "--socket", str(self.path), "--window", window],
                                         stdout=log, stderr=subprocess.STDOUT)
        wait_for(lambda: self.proc.poll() is not None or keeper_status(str(self.path)), 10, "the keeper to listen")
        assert self.proc.poll() is None, self.log()

    def status(self) -> KeeperStatus:
        status = keeper_status(str(self.path))
        assert status is not None, f"the keeper stopped answering:\n{self.log()}"
        return status

    def memory_files(self) -> int:
        """Memory files the keeper process holds open (the memory it keeps from being freed)."""
        fds = f"/proc/{self.proc.pid}/fd"
        return sum(os.readlink(f"{fds}/{fd}").startswith("/memfd:") for fd in os.listdir(fds))

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(10)
        return self.proc.returncode


@pytest.fixture
def standalone_keeper(tmp_path):
    """standalone_keeper(window) -> a running StandaloneKeeper; ended at teardown, where it
    must have run all along and end cleanly on SIGTERM."""
    started: list[StandaloneKeeper] = []

    def start(window: str) -> StandaloneKeeper:
        started.append(StandaloneKeeper(tmp_path / f"keeper-{len(started)}", window))
        return started[-1]

    yield start
    for keeper in started:
        assert keeper.proc.poll() is None, f"the keeper ended under its daemons:\n{keeper.log()}"
        assert keeper.stop() == 0, keeper.log()
        assert not keeper.path.exists(), "SIGTERM removes the keeper's socket"


def _write(session, arena: Arena, blocks: list[bytes], tag: str) -> None:
    for first in range(0, len(blocks), 50):
        batch = blocks[first:first + 50]
        lease = session.borrow(len(batch))
        for slot, key in zip(lease.slots, batch):
            arena.write(slot, page(f"{tag}:{key.hex()}"))
        session.commit(lease.lease_id, batch)


def _read(session, arena: Arena, blocks: list[bytes], tag: str) -> tuple[int, int]:
    """(how many of `blocks` are found, how many of those read back the bytes `tag` wrote)."""
    found = equal = 0
    for key in blocks:
        if session.lookup([key]).hit_blocks:
            found += 1
            read = session.acquire([key])
            equal += arena.read(read.slots[0]) == page(f"{tag}:{key.hex()}")
            session.release(read.lease_id)
    return found, equal


class Host:
    """Daemons of one socket and cache directory (`name`), each using the standalone keeper;
    a host tier only (disk 0), so every page found after a restart came from the keeper."""

    def __init__(self, daemons, connect, keeper: StandaloneKeeper, name: str = "d") -> None:
        self.daemons, self.connect, self.name = daemons, connect, name
        self.args = ("--arena-prefix", f"kvtier-test-ext-{uuid.uuid4().hex[:6]}", "--keeper-socket", str(keeper.path))

    def start(self):
        daemon = self.daemons.start(*self.args, name=self.name, host_size="8MiB", disk_size="0")
        daemon.arena_prefix = self.args[1]
        return daemon

    def session(self, daemon):
        s = self.connect(daemon.target).session("ext")
        return s, Arena.of(s)


def test_a_standalone_keeper_serves_daemon_after_daemon(daemons, connect, standalone_keeper):
    """kill -9: the next daemon adopts every page, bytes equal. Clean stop: the keeper frees
    everything and the next daemon finds nothing. Pages written again after that and a kill
    read back the new bytes. The keeper runs throughout."""
    keeper = standalone_keeper("60s")
    host = Host(daemons, connect, keeper)
    blocks = keys("ext", 400)

    first = host.start()
    s, arena = host.session(first)
    _write(s, arena, blocks, "first")
    assert keeper.status().held
    arena.close()
    assert first.stop(signal.SIGKILL) == -signal.SIGKILL
    wait_for(lambda: not keeper.status().held, 5, "the keeper to see its daemon go")
    assert keeper.status().files > 0

    second = host.start()
    s, arena = host.session(second)
    assert _read(s, arena, blocks, "first") == (len(blocks), len(blocks)), second.log()
    assert "400 pages found again" in second.log()
    arena.close()
    assert second.stop(signal.SIGTERM) == 0
    assert keeper.status() == KeeperStatus(files=0, held=False), "a clean stop leaves nothing with the keeper"
    assert keeper.memory_files() == 0

    third = host.start()
    s, arena = host.session(third)
    assert _read(s, arena, blocks, "first") == (0, 0), "nothing of a cleanly stopped daemon is served again"
    assert "adopted host arena" not in third.log()
    _write(s, arena, blocks, "third")
    arena.close()
    assert third.stop(signal.SIGKILL) == -signal.SIGKILL

    fourth = host.start()
    s, arena = host.session(fourth)
    assert _read(s, arena, blocks, "third") == (len(blocks), len(blocks)), fourth.log()
    arena.close()


def test_after_the_window_the_keeper_frees_the_files_and_waits_on(daemons, connect, standalone_keeper):
    keeper = standalone_keeper("1s")
    host = Host(daemons, connect, keeper)
    blocks = keys("window", 50)
    first = host.start()
    s, arena = host.session(first)
    _write(s, arena, blocks, "first")
    arena.close()
    assert first.stop(signal.SIGKILL) == -signal.SIGKILL
    wait_for(lambda: keeper.status().files == 0, 10, "the keeper to free the files after its 1 s window")
    assert keeper.memory_files() == 0
    assert "no daemon came back" in keeper.log()
    probe = subprocess.run([*KEEPER_CLI, "--check", "--socket", str(keeper.path)], check=False, capture_output=True,
                           text=True, timeout=30)
    assert probe.returncode == 0 and "0 files kept, no daemon holds it" in probe.stdout, probe.stdout + probe.stderr

    second = host.start()
    s, arena = host.session(second)
    assert _read(s, arena, blocks, "first") == (0, 0)
    _write(s, arena, blocks, "second")  # and the keeper keeps this daemon's files again
    arena.close()
    assert keeper.status().files > 0 and keeper.status().held


def test_a_daemon_of_another_socket_never_gets_the_pages(daemons, connect, standalone_keeper):
    """Two daemons (other sockets, other cache directories) pointed at one keeper: the
    second frees the first's files instead of adopting them, so neither the second nor the
    first's successor serves them."""
    keeper = standalone_keeper("60s")
    one, other = Host(daemons, connect, keeper, "one"), Host(daemons, connect, keeper, "other")
    other.args = one.args[:2] + other.args[2:]  # the same arena prefix and layout: only the owner tells them apart
    blocks = keys("owner", 50)
    first = one.start()
    s, arena = one.session(first)
    _write(s, arena, blocks, "one")
    arena.close()
    assert first.stop(signal.SIGKILL) == -signal.SIGKILL

    intruder = other.start()
    s, arena = other.session(intruder)
    assert _read(s, arena, blocks, "one") == (0, 0)
    arena.close()
    assert "files kept for the daemon of" in keeper.log()
    assert intruder.stop(signal.SIGTERM) == 0
    successor = one.start()
    s, arena = one.session(successor)
    assert _read(s, arena, blocks, "one") == (0, 0)
    arena.close()


def test_with_no_keeper_listening_a_daemon_starts_cold_and_says_what_to_check(daemons, tmp_path):
    absent = tmp_path / "nowhere" / "keeper.sock"
    daemon = daemons.start("--keeper-socket", str(absent))
    log = daemon.log()
    assert "no arena keeper at keeper_socket: serving without warm restart" in log
    assert f"kvtier keeper --check --socket {absent}" in log
    assert daemon.stop(signal.SIGTERM) == 0


def test_a_kvtier_folder_in_the_working_directory_does_not_shadow_the_spawned_keeper(tmp_path):
    """`kvtier serve` run where a `kvtier/` folder is (a checkout, a build directory): the
    keeper it spawns imports the installed kvtier, not that folder."""
    shadow = tmp_path / "work"
    (shadow / "kvtier" / "mechanism").mkdir(parents=True)
    for module in ("kvtier/__init__.py", "kvtier/mechanism/__init__.py", "kvtier/mechanism/keeper.py"):
        (shadow / module).write_text("raise SystemExit('imported the kvtier/ folder of the working directory')\n")
    socket, cache = tmp_path / "run" / "kvtier.sock", tmp_path / "cache"
    log = tmp_path / "daemon.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(Path(sys.executable).parent / "kvtier"), "serve", "--socket", str(socket),
                                 "--cache-dir", str(cache), "--host-size", "1MiB", "--disk-size", "0",
                                 "--arena-prefix", f"kvtier-test-shadow-{uuid.uuid4().hex[:6]}"],
                                cwd=shadow, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        wait_serving(f"unix://{socket}", proc=proc)
        assert keeper_status(keeper_path(str(cache), str(socket))) is not None, log.read_text()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0, log.read_text()
