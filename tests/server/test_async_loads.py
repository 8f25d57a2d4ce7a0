"""The asynchronous read path against a real daemon: merged loads, wait policies, held
prefetches, back-pressure, cancellation when a session ends, corrupt pages, fsync policies.

Every assertion rests on a fact that does not depend on speed:

- an Acquire holds the store's lock for its whole call except while it waits, so with
  WAIT_NONE no load can finish during the call: `ready` is exactly the pages that were in
  host and loaded when it arrived;
- a page is read from disk once per load, so merged loads show as bytes read == distinct
  pages x slot bytes (and promotions == distinct pages) however the calls interleave;
- "no load pending" is read from one Stats snapshot (taken under the store's lock): when
  the host held nothing at a baseline and nothing was committed since, every host page came
  from a load, so pages still loading = cached - promotions + evictions (since the baseline);
- ordering between two clients is forced through state the daemon reports (an Acquire has
  registered once kvtier_acquire_pages_total counts its pages), never by sleeping.

The one figure that needs a slow enough disk is stated where it is used: closing a session
~1 ms after prefetching 128 pages of 2 MiB with one reader thread leaves loads undone
(they take ~200 ms even on this machine's disk, which reads a 2 MiB page in ~1.4 ms).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import grpc
import lmdb
import pytest
from kvtier_client.proto.v1 import kvtier_pb2 as pb
from kvtier.core.chunks import chunk_bytes_for
from kvtier.mechanism.disk_index import encode_key, unpack_entry
from rpc import (
    LAYOUT,
    Arena,
    Session,
    expect_code,
    free_port,
    keys,
    page,
    pool_stats,
    samples,
    scrape,
    tier_stats,
    value,
    wait_for,
)

#: A Llama-3-8B page: 32 layers, 8 KV heads, head dim 128, 16 tokens, fp16 = 2 MiB (= its slot).
BIG = pb.PageLayout(layers=32, kv_heads=8, head_dim=128, block_tokens=16, dtype="float16", order="page_first")
BIG_TIERS = {"host_size": "320MiB", "disk_size": "600MiB"}  # 160 host pages, 300 disk pages
#: Deadline for calls that wait on many large loads (a hang still fails, it just takes longer).
LONG = 60.0


class Store:
    """One session of a test client, its mapping of the host arena, and the steps these tests repeat."""

    def __init__(self, conn, namespace: str, layout: pb.PageLayout = LAYOUT) -> None:
        self.conn = conn
        self.s: Session = conn.session(namespace, layout=layout)
        self.pool = self.s.reply.pool_id
        self.arena = Arena.of(self.s)
        self.capacity = next(t.capacity_pages for t in self.s.reply.tiers if t.tier == pb.TIER_HOST)

    def content(self, key: bytes) -> bytes:
        return page(key.hex(), self.arena.page_bytes)

    def put(self, ks: list[bytes]) -> None:
        """Commit each key with its own content, in batches the host tier can lend."""
        for start in range(0, len(ks), self.capacity):
            batch = ks[start : start + self.capacity]
            lease = self.s.borrow(len(batch))
            for slot, key in zip(lease.slots, batch):
                self.arena.write(slot, self.content(key))
            self.s.commit(lease.lease_id, batch)

    def push_to_disk(self) -> pb.TierStats:
        """Evict every cached host page (demoting those without a disk copy); returns the
        host stats of the now empty tier: the baseline for `settle`."""
        self.s.release(self.s.borrow(self.capacity).lease_id)
        host = self.host()
        assert (host.cached_pages, host.free_pages) == (0, self.capacity)
        return host

    def acquire(self, ks: list[bytes], wait: int = pb.WAIT_ALL, deadline_ms: int = 0,
                timeout: float = LONG) -> pb.AcquireResponse:
        request = pb.AcquireRequest(session_id=self.s.id, keys=ks, tier=pb.TIER_HOST, wait=wait, deadline_ms=deadline_ms)
        return self.s.call("Acquire", request, timeout=timeout)

    def assert_bytes(self, lease: pb.AcquireResponse, ks: list[bytes]) -> None:
        """The lease's slots hold, in order, the pages committed under ks (its ready prefix)."""
        assert len(lease.slots) == lease.ready
        for i, (slot, key) in enumerate(zip(lease.slots, ks)):
            assert self.arena.read(slot) == self.content(key), f"page {i} of the lease has the wrong bytes"

    def tiers(self, ks: list[bytes]) -> list[int]:
        reply = self.s.lookup(ks)
        assert reply.hit_blocks == len(ks)
        return list(reply.tiers)

    def host(self) -> pb.TierStats:
        return tier_stats(self.conn.state(), self.pool, pb.TIER_HOST)

    def disk(self) -> pb.TierStats:
        return tier_stats(self.conn.state(), self.pool, pb.TIER_DISK)

    def settle(self, base: pb.TierStats, timeout: float = 30.0) -> pb.TierStats:
        """Wait until no host page is loading. Valid when the host was empty at `base` and
        nothing was committed since: then pages loading = cached - promoted + evicted."""

        def quiet():
            h = self.host()
            return h if h.cached_pages - (h.promotions - base.promotions) + (h.evictions - base.evictions) == 0 else None

        return wait_for(quiet, timeout, "disk loads to finish")


@pytest.fixture
def store(connect):
    """store(target, namespace, layout) -> Store; arenas unmapped at teardown."""
    opened: list[Store] = []

    def factory(target: str, namespace: str, layout: pb.PageLayout = LAYOUT) -> Store:
        st = Store(connect(target), namespace, layout)
        opened.append(st)
        return st

    yield factory
    for st in opened:
        st.arena.close()


def assert_idle(st: Store) -> None:
    """What must hold once every lease is released: nothing writing or pinned, and in every
    tier free + cached == capacity."""
    state = st.conn.state()
    assert state.leases == 0
    for t in pool_stats(state, st.pool).tiers:
        assert (t.writing_pages, t.pinned_pages) == (0, 0), t
        assert t.free_pages + t.cached_pages == t.capacity_pages, t


def assert_disk_queue_empty(port: int, pool: str) -> None:
    _, families = scrape(port)
    assert value(families, "kvtier_disk_queue_depth", pool=pool, kind="acquire") == 0
    assert value(families, "kvtier_disk_queue_depth", pool=pool, kind="prefetch") == 0
    assert value(families, "kvtier_disk_reads_in_flight", pool=pool) == 0


def loads_observed(families: dict, **labels) -> float:
    return sum(s.value for s in samples(families, "kvtier_disk_load_duration_seconds_count", **labels))


@contextmanager
def heartbeating(session: Session):
    """Keep a session alive (a daemon with a short --session-timeout) while the block runs."""
    stop = threading.Event()

    def beat():
        while not stop.wait(0.1):
            session.heartbeat()

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


# -- (a) merged loads ---------------------------------------------------------------
def test_concurrent_clients_read_each_disk_page_once(daemons, store):
    port = free_port()
    d = daemons.start("--metrics-port", str(port), "--fsync", "never", **BIG_TIERS)
    owner = store(d.target, "merge", BIG)
    k = keys("merge", 64)
    owner.put(k)
    base = owner.push_to_disk()
    _, families = scrape(port)
    assert value(families, "kvtier_disk_read_bytes_total", pool=owner.pool) == 0

    # Two clients, each with its own channel and session, start together: one prefetches
    # everything and then acquires it in order, the other acquires it in reverse order
    # (its WAIT_ALL boosts the other's queued prefetches) and then prefetches it again.
    clients = [store(d.target, "merge", BIG) for _ in range(2)]
    barrier = threading.Barrier(2)

    def forward(c: Store) -> None:
        barrier.wait()
        assert c.s.prefetch(k).accepted == len(k)
        lease = c.acquire(k)
        assert lease.ready == len(k)
        c.assert_bytes(lease, k)
        c.s.release(lease.lease_id)

    def backward(c: Store) -> None:
        barrier.wait()
        rk = k[::-1]
        lease = c.acquire(rk)
        assert lease.ready == len(k)
        c.assert_bytes(lease, rk)
        assert c.s.prefetch(k).accepted == len(k)  # all in host: nothing to load, all accepted
        c.s.release(lease.lease_id)

    with ThreadPoolExecutor(2) as pool:
        for f in [pool.submit(forward, clients[0]), pool.submit(backward, clients[1])]:
            f.result()

    # Each page was read from disk exactly once, however the four calls interleaved.
    host = owner.settle(base)
    assert host.promotions - base.promotions == len(k)
    assert host.cached_pages == len(k)
    _, families = scrape(port)
    assert value(families, "kvtier_disk_read_bytes_total", pool=owner.pool) == len(k) * owner.s.reply.slot_bytes
    assert loads_observed(families, result="ok") == len(k)
    assert loads_observed(families, result="corrupt") == 0
    arrivals = {w: value(families, "kvtier_acquire_pages_total", pool=owner.pool, on_arrival=w) for w in ("ready", "loaded")}
    assert sum(arrivals.values()) == 2 * len(k)
    assert_disk_queue_empty(port, owner.pool)
    assert_idle(owner)


# -- (b) cancellation when a session ends ----------------------------------------------
def test_closing_a_session_withdraws_its_queued_prefetches(daemons, store, connect):
    port = free_port()
    d = daemons.start("--metrics-port", str(port), "--io-depth", "1", "--fsync", "never", **BIG_TIERS)
    owner = store(d.target, "cancel", BIG)
    k = keys("cancel", 128)
    owner.put(k)
    base = owner.push_to_disk()

    # A client queues 128 loads of 2 MiB behind one reader thread and leaves at once.
    hinter = connect(d.target).session("cancel", layout=BIG)
    assert hinter.prefetch(k).accepted == len(k)
    assert hinter.close().released_leases == 0

    # Its queued loads were withdrawn: fewer pages arrived than were asked for, and every
    # withdrawn page's host slot is free again (cached == promoted, free + cached == capacity).
    host = owner.settle(base)
    promoted = host.promotions - base.promotions
    assert promoted < len(k), "closing the session must withdraw the loads still queued"
    assert host.cached_pages == promoted
    assert host.free_pages == owner.capacity - promoted
    assert owner.tiers(k).count(pb.TIER_HOST) == promoted
    assert_disk_queue_empty(port, owner.pool)
    _, families = scrape(port)
    assert loads_observed(families) == promoted  # only started loads read anything
    assert value(families, "kvtier_disk_read_bytes_total", pool=owner.pool) == promoted * owner.s.reply.slot_bytes
    assert_idle(owner)

    # Nothing was lost: every page, arrived or withdrawn, is served with its bytes.
    lease = owner.acquire(k)
    assert (lease.ready, lease.promoted) == (len(k), len(k) - promoted)
    owner.assert_bytes(lease, k)
    owner.s.release(lease.lease_id)
    assert_idle(owner)


# A client that registers, prefetches the keys given on its command line, says how many
# were accepted, and then sleeps until it is killed (no heartbeats, no goodbye).
HINTER = textwrap.dedent(
    """
    import sys, time
    import grpc
    from kvtier_client.handoff import attach
    from kvtier_client.keys import hash_fingerprint
    from kvtier_client.proto.v1 import kvtier_pb2 as pb, kvtier_pb2_grpc

    stub = kvtier_pb2_grpc.KVTierStub(grpc.insecure_channel(sys.argv[1]))
    layout = pb.PageLayout(layers=32, kv_heads=8, head_dim=128, block_tokens=16, dtype="float16")
    reg = stub.Register(pb.RegisterRequest(namespace="killed", layout=layout, hash_algorithm="xxh3-128",
                                           hash_fingerprint=hash_fingerprint("xxh3-128"), client_name="doomed"), timeout=10)
    key = (("kvtier-session-key", attach(reg.handoff_socket, reg.session_id, None).session_key),)
    keys = [bytes.fromhex(k) for k in sys.argv[2:]]
    reply = stub.Prefetch(pb.PrefetchRequest(session_id=reg.session_id, keys=keys, tier=pb.TIER_HOST), timeout=10, metadata=key)
    print(reg.session_id, reply.accepted, flush=True)
    time.sleep(600)
    """
)


def test_killed_client_prefetches_end_with_its_session(daemons, store):
    port = free_port()
    d = daemons.start("--metrics-port", str(port), "--io-depth", "1", "--fsync", "never", "--session-timeout", "1s",
                      **BIG_TIERS)
    owner = store(d.target, "killed", BIG)
    k = keys("killed", 128)
    with heartbeating(owner.s):
        owner.put(k)
        base = owner.push_to_disk()

        # The client prefetches every page and is killed with SIGKILL right after.
        client = daemons.child(subprocess.Popen([sys.executable, "-c", HINTER, d.target, *(key.hex() for key in k)],
                                                stdout=subprocess.PIPE, text=True))
        line = client.stdout.readline().split()
        assert len(line) == 2, f"the client failed (exit {client.poll()})"
        session_id, accepted = line[0], int(line[1])
        assert accepted == len(k)
        client.send_signal(signal.SIGKILL)
        client.wait()

        # The heartbeat timeout ends its session: its queued loads are withdrawn (those
        # a reader already took finish and stay, held), nothing of it is pinned or loading.
        wait_for(lambda: owner.conn.state().sessions == 1, 10, "the killed client's session to time out")
        expect_code(grpc.StatusCode.NOT_FOUND, owner.conn.call, "Heartbeat", pb.HeartbeatRequest(session_id=session_id))
        host = owner.settle(base)
        promoted = host.promotions - base.promotions
        assert promoted <= len(k)
        assert host.cached_pages == promoted and host.free_pages == owner.capacity - promoted
        assert_disk_queue_empty(port, owner.pool)
        assert_idle(owner)

        # Every page is still served with its bytes.
        lease = owner.acquire(k)
        assert lease.ready == len(k)
        owner.assert_bytes(lease, k)
        owner.s.release(lease.lease_id)
        assert_idle(owner)


# -- (c) one session's cancellation never breaks another's wait -------------------------
def test_cancellation_spares_pages_another_session_waits_for(daemons, store, connect):
    port = free_port()
    d = daemons.start("--metrics-port", str(port), "--io-depth", "1", "--fsync", "never", **BIG_TIERS)
    owner = store(d.target, "shared", BIG)
    k = keys("shared", 128)
    owner.put(k)
    base = owner.push_to_disk()
    waited = k[:64]

    # Session A queues loads of all 128 pages; session B then waits (WAIT_ALL) for the first 64.
    hinter = connect(d.target).session("shared", layout=BIG)
    assert hinter.prefetch(k).accepted == len(k)
    reader = store(d.target, "shared", BIG)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(reader.acquire, waited)

        # Once B's Acquire has registered as a waiter on those pages (the daemon counts its
        # pages under the same lock), A leaves: its queued loads are withdrawn, except those B waits for.
        def registered():
            _, families = scrape(port)
            return sum(s.value for s in samples(families, "kvtier_acquire_pages_total", pool=owner.pool)) == len(waited)

        wait_for(registered, 10, "the Acquire to register its pages")
        hinter.close()
        lease = pending.result()

    # B got every page it waited for, with the committed bytes.
    assert lease.ready == len(waited)
    reader.assert_bytes(lease, waited)
    host = owner.settle(base)
    assert host.pinned_pages == len(waited)
    reader.s.release(lease.lease_id)
    assert_disk_queue_empty(port, owner.pool)
    assert_idle(owner)
    promoted = host.promotions - base.promotions
    assert len(waited) <= promoted <= len(k) and host.cached_pages == promoted


# -- (d) back-pressure -------------------------------------------------------------------
def test_prefetch_flood_is_bounded_and_acquire_still_completes(daemons, store, connect):
    port = free_port()
    # 64 host pages, at most 4 queued prefetch loads, one reader, holds longer than the test.
    d = daemons.start("--metrics-port", str(port), "--max-queued-prefetch", "4", "--io-depth", "1",
                      "--prefetch-hold", "60s", "--fsync", "never", host_size="256KiB", disk_size="8MiB")
    owner = store(d.target, "flood")
    flood, wanted, wanted_later = keys("flood", 1024), keys("wanted", 8), keys("wanted-later", 8)
    owner.put(flood + wanted + wanted_later)
    base = owner.push_to_disk()

    # Four clients each send 16 Prefetch calls of 8 disk-only keys never asked for before.
    windows = [flood[i : i + 8] for i in range(0, 512, 8)]
    hinters = [connect(d.target).session("flood") for _ in range(4)]
    started = threading.Event()
    done = threading.Event()

    def hint(h: Session, mine: list[list[bytes]]) -> list[int]:
        got = []
        for window in mine:
            got.append(h.prefetch(window).accepted)
            started.set()
        return got

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(hint, h, windows[i::4]) for i, h in enumerate(hinters)]
        threading.Thread(target=lambda: ([f.exception() for f in futures], done.set()), daemon=True).start()
        assert started.wait(10)

        # An Acquire in the middle of the flood gets every page, with its bytes.
        lease = owner.acquire(wanted)
        assert lease.ready == len(wanted)
        owner.assert_bytes(lease, wanted)
        owner.s.release(lease.lease_id)

        # While the flood lasts: the prefetch queue never exceeds its bound, every host
        # slot is accounted for.
        while not done.is_set():
            _, families = scrape(port)
            assert value(families, "kvtier_disk_queue_depth", pool=owner.pool, kind="prefetch") <= 4
            host = owner.host()
            assert host.free_pages + host.writing_pages + host.cached_pages == owner.capacity
        accepted = [n for f in futures for n in f.result()]

    # Each call of 8 fresh disk-only keys was accepted for at most 4 (the queue bound).
    assert len(accepted) == 64 and max(accepted) <= 4 and sum(accepted) >= 4

    # Keep hinting (fresh keys, the queue empty each time) until a hint is refused
    # outright: held prefetched pages then fill the host tier, and no hint can evict one.
    # Prefetches never take more than the tier's capacity.
    owner.settle(base)
    for window in (flood[i : i + 8] for i in range(512, 1024, 8)):
        accepted = owner.s.prefetch(window).accepted
        owner.settle(base)
        if accepted == 0:
            break
    assert accepted == 0
    host = owner.host()
    assert (host.cached_pages, host.free_pages, host.pinned_pages) == (owner.capacity, 0, 0)

    # A hint never costs a real request its pages: with the host full of held prefetched
    # pages, an Acquire of other disk pages and a Borrow still get theirs.
    lease = owner.acquire(wanted_later)
    assert lease.ready == len(wanted_later)
    owner.assert_bytes(lease, wanted_later)
    owner.s.release(lease.lease_id)
    owner.s.release(owner.s.borrow(8).lease_id)
    assert_disk_queue_empty(port, owner.pool)
    assert_idle(owner)


# -- (e) wait policies -------------------------------------------------------------------
def test_wait_policies(daemons, store):
    d = daemons.start("--io-depth", "1", "--fsync", "never", **BIG_TIERS)
    st = store(d.target, "wait", BIG)
    k = keys("wait", 128)
    st.put(k)
    base = st.push_to_disk()

    # WAIT_ALL: every page ready, with the committed bytes.
    lease = st.acquire(k[:4], pb.WAIT_ALL)
    assert (lease.ready, lease.promoted) == (4, 4)
    st.assert_bytes(lease, k[:4])
    st.s.release(lease.lease_id)

    # WAIT_NONE: exactly the leading pages already in host (k[0..3]) are ready; no load can
    # finish during the call. The rest keep loading.
    assert st.tiers(k[:16]) == [pb.TIER_HOST] * 4 + [pb.TIER_DISK] * 12
    lease = st.acquire(k[:16], pb.WAIT_NONE)
    assert (lease.ready, len(lease.slots), lease.promoted) == (4, 4, 12)
    st.assert_bytes(lease, k[:4])
    st.s.release(lease.lease_id)
    # The ready prefix stops at the first page that is not ready, whatever follows it.
    lease = st.acquire([k[0], k[16], k[1]], pb.WAIT_NONE)
    assert (lease.ready, len(lease.slots), lease.promoted) == (1, 1, 1)
    st.s.release(lease.lease_id)
    # The pages a WAIT_NONE left loading arrive by themselves.
    st.settle(base)
    lease = st.acquire(k[:17], pb.WAIT_NONE)
    assert (lease.ready, lease.promoted) == (17, 0)
    st.assert_bytes(lease, k[:17])
    st.s.release(lease.lease_id)

    # WAIT_DEADLINE of 1 ms on 64 disk pages of 2 MiB behind one reader: only part of them
    # (128 MiB cannot be read and checked in 1 ms); the ready prefix is pinned, the rest loads on.
    tiny = k[64:]
    lease = st.acquire(tiny, pb.WAIT_DEADLINE, deadline_ms=1)
    assert lease.ready < len(tiny) and len(lease.slots) == lease.ready
    st.assert_bytes(lease, tiny)
    st.s.release(lease.lease_id)

    # WAIT_DEADLINE with a generous deadline: every page.
    generous = k[17:64]
    lease = st.acquire(generous, pb.WAIT_DEADLINE, deadline_ms=int(LONG * 1000) - 5000)
    assert (lease.ready, lease.promoted) == (len(generous), len(generous))
    st.assert_bytes(lease, generous)
    st.s.release(lease.lease_id)

    # Everything arrives; then all 128 are ready on arrival.
    host = st.settle(base)
    assert host.promotions - base.promotions == len(k)
    lease = st.acquire(k, pb.WAIT_NONE)
    assert (lease.ready, lease.promoted) == (len(k), 0)
    st.assert_bytes(lease, k)
    st.s.release(lease.lease_id)
    assert_idle(st)


def test_prefetched_page_is_held_then_ages(daemons, store):
    held = keys("held", 4)
    fill = keys("fill", 12)
    # 16 host pages. With the default hold (10 s), prefetch `held` and then fill the host.
    d = daemons.start("--policy", "lru", name="hold-10s", host_size="64KiB", disk_size="1MiB")  # LRU's order below
    st = store(d.target, "hold")
    st.put(held)
    base = st.push_to_disk()
    assert st.s.prefetch(held).accepted == 4
    st.settle(base)
    st.put(fill)
    assert st.host().free_pages == 0
    # A borrow needs 4 pages. `held` is least recently used and would be taken; held, it
    # stays, and the 4 oldest fill pages go to disk instead.
    st.s.release(st.s.borrow(4).lease_id)
    assert st.tiers(held) == [pb.TIER_HOST] * 4
    assert st.tiers(fill[:4]) == [pb.TIER_DISK] * 4
    lease = st.acquire(held, pb.WAIT_NONE)
    assert (lease.ready, lease.promoted) == (4, 0)
    st.assert_bytes(lease, held)
    st.s.release(lease.lease_id)

    # With --prefetch-hold 1s the same page is evictable once the hold is over: the loads
    # finished before settle() returned, so their hold ends within 1 s of that.
    d = daemons.start("--prefetch-hold", "1s", "--policy", "lru", name="hold-1s", host_size="64KiB", disk_size="1MiB")
    st = store(d.target, "hold")
    st.put(held)
    base = st.push_to_disk()
    assert st.s.prefetch(held).accepted == 4
    st.settle(base)
    time.sleep(1.1)
    st.put(fill)
    st.s.release(st.s.borrow(4).lease_id)
    assert st.tiers(held) == [pb.TIER_DISK] * 4
    assert st.tiers(fill) == [pb.TIER_HOST] * 12
    assert_idle(st)


# -- (f) corrupt pages --------------------------------------------------------------------
def disk_offset(cache_dir, pool: str, namespace: str, key: bytes, slot_bytes: int) -> int:
    """Where a page's stored bytes start in the slab, read from the tier's LMDB index
    (kvtier.mechanism.disk_index): its first chunk."""
    env = lmdb.open(str(cache_dir / pool / "index.lmdb"), readonly=True, lock=False, max_dbs=2)
    try:
        db = env.open_db(b"pages", create=False)
        raw_key = encode_key(namespace, key)
        with env.begin(db=db) as txn:
            raw = txn.get(raw_key)
        assert raw is not None, f"{key.hex()} is not in the disk index"
        return unpack_entry(raw_key, raw).extent[0] * chunk_bytes_for(slot_bytes)
    finally:
        env.close()


def test_corrupt_page_under_wait_all(daemons, store):
    port = free_port()
    d = daemons.start("--metrics-port", str(port), host_size="64KiB", disk_size="1MiB")
    st = store(d.target, "corrupt")
    k = keys("corrupt", 8)
    st.put(k)
    base = st.push_to_disk()

    # Flip the first bytes of k[3]'s slot in the slab file.
    at = disk_offset(d.cache_dir, st.pool, "corrupt", k[3], st.s.reply.slot_bytes)
    with open(d.cache_dir / st.pool / "slab.bin", "r+b") as slab:
        slab.seek(at)
        head = slab.read(64)
        slab.seek(at)
        slab.write(bytes(b ^ 0xFF for b in head))
        slab.flush()
        os.fsync(slab.fileno())

    # WAIT_ALL: NOT_FOUND naming key 3; the call holds nothing.
    message = expect_code(grpc.StatusCode.NOT_FOUND, st.acquire, k, pb.WAIT_ALL)
    assert "key 3" in message and "checksum" in message
    assert st.conn.state().leases == 0
    # The corrupt page is gone from both tiers; the others arrived (WAIT_ALL waited for all).
    host = st.settle(base)
    assert host.pinned_pages == 0
    assert st.disk().corrupt_pages == 1
    assert st.s.lookup(k).hit_blocks == 3
    assert (host.promotions - base.promotions, host.cached_pages) == (7, 7)
    _, families = scrape(port)
    assert value(families, "kvtier_disk_load_duration_seconds_count", kind="acquire", result="corrupt") == 1
    assert value(families, "kvtier_disk_load_duration_seconds_count", kind="acquire", result="ok") == 7
    assert_idle(st)
    # The pages before it are served intact.
    lease = st.acquire(k[:3])
    assert lease.ready == 3
    st.assert_bytes(lease, k[:3])
    st.s.release(lease.lease_id)
    assert_idle(st)


# -- (g) fsync policies -------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["batch", "interval", "never"])
def test_each_fsync_policy_serves_and_persists_across_a_restart(daemons, store, policy):
    args = ["--fsync", policy, *(["--fsync-interval", "50ms"] if policy == "interval" else [])]
    d = daemons.start(*args, name="durable", host_size="64KiB", disk_size="1MiB")
    st = store(d.target, "durable")
    k = keys(f"durable-{policy}", 24)
    # 24 pages through a 16-page host tier: 8 are demoted on the way, 16 stay host-only.
    st.put(k[:16])
    st.put(k[16:])
    assert st.tiers(k).count(pb.TIER_DISK) == 8
    for chunk in (k[:8], k[8:16], k[16:]):
        lease = st.acquire(chunk)
        assert lease.ready == len(chunk)
        st.assert_bytes(lease, chunk)
        st.s.release(lease.lease_id)
    assert_idle(st)
    st.conn.close()
    st.arena.close()

    # A clean stop saves the host-only pages to disk; the next start serves all 24 from disk.
    assert d.stop() == 0
    d = daemons.start(*args, name="durable", host_size="64KiB", disk_size="1MiB")
    st = store(d.target, "durable")
    assert st.tiers(k) == [pb.TIER_DISK] * 24
    for chunk in (k[:8], k[8:16], k[16:]):
        lease = st.acquire(chunk)
        assert (lease.ready, lease.promoted) == (len(chunk), len(chunk))
        st.assert_bytes(lease, chunk)
        st.s.release(lease.lease_id)
    assert st.disk().corrupt_pages == 0
    assert_idle(st)
