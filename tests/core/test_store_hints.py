"""Clients' hints in the block store (kvtier.core.control), through the bookkeeping ports:
a scenario per rule of docs/cache-control.md, and random sequences checking the one rule
no pressure may break: a hard-pinned host copy stays while it is pinned."""
from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvtier_client.errors import CapacityError, FailedPrecondition, InvalidArgument
from kvtier_client.steering import PinMode, Priority
from kvtier_client.tiers import Tier

from kvtier.core import BlockState, BlockStore, MissReason, Quota
from kvtier.core.bookkeeping import bookkeeping_ports
from kvtier.core.invariants import check_invariants
from kvtier.policy import FrecencyPolicy, LRUPolicy
from kvtier.policy.classes import Rank
from kvtier.replay.mooncake import _LAYOUT

S = "session"
HARD, SOFT = PinMode.HARD, PinMode.SOFT


def store(host: int = 4, disk: int = 0, policy=FrecencyPolicy, **kw) -> BlockStore:
    return BlockStore(_LAYOUT, host_pages=host, disk_pages=disk, policy=policy,
                      ports=bookkeeping_ports(_LAYOUT.page_bytes), prefetch_hold=0.0, **kw)


def put(s: BlockStore, ns: str, *keys: bytes, session: str = S) -> None:
    lease = s.borrow(session, ns, len(keys))
    s.commit(session, lease.lease_id, list(keys))
    check_invariants(s)


def where(s: BlockStore, ns: str, tier: Tier) -> set[bytes]:
    return {key for (n, key), b in s.blocks.items() if n == ns and tier in b.copies}


def keys(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}{i}".encode() for i in range(n)]


def test_a_soft_pinned_prefix_survives_a_flood_that_evicts_everything_else():
    s = store(host=4, disk=8)
    prefix = keys("sys", 3)
    put(s, "A", *prefix)
    assert s.control.pin(S, "A", prefix, SOFT, 60).applied == 3
    for i in range(40):
        put(s, "A" if i % 2 else "B", f"flood{i}".encode())
    assert set(prefix) <= where(s, "A", Tier.HOST)  # evicted last: never, while others could go
    assert len(where(s, "A", Tier.DISK) | where(s, "B", Tier.DISK)) == 8


def test_a_hard_pin_is_charged_to_the_guarantee_and_refused_past_it_changing_nothing():
    s = store(host=6)
    put(s, "A", *keys("a", 4))
    with pytest.raises(FailedPrecondition, match="no guaranteed host pages"):
        s.control.pin(S, "A", keys("a", 1), HARD, 0)
    s.set_quotas({"A": Quota(guaranteed_host_pages=2)})
    assert s.control.pin(S, "A", keys("a", 2), HARD, 0).applied == 2
    assert s.control.pin(S, "A", keys("a", 2), HARD, 30).applied == 2  # pinned again: not charged twice
    with pytest.raises(CapacityError, match="past its 2 guaranteed host pages"):
        s.control.pin(S, "A", keys("a", 3), HARD, 0)
    assert s.control.usage("A").hard == 2 and s.control.hints.rank(("A", b"a2")) is Rank.NORMAL
    check_invariants(s)


def test_hard_pinned_pages_stay_in_host_and_the_namespace_fails_rather_than_evict_them():
    s = store(host=4, disk=8)
    s.set_quotas({"A": Quota(guaranteed_host_pages=3, max_host_pages=4)})
    put(s, "A", *keys("a", 3))
    s.control.pin(S, "A", keys("a", 3), HARD, 0)
    for i in range(20):
        put(s, "A", f"x{i}".encode())
        put(s, "B", f"y{i}".encode())
    assert set(keys("a", 3)) <= where(s, "A", Tier.HOST)
    with pytest.raises(CapacityError):  # one slot left that is not pinned: two can't fit
        s.borrow(S, "A", 2)
    s.control.unpin("A", keys("a", 3))
    put(s, "A", b"n1", b"n2")
    assert len(set(keys("a", 3)) & where(s, "A", Tier.HOST)) <= 2


def test_retain_cold_goes_first_and_high_after_every_normal_page():
    s = store(host=4, policy=LRUPolicy)
    put(s, "A", b"h", b"c", b"n1", b"n2")
    s.control.retain(S, "A", [b"h"], Priority.HIGH, 60)
    s.control.retain(S, "A", [b"c"], Priority.COLD, 60)
    put(s, "A", b"m1")
    assert b"c" not in where(s, "A", Tier.HOST)  # the newest of the older pages, but cold
    put(s, "A", b"m2", b"m3")
    assert where(s, "A", Tier.HOST) == {b"h", b"m1", b"m2", b"m3"}  # high outlived the older normal ones


def test_ttl_ends_a_hint_and_a_hint_without_one_ends_with_its_session():
    s = store(host=4)
    put(s, "A", b"p", b"q")
    s.control.pin("s1", "A", [b"p"], SOFT, 0.2)
    s.control.pin("s2", "A", [b"q"], SOFT, 0)
    s.end_session("s1")
    assert s.control.usage("A").soft == 2  # p has a TTL: it outlives s1
    s.end_session("s2")
    assert s.control.usage("A").soft == 1
    time.sleep(0.25)
    assert s.control.hints.rank(("A", b"p")) is Rank.NORMAL and s.control.usage("A").soft == 0
    with pytest.raises(InvalidArgument, match="ttl"):
        s.control.pin(S, "A", [b"p"], SOFT, -1)


def test_demote_moves_host_pages_to_disk_and_skips_leased_and_hard_pinned_ones():
    s = store(host=4, disk=8)
    s.set_quotas({"A": Quota(guaranteed_host_pages=1)})
    put(s, "A", b"a", b"b", b"c")
    s.control.pin(S, "A", [b"c"], HARD, 0)
    grant = s.acquire(S, "A", [b"b"])
    result = s.control.demote("A", [b"a", b"b", b"c", b"zz"])
    assert (result.applied, result.missing, result.skipped) == (1, 1, 2), result.note
    assert where(s, "A", Tier.HOST) == {b"b", b"c"} and b"a" in where(s, "A", Tier.DISK)
    s.release(S, grant.lease_id)
    check_invariants(s)
    with pytest.raises(FailedPrecondition, match="no disk tier"):
        store(host=2).control.demote("A", [b"a"])


def test_drop_forgets_every_copy_and_stats_why_says_a_drop_did_it():
    s = store(host=2, disk=8)
    put(s, "A", b"a", b"b")
    s.control.pin(S, "A", [b"a"], SOFT, 60)
    put(s, "A", b"c", b"d")  # a and b reach disk as they leave host
    grant = s.acquire(S, "A", [b"d"])
    result = s.control.drop("A", [b"a", b"b", b"d"])
    assert (result.applied, result.skipped) == (2, 1)
    assert (("A", b"a") not in s.blocks and ("A", b"b") not in s.blocks and not s.control.hints.hints)
    why = s.explain("A", [b"a"]).blocks[0]
    assert (why.state, why.policy) == (BlockState.DROPPED, "")  # a reason of its own, not an eviction
    s.lookup("A", [b"a", b"b"])
    assert s.stats().namespace("A").misses[MissReason.DROPPED.value] == 2
    s.release(S, grant.lease_id)
    check_invariants(s)


def test_lowering_a_guarantee_turns_the_excess_hard_pins_soft():
    s = store(host=4)
    s.set_quotas({"A": Quota(guaranteed_host_pages=3)})
    put(s, "A", *keys("a", 3))
    s.control.pin(S, "A", keys("a", 3), HARD, 0)
    s.set_quotas({"A": Quota(guaranteed_host_pages=1)})
    usage = s.control.usage("A")
    assert (usage.hard, usage.soft) == (1, 2)
    check_invariants(s)


# -- random sequences: no pressure evicts a hard-pinned host copy ---------------------------
step = st.one_of(
    st.tuples(st.just("put"), st.sampled_from("AB"), st.integers(0, 11), st.integers(1, 3)),
    st.tuples(st.just("pin"), st.sampled_from("AB"), st.integers(0, 11), st.sampled_from([HARD, SOFT])),
    st.tuples(st.just("retain"), st.sampled_from("AB"), st.integers(0, 11), st.sampled_from(list(Priority))),
    st.tuples(st.just("unpin"), st.sampled_from("AB"), st.integers(0, 11), st.none()),
    st.tuples(st.just("demote"), st.sampled_from("AB"), st.integers(0, 11), st.none()),
    st.tuples(st.just("drop"), st.sampled_from("AB"), st.integers(0, 11), st.none()),
    st.tuples(st.just("read"), st.sampled_from("AB"), st.integers(0, 11), st.none()),
    st.tuples(st.just("end"), st.sampled_from("AB"), st.integers(0, 11), st.none()),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(step, max_size=40))
def test_no_pressure_evicts_a_hard_pinned_host_copy(steps):
    s = store(host=6, disk=6)
    s.set_quotas({"A": Quota(guaranteed_host_pages=2, max_host_pages=5), "B": Quota(guaranteed_host_pages=2)})
    for op, ns, i, arg in steps:
        key = f"k{i}".encode()
        pinned = {ref for ref, h in s.control.hints.hints.items()
                  if h.rank is Rank.HARD_PIN and Tier.HOST in s.blocks[ref].copies}
        session = f"{ns}{i % 2}"
        try:
            if op == "put":
                put(s, ns, *[f"k{(i + j) % 12}{ns}{len(s.blocks)}".encode() for j in range(arg)], session=session)
            elif op == "pin":
                s.control.pin(session, ns, [key], arg, 0 if i % 3 else 30)
            elif op == "retain":
                s.control.retain(session, ns, [key], arg, 30)
            elif op == "unpin":
                s.control.unpin(ns, [key])
            elif op == "demote":
                s.control.demote(ns, [key])
            elif op == "drop":
                s.control.drop(ns, [key])
            elif op == "read" and (ns, key) in s.blocks:
                s.release(session, s.acquire(session, ns, [key]).lease_id)
            elif op == "end":
                s.end_session(session)
        except (CapacityError, FailedPrecondition):
            pass
        check_invariants(s)
        touched = {(ns, key)} if op in ("unpin", "drop", "end", "pin") else set()
        for ref in pinned - touched:
            if op == "end" and ref not in s.control.hints.hints:
                continue  # the session's pins ended with it
            assert Tier.HOST in s.blocks[ref].copies, f"{op} evicted hard-pinned {ref}"


def test_a_prefetch_with_a_deadline_holds_pages_already_in_host_until_then():
    s = store(host=3, policy=LRUPolicy)
    put(s, "A", b"a", b"b", b"c")
    assert s.prefetch(S, "A", [b"a"], hold=60) == 1
    put(s, "A", b"d", b"e")  # a was the oldest: held, it stays; b and c go
    assert where(s, "A", Tier.HOST) == {b"a", b"d", b"e"}
    with pytest.raises(InvalidArgument, match="deadline"):
        s.prefetch(S, "A", [b"a"], hold=601)


def test_a_demote_to_a_full_disk_keeps_the_disk_copies_of_the_pages_it_demotes():
    """A demote's write-out and an eviction's are one rule (DiskWrites.write_out_first): the
    disk copy that makes a demoted page clean is never evicted to make room for another
    demoted page, so no page is written twice (before, the demote's own copy of the rule
    evicted a's disk copy for b, then wrote a again)."""
    s = store(host=4, disk=2, policy=LRUPolicy)
    put(s, "A", b"a")
    assert s.write_back(reserve=4) == 1  # a: in host and on disk (clean), the disk's oldest
    put(s, "A", b"c")
    s.control.demote("A", [b"c"])  # the disk is full: a, c
    put(s, "A", b"b")  # dirty: host only
    written = s.stats().tier(Tier.DISK).counters.demotions
    result = s.control.demote("A", [b"a", b"b"])
    assert result.applied == 2, result.note
    assert where(s, "A", Tier.DISK) == {b"a", b"b"} and not where(s, "A", Tier.HOST)
    assert s.stats().tier(Tier.DISK).counters.demotions - written == 1  # b only
    check_invariants(s)
