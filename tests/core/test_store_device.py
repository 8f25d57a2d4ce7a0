"""The device tier's bookkeeping in the block store, on CPU: the store driven through the
replay's bookkeeping mover (kvtier.replay, the real component trace replay uses), which
completes every promotion at once and moves no bytes. The bytes themselves move through
the CUDA copy engine, tested on a GPU (tests/mechanism/test_device_gpu.py).

Layout of the scenarios: 2 device pages over 3 host pages over 4 disk pages."""
from __future__ import annotations

import pytest
from kvtier_client.errors import CapacityError, InvalidArgument
from kvtier_client.tiers import Tier

from kvtier.core.invariants import check_invariants
from kvtier.core.store import BlockStore
from kvtier.core.bookkeeping import BookkeepingDevice, bookkeeping_ports
from kvtier.replay.mooncake import _LAYOUT

NS, S = "ns", "session"


def store(device: int = 2, host: int = 3, disk: int = 4) -> BlockStore:
    return BlockStore(_LAYOUT, host_pages=host, disk_pages=disk, device_pages=device, ports=bookkeeping_ports(_LAYOUT.page_bytes),
                      prefetch_hold=0.0)


def put(s: BlockStore, *keys: bytes) -> None:
    lease = s.borrow(S, NS, len(keys))
    s.commit(S, lease.lease_id, list(keys))


def tiers(s: BlockStore, key: bytes) -> set[Tier]:
    block = s.blocks.get((NS, key))
    return set(block.copies) if block else set()


def test_acquire_into_device_promotes_from_host_and_keeps_the_host_copy():
    s = store()
    put(s, b"a", b"b")
    lease = s.acquire(S, NS, [b"a", b"b"], Tier.DEVICE)
    assert lease.tier is Tier.DEVICE and lease.ready == 2 and lease.transfer is not None
    assert tiers(s, b"a") == {Tier.DEVICE, Tier.HOST}
    assert s.stats().tier(Tier.DEVICE).counters.promotions == 2
    assert s.stats().tier(Tier.DEVICE).pinned == 2
    check_invariants(s)
    s.release(S, lease.lease_id)
    # Already there: a second acquire moves nothing and needs no wait.
    again = s.acquire(S, NS, [b"a"], Tier.DEVICE)
    assert again.transfer is None and again.promoted == 0
    assert s.lookup(NS, [b"a"]).tiers == (Tier.DEVICE,)
    check_invariants(s)


def test_acquire_into_device_climbs_from_disk_through_host():
    s = store()
    put(s, b"a", b"b", b"c")
    put(s, b"d", b"e", b"f")  # host holds 3: a, b, c go to disk
    assert tiers(s, b"a") == {Tier.DISK}
    lease = s.acquire(S, NS, [b"a"], Tier.DEVICE)
    assert lease.ready == 1
    assert tiers(s, b"a") == {Tier.DEVICE, Tier.HOST, Tier.DISK}
    check_invariants(s)


def test_device_eviction_demotes_device_only_pages_to_host_then_disk():
    s = store(device=1, host=2, disk=4)
    put(s, b"a")
    s.release(S, s.acquire(S, NS, [b"a"], Tier.DEVICE).lease_id)
    put(s, b"b", b"c")  # host evicts a (to disk): a is on device and disk only
    assert tiers(s, b"a") == {Tier.DEVICE, Tier.DISK}
    # b needs the one device page: a is demoted to host on the way out (host -> disk cascade).
    s.release(S, s.acquire(S, NS, [b"b"], Tier.DEVICE).lease_id)
    assert Tier.DEVICE not in tiers(s, b"a") and Tier.HOST in tiers(s, b"a")
    assert s.stats().tier(Tier.HOST).counters.demotions == 1
    check_invariants(s)


def test_host_acquire_of_a_device_only_page_copies_it_down():
    s = store(device=2, host=2, disk=0)
    put(s, b"a")
    s.release(S, s.acquire(S, NS, [b"a"], Tier.DEVICE).lease_id)
    put(s, b"b", b"c")  # no disk: host drops a, the device keeps it
    assert tiers(s, b"a") == {Tier.DEVICE}
    lease = s.acquire(S, NS, [b"a"], Tier.HOST)
    assert lease.ready == 1 and tiers(s, b"a") == {Tier.DEVICE, Tier.HOST}
    check_invariants(s)


def test_pinned_device_pages_are_never_evicted():
    s = store(device=2, host=3, disk=0)
    put(s, b"a", b"b", b"c")
    held = s.acquire(S, NS, [b"a", b"b"], Tier.DEVICE)
    with pytest.raises(CapacityError, match="device tier is full"):
        s.acquire(S, NS, [b"c"], Tier.DEVICE)
    assert tiers(s, b"c") == {Tier.HOST}
    check_invariants(s)
    s.release(S, held.lease_id)
    s.acquire(S, NS, [b"c"], Tier.DEVICE)
    check_invariants(s)


def test_device_leases_end_with_their_session():
    s = store()
    put(s, b"a")
    s.acquire(S, NS, [b"a"], Tier.DEVICE)
    assert s.end_session(S) == 1
    assert s.stats().tier(Tier.DEVICE).pinned == 0
    check_invariants(s)


def test_device_requests_on_a_daemon_without_a_device_say_so():
    s = store(device=0)
    put(s, b"a")
    with pytest.raises(InvalidArgument, match="this daemon has no device tier"):
        s.acquire(S, NS, [b"a"], Tier.DEVICE)
    with pytest.raises(InvalidArgument, match="prefetch loads pages into host, not device"):
        store().prefetch(S, NS, [b"a"], Tier.DEVICE)


def test_the_byte_slow_path_refuses_device_leases():
    from kvtier_client.errors import FailedPrecondition

    from kvtier.core.store import LeaseKind

    s = store()
    put(s, b"a")
    lease = s.acquire(S, NS, [b"a"], Tier.DEVICE)
    with pytest.raises(FailedPrecondition, match="acquire into host"):
        with s.lease_slots(S, lease.lease_id, LeaseKind.READ):
            pass


def test_making_device_room_keeps_the_host_copies_of_co_victims():
    """Evicting two device pages, one with a host copy: making host room for the other
    must not take the first's host copy (without a disk tier it would be lost)."""
    s = store(device=2, host=3, disk=0)
    put(s, b"a", b"b")
    s.release(S, s.acquire(S, NS, [b"a", b"b"], Tier.DEVICE).lease_id)
    put(s, b"c")
    put(s, b"d")  # host (3 pages) drops its coldest, a: a is device-only now
    assert tiers(s, b"a") == {Tier.DEVICE} and tiers(s, b"b") == {Tier.DEVICE, Tier.HOST}
    # c and d need both device pages: a and b go. Host is b, c, d, with c and d in use,
    # so a cannot be copied down; b's host copy must survive.
    s.acquire(S, NS, [b"c", b"d"], Tier.DEVICE)
    assert tiers(s, b"b") == {Tier.HOST}
    assert tiers(s, b"a") == set()
    check_invariants(s)


class GivingMover(BookkeepingDevice):
    """The replay's device port, also noting every device give and promotion in order; its
    device may have no memory left to give (`no_memory`), as a GPU whose old holders'
    processes keep what they mapped."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.no_memory = False

    def give(self, slots, namespace):
        if self.no_memory:
            raise CapacityError("GPU has no memory for a device page passing to another namespace")
        self.calls.append(("give", tuple(slots), namespace))

    def promote(self, pairs, on_done):
        self.calls.append(("promote", tuple(d for _, d in pairs)))
        return super().promote(pairs, on_done)


def giving_store() -> tuple[BlockStore, GivingMover]:
    mover = GivingMover()
    return BlockStore(_LAYOUT, host_pages=4, device_pages=2, ports=bookkeeping_ports(_LAYOUT.page_bytes, device=mover),
                      prefetch_hold=0.0), mover


def test_a_promotion_gives_its_device_slots_to_the_namespace_before_copying():
    s, mover = giving_store()
    for ns, key in (("A", b"a"), ("B", b"b")):
        lease = s.borrow(S, ns, 1)
        s.commit(S, lease.lease_id, [key])
    first = s.acquire(S, "A", [b"a"], Tier.DEVICE)
    second = s.acquire(S, "B", [b"b"], Tier.DEVICE)
    assert mover.calls == [("give", tuple(first.slots), "A"), ("promote", tuple(first.slots)),
                           ("give", tuple(second.slots), "B"), ("promote", tuple(second.slots))]
    check_invariants(s)


def test_a_device_without_memory_to_give_refuses_the_acquire_and_changes_nothing():
    s, mover = giving_store()
    lease = s.borrow(S, "A", 1)
    s.commit(S, lease.lease_id, [b"a"])
    mover.no_memory = True
    with pytest.raises(CapacityError, match="no memory"):
        s.acquire(S, "A", [b"a"], Tier.DEVICE)
    assert set(s.blocks[("A", b"a")].copies) == {Tier.HOST}
    assert s.stats().tier(Tier.DEVICE).free == 2 and not s.leases
    check_invariants(s)
    mover.no_memory = False  # the old holders let go: the same acquire works
    assert s.acquire(S, "A", [b"a"], Tier.DEVICE).ready == 1
    check_invariants(s)
