"""WatchEvents streams are few (each holds one of the daemon's gRPC threads; 8 in all), so
each credential may hold only 2: one tenant opening stream after stream cannot take them all
(it used to get all 8, and every other tenant RESOURCE_EXHAUSTED). The credential is the
token; without tokens, the set of namespaces watched."""
from __future__ import annotations

import shutil
import tempfile

import pytest
from kvtier_client import KVTierClient
from kvtier_client.errors import CapacityError
from rpc import wait_for

TOKEN_A = "token-a-5b0c9e8d7f6a4b3c2d1e0f9a8b7c6d5e"
TOKEN_B = "token-b-1f2e3d4c5b6a79880f1e2d3c4b5a6978"
PER_HOLDER = 2


@pytest.fixture
def endpoint():
    """A short ipc:// path (a Unix socket address holds 107 bytes)."""
    directory = tempfile.mkdtemp(prefix="kv-ev-")
    yield f"ipc://{directory}/events"
    shutil.rmtree(directory, ignore_errors=True)


def open_until_refused(kv: KVTierClient, namespaces=None, at_most: int = 8) -> tuple[list, str]:
    """Streams opened before the daemon refused one, and its message."""
    streams = []
    try:
        for _ in range(at_most):
            streams.append(kv.watch_events(namespaces))
    except CapacityError as exc:
        return streams, str(exc)
    for stream in streams:
        stream.close()
    raise AssertionError(f"{at_most} streams opened for one holder; none refused")


def test_one_token_cannot_hold_every_watch_stream(daemons, tmp_path, endpoint):
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(f'[tokens]\n"{TOKEN_A}" = ["tenant-a"]\n"{TOKEN_B}" = ["tenant-b"]\n')
    daemon = daemons.start("--events", endpoint, "--events-namespaces", "tenant-a,tenant-b", "--tokens-file", str(tokens))
    with KVTierClient(daemon.target, token=TOKEN_A) as a, KVTierClient(daemon.target, token=TOKEN_B) as b:
        mine, message = open_until_refused(a)
        theirs = []
        try:
            assert len(mine) == PER_HOLDER and "holds 2 event watches already" in message
            assert TOKEN_A not in message
            theirs, _ = open_until_refused(b)  # B's place was left to it
            assert len(theirs) == PER_HOLDER
            mine.pop().close()  # a closed stream frees its holder's place (once the daemon sees it end)
            mine.append(wait_for(lambda: _try(a), 10, "A's closed stream to free its place"))
        finally:
            for stream in mine + theirs:
                stream.close()


def test_without_tokens_each_set_of_namespaces_has_its_own_watch_streams(daemons, endpoint):
    daemon = daemons.start("--events", endpoint)
    with KVTierClient(daemon.target) as kv:
        x, _ = open_until_refused(kv, ["x"])
        others = []
        try:
            assert len(x) == PER_HOLDER
            others = [kv.watch_events(["y"]), kv.watch_events(["x", "y"]), kv.watch_events()]
        finally:
            for stream in x + others:
                stream.close()


def _try(kv: KVTierClient):
    try:
        return kv.watch_events()
    except CapacityError:
        return None
