"""The host arena's slot table and adoption through a real arena keeper process: what a
crashed daemon's memory gives back, and what it must not (torn entries, pages whose bytes
changed, another layout's arena, bytes of free slots).

`keeper.crash()` hangs up as a dying daemon does and connects again as its successor;
tests/server/test_warm_restart.py kills real daemons.
"""
from __future__ import annotations

import os
import time

from kvtier_client.ids import Slot
from kvtier_client.layout import PageLayout
from kvtier_client.tiers import Tier

from kvtier.core.ports import PageRecord
from kvtier.mechanism.host import HostArena

LAYOUT = PageLayout(layers=1, kv_heads=1, head_dim=64, block_tokens=16, dtype="float16")  # 4 KiB pages


def _fill(arena: HostArena, slots: range, namespace: str = "ns") -> None:
    for slot in slots:
        arena.give(slot, namespace)
        arena.page(slot)[:] = slot + 1
    arena.publish(arena.stage([PageRecord(namespace, f"key-{slot}".encode(), Slot(slot), None) for slot in slots]))


def test_a_crashed_arena_is_adopted_with_its_published_pages(shm_prefix, keeper):
    name = f"{shm_prefix}-adopt"
    first = HostArena(name, LAYOUT, 8, keeper=keeper.client)
    _fill(first, range(3), "a")
    _fill(first, range(3, 5), "b")
    first.unpublish([Slot(4)])  # evicted before the crash: not found again
    first.close(keep=True)

    kept = keeper.kept(LAYOUT)  # first: the successor's connection
    second = HostArena(name, LAYOUT, 8, keeper=keeper.client, kept=kept)
    try:
        assert sorted((r.namespace, r.slot) for r in second.adopted) == [("a", 0), ("a", 1), ("a", 2), ("b", 3)]
        assert all((second.page(r.slot) == r.slot + 1).all() for r in second.adopted)
        assert [r.key for r in sorted(second.adopted, key=lambda r: r.seq)] == [b"key-0", b"key-1", b"key-2", b"key-3"]
        # Every other slot is cut out of every file: slot 4's bytes (b's) are gone from b's file.
        b = second.memory("b")
        assert not b.bytes[4 * LAYOUT.slot_bytes : 5 * LAYOUT.slot_bytes].any()
        assert not second.memory("a").bytes[3 * LAYOUT.slot_bytes : 8 * LAYOUT.slot_bytes].any()
    finally:
        second.close()
    assert keeper.client.take_all() == []  # a clean close leaves nothing with the keeper


def test_changed_bytes_and_torn_entries_are_dropped(shm_prefix, keeper):
    name = f"{shm_prefix}-torn"
    first = HostArena(name, LAYOUT, 8, keeper=keeper.client)
    _fill(first, range(4))
    first.page(1)[7] ^= 0xFF  # an engine wrote into a published page
    first.close(keep=True)
    kept = keeper.kept(LAYOUT)
    table = next(f for f in kept if f.meta["kind"] == "slots")
    os.pwrite(table.fd, b"\xff\xff", 4096 + 2 * 512 + 40)  # a crash in the middle of writing slot 2's entry

    second = HostArena(name, LAYOUT, 8, keeper=keeper.client, kept=kept)
    try:
        assert sorted(r.slot for r in second.adopted) == [0, 3]
    finally:
        second.close()


def test_an_arena_of_another_size_is_not_adopted(shm_prefix, keeper):
    name = f"{shm_prefix}-other"
    first = HostArena(name, LAYOUT, 8, keeper=keeper.client)
    _fill(first, range(2))
    first.close(keep=True)
    kept = keeper.kept(LAYOUT)
    second = HostArena(name, LAYOUT, 6, keeper=keeper.client, kept=kept)
    try:
        assert second.adopted == []
        second.give(0, "ns")
        assert not second.page(0).any()
    finally:
        second.close()
    assert keeper.client.take_all() == []  # the old files were freed, not left with the keeper


def test_free_slots_of_an_adopted_arena_hold_nothing_for_a_new_writer(make_kept_pool):
    """Slots whose entries were dropped held some namespace's bytes: a borrow by any
    namespace must see zeros there, never them."""
    pool = make_kept_pool(host_pages=4, disk_pages=0)
    lease = pool.store.borrow("s", "tenant-a", 4)
    for slot in lease.slots:
        pool.host.page(slot)[:] = 0xAA
    pool.store.commit("s", lease.lease_id, [b"a0", b"a1"])  # two published, two freed with a's bytes in them
    pool.store.stop_loads()
    pool.host.close(keep=True)  # the crash: nothing persisted, the arena left as it is
    make_kept_pool.open.remove(pool)

    again = make_kept_pool(host_pages=4, disk_pages=0, kept=make_kept_pool.keeper.kept(pool.layout))
    assert again.store.lookup("tenant-a", [b"a0", b"a1"]).hit_blocks == 2
    for namespace in ("tenant-b", "tenant-a"):
        grant = again.store.borrow("s", namespace, 2)
        assert all(not again.host.page(slot).any() for slot in grant.slots)
        again.store.release("s", grant.lease_id)
    assert again.store.stats().tier(Tier.HOST).cached == 2


def test_a_stop_whose_deadline_passes_keeps_the_arena_for_the_next_daemon(make_kept_pool):
    """Pool.close with a deadline already passed copies nothing to disk and leaves the arena
    and its slot table with the keeper: the next pool adopts every page."""
    pool = make_kept_pool(host_pages=4, disk_pages=8)
    lease = pool.store.borrow("s", "ns", 3)
    for i, slot in enumerate(lease.slots):
        pool.host.page(slot)[:] = i + 1
    pool.store.commit("s", lease.lease_id, [b"k0", b"k1", b"k2"])
    make_kept_pool.close(pool, deadline=time.monotonic() - 1)

    again = make_kept_pool(host_pages=4, disk_pages=8, kept=make_kept_pool.keeper.kept(pool.layout))
    assert len(again.host.adopted) == 3
    assert again.store.lookup("ns", [b"k0", b"k1", b"k2"]).tiers == (Tier.HOST,) * 3
    assert again.store.stats().tier(Tier.DISK).cached == 0  # nothing was copied: the arena kept them
