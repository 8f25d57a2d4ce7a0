"""Stopping: SIGTERM is a clean exit that removes the sockets, frees the host arenas (its
arena keeper ends), closes the disk index and keeps every committed page (a new daemon on
the same cache dir serves the same bytes); a drain that times out still exits 0; after
kill -9 the next daemon takes over the keeper and adopts the host arena
(tests/server/test_warm_restart.py has the figures)."""
from __future__ import annotations

import os
import signal
import stat
import time

import lmdb
from kvtier_client.proto.v1 import kvtier_pb2 as pb
from daemon import keeper_socket
from rpc import Arena, in_dev_shm, keys, page, tier_stats


def test_sigterm_persists_pages_for_the_next_daemon(daemons, connect):
    first = daemons.start(name="d")
    conn = connect(first.target)
    s = conn.session("persist")
    prefix = keys("persist", 6)
    arena = Arena.of(s)
    lease = s.borrow(len(prefix))
    for i, slot in enumerate(lease.slots):
        arena.write(slot, page(f"persist-{i}"))
    arena.close()
    s.commit(lease.lease_id, prefix)
    assert s.lookup(prefix).tiers == [pb.TIER_HOST] * 6  # host only: written back at shutdown, not before
    assert in_dev_shm(first.arena_prefix) == []  # host memory has no path
    # Restrictive permissions: owner and group (the engine's sidecar volume), nobody else;
    # the keeper, which holds every namespace's memory, only the daemon's own user.
    assert stat.S_IMODE(first.socket.stat().st_mode) == 0o660
    assert stat.S_IMODE(os.stat(s.reply.handoff_socket).st_mode) == 0o660
    assert stat.S_IMODE(keeper_socket(first).stat().st_mode) == 0o600
    conn.close()

    assert first.stop(signal.SIGTERM) == 0
    assert not first.socket.exists() and not os.path.exists(s.reply.handoff_socket)
    assert not keeper_socket(first).exists()  # the keeper ended: the host memory is freed
    assert '"msg": "stopped"' in first.log()
    # The LMDB index was committed and closed: another process can read all six entries.
    with lmdb.open(str(first.cache_dir / s.reply.pool_id / "index.lmdb"), readonly=True, lock=False, max_dbs=2) as env:
        with env.begin(db=env.open_db(b"pages", create=False)) as txn:
            assert txn.stat()["entries"] == 6

    second = daemons.start(name="d")  # same socket path and cache dir, new arena
    conn = connect(second.target)
    s = conn.session("persist")
    state = conn.state()
    assert tier_stats(state, s.reply.pool_id, pb.TIER_DISK).cached_pages == 6
    assert tier_stats(state, s.reply.pool_id, pb.TIER_HOST).cached_pages == 0
    assert s.lookup(prefix).tiers == [pb.TIER_DISK] * 6
    assert conn.session("someone-else").lookup(prefix).hit_blocks == 0  # persisted with their namespace

    read = s.acquire(prefix)
    assert (read.tier, read.ready, read.promoted) == (pb.TIER_HOST, 6, 6)
    arena = Arena.of(s)
    try:
        for i, slot in enumerate(read.slots):
            assert arena.read(slot) == page(f"persist-{i}"), f"page {i} came back different"
    finally:
        arena.close()
    s.release(read.lease_id)



def test_drain_timeout_releases_what_clients_still_hold(daemons, connect):
    d = daemons.start("--drain-timeout", "1s")
    conn = connect(d.target)
    s = conn.session("stubborn")
    committed = keys("stubborn", 2)
    s.put(committed)
    s.acquire(committed)
    s.borrow(3)  # never released: the drain must give up on it

    d.proc.send_signal(signal.SIGINT)  # Ctrl-C drains like SIGTERM
    start = time.monotonic()
    assert d.proc.wait(timeout=10) == 0
    assert 1.0 <= time.monotonic() - start < 4.0
    assert "drain timed out" in d.log()
    assert not keeper_socket(d).exists()

    again = daemons.start(name="d")  # the same cache dir: committed pages were kept, borrowed ones not
    s = connect(again.target).session("stubborn")
    assert s.lookup(committed).tiers == [pb.TIER_DISK] * 2


def test_restart_after_kill_9(daemons, connect):
    """A crashed daemon leaves its socket and its arena keeper behind; the next one on the
    same paths replaces the socket, adopts the arena from the keeper (warm restart) and
    serves the pages from host."""
    first = daemons.start("--write-through")
    s = connect(first.target).session("crash")
    blocks = keys("crash", 3)
    arena = Arena.of(s)
    lease = s.borrow(3)
    for i, slot in enumerate(lease.slots):
        arena.write(slot, page(f"crash-{i}"))
    arena.close()
    s.commit(lease.lease_id, blocks)

    assert first.stop(signal.SIGKILL) == -signal.SIGKILL
    assert first.socket.is_socket() and keeper_socket(first).is_socket()  # what a crash leaves

    second = daemons.start(name="d")
    s = connect(second.target).session("crash")
    assert "adopted host arena" in second.log() and "3 pages found again" in second.log()
    assert s.lookup(blocks).tiers == [pb.TIER_HOST] * 3
    read = s.acquire(blocks)
    assert read.promoted == 0  # found again in host: no disk read
    arena = Arena.of(s)
    try:
        assert [arena.read(slot) for slot in read.slots] == [page(f"crash-{i}") for i in range(3)]
    finally:
        arena.close()
    s.release(read.lease_id)


def test_a_keeper_with_no_successor_frees_the_memory(daemons, connect):
    """After a crash the keeper waits warm_restart_window for a successor, then exits: the
    host memory is never held forever."""
    first = daemons.start("--warm-restart-window", "1s")
    s = connect(first.target).session("orphan")
    s.put(keys("orphan", 4))
    assert first.stop(signal.SIGKILL) == -signal.SIGKILL
    assert keeper_socket(first).is_socket()  # holding the arena, waiting
    deadline = time.monotonic() + 10
    while keeper_socket(first).exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not keeper_socket(first).exists(), "the keeper outlived its window"


def test_no_keeper_with_a_window_of_zero(daemons, connect):
    d = daemons.start("--warm-restart-window", "0")
    s = connect(d.target).session("no-keeper")
    s.put(keys("no-keeper", 2))
    assert not keeper_socket(d).exists()
    assert d.stop(signal.SIGKILL) == -signal.SIGKILL
    again = daemons.start("--warm-restart-window", "0", name="d")
    s = connect(again.target).session("no-keeper")
    assert s.lookup(keys("no-keeper", 2)).hit_blocks == 0  # write-back, no keeper: the host pages are gone
