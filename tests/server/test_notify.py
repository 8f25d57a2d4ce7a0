"""systemd's readiness protocol against a real daemon: a datagram socket bound as
$NOTIFY_SOCKET receives READY=1 once it serves, RELOADING=1 then READY=1 around a SIGHUP,
STOPPING=1 when it drains. A SIGHUP keeps open sessions (and their leases) working."""
from __future__ import annotations

import os
import signal
import socket
import uuid

import pytest
from daemon import wait_serving
from rpc import keys

TOKEN = "notify-token-5e6f7a8b9c0d1e2f3a"


class NotifySocket:
    def __init__(self, address: str, bind_to: str) -> None:
        self.address = address  # what $NOTIFY_SOCKET says
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(bind_to)
        self.sock.settimeout(15)

    def receive(self) -> dict[str, str]:
        message = self.sock.recv(4096).decode()
        return dict(line.split("=", 1) for line in message.splitlines())

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def notify_path(tmp_path):
    path = tmp_path / "notify.sock"
    if len(str(path)) >= 100:  # sun_path: fall back to a short name
        path = f"/tmp/kvtier-notify-{uuid.uuid4().hex[:8]}.sock"
    notify = NotifySocket(str(path), str(path))
    yield notify
    notify.close()
    if os.path.exists(str(path)):
        os.unlink(str(path))


def test_ready_reloading_stopping(daemons, connect, tmp_path, notify_path):
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(f'[tokens]\n"{TOKEN}" = ["a"]\n')
    d = daemons.start("--tokens-file", str(tokens), env={"NOTIFY_SOCKET": notify_path.address})
    ready = notify_path.receive()  # start_daemon returned once SERVING: READY=1 was sent by then
    assert ready["READY"] == "1" and ready["MAINPID"] == str(d.proc.pid)

    s = connect(d.target, token=TOKEN).session("a")
    cached = keys("notify", 3)
    s.put(cached)
    held = s.acquire(cached)
    writing = s.borrow(1)

    d.proc.send_signal(signal.SIGHUP)
    reloading = notify_path.receive()
    assert reloading["RELOADING"] == "1" and int(reloading["MONOTONIC_USEC"]) > 0
    assert notify_path.receive()["READY"] == "1"
    assert "reloaded the tokens file" in d.log()

    # The session, its leases and its pages survived the reload.
    assert s.heartbeat().leases == 2
    assert s.lookup(cached).hit_blocks == 3
    s.commit(writing.lease_id, keys("notify-after", 1))
    s.release(held.lease_id)
    assert s.lookup([*cached, *keys("notify-after", 1)]).hit_blocks == 4

    d.proc.send_signal(signal.SIGTERM)
    assert notify_path.receive()["STOPPING"] == "1"
    assert d.proc.wait(timeout=20) == 0


def test_abstract_notify_socket(daemons):
    name = f"kvtier-test-notify-{uuid.uuid4().hex[:8]}"
    notify = NotifySocket("@" + name, "\0" + name)
    try:
        daemons.start(env={"NOTIFY_SOCKET": notify.address})
        assert notify.receive()["READY"] == "1"
    finally:
        notify.close()


def test_no_notify_socket_is_fine(daemons, connect):
    d = daemons.start(env={"NOTIFY_SOCKET": str(daemons.base / "nobody-listens.sock")})
    wait_serving(d.target)
    assert connect(d.target).session("a").lookup(keys("x", 1)).hit_blocks == 0
    assert "sd_notify failed" in d.log()
