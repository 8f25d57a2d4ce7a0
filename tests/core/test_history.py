"""The miss history and `explain`: why a looked-up key missed, driven through the
bookkeeping mover (no bytes; a subclass fails the checksum of chosen disk pages)."""
from __future__ import annotations

import time
import tracemalloc
from dataclasses import asdict

import pytest
from kvtier_client.errors import NotFound
from kvtier_client.tiers import Tier

from kvtier.core import BlockState, BlockStore, MissReason
from kvtier.core.history import ENTRY_BYTES, MissHistory
from kvtier.core.bookkeeping import BookkeepingDisk, bookkeeping_ports
from kvtier.core.invariants import check_invariants
from kvtier.core.ports import LoadJob
from kvtier.replay.mooncake import _LAYOUT

NS, S = "ns", "session"


class RottenMover(BookkeepingDisk):
    """Disk pages whose key is in `rotten` fail their checksum on load."""

    def __init__(self) -> None:
        super().__init__(_LAYOUT.page_bytes)
        self.rotten: set[bytes] = set()

    def load(self, job: LoadJob) -> None:
        job.on_done(job, job.record.key not in self.rotten)


def store(host: int = 2, disk: int = 0, **kw) -> BlockStore:
    return BlockStore(_LAYOUT, host_pages=host, disk_pages=disk, ports=bookkeeping_ports(_LAYOUT.page_bytes, disk=RottenMover()),
                      prefetch_hold=0.0, **kw)


def put(s: BlockStore, *keys: bytes, ns: str = NS, parent: bytes | None = None) -> None:
    lease = s.borrow(S, ns, len(keys))
    s.commit(S, lease.lease_id, list(keys), parent)


def misses(s: BlockStore, ns: str = NS) -> dict[str, int]:
    return dict(s.stats().namespace(ns).misses)


def states(s: BlockStore, keys: list[bytes], ns: str = NS) -> list[BlockState]:
    return [b.state for b in s.explain(ns, keys).blocks]


def test_every_key_after_the_prefix_is_counted_by_reason():
    s = store(host=3)
    put(s, b"a", b"b", b"c")
    put(s, b"d")  # a (the oldest) is evicted
    result = s.lookup(NS, [b"a", b"b", b"c", b"x", b"d"])
    assert result.hit_blocks == 0
    assert misses(s) == {"never_stored": 1, "evicted": 1, "corrupt": 0, "beyond_prefix": 3, "dropped": 0}
    assert set(misses(s)) == {r.value for r in MissReason}
    usage = s.stats().namespace(NS)
    assert (usage.lookup_blocks, usage.miss_blocks) == (5, 5)
    # A hit prefix is not a miss; the counts add up.
    s.lookup(NS, [b"b", b"c", b"a"])
    assert misses(s)["evicted"] == 2 and sum(misses(s).values()) == s.stats().namespace(NS).miss_blocks


def test_explain_says_what_a_lookup_would_find_and_why():
    s = store(host=3)
    put(s, b"a", b"b", b"c")
    before = time.monotonic()
    put(s, b"d")
    explanation = s.explain(NS, [b"b", b"c", b"a", b"d", b"x"])
    assert explanation.hit_blocks == 2
    cached_b, cached_c, evicted, beyond, never = explanation.blocks
    assert [b.index for b in explanation.blocks] == [0, 1, 2, 3, 4]
    assert (cached_b.state, cached_b.tier) == (BlockState.CACHED, Tier.HOST)
    assert (evicted.state, evicted.tier, evicted.policy, evicted.own_pressure) == (BlockState.EVICTED, Tier.HOST, "lru", True)
    assert 0 <= evicted.seconds_ago <= time.monotonic() - before + 0.001
    assert (beyond.state, beyond.tier) == (BlockState.BEYOND_PREFIX, Tier.HOST)
    assert (never.state, never.tier) == (BlockState.NEVER_STORED, None)


def test_explain_changes_no_counter_and_no_recency():
    s = store(host=2)
    put(s, b"a", b"b")
    put(s, b"c")
    stats = asdict(s.stats())
    order = s.tiers[Tier.HOST].policy.victims(2, lambda ref: False)
    s.explain(NS, [b"a", b"b", b"c", b"x"])
    s.explain("another", [b"a"])
    assert asdict(s.stats()) == stats
    assert s.tiers[Tier.HOST].policy.victims(2, lambda ref: False) == order


def test_an_eviction_for_another_namespace_is_not_own_pressure():
    s = store(host=2)
    put(s, b"a", b"b")
    put(s, b"c", ns="other")
    (status,) = s.explain(NS, [b"a"]).blocks
    assert status.state is BlockState.EVICTED and not status.own_pressure
    # Namespaces keep their own records: the same key in another namespace was never stored.
    assert states(s, [b"a"], ns="other") == [BlockState.NEVER_STORED]
    s.lookup("other", [b"a"])
    assert misses(s, "other")["never_stored"] == 1 and misses(s)["evicted"] == 0


def test_a_page_evicted_from_disk_last_left_the_disk():
    s = store(host=1, disk=1)
    put(s, b"a")
    put(s, b"b")  # a to disk
    assert states(s, [b"a"]) == [BlockState.CACHED] and s.explain(NS, [b"a"]).blocks[0].tier is Tier.DISK
    put(s, b"c")  # b to disk, a off it
    (status,) = s.explain(NS, [b"a"]).blocks
    assert (status.state, status.tier) == (BlockState.EVICTED, Tier.DISK)


def test_a_page_dropped_for_its_checksum_is_corrupt():
    s = store(host=1, disk=2)
    put(s, b"a")
    put(s, b"b")  # a to disk
    s._ports.disk.rotten.add(b"a")
    with pytest.raises(NotFound, match="checksum"):
        s.acquire(S, NS, [b"a"])
    check_invariants(s)
    (status,) = s.explain(NS, [b"a"]).blocks
    assert (status.state, status.tier, status.policy) == (BlockState.CORRUPT, Tier.DISK, "")
    s.lookup(NS, [b"a"])
    assert misses(s)["corrupt"] == 1


def test_committing_a_key_again_clears_its_record():
    s = store(host=1)
    put(s, b"a")
    put(s, b"b")
    assert states(s, [b"a"]) == [BlockState.EVICTED]
    put(s, b"a")
    assert states(s, [b"a", b"b"]) == [BlockState.CACHED, BlockState.EVICTED]
    assert s._index.history.departure(NS, b"a") is None
    put(s, b"c")  # a evicted again: recorded afresh
    assert states(s, [b"a"]) == [BlockState.EVICTED]


def test_the_history_forgets_its_oldest_records_first():
    s = store(host=1, history_size=3)
    keys = [b"k%d" % i for i in range(6)]
    for key in keys:
        put(s, key)
    # k0..k4 were evicted; only the last three are remembered.
    assert states(s, keys) == [BlockState.NEVER_STORED] * 2 + [BlockState.EVICTED] * 3 + [BlockState.BEYOND_PREFIX]
    assert states(store(host=1, history_size=0), [b"x"]) == [BlockState.NEVER_STORED]


def test_the_history_is_bounded_in_total_not_per_namespace():
    """A client that misses in ever more namespaces grows it no further than its size; stats
    give its entries, limit and estimated bytes."""
    s = store(host=1, history_size=50)
    for i in range(200):
        put(s, b"k", ns=f"ns-{i}")  # each evicts the previous namespace's k
    usage = s.stats()
    assert (usage.history_entries, usage.history_limit) == (50, 50)
    assert usage.history_bytes == 50 * ENTRY_BYTES
    assert states(s, [b"k"], ns="ns-100") == [BlockState.NEVER_STORED]  # forgotten: among the oldest
    assert states(s, [b"k"], ns="ns-198") == [BlockState.EVICTED]


def test_an_entry_costs_about_what_stats_estimate():
    """ENTRY_BYTES against tracemalloc: refs of 16-byte keys (what xxh3-128 keys are), made
    as the index makes them, then kept only by the history."""
    history = MissHistory(size=20_000)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(20_000):
            history.record((NS, i.to_bytes(16, "big")), MissReason.EVICTED, Tier.HOST, time.monotonic(), "lru")
        per_entry = (tracemalloc.get_traced_memory()[0] - before) / 20_000
    finally:
        tracemalloc.stop()
    assert 0.7 * ENTRY_BYTES < per_entry < 1.3 * ENTRY_BYTES, per_entry
    departure = history.departure(NS, (19_999).to_bytes(16, "big"))
    assert (departure.reason, departure.tier, departure.policy) == (MissReason.EVICTED, Tier.HOST, "lru")


def test_every_reason_and_field_of_a_departure_comes_back_as_recorded():
    """An entry is one packed int: each reason (DROPPED is the fifth: 3 bits), tier, policy
    and pressure must read back unchanged."""
    history = MissHistory(size=64)
    when = time.monotonic()
    for i, (reason, tier) in enumerate((r, t) for r in MissReason for t in Tier):
        history.record((NS, bytes([i + 1])), reason, tier, when, f"policy-{i % 3}", bool(i % 2))
    for i, (reason, tier) in enumerate((r, t) for r in MissReason for t in Tier):
        gone = history.departure(NS, bytes([i + 1]))
        assert (gone.reason, gone.tier, gone.policy, gone.own_pressure) == (reason, tier, f"policy-{i % 3}", bool(i % 2))
        assert abs(gone.when - when) < 1e-5 and history.reason((NS, bytes([i + 1]))) is reason


def test_a_negative_history_size_is_refused():
    with pytest.raises(ValueError, match="history size"):
        store(history_size=-1)


def test_evicted_keys_of_a_namespace_stay_its_own():
    s = store(host=1)
    put(s, b"a", ns="A")
    put(s, b"a", ns="B")  # A's a evicted for B
    assert states(s, [b"a"], ns="A") == [BlockState.EVICTED]
    assert states(s, [b"a"], ns="B") == [BlockState.CACHED]
