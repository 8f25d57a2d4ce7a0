"""The host arena's slot table and adoption: what a stale arena gives back, and what it
must not (torn entries, pages whose bytes changed, another layout's arena, stale bytes in
free slots handed to a new writer).

`close(keep=True)` leaves the arena and its table exactly as a crash would (files in
/dev/shm, the lock released); tests/server/test_warm_restart.py kills real daemons.
"""
from __future__ import annotations

import os
import time

from kvtier_client.ids import Slot
from kvtier_client.layout import PageLayout
from kvtier_client.shm import shm_path
from kvtier_client.tiers import Tier

from kvtier.core.ports import PageRecord
from kvtier.mechanism.host import HostArena
from kvtier.mechanism.slottable import table_path

LAYOUT = PageLayout(layers=1, kv_heads=1, head_dim=64, block_tokens=16, dtype="float16")  # 4 KiB pages


def _fill(arena: HostArena, slots: range, namespace: str = "ns") -> list[PageRecord]:
    for slot in slots:
        arena.page(slot)[:] = slot + 1
    return arena.publish([PageRecord(namespace, f"key-{slot}".encode(), Slot(slot), None) for slot in slots])


def test_a_stale_arena_is_adopted_with_its_published_pages(shm_prefix):
    name = f"{shm_prefix}-adopt"
    first = HostArena(name, LAYOUT, 8)
    _fill(first, range(5))
    first.unpublish([Slot(4)])  # evicted before the crash: not found again
    first.close(keep=True)

    second = HostArena(name, LAYOUT, 8)
    try:
        assert second.reused and not second.stale_removed
        assert sorted(r.slot for r in second.adopted) == [0, 1, 2, 3]
        assert all((second.page(r.slot) == r.slot + 1).all() for r in second.adopted)
        assert [r.key for r in sorted(second.adopted, key=lambda r: r.seq)] == [b"key-0", b"key-1", b"key-2", b"key-3"]
    finally:
        second.close()
    assert not os.path.exists(shm_path(name)) and not os.path.exists(table_path(shm_path(name)))


def test_changed_bytes_and_torn_entries_are_dropped(shm_prefix):
    name = f"{shm_prefix}-torn"
    first = HostArena(name, LAYOUT, 8)
    _fill(first, range(4))
    first.page(1)[7] ^= 0xFF  # an engine wrote into a published page
    first.close(keep=True)
    with open(table_path(shm_path(name)), "r+b") as table:  # a crash in the middle of writing slot 2's entry
        table.seek(4096 + 2 * 512 + 40)
        table.write(b"\xff\xff")

    second = HostArena(name, LAYOUT, 8)
    try:
        assert sorted(r.slot for r in second.adopted) == [0, 3]
    finally:
        second.close()


def test_an_arena_of_another_size_or_layout_is_replaced(shm_prefix):
    name = f"{shm_prefix}-other"
    first = HostArena(name, LAYOUT, 8)
    _fill(first, range(2))
    first.close(keep=True)
    other = PageLayout(layers=2, kv_heads=1, head_dim=32, block_tokens=16, dtype="float16")  # same page size
    second = HostArena(name, other, 8)
    try:
        assert second.stale_removed and not second.reused and second.adopted == []
        assert not second.page(0).any()
    finally:
        second.close()


def test_free_slots_of_an_adopted_arena_are_zeroed_before_a_writer_gets_them(make_pool):
    """Slots whose entries were dropped still hold some namespace's bytes: a borrow by any
    namespace must see zeros there, never them."""
    pool = make_pool(host_pages=4, disk_pages=0)
    lease = pool.store.borrow("s", "tenant-a", 4)
    for slot in lease.slots:
        pool.host.page(slot)[:] = 0xAA
    pool.store.commit("s", lease.lease_id, [b"a0", b"a1"])  # two published, two freed with a's bytes in them
    name = pool.host.name
    pool.store.stop_loads()
    pool.host.close(keep=True)  # the crash: nothing persisted, the arena left as it is

    again = make_pool(host_pages=4, disk_pages=0)  # the same arena name: the factory's prefix, the same layout
    assert again.host.name == name and again.host.reused
    assert again.store.lookup("tenant-a", [b"a0", b"a1"]).hit_blocks == 2
    grant = again.store.borrow("s", "tenant-b", 2)
    assert all(not again.host.page(slot).any() for slot in grant.slots)
    assert again.store.stats().tier(Tier.HOST).cached == 2
    again.store.release("s", grant.lease_id)


def test_a_stop_whose_deadline_passes_keeps_the_arena_for_the_next_daemon(make_pool):
    """Pool.close with a deadline already passed copies nothing to disk and keeps the arena
    and its slot table instead of removing them: the next pool adopts every page."""
    pool = make_pool(host_pages=4, disk_pages=8)
    lease = pool.store.borrow("s", "ns", 3)
    for i, slot in enumerate(lease.slots):
        pool.host.page(slot)[:] = i + 1
    pool.store.commit("s", lease.lease_id, [b"k0", b"k1", b"k2"])
    make_pool.close(pool, deadline=time.monotonic() - 1)

    again = make_pool(host_pages=4, disk_pages=8)
    assert again.host.reused and len(again.host.adopted) == 3
    assert again.store.lookup("ns", [b"k0", b"k1", b"k2"]).tiers == (Tier.HOST,) * 3
    assert again.store.stats().tier(Tier.DISK).cached == 0  # nothing was copied: the arena kept them
