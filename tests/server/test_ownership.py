"""One daemon per cache directory and per socket (docs/operations.md): a second daemon on
either is refused with one line and exit code 2 and changes nothing of the first's; two
started at the same moment on one socket leave exactly one serving; a daemon killed with -9
frees both at once. Real `kvtier serve` processes, real locks."""
from __future__ import annotations

import signal
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

import pytest
from daemon import Daemon, launch, wait_serving
from kvtier_client.proto.v1 import kvtier_pb2 as pb
from rpc import Arena, keys, page, run_kvtier, tier_stats
from test_serve import assert_refused, serve_args

CACHE_LOCK = ".kvtier.lock"


def put_pages(conn_session, tag: str, n: int) -> list[bytes]:
    """Write n pages of known content and commit them (through to disk with --write-through)."""
    blocks = keys(tag, n)
    lease = conn_session.borrow(n)
    arena = Arena.of(conn_session)
    try:
        for i, slot in enumerate(lease.slots):
            arena.write(slot, page(f"{tag}-{i}"))
    finally:
        arena.close()
    conn_session.commit(lease.lease_id, blocks)
    return blocks


def read_pages(conn_session, blocks: list[bytes]) -> list[bytes]:
    read = conn_session.acquire(blocks)
    arena = Arena.of(conn_session)
    try:
        return [arena.read(slot) for slot in read.slots]
    finally:
        arena.close()
        conn_session.release(read.lease_id)


def test_second_daemon_on_a_cache_dir_is_refused(daemons, connect):
    """Not flaky: the first daemon is SERVING, so it took the lock (and wrote its pid) before
    the second starts; the second's refusal is decided by a flock that is held, not by timing."""
    first = daemons.start("--write-through", name="d")
    s = connect(first.target).session("owner")
    before = put_pages(s, "before", 3)  # on disk before the second daemon looks at the directory
    assert tier_stats(s.conn.state(), s.reply.pool_id, pb.TIER_DISK).cached_pages == 3

    other = first.socket.parent.parent.parent / "other"
    second = run_kvtier(*serve_args(other), "--cache-dir", str(first.cache_dir))
    assert_refused(second, "cache_dir", str(first.cache_dir), f"pid {first.proc.pid}", "--cache-dir")
    assert not (other / "run" / "kvtier.sock").exists()

    # The first daemon serves on, its disk tier whole: old pages found, new ones written through.
    assert first.proc.poll() is None
    assert s.lookup(before).hit_blocks == 3
    after = put_pages(s, "after", 3)
    assert tier_stats(s.conn.state(), s.reply.pool_id, pb.TIER_DISK).cached_pages == 6
    s.conn.close()
    assert first.stop() == 0

    # A later daemon on that directory reads back every page from disk, byte for byte.
    again = daemons.start(name="d")
    s = connect(again.target).session("owner")
    assert s.lookup(before + after).tiers == [pb.TIER_DISK] * 6
    assert read_pages(s, before + after) == [page(f"before-{i}") for i in range(3)] + [page(f"after-{i}") for i in range(3)]


@pytest.mark.parametrize("tries", [4, pytest.param(100, marks=pytest.mark.slow)])
def test_two_daemons_started_together_on_one_socket(daemons, tmp_path, tries):
    """Not flaky: whatever the order in which the two processes reach the socket, exactly one
    holds its lock and the other is refused; the test waits for process exits and SERVING, never
    for a time. The tries only vary the interleaving, which decided it while a health probe did."""
    base = tmp_path / "race"
    base.mkdir()
    with ThreadPoolExecutor(2) as waiter:
        for attempt in range(tries):
            pair = [
                launch(base, "--cache-dir", str(base / f"cache-{attempt}-{i}"), "--host-size", "1MiB",
                       "--disk-size", "4MiB", wait=False)
                for i in range(2)
            ]
            daemons.started.extend(pair)  # teardown checks their exits and arenas
            try:
                race_once(pair, waiter, f"try {attempt}")
            finally:  # a failed try leaves no process for the waiter threads to wait on forever
                for d in pair:
                    if d.proc.poll() is None:
                        d.proc.kill()


def race_once(pair: list[Daemon], waiter: ThreadPoolExecutor, name: str) -> None:
    """One daemon of the pair is refused (exit 2, one line); the other serves, and at SIGTERM
    exits 0 and removes the socket, leaving its lock file without a pid."""
    exits = {waiter.submit(d.proc.wait): d for d in pair}
    done, _ = wait(exits, timeout=30, return_when=FIRST_COMPLETED)
    assert done, f"{name}: neither daemon exited: both hold the socket?\n{logs(pair)}"
    loser = exits[done.pop()]
    survivor = next(d for d in pair if d is not loser)
    assert loser.proc.returncode == 2, f"{name}: {logs(pair)}"
    lines = loser.log().strip().splitlines()
    assert len(lines) == 1 and "another kvtier daemon is serving" in lines[0], f"{name}: {logs(pair)}"

    # The survivor answers on the socket, which the loser left alone.
    wait_serving(survivor.target, proc=survivor.proc)
    assert survivor.stop(signal.SIGTERM) == 0, f"{name}: {logs(pair)}"
    assert not survivor.socket.exists(), f"{name}: the stopped survivor left its socket"
    assert survivor.socket.with_name(survivor.socket.name + ".lock").read_text() == ""  # no pid of a gone owner


def test_kill_9_frees_the_cache_dir_and_the_socket_at_once(daemons, connect):
    """Not flaky: the kernel drops a process's flocks when it closes the process's files, which
    is done by the time wait() reports the kill; the lock files still name the dead pid, so
    nothing but the kernel's release lets the second daemon in."""
    first = daemons.start("--write-through", name="d")
    s = connect(first.target).session("crash")
    blocks = put_pages(s, "crash", 2)
    s.conn.close()
    socket_lock = first.socket.with_name(first.socket.name + ".lock")
    assert first.stop(signal.SIGKILL) == -signal.SIGKILL
    dead = f"{first.proc.pid}\n"
    assert (first.cache_dir / CACHE_LOCK).read_text() == dead and socket_lock.read_text() == dead

    second = daemons.start(name="d")  # same socket and cache dir; fails fast if it is refused
    assert (first.cache_dir / CACHE_LOCK).read_text() == socket_lock.read_text() == f"{second.proc.pid}\n"
    s = connect(second.target).session("crash")
    assert read_pages(s, blocks) == [page(f"crash-{i}") for i in range(2)]


def logs(pair: list[Daemon]) -> str:
    return "\n".join(f"--- pid {d.proc.pid} (exit {d.proc.poll()}) ---\n{d.log()}" for d in pair)
