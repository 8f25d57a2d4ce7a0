"""The standalone arena keeper (`kvtier keeper`, kvtier/keeper_cli.py) as a real process:
it answers its probe, refuses `exit` (only SIGTERM ends it), frees everything on a daemon's
`clear` and stays for the next daemon, refuses to start where another keeper answers and
takes over the socket a killed one left. The daemon-level behaviour (kill -9, clean stop,
window) is tests/server/test_warm_restart_standalone.py.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from kvtier.mechanism.keeper import (
    KeeperClient,
    KeeperStatus,
    keeper_status,
    socket_address,
)

KEEPER_CLI = [sys.executable, "-P", "-m", "kvtier.keeper_cli"]


def start(path: str) -> subprocess.Popen:
    proc = subprocess.Popen([*KEEPER_CLI, "--socket", path, "--window", "60s"], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 10
    while keeper_status(path) is None:
        assert proc.poll() is None and time.monotonic() < deadline, "the keeper did not listen"
        time.sleep(0.02)
    return proc


def stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(10)


@pytest.fixture
def path(tmp_path):
    return str(tmp_path / "keeper" / "keeper.sock")


def ask(path: str, payload: bytes) -> list[dict]:
    """Every message the keeper answers `payload` with, until it hangs up."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(5)
        with socket_address(path) as address:
            sock.connect(address)
        sock.send(payload)
        got = []
        while data := sock.recv(65536):
            got.append(json.loads(data))
        return got


def test_exit_is_refused_and_only_sigterm_ends_it(path):
    proc = start(path)
    assert ask(path, b'{"op": "exit"}') == [{"error": "a standalone keeper ends on SIGTERM, not on request "
                                                      "(clear frees what it keeps)"}]
    assert ask(path, b'{"op": "status"}') == [{"files": 0, "held": False}]
    assert proc.poll() is None
    assert stop(proc) == 0
    assert not os.path.exists(path)
    assert "signalled: freeing 0 kept files and exiting" in proc.stderr.read()


def test_a_daemons_clear_frees_everything_and_the_keeper_waits_for_the_next(path):
    proc = start(path)
    try:
        client = KeeperClient.connect_external(path, "/run/kvtier/kvtier.sock")
        assert client is not None
        for i in range(3):
            fd = os.memfd_create(f"kept-{i}", os.MFD_CLOEXEC)
            client.keep(f"layout/ns/{i}", fd, {})
            os.close(fd)
        deadline = time.monotonic() + 5
        while keeper_status(path) != KeeperStatus(files=3, held=True):
            assert time.monotonic() < deadline, keeper_status(path)
            time.sleep(0.01)
        client.close(keep=False)  # a clean stop: returns once the keeper has freed everything
        assert keeper_status(path) == KeeperStatus(files=0, held=False)
        memfds = [os.readlink(f"/proc/{proc.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{proc.pid}/fd")]
        assert not [m for m in memfds if m.startswith("/memfd:")]
        successor = KeeperClient.connect_external(path, "/run/kvtier/kvtier.sock")
        assert successor is not None and successor.take_all() == []
        successor.close(keep=False)
        assert proc.poll() is None
    finally:
        assert stop(proc) == 0


def test_one_keeper_per_socket_and_a_killed_ones_socket_is_taken_over(path):
    first = start(path)
    second = subprocess.run([*KEEPER_CLI, "--socket", path], check=False, capture_output=True, text=True, timeout=30)
    assert second.returncode == 1 and f"another arena keeper serves {path}" in second.stderr
    first.kill()
    first.wait()
    assert os.path.exists(path)  # a SIGKILL leaves the socket file
    third = start(path)
    assert stop(third) == 0
