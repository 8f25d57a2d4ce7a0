"""Disk writes outside the store's lock (kvtier.core.disk_writes): eviction write-outs, write-back
and write-through, with a real BlockStore and a bookkeeping mover whose `store` can be held
at a gate, so a test decides what happens while a write is in flight."""
from __future__ import annotations

import threading

import pytest
from kvtier_client.tiers import Tier

from kvtier.core import BlockStore, Quota, clean_reserve
from kvtier.core.bookkeeping import BookkeepingDisk, bookkeeping_ports
from kvtier.core.invariants import check_invariants, check_quotas_kept
from kvtier.policy import ReuseAdmission
from kvtier.replay.mooncake import _LAYOUT

S = "session"
WAIT = 10


class GatedMover(BookkeepingDisk):
    """The bookkeeping mover, counting stores; while `gate` is closed a store waits at it
    (`entered` is set when one does), and `fail` makes stores raise OSError."""

    def __init__(self) -> None:
        super().__init__(_LAYOUT.page_bytes)
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.fail = False
        self.stored: list[list[bytes]] = []

    def store(self, moves):
        self.entered.set()
        assert self.gate.wait(WAIT)
        self.stored.append([record.key for _, record in moves])
        if self.fail:
            raise OSError(5, "injected EIO")
        return super().store(moves)


def store(mover: GatedMover, host: int = 2, disk: int = 4, **kw) -> BlockStore:
    return BlockStore(_LAYOUT, host_pages=host, disk_pages=disk, ports=bookkeeping_ports(_LAYOUT.page_bytes, disk=mover),
                      prefetch_hold=0.0, **kw)


def put(s: BlockStore, ns: str, *keys: bytes) -> None:
    lease = s.borrow(S, ns, len(keys))
    s.commit(S, lease.lease_id, list(keys))


def tiers(s: BlockStore, ns: str, key: bytes) -> set[Tier]:
    block = s.blocks.get((ns, key))
    return set(block.copies) if block else set()


class Background:
    """Run a store call on another thread; `result()` joins it."""

    def __init__(self, call) -> None:
        self.value = self.error = None
        self.thread = threading.Thread(target=self._run, args=(call,), daemon=True)
        self.thread.start()

    def _run(self, call) -> None:
        try:
            self.value = call()
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            self.error = exc

    def result(self):
        self.thread.join(WAIT)
        assert not self.thread.is_alive(), "the call did not finish"
        if self.error is not None:
            raise self.error
        return self.value


def eviction_in_flight(mover: GatedMover, s: BlockStore) -> Background:
    """Fill host with a1, a2 (dirty), then start a borrow that must write a1 out; return it
    held at the gate, its write in flight."""
    put(s, "A", b"a1")
    put(s, "A", b"a2")
    mover.gate.clear()
    borrow = Background(lambda: s.borrow("writer", "A", 1))
    assert mover.entered.wait(WAIT)
    return borrow


def test_an_eviction_writes_outside_the_lock_with_its_victim_readable_and_protected():
    mover = GatedMover()
    s = store(mover)
    borrow = eviction_in_flight(mover, s)
    # The write is in flight and the lock is free: a1 is still a host hit, can be acquired
    # and released, and is protected (saved), its disk slot `writing`.
    assert list(s.saving) == [("A", b"a1")] and s.blocks[("A", b"a1")].copies[Tier.HOST].saved
    check_invariants(s)
    assert s.stats().tier(Tier.DISK).writing == 1
    assert s.lookup("A", [b"a1", b"a2"]).tiers == (Tier.HOST, Tier.HOST)
    lease = s.acquire("reader", "A", [b"a2"])
    s.release("reader", lease.lease_id)
    mover.gate.set()
    grant = borrow.result()
    # The borrow ran again after the write: a1 now only on disk, no second write.
    assert mover.stored == [[b"a1"]]
    assert tiers(s, "A", b"a1") == {Tier.DISK} and tiers(s, "A", b"a2") == {Tier.HOST}
    assert len(grant.slots) == 1 and not s.saving
    check_invariants(s)


def test_a_victim_pinned_during_its_write_stays_and_another_goes():
    mover = GatedMover()
    s = store(mover)
    borrow = eviction_in_flight(mover, s)
    held = s.acquire("reader", "A", [b"a1"])  # pinned while its write runs
    mover.gate.set()
    borrow.result()
    # a1 keeps its host copy (pinned) and gained a disk copy; a2 was written and evicted.
    assert mover.stored == [[b"a1"], [b"a2"]]
    assert tiers(s, "A", b"a1") == {Tier.HOST, Tier.DISK}
    assert tiers(s, "A", b"a2") == {Tier.DISK}
    check_invariants(s)
    s.release("reader", held.lease_id)


def test_a_borrow_waits_for_a_write_back_in_flight_instead_of_evicting_hotter_pages():
    mover = GatedMover()
    s = store(mover)
    put(s, "A", b"a1")
    put(s, "A", b"a2")
    mover.gate.clear()
    cleaning = Background(lambda: s.write_back(reserve=1))  # writes a1, the eviction end
    assert mover.entered.wait(WAIT)
    borrow = Background(lambda: s.borrow("writer", "A", 1))
    borrow.thread.join(0.2)
    assert borrow.thread.is_alive()  # waiting for a1's write, not writing a2
    mover.gate.set()
    assert cleaning.result() == 1
    borrow.result()
    assert mover.stored == [[b"a1"]]  # the borrow itself wrote nothing
    assert tiers(s, "A", b"a1") == {Tier.DISK} and tiers(s, "A", b"a2") == {Tier.HOST}
    check_invariants(s)


def test_a_failed_eviction_write_frees_its_disk_slots_and_drops_the_victim():
    mover = GatedMover()
    mover.fail = True
    s = store(mover)
    put(s, "A", b"a1")
    put(s, "A", b"a2")
    s.borrow("writer", "A", 1)  # refused by nothing: a1 is dropped, as if the disk were full
    assert mover.stored == [[b"a1"]]  # tried once, not again
    disk = s.stats().tier(Tier.DISK)
    assert disk.counters.io_errors == 1 and disk.free == 4 and disk.writing == 0
    assert tiers(s, "A", b"a1") == set()
    check_invariants(s)


def test_a_failed_write_back_keeps_the_pages_cached_in_host():
    mover = GatedMover()
    mover.fail = True
    s = store(mover, host=4)
    put(s, "A", b"a1", b"a2")
    assert s.write_back(reserve=4) == 0  # nothing written
    disk = s.stats().tier(Tier.DISK)
    assert disk.counters.io_errors == 2 and disk.free == 4 and disk.writing == 0
    assert tiers(s, "A", b"a1") == tiers(s, "A", b"a2") == {Tier.HOST}
    check_invariants(s)


def test_write_back_keeps_a_reserve_of_clean_pages_so_a_borrow_writes_nothing():
    mover = GatedMover()
    s = store(mover, host=6, disk=8)
    for i in range(6):
        put(s, "A", b"a%d" % i)
    assert s.write_back(reserve=2) == 2  # the two least recently used
    assert s.write_back(reserve=2) == 0  # the reserve is there
    assert [tiers(s, "A", b"a%d" % i) for i in range(3)] == [{Tier.HOST, Tier.DISK}] * 2 + [{Tier.HOST}]
    s.borrow("writer", "A", 2)
    assert len(mover.stored) == 1  # the borrow evicted the clean pages without a write
    assert tiers(s, "A", b"a0") == tiers(s, "A", b"a1") == {Tier.DISK}
    check_invariants(s)


def test_write_back_writes_nothing_while_host_has_free_slots_enough():
    mover = GatedMover()
    s = store(mover, host=6, disk=8)
    put(s, "A", b"a1", b"a2")
    assert s.write_back(reserve=4) == 0 and not mover.stored


def test_a_write_through_commit_writes_outside_the_lock_its_pages_hits_meanwhile():
    mover = GatedMover()
    s = store(mover, host=4, write_through=True)
    mover.gate.clear()
    lease = s.borrow(S, "A", 2)
    commit = Background(lambda: s.commit(S, lease.lease_id, [b"a1", b"a2"]))
    assert mover.entered.wait(WAIT)
    assert s.lookup("A", [b"a1", b"a2"]).hit_blocks == 2  # published, while being written
    assert set(s.saving) == {("A", b"a1"), ("A", b"a2")}
    check_invariants(s)
    mover.gate.set()
    assert commit.result().committed == 2
    assert mover.stored == [[b"a1", b"a2"]]  # one batch
    assert tiers(s, "A", b"a1") == tiers(s, "A", b"a2") == {Tier.HOST, Tier.DISK}
    check_invariants(s)


def test_a_disk_write_in_flight_counts_against_its_namespace_s_disk_quota():
    mover = GatedMover()
    s = store(mover, host=2, disk=4)
    s.set_quotas({"A": Quota(max_disk_pages=1)})
    borrow = eviction_in_flight(mover, s)
    assert s.stats().namespace("A").tier(Tier.DISK).pages == 1  # the slot being written
    check_invariants(s)
    check_quotas_kept(s)
    mover.gate.set()
    borrow.result()
    put(s, "A", b"a3")  # a2 goes to disk: a1 gives up A's one disk page
    assert tiers(s, "A", b"a1") == set() and tiers(s, "A", b"a2") == {Tier.DISK}
    check_invariants(s)
    check_quotas_kept(s)


def test_a_write_back_never_gives_up_a_disk_copy_of_a_page_still_in_host():
    mover = GatedMover()
    s = store(mover, host=4, disk=2)
    put(s, "A", b"a1", b"a2", b"a3", b"a4")
    assert s.write_back(reserve=2) == 2  # a1, a2 clean; the disk is full
    s.acquire("r", "A", [b"a1", b"a2"])  # a3, a4 are now the eviction end
    assert s.write_back(reserve=2) == 0  # their room would dirty a1 and a2 again
    assert tiers(s, "A", b"a1") == tiers(s, "A", b"a2") == {Tier.HOST, Tier.DISK}


@pytest.mark.parametrize("host, reserve", [(3, 0), (255, 0), (256, 64), (4096, 128), (1 << 20, 1 << 15)])
def test_the_clean_reserve_rule(host, reserve):
    assert clean_reserve(host) == reserve


def test_disk_admission_keeps_pages_that_never_come_back_off_the_disk():
    mover = GatedMover()
    admission = ReuseAdmission(host_pages=2, disk_pages=64, min_samples=4)
    s = store(mover, host=2, disk=64, admission=admission)
    for i in range(80):  # one-off pages: each evicted by the next, none ever asked for again
        put(s, "A", b"once-%d" % i)
    disk = s.stats().tier(Tier.DISK).counters
    assert admission.return_rates[0] == 0.0 and disk.refused > 0
    written = {key for batch in mover.stored for key in batch}
    assert disk.demotions == len(written) and disk.demotions + disk.refused == 78
    refused = b"once-%d" % 77
    assert refused not in written and not tiers(s, "A", refused)  # gone, not on disk
    # Write-back asks the same question: a host of dirty pages of a refused kind writes nothing.
    assert s.write_back(2) == 0
    # A page that is used again in host is of another kind (used twice), and is written.
    put(s, "A", b"hot")
    grant = s.acquire(S, "A", [b"hot"], Tier.HOST)
    s.release(S, grant.lease_id)
    put(s, "A", b"x")
    put(s, "A", b"y")
    assert Tier.DISK in tiers(s, "A", b"hot")
    check_invariants(s)
