"""The mechanism hears of every host slot that changes hands (`HostPort.give`): before
a writer, a disk load or a demotion puts another namespace's bytes in it, and only then."""
from __future__ import annotations

from kvtier_client.ids import Slot
from kvtier_client.tiers import Tier

from kvtier.core import BlockStore
from kvtier.core.bookkeeping import BookkeepingHost, bookkeeping_ports
from kvtier.replay.mooncake import _LAYOUT

S = "session"


class GivingHost(BookkeepingHost):
    def __init__(self) -> None:
        self.given: list[tuple[Slot, str]] = []

    def give(self, slot: Slot, namespace: str) -> None:
        self.given.append((slot, namespace))


def store(**tiers) -> tuple[BlockStore, GivingHost]:
    host = GivingHost()
    return BlockStore(_LAYOUT, ports=bookkeeping_ports(_LAYOUT.page_bytes, host=host), prefetch_hold=0.0, **tiers), host


def put(s: BlockStore, ns: str, *keys: bytes) -> list[Slot]:
    lease = s.borrow(S, ns, len(keys))
    s.commit(S, lease.lease_id, list(keys))
    return list(lease.slots)


def test_a_writer_gets_a_slot_given_to_its_namespace_once():
    s, mover = store(host_pages=1)
    (slot,) = put(s, "A", b"a1")
    assert mover.given == [(slot, "A")]
    put(s, "A", b"a2")  # the same slot, the same namespace: nothing to tell
    assert mover.given == [(slot, "A")]
    put(s, "B", b"b1")
    assert mover.given == [(slot, "A"), (slot, "B")]


def test_a_disk_load_gives_its_slot_to_the_page_s_namespace():
    s, mover = store(host_pages=1, disk_pages=2)
    put(s, "A", b"a1")
    (slot,) = put(s, "B", b"b1")  # a1 to disk
    s.release(S, s.acquire(S, "A", [b"a1"]).lease_id)  # b1 to disk, a1 loaded into the slot
    assert mover.given == [(slot, "A"), (slot, "B"), (slot, "A")]


def test_a_demotion_gives_its_slot_to_the_page_s_namespace():
    s, mover = store(device_pages=1, host_pages=2)
    put(s, "A", b"a1")
    s.release(S, s.acquire(S, "A", [b"a1"], Tier.DEVICE).lease_id)
    (slot,) = put(s, "B", b"b1")
    put(s, "B", b"b2")  # a1's host copy goes: a1 is on the device only
    assert set(s.blocks[("A", b"a1")].copies) == {Tier.DEVICE}
    # Device room for b2 demotes a1 to host, into b1's slot (b1 dropped: no disk).
    s.release(S, s.acquire(S, "B", [b"b2"], Tier.DEVICE).lease_id)
    assert s.blocks[("A", b"a1")].copies[Tier.HOST].slot == slot
    assert mover.given[-1] == (slot, "A")
