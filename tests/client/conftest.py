"""Fixtures for the client's end-to-end tests: real `kvtier serve` processes over real
sockets and real shared memory files (tests/daemon.py), and clients closed at teardown.

Every daemon started here is stopped at teardown, even when the test fails.
"""
from __future__ import annotations

import pytest
from daemon import Daemon, start_daemon, stop_all
from kvtier_client import KVTierClient


@pytest.fixture(scope="module")
def daemon(tmp_path_factory) -> Daemon:
    """One daemon shared by a module's tests (each test uses its own namespace or layout)."""
    d = start_daemon(tmp_path_factory.mktemp("kvd"))
    try:
        yield d
    finally:
        problems = stop_all([d])
        assert not problems, "\n".join(problems)


@pytest.fixture
def daemons(tmp_path):
    """`daemons(*serve_args, path=tmp_path)` starts a daemon of the test's own; all are stopped
    at teardown. The same `path` means the same socket and cache dir (a restart)."""
    started: list[Daemon] = []

    def start(*args: str, path=None, **kwargs) -> Daemon:
        d = start_daemon(path or tmp_path, *args, **kwargs)
        started.append(d)
        return d

    start.started = started
    try:
        yield start
    finally:
        problems = stop_all(started)
        assert not problems, "\n".join(problems)


@pytest.fixture(params=["lane", "grpc"])
def transport(request) -> str:
    """Every client test runs on both transports: the fast lane, and gRPC alone."""
    return request.param


@pytest.fixture
def clients(transport):
    """`clients(target, **kwargs)` makes a KVTierClient on the test's transport, closed at
    teardown. A same-host client meant for the lane must really have used it."""
    made: list[KVTierClient] = []

    def make(target: str, **kwargs) -> KVTierClient:
        kwargs.setdefault("lane", transport == "lane")
        client = KVTierClient(target, **kwargs)
        made.append(client)
        return client

    try:
        yield make
        for client in made:
            session = client._session
            if session is not None and client.target.startswith("unix:") and client.map_arena and client.lane:
                assert client.transport == "lane", "a same-host client fell back to gRPC; the daemon log says why"
    finally:
        for client in made:
            client.close()


@pytest.fixture
def namespace(request) -> str:
    """A namespace of the test's own, so tests sharing a daemon never see each other's keys."""
    return f"test/{request.node.name}".replace("[", "-").replace("]", "")
