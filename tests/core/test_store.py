"""BlockStore through a real Pool: real host memory files and a real LMDB disk tier.

Scenario tests: each walks through steps with one comment per step, checking the store's
invariants (and the disk index) after every one.
"""
from __future__ import annotations

import os

import pytest
from kvtier_client.errors import CapacityError, FailedPrecondition, InvalidArgument, NotFound
from kvtier_client.keys import block_keys
from kvtier_client.layout import PageLayout
from kvtier_client.tiers import Tier

from kvtier.core.store import PrefixMatch

from store_helpers import check, pattern, read_page, snapshot, tier_of, write_page

NS = "model-a/tenant-1"


def keys(n: int, seed: int = 0) -> list[bytes]:
    """n chained block keys of a made-up sequence."""
    return block_keys([seed * 100_000 + i for i in range(16 * n)], 16)


def put(pool, keys_, *, session="s", namespace=NS, parent=None):
    """Borrow, fill each page with its key's pattern, commit. Returns the slots used."""
    lease = pool.store.borrow(session, namespace, len(keys_))
    for slot, key in zip(lease.slots, keys_):
        write_page(pool, slot, pattern(key, pool.layout.page_bytes, namespace))
    result = pool.store.commit(session, lease.lease_id, keys_, parent=parent)
    assert result.lease_id == lease.lease_id
    check(pool)
    return lease.slots, result


def assert_served(pool, keys_, *, namespace=NS, session="reader", promoted=None):
    """Acquire keys, check every page holds the bytes committed under its key, release."""
    lease = pool.store.acquire(session, namespace, keys_)
    check(pool)
    if promoted is not None:
        assert lease.promoted == promoted
    for slot, key in zip(lease.slots, keys_):
        assert read_page(pool, slot) == pattern(key, pool.layout.page_bytes, namespace), f"wrong bytes for {key.hex()}"
    pool.store.release(session, lease.lease_id)
    check(pool)
    return lease


def test_borrow_commit_lookup_acquire_release(make_pool):
    pool = make_pool(host_pages=4)
    store, k = pool.store, keys(3)
    # Borrow three pages: three distinct slots, leased for writing.
    lease = store.borrow("s", NS, 3)
    check(pool)
    assert len(set(lease.slots)) == 3 and lease.tier is Tier.HOST
    host = store.stats().tier(Tier.HOST)
    assert (host.capacity, host.free, host.writing, host.cached) == (4, 1, 3, 0)
    assert store.stats().leases == 1 and store.stats().sessions == 1
    # Nothing is cached until commit.
    assert store.lookup(NS, k).hit_blocks == 0
    for slot, key in zip(lease.slots, k):
        write_page(pool, slot, pattern(key, pool.layout.page_bytes, NS))
    # Commit: the pages become the cached copies of the keys; the lease ends.
    result = store.commit("s", lease.lease_id, k)
    check(pool)
    assert (result.committed, result.duplicates) == (3, ())
    host = store.stats().tier(Tier.HOST)
    assert (host.free, host.writing, host.cached, host.pinned) == (1, 0, 3, 0)
    assert store.stats().leases == 0 and store.stats().sessions == 0
    # Lookup: the longest cached prefix, stopping at the first miss.
    assert store.lookup(NS, k) == PrefixMatch(3, (Tier.HOST,) * 3)
    assert store.lookup(NS, [k[0], b"missing", k[2]]).hit_blocks == 1
    assert store.lookup(NS, [b"missing"] + k).hit_blocks == 0
    stats = store.stats()
    assert (stats.lookup_blocks, stats.miss_blocks, stats.tier(Tier.HOST).counters.hits) == (3 + 3 + 3 + 4, 3 + 2 + 4, 3 + 1)
    # Acquire pins the very pages that were committed.
    read = store.acquire("r", NS, k[:2])
    check(pool)
    assert read.slots == lease.slots[:2] and read.promoted == 0
    assert store.stats().tier(Tier.HOST).pinned == 2
    for slot, key in zip(read.slots, k):
        assert read_page(pool, slot) == pattern(key, pool.layout.page_bytes, NS)
    # Release unpins.
    store.release("r", read.lease_id)
    check(pool)
    assert store.stats().tier(Tier.HOST).pinned == 0 and store.stats().leases == 0


def test_commit_fewer_keys_frees_the_rest(make_pool):
    pool = make_pool(host_pages=4)
    lease = pool.store.borrow("s", NS, 4)
    result = pool.store.commit("s", lease.lease_id, keys(1))
    check(pool)
    assert result.committed == 1
    assert pool.store.stats().tier(Tier.HOST).free == 3
    assert pool.store.blocks[(NS, keys(1)[0])].copies[Tier.HOST].slot == lease.slots[0]


def test_commit_of_a_cached_key_is_a_duplicate_and_frees_its_page(make_pool):
    pool = make_pool(host_pages=4)
    k = keys(3)
    (first_slot,), _ = put(pool, k[:1])
    # A second writer computed the same block: its page is freed, the cached one kept.
    lease = pool.store.borrow("s2", NS, 3)
    for slot in lease.slots:
        write_page(pool, slot, b"\x01" * pool.layout.page_bytes)
    result = pool.store.commit("s2", lease.lease_id, [k[0], k[1], k[1]])
    check(pool)
    assert (result.committed, result.duplicates) == (1, (0, 2))  # k[1] repeated counts too
    assert pool.store.blocks[(NS, k[0])].copies[Tier.HOST].slot == first_slot
    assert pool.store.blocks[(NS, k[1])].copies[Tier.HOST].slot == lease.slots[1]
    assert pool.store.stats().tier(Tier.HOST).free == 4 - 2
    assert read_page(pool, first_slot) == pattern(k[0], pool.layout.page_bytes, NS)  # not overwritten
    assert pool.store.blocks[(NS, k[1])].parent == (NS, k[0])


def test_acquire_promotes_disk_pages_into_host_with_their_bytes(make_pool):
    pool = make_pool(host_pages=2, disk_pages=8)
    k = keys(6)
    # Six one-page commits through a two-page host: the four oldest are demoted to disk.
    for key in k:
        put(pool, [key])
    assert [tier_of(pool, NS, key) for key in k] == [{Tier.DISK}] * 4 + [{Tier.HOST}] * 2
    assert pool.store.lookup(NS, k).tiers == (Tier.DISK,) * 4 + (Tier.HOST,) * 2
    disk = pool.store.stats().tier(Tier.DISK)
    assert (disk.cached, disk.counters.demotions, disk.counters.bytes_in) == (4, 4, 4 * pool.layout.page_bytes)
    # The host slots have been overwritten since; the bytes must come back from disk.
    assert_served(pool, k[:2], promoted=2)
    assert tier_of(pool, NS, k[0]) == {Tier.HOST, Tier.DISK}  # promotion copies, the disk copy stays
    host = pool.store.stats().tier(Tier.HOST)
    assert (host.counters.promotions, host.counters.bytes_in) == (2, 2 * pool.layout.page_bytes)
    # Promoting the other two evicts k[0], k[1] from host (they have disk copies: no new demotion).
    assert_served(pool, k[2:4], promoted=2)
    assert pool.store.stats().tier(Tier.DISK).counters.demotions == 6  # k[4], k[5] went down to make room
    assert_served(pool, k[4:], promoted=2)
    assert_served(pool, k[:2], promoted=2)


def test_leased_pages_are_never_evicted(make_pool):
    pool = make_pool(host_pages=4)
    k = keys(3)
    put(pool, k[:2])
    pinned = pool.store.acquire("r", NS, k[:1])  # k[0] pinned, k[1] evictable
    writing = pool.store.borrow("w", NS, 1)
    write_page(pool, writing.slots[0], b"\x07" * pool.layout.page_bytes)
    # Needs two pages: one free, and k[1] (the only unleased page) goes.
    extra = pool.store.borrow("w", NS, 2)
    check(pool)
    assert tier_of(pool, NS, k[1]) == set() and tier_of(pool, NS, k[0]) == {Tier.HOST}
    assert read_page(pool, pinned.slots[0]) == pattern(k[0], pool.layout.page_bytes, NS)
    assert read_page(pool, writing.slots[0]) == b"\x07" * pool.layout.page_bytes
    assert not set(extra.slots) & {pinned.slots[0], writing.slots[0]}
    # Now every page is leased: one more is refused, and nothing changed.
    before = snapshot(pool)
    with pytest.raises(CapacityError, match="host tier is full"):
        pool.store.borrow("w", NS, 1)
    assert snapshot(pool) == before
    check(pool)


def test_full_tier_with_everything_pinned_refuses_and_changes_nothing(make_pool):
    pool = make_pool(host_pages=3, disk_pages=4)
    k = keys(5)
    for key in k:
        put(pool, [key])  # k[0], k[1] on disk, k[2..4] in host
    held = pool.store.acquire("r", NS, k[2:])
    check(pool)
    before = snapshot(pool)
    # A borrow needs a page and none can go.
    with pytest.raises(CapacityError, match="host tier is full: 1 pages needed, 0 free, 0 evictable"):
        pool.store.borrow("w", NS, 1)
    assert snapshot(pool) == before
    # An acquire needing a promotion is refused the same way, pins and all.
    with pytest.raises(CapacityError):
        pool.store.acquire("r2", NS, k[:2])
    assert snapshot(pool) == before
    with pytest.raises(CapacityError):
        pool.store.acquire("r", NS, [k[0]] + k[2:3])  # a mix of host-pinned and disk-only keys
    assert snapshot(pool) == before
    check(pool)
    # Releasing makes room again.
    pool.store.release("r", held.lease_id)
    assert_served(pool, k[:2], promoted=2)


def test_write_through_copies_to_disk_at_commit(make_pool):
    pool = make_pool(host_pages=2, disk_pages=4, write_through=True)
    k = keys(3)
    put(pool, k[:2])
    assert {r.key for r in pool.disk.records()} == set(k[:2])
    assert [tier_of(pool, NS, key) for key in k[:2]] == [{Tier.HOST, Tier.DISK}] * 2
    assert pool.store.stats().tier(Tier.DISK).counters.demotions == 2
    # The disk copy already holds the page's bytes: evict the host copy and read it back.
    put(pool, k[2:])
    assert tier_of(pool, NS, k[0]) == {Tier.DISK}
    assert pool.store.stats().tier(Tier.DISK).counters.demotions == 3  # eviction copied nothing more
    assert_served(pool, k[:1], promoted=1)


def test_write_back_copies_to_disk_only_at_eviction(make_pool):
    pool = make_pool(host_pages=2, disk_pages=4, write_through=False)
    k = keys(3)
    put(pool, k[:2])
    assert list(pool.disk.records()) == []
    assert pool.store.stats().tier(Tier.DISK).cached == 0
    put(pool, k[2:])
    assert [r.key for r in pool.disk.records()] == [k[0]]
    assert tier_of(pool, NS, k[0]) == {Tier.DISK}
    assert_served(pool, k[:1], promoted=1)


def test_cascade_host_to_disk_to_dropped(make_pool):
    pool = make_pool(host_pages=2, disk_pages=2)
    k = keys(6)
    for key in k:
        put(pool, [key])
    # Worked by hand, LRU in both tiers: k0,k1 fill host; each later commit demotes the
    # oldest host page, and from k4 on the disk is full, so its oldest page is dropped.
    assert [tier_of(pool, NS, key) for key in k] == [set(), set(), {Tier.DISK}, {Tier.DISK}, {Tier.HOST}, {Tier.HOST}]
    assert pool.store.lookup(NS, k).hit_blocks == 0  # k0 is gone, so no prefix hits
    assert pool.store.lookup(NS, k[2:]).tiers == (Tier.DISK, Tier.DISK, Tier.HOST, Tier.HOST)
    stats = pool.store.stats()
    assert stats.tier(Tier.HOST).counters.evictions == 4
    assert (stats.tier(Tier.DISK).counters.demotions, stats.tier(Tier.DISK).counters.evictions) == (4, 2)
    assert {r.key for r in pool.disk.records()} == {k[2], k[3]}
    assert_served(pool, k[2:4], promoted=2)


def test_no_disk_tier_drops_on_eviction(make_pool):
    pool = make_pool(host_pages=2)
    k = keys(3)
    for key in k:
        put(pool, [key])
    assert [tier_of(pool, NS, key) for key in k] == [set(), {Tier.HOST}, {Tier.HOST}]
    assert pool.store.stats().tier(Tier.DISK) is None


def test_prefix_policy_evicts_leaves_before_their_prefix(make_pool):
    # The same steps under both policies: commit a 3-block chain, touch its root last,
    # then borrow one page.
    results = {}
    for policy in ("lru", "prefix"):
        pool = make_pool(host_pages=3, policy=policy)
        k = keys(3)
        put(pool, k)
        assert_served(pool, k[:1])
        pool.store.borrow("w", NS, 1)
        check(pool)
        results[policy] = [bool(tier_of(pool, NS, key)) for key in k]
        make_pool.close(pool)
    assert results["lru"] == [True, False, True]  # the least recently used block, mid-chain
    assert results["prefix"] == [True, True, False]  # the leaf, although its root was used last


def test_namespaces_are_isolated(make_pool):
    pool = make_pool(host_pages=4, disk_pages=4)
    key = keys(1)
    # The same key in two namespaces is two blocks with their own bytes.
    put(pool, key, namespace="A")
    assert pool.store.lookup("B", key).hit_blocks == 0
    with pytest.raises(NotFound):
        pool.store.acquire("s", "B", key)
    put(pool, key, namespace="B")
    assert len(pool.store.blocks) == 2
    assert pattern(key[0], pool.layout.page_bytes, "A") != pattern(key[0], pool.layout.page_bytes, "B")
    assert_served(pool, key, namespace="A")
    assert_served(pool, key, namespace="B")
    assert pool.store.lookup("C", key).hit_blocks == 0


def test_a_page_reused_by_another_namespace_is_zeroed(make_pool):
    pool = make_pool(host_pages=2, disk_pages=0)
    page = pool.layout.page_bytes
    # A writes a page and gives it back uncommitted: B's next borrow gets that slot, zeroed.
    a = pool.store.borrow("a", "A", 1)
    write_page(pool, a.slots[0], b"\xaa" * page)
    pool.store.release("a", a.lease_id)
    b = pool.store.borrow("b", "B", 1)
    assert b.slots == a.slots
    assert read_page(pool, b.slots[0]) == bytes(page)
    pool.store.release("b", b.lease_id)
    # A cached page of A evicted for B: also zeroed.
    put(pool, keys(2), namespace="A")
    b = pool.store.borrow("b", "B", 1)
    assert read_page(pool, b.slots[0]) == bytes(page)
    check(pool)


def test_a_failed_promotion_leaves_no_bytes_for_another_namespace(make_pool):
    pool = make_pool(host_pages=2, disk_pages=4)
    page = pool.layout.page_bytes
    secret = keys(1, seed=9)
    # B's page goes to disk, A's pages take the host.
    put(pool, secret, namespace="B", session="b")
    put(pool, keys(2), namespace="A", session="a")
    assert tier_of(pool, "B", secret[0]) == {Tier.DISK}
    # One byte of B's page rots on disk; B's acquire reads the rest of it into a host
    # slot that A used before, finds the checksum wrong and frees the slot.
    record = next(r for r in pool.disk.records() if r.namespace == "B")
    corrupt_disk_page(pool, record.slot, offset=page - 1)
    with pytest.raises(NotFound, match="failed its checksum"):
        pool.store.acquire("b", "B", secret)
    check(pool)
    # A's next page is that slot: it must not carry B's bytes.
    a = pool.store.borrow("a", "A", 1)
    data = read_page(pool, a.slots[0])
    assert data[: page - 1] != pattern(secret[0], page, "B")[: page - 1]
    assert data == bytes(page)


def corrupt_disk_page(pool, slot: int, offset: int = 100) -> None:
    """Flip a byte of the page whose disk copy has `slot`, in its first chunk."""
    record = next(r for r in pool.disk.records() if r.slot == slot)
    with open(pool.disk.slab_path, "r+b") as f:
        f.seek(record.extent[0] * pool.disk.chunk_bytes + offset)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0xFF]))


def test_corrupt_disk_page_on_acquire(make_pool):
    pool = make_pool(host_pages=3, disk_pages=6)
    k = keys(6)
    for key in k:
        put(pool, [key])  # k0..k2 on disk, k3..k5 in host
    record = next(r for r in pool.disk.records() if r.key == k[1])
    corrupt_disk_page(pool, record.slot)
    # Acquire k0..k2: k1 fails its checksum. The call raises NotFound naming it and holds nothing.
    with pytest.raises(NotFound, match="the page of key 1 .* failed its checksum"):
        pool.store.acquire("r", NS, k[:3])
    check(pool)
    stats = pool.store.stats()
    assert stats.tier(Tier.DISK).counters.corrupt_pages == 1
    assert stats.tier(Tier.HOST).pinned == 0 and stats.tier(Tier.DISK).pinned == 0
    assert stats.leases == 0 and stats.sessions == 0
    # k1 was dropped: it is a miss now, and gone from the disk index.
    assert tier_of(pool, NS, k[1]) == set()
    assert k[1] not in {r.key for r in pool.disk.records()}
    assert pool.store.lookup(NS, k).hit_blocks == 1
    # The good pages were loaded and are served with their bytes.
    assert_served(pool, [k[0], k[2]], promoted=0)
    # Recommitting k1 works.
    put(pool, [k[1]])
    assert_served(pool, k[:3])


@pytest.mark.parametrize("policy", ["lru", "prefix"])
def test_restart_recovers_host_pages_through_disk(make_pool, policy):
    pool = make_pool(host_pages=6, disk_pages=8, policy=policy, fsync="batch")
    disk_dir = make_pool.disk_dir
    chain, other = keys(3), keys(2, seed=5)
    put(pool, chain)
    put(pool, other, namespace="B")
    assert list(pool.disk.records()) == []  # write-back: nothing on disk yet
    # A clean close persists the host-only pages.
    make_pool.close(pool)
    # A new pool on the same directory finds them on disk, parents and all.
    again = make_pool(host_pages=6, disk_pages=8, policy=policy, disk_dir=disk_dir)
    check(again)
    assert again.store.lookup(NS, chain).tiers == (Tier.DISK,) * 3
    assert again.store.lookup("B", other).tiers == (Tier.DISK,) * 2
    assert again.store.blocks[(NS, chain[2])].parent == (NS, chain[1])
    assert again.store.blocks[(NS, chain[0])].parent is None
    assert again.store.stats().tier(Tier.DISK).cached == 5
    assert_served(again, chain, promoted=3)
    assert_served(again, other, namespace="B", promoted=2)


def test_persist_keeps_what_the_disk_can_hold_prefixes_first(make_pool):
    pool = make_pool(host_pages=4, disk_pages=2)
    chain = keys(4)
    put(pool, chain)
    assert pool.store.persist() == 2
    check(pool)
    assert {r.key for r in pool.disk.records()} == set(chain[:2])  # a prefix is worth more than a suffix


@pytest.mark.timeout(20)
def test_persist_terminates_on_a_parent_cycle(make_pool):
    # Parents are the client's word: two commits can name each other as parents. A clean
    # shutdown must still finish (it orders pages by depth in the chain).
    pool = make_pool(host_pages=4, disk_pages=4)
    a, b = keys(2, seed=3)
    put(pool, [a], parent=b)
    put(pool, [b], parent=a)
    assert pool.store.persist() == 2
    check(pool)


def test_a_parent_cycle_across_commits_stays_evictable_under_prefix(make_pool):
    # Two blocks that name each other as parents (across two commits) would have no leaf;
    # the prefix policy drops the edge that closes the loop, so both stay evictable.
    pool = make_pool(host_pages=2, policy="prefix")
    a, b = keys(2, seed=4)
    put(pool, [a], parent=b)
    put(pool, [b], parent=a)
    pool.store.borrow("w", NS, 2)  # needs both cached, unleased pages
    check(pool)


def test_prefetch_loads_disk_pages_unpinned_and_stops_at_a_miss(make_pool):
    pool = make_pool(host_pages=3, disk_pages=6)
    k = keys(5)
    for key in k:
        put(pool, [key])  # k0, k1 on disk; k2..k4 in host
    assert pool.store.prefetch("s", NS, [k[0], k[1], b"missing", k[2]]) == 2
    assert pool.store.wait_loaded(10)
    check(pool)
    assert Tier.HOST in tier_of(pool, NS, k[0]) and Tier.HOST in tier_of(pool, NS, k[1])
    assert pool.store.stats().tier(Tier.HOST).pinned == 0 and pool.store.stats().leases == 0
    assert pool.store.stats().tier(Tier.HOST).counters.promotions == 2
    assert_served(pool, k[:2], promoted=0)  # already here, with the committed bytes


def test_held_prefetched_pages_go_last_and_never_for_a_hint(make_pool):
    pool = make_pool(host_pages=2, disk_pages=6)  # the default hold (10 s) outlasts the test
    k = keys(4)
    put(pool, k[:2])
    put(pool, k[2:])  # k0, k1 demoted to disk; k2, k3 in host
    # Two hints fill the host with held pages (k2, k3 make way: they are not held).
    assert pool.store.prefetch("s", NS, k[:2]) == 2
    assert pool.store.wait_loaded(10)
    check(pool)
    # A third hint finds no room: a hint never evicts a held page, and changes nothing.
    before = snapshot(pool)
    assert pool.store.prefetch("s", NS, [k[2]]) == 0
    assert snapshot(pool) == before
    # An acquire is never refused for held pages: it takes the least recent one (k0).
    assert_served(pool, [k[2]], promoted=1)
    assert Tier.HOST not in tier_of(pool, NS, k[0]) and Tier.HOST in tier_of(pool, NS, k[1])
    # Held pages go last: a borrow of one page takes k2 (acquired, no longer held), not
    # the less recently used but held k1; a borrow of two takes k1 too.
    pool.store.release("w", pool.store.borrow("w", NS, 1).lease_id)
    assert Tier.HOST in tier_of(pool, NS, k[1]) and Tier.HOST not in tier_of(pool, NS, k[2])
    pool.store.release("w", pool.store.borrow("w", NS, 2).lease_id)
    assert Tier.HOST not in tier_of(pool, NS, k[1])
    check(pool)


def test_closing_a_pool_twice_is_harmless(make_pool):
    pool = make_pool(host_pages=4, disk_pages=2)
    disk_dir = make_pool.disk_dir
    put(pool, keys(4))  # more host-only pages than the disk can take: some stay unsaved
    pool.close()
    pool.close()
    make_pool.open.remove(pool)
    again = make_pool(host_pages=4, disk_pages=2, disk_dir=disk_dir)
    assert again.store.lookup(NS, keys(4)).hit_blocks == 2


def test_end_session_releases_everything(make_pool):
    pool = make_pool(host_pages=5)
    k = keys(2)
    put(pool, k)
    pool.store.acquire("gone", NS, k)
    pool.store.borrow("gone", NS, 2)
    pool.store.borrow("stays", NS, 1)
    check(pool)
    assert pool.store.end_session("gone") == 2
    check(pool)
    host = pool.store.stats().tier(Tier.HOST)
    assert (host.free, host.writing, host.cached, host.pinned) == (2, 1, 2, 0)
    assert set(pool.store.sessions) == {"stays"}
    assert pool.store.end_session("gone") == 0
    assert pool.store.end_session("never-seen") == 0


# -- caller mistakes: typed errors, and the state is left exactly as it was -----------
def _populated(make_pool):
    pool = make_pool(host_pages=4, disk_pages=4)
    k = keys(2)
    put(pool, k)
    read = pool.store.acquire("r", NS, k[:1])
    write = pool.store.borrow("w", NS, 1)
    check(pool)
    return pool, k, read, write


BAD_REQUESTS = {
    # InvalidArgument: malformed counts, keys, namespaces
    "borrow zero": (InvalidArgument, lambda s, k, r, w: s.borrow("w", NS, 0)),
    "borrow negative": (InvalidArgument, lambda s, k, r, w: s.borrow("w", NS, -2)),
    "borrow bool": (InvalidArgument, lambda s, k, r, w: s.borrow("w", NS, True)),
    "borrow str": (InvalidArgument, lambda s, k, r, w: s.borrow("w", NS, "1")),
    "borrow beyond tier": (InvalidArgument, lambda s, k, r, w: s.borrow("w", NS, 5)),
    "empty namespace": (InvalidArgument, lambda s, k, r, w: s.borrow("w", "", 1)),
    "namespace not str": (InvalidArgument, lambda s, k, r, w: s.lookup(b"ns", k)),
    "namespace too long": (InvalidArgument, lambda s, k, r, w: s.lookup("n" * 256, k)),
    "empty key": (InvalidArgument, lambda s, k, r, w: s.lookup(NS, [b""])),
    "key too long": (InvalidArgument, lambda s, k, r, w: s.lookup(NS, [b"k" * 65])),
    "key not bytes": (InvalidArgument, lambda s, k, r, w: s.acquire("r", NS, ["ab"])),
    "bad key in commit": (InvalidArgument, lambda s, k, r, w: s.commit("w", w.lease_id, [b"ok", 7])),
    "bad parent": (InvalidArgument, lambda s, k, r, w: s.commit("w", w.lease_id, [b"ok"], parent=b"")),
    "parent among keys": (InvalidArgument, lambda s, k, r, w: s.commit("w", w.lease_id, [b"ok"], parent=b"ok")),
    "too many keys": (InvalidArgument, lambda s, k, r, w: s.commit("w", w.lease_id, [b"a", b"b"])),
    "acquire same key twice": (InvalidArgument, lambda s, k, r, w: s.acquire("r", NS, [k[0], k[0]])),
    "acquire into disk": (InvalidArgument, lambda s, k, r, w: s.acquire("r", NS, k[:1], Tier.DISK)),
    "prefetch into disk": (InvalidArgument, lambda s, k, r, w: s.prefetch("s", NS, k, Tier.DISK)),
    "prefetch bad key": (InvalidArgument, lambda s, k, r, w: s.prefetch("s", NS, [b""])),
    # NotFound: unknown lease, uncached key
    "unknown lease": (NotFound, lambda s, k, r, w: s.release("w", 999)),
    "lease id not int": (NotFound, lambda s, k, r, w: s.release("w", "1")),
    "commit unknown lease": (NotFound, lambda s, k, r, w: s.commit("w", 999, [b"a"])),
    "acquire uncached": (NotFound, lambda s, k, r, w: s.acquire("r", NS, [k[0], b"nope"])),
    "acquire other namespace": (NotFound, lambda s, k, r, w: s.acquire("r", "other", k[:1])),
    # FailedPrecondition: wrong session, wrong kind
    "release from another session": (FailedPrecondition, lambda s, k, r, w: s.release("w", r.lease_id)),
    "commit from another session": (FailedPrecondition, lambda s, k, r, w: s.commit("r", w.lease_id, [b"a"])),
    "commit a read lease": (FailedPrecondition, lambda s, k, r, w: s.commit("r", r.lease_id, [b"a"])),
}


@pytest.mark.parametrize("name", BAD_REQUESTS)
def test_bad_requests_raise_and_change_nothing(make_pool, name):
    error, call = BAD_REQUESTS[name]
    pool, k, read, write = _populated(make_pool)
    before = snapshot(pool)
    with pytest.raises(error) as info:
        call(pool.store, k, read, write)
    assert str(info.value)  # a message saying what to fix
    assert snapshot(pool) == before
    check(pool)


def test_double_release_and_commit_after_end(make_pool):
    pool, k, read, write = _populated(make_pool)
    pool.store.release("r", read.lease_id)
    pool.store.commit("w", write.lease_id, [b"x"])
    before = snapshot(pool)
    for call in (
        lambda: pool.store.release("r", read.lease_id),
        lambda: pool.store.release("w", write.lease_id),
        lambda: pool.store.commit("w", write.lease_id, [b"y"]),
    ):
        with pytest.raises(FailedPrecondition, match="already been released or committed"):
            call()
        assert snapshot(pool) == before
    check(pool)


def test_acquire_larger_than_the_tier_is_invalid(make_pool):
    pool = make_pool(host_pages=2, disk_pages=4)
    k = keys(3)
    for key in k:
        put(pool, [key])
    before = snapshot(pool)
    with pytest.raises(InvalidArgument, match="exceeds the host tier's 2"):
        pool.store.acquire("r", NS, k)
    assert snapshot(pool) == before


def test_closing_pools_frees_their_host_memory(make_pool, shm_prefix):
    # Two layouts, two arenas, a memory file per namespace; host memory never has a path,
    # and closing the pools closes every file.
    first = make_pool(host_pages=2, disk_pages=2)
    second = make_pool(host_pages=2, layout=PageLayout(layers=2, kv_heads=1, head_dim=64, block_tokens=16))
    put(first, keys(1))
    put(first, keys(1), namespace="B")
    put(second, keys(1))
    files = [first.host.file_for(NS), first.host.file_for("B"), second.host.file_for(NS)]
    assert [n for n in os.listdir("/dev/shm") if shm_prefix in n] == []
    make_pool.close_all()
    for fd in files:
        with pytest.raises(OSError):
            os.fstat(fd)
