"""A daemon restart under a live client: the same client object re-registers, maps the new
arena and finds the pages that were persisted to disk; leases of the old session fail typed."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from client_helpers import LAYOUT, as_bytes, kv_pages, tokens
from kvtier_client import Backoff, DaemonRestarted, KVTierClient, PoolInfo, Tier, Unavailable


def test_client_survives_daemon_restart(daemons, clients, tmp_path):
    first = daemons("--drain-timeout", "1s", path=tmp_path)
    client = clients(first.target, backoff=Backoff(initial=0.05, maximum=0.5, total=20.0))
    before = client.register("test/restart", LAYOUT)
    keys = client.block_keys(tokens(64, seed=11))
    data = kv_pages(len(keys), LAYOUT, seed=11)
    with client.borrow(len(keys)) as lease:
        for page, payload in zip(lease.pages, data):
            as_bytes(page)[:] = payload
        lease.commit(keys)
    stale_write = client.borrow(2)  # held across the restart
    stale_read = client.acquire(keys[:1])

    # SIGTERM: the daemon drains (our leases time the drain out), saves host pages to disk
    # and exits 0; a new daemon starts on the same socket and cache directory.
    assert first.stop() == 0, first.log()
    second = daemons(path=tmp_path)
    assert second.socket == first.socket and second.cache_dir == first.cache_dir

    # The same client carries on: the pages are found again, now on disk ...
    hit = client.lookup(keys)
    assert hit.hit_blocks == len(keys)
    assert set(hit.tiers) == {Tier.DISK}
    after = client.pool
    assert after.session_id != before.session_id
    assert after.handoff_socket == f"{second.socket}.handoff"  # attached to the new daemon, its arena mapped
    assert client.reconnects == 1

    # ... and read back through the new mapping, byte for byte, after promotion to host.
    with client.acquire(keys) as lease:
        assert lease.promoted == len(keys)
        for page, payload in zip(lease.pages, data):
            np.testing.assert_array_equal(as_bytes(page), payload)
    assert client.lookup(keys).tiers[0] == Tier.HOST

    # Leases of the old session say what happened; leaving their blocks does not raise.
    with pytest.raises(DaemonRestarted, match="restarted"):
        stale_write.commit(keys[:2])
    with pytest.raises(DaemonRestarted):
        client.release(stale_read)
    with client.borrow(1) as fresh:
        fresh.pages[0][...] = 1  # the new arena is writable
    with stale_write:
        pass

    assert client.reconnects == 1
    assert client.stats().leases == 0


def test_unreachable_daemon_gives_up_after_backoff(tmp_path):
    target = f"unix://{tmp_path}/nobody.sock"
    with KVTierClient(target, backoff=Backoff(initial=0.05, maximum=0.2, total=0.6)) as client:
        started = time.monotonic()
        with pytest.raises(Unavailable, match="still unavailable"):
            client.register("test/nobody", LAYOUT)
        elapsed = time.monotonic() - started
    assert 0.3 < elapsed < 3.0


def test_restart_while_idle_is_noticed_by_heartbeats(daemons, clients, tmp_path):
    """No engine call after the restart: the heartbeat thread registers again by itself."""
    first = daemons("--session-timeout", "1s", path=tmp_path)
    seen: list[tuple[PoolInfo, PoolInfo, str]] = []
    reconnected = threading.Event()

    def on_reconnect(old: PoolInfo, new: PoolInfo) -> None:
        seen.append((old, new, threading.current_thread().name))
        reconnected.set()

    client = clients(first.target, backoff=Backoff(initial=0.05, maximum=0.2, total=20.0), on_reconnect=on_reconnect)
    before = client.register("test/idle-restart", LAYOUT)
    assert first.stop() == 0
    second = daemons("--session-timeout", "1s", path=tmp_path)
    assert reconnected.wait(10), "no re-registration within 10 s of the restart (heartbeats every ~0.33 s)"
    [(old, new, thread)] = seen
    assert thread.startswith("kvtier-heartbeat")  # no engine call was made
    assert old == before and new == client.pool
    assert new.session_id != before.session_id and new.namespace == before.namespace
    assert new.handoff_socket == f"{second.socket}.handoff"
