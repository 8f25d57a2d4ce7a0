"""Tenant quotas in the block store, driven through the bookkeeping mover (no bytes).

The rules (docs/policies.md, "Quotas"): a namespace at its maximum evicts its own pages
first, and fails if it cannot; no namespace is evicted below its guarantee by another's
request; without quotas nothing changes. A brute-force model of LRU with quotas checks
every step of random sequences; scenario tests name each rule.
"""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvtier_client.errors import CapacityError
from kvtier_client.tiers import Tier

from kvtier.core import BlockStore, Quota
from kvtier.core.bookkeeping import bookkeeping_ports
from kvtier.core.invariants import check_guarantees_kept, check_invariants, check_quotas_kept
from kvtier.policy import LRUPolicy, PrefixLRUPolicy
from kvtier.replay.mooncake import _LAYOUT

S = "session"


def store(host: int = 4, disk: int = 0, device: int = 0, policy=LRUPolicy, **kw) -> BlockStore:
    return BlockStore(_LAYOUT, host_pages=host, disk_pages=disk, device_pages=device, policy=policy,
                      ports=bookkeeping_ports(_LAYOUT.page_bytes), prefetch_hold=0.0, **kw)


def put(s: BlockStore, ns: str, *keys: bytes) -> None:
    lease = s.borrow(S, ns, len(keys))
    s.commit(S, lease.lease_id, list(keys))
    check_invariants(s)


def pages(s: BlockStore, ns: str, tier: Tier = Tier.HOST) -> int:
    usage = s.stats().namespace(ns)
    return usage.tier(tier).pages if usage else 0


def cached(s: BlockStore, ns: str, tier: Tier = Tier.HOST) -> set[bytes]:
    return {key for (n, key), b in s.blocks.items() if n == ns and tier in b.copies}


def k(name: str) -> bytes:
    return name.encode()


# -- the rules, one scenario each -------------------------------------------------------
def test_at_its_maximum_a_namespace_evicts_its_own_pages_first():
    s = store(host=4)
    s.set_quotas({"A": Quota(max_host_pages=2)})
    put(s, "A", k("a1"))
    put(s, "B", k("b1"))
    put(s, "A", k("a2"))
    # A is at its maximum: a3 takes the place of A's oldest page although a slot is free
    # and B's page is older.
    put(s, "A", k("a3"))
    assert cached(s, "A") == {k("a2"), k("a3")} and cached(s, "B") == {k("b1")}
    assert s.stats().tier(Tier.HOST).free == 1
    check_quotas_kept(s)


def test_a_namespace_at_its_maximum_with_nothing_of_its_own_to_evict_is_refused():
    s = store(host=4)
    s.set_quotas({"A": Quota(max_host_pages=2)})
    put(s, "A", k("a1"), k("a2"))
    read = s.acquire(S, "A", [k("a1"), k("a2")])  # both pinned
    before = s.stats()
    with pytest.raises(CapacityError, match="namespace 'A' is at its host quota of 2 pages"):
        s.borrow(S, "A", 1)
    assert s.stats() == before
    # Once released, its own oldest page goes.
    s.release(S, read.lease_id)
    put(s, "A", k("a3"))
    assert cached(s, "A") == {k("a2"), k("a3")}


def test_pages_borrowed_for_writing_count_against_the_quota():
    s = store(host=4)
    s.set_quotas({"A": Quota(max_host_pages=2)})
    lease = s.borrow(S, "A", 2)
    assert pages(s, "A") == 2
    with pytest.raises(CapacityError, match="quota"):
        s.borrow(S, "A", 1)
    with pytest.raises(CapacityError, match="quota"):
        s.borrow(S, "A", 3)  # more than its maximum at all
    s.release(S, lease.lease_id)
    assert pages(s, "A") == 0


def test_another_namespace_never_evicts_below_a_guarantee():
    s = store(host=4)
    s.set_quotas({"B": Quota(guaranteed_host_pages=2)})
    put(s, "B", k("b1"), k("b2"), k("b3"))
    # A needs 4 pages: 1 free, and B can give only 1 of its 3: refused, nothing changed.
    before = s.stats()
    with pytest.raises(CapacityError, match="guaranteed to other namespaces"):
        s.borrow(S, "A", 4)
    assert s.stats() == before
    put(s, "A", k("a1"), k("a2"))  # takes the free slot and B's oldest page
    assert cached(s, "B") == {k("b2"), k("b3")}
    # B is at its guarantee: A's next page evicts A's own oldest, though B's are older.
    put(s, "A", k("a3"))
    assert cached(s, "B") == {k("b2"), k("b3")} and cached(s, "A") == {k("a2"), k("a3")}


def test_a_guarantee_does_not_protect_a_namespace_from_itself():
    s = store(host=2)
    s.set_quotas({"B": Quota(guaranteed_host_pages=2)})
    put(s, "B", k("b1"), k("b2"))
    put(s, "B", k("b3"))
    assert cached(s, "B") == {k("b2"), k("b3")}


def test_a_namespace_below_its_guarantee_loses_nothing_to_others():
    s = store(host=3)
    s.set_quotas({"B": Quota(guaranteed_host_pages=2)})
    put(s, "B", k("b1"))
    put(s, "A", k("a1"), k("a2"))
    with pytest.raises(CapacityError):
        s.borrow(S, "A", 3)  # A's two and... B's one is below its guarantee
    put(s, "A", k("a3"))  # A's own oldest goes
    assert cached(s, "B") == {k("b1")}


def test_the_prefix_policy_is_asked_again_when_a_guarantee_cuts_its_proposal():
    s = store(host=4, policy=PrefixLRUPolicy)
    s.set_quotas({"B": Quota(guaranteed_host_pages=1)})
    # B's chain b1 <- b2 is older than A's a1 <- a2; B can give one page: the leaf b2.
    lease = s.borrow(S, "B", 2)
    s.commit(S, lease.lease_id, [k("b1"), k("b2")])
    lease = s.borrow(S, "A", 2)
    s.commit(S, lease.lease_id, [k("a1"), k("a2")])
    put(s, "C", k("c1"), k("c2"))  # proposal b2, b1 is cut after b2; then a2 is asked for
    assert cached(s, "B") == {k("b1")} and cached(s, "A") == {k("a1")}
    check_invariants(s)


def test_without_quotas_any_namespace_evicts_any_other():
    s = store(host=2)
    put(s, "B", k("b1"), k("b2"))
    put(s, "A", k("a1"), k("a2"))
    assert cached(s, "B") == set()


def test_a_prefetch_at_its_quota_just_stops():
    s = store(host=2, disk=4)
    put(s, "A", k("a1"), k("a2"))
    put(s, "B", k("b1"), k("b2"))  # A's pages go to disk
    s.set_quotas({"A": Quota(max_host_pages=1)})
    read = s.acquire(S, "A", [k("a1")])  # A's one page, pinned
    s._ports.disk.prefetch_room = lambda: 10  # the bookkeeping disk takes prefetches here
    assert s.prefetch(S, "A", [k("a2")]) == 0
    s.release(S, read.lease_id)
    check_invariants(s)


# -- disk and device ------------------------------------------------------------------
def test_a_demotion_beyond_the_disk_quota_evicts_the_namespace_s_own_disk_pages():
    s = store(host=2, disk=4)
    s.set_quotas({"A": Quota(max_disk_pages=1)})
    put(s, "B", k("b1"))
    put(s, "A", k("a1"))
    put(s, "A", k("a2"), k("a3"))  # b1 and a1 go to disk
    assert cached(s, "A", Tier.DISK) == {k("a1")} and cached(s, "B", Tier.DISK) == {k("b1")}
    # a2 and a3 leave host: A's disk quota takes one of them, in eviction order, once a1
    # has given up its place; a3 is not copied (dropped, as when the disk is full).
    put(s, "B", k("b2"), k("b3"))
    assert cached(s, "A", Tier.DISK) == {k("a2")} and cached(s, "B", Tier.DISK) == {k("b1")}
    assert ("A", k("a3")) not in s.blocks and pages(s, "A", Tier.DISK) == 1
    assert s.explain("A", [k("a1")]).blocks[0].own_pressure


def test_a_disk_copy_that_does_not_fit_is_not_made():
    s = store(host=3, disk=3, write_through=True)
    s.set_quotas({"A": Quota(max_disk_pages=1)})
    put(s, "A", k("a1"))  # written through
    put(s, "A", k("a2"))  # a1's disk copy gives up A's one disk page for a2
    assert cached(s, "A", Tier.DISK) == {k("a2")}
    # At a clean stop no disk copy of a page still in host is given up: A's only disk page
    # stays, and a1 does not fit A's disk quota: not copied.
    assert s.persist() == 0
    assert cached(s, "A", Tier.DISK) == {k("a2")} and cached(s, "A") == {k("a1"), k("a2")}
    check_invariants(s)


def test_a_guaranteed_disk_keeps_other_namespaces_pages_off_it():
    s = store(host=1, disk=2)
    s.set_quotas({"B": Quota(guaranteed_disk_pages=2)})
    put(s, "B", k("b1"))
    put(s, "B", k("b2"))
    put(s, "B", k("b3"))  # b1, b2 on disk
    put(s, "A", k("a1"))  # b3 demoted for B: B's own disk page b1 goes
    put(s, "A", k("a2"))  # a1 cannot go to disk: B is at its guarantee there
    assert cached(s, "B", Tier.DISK) == {k("b2"), k("b3")}
    assert (("A", k("a1"))) not in s.blocks


def test_device_pages_demoted_for_a_namespace_at_its_host_quota_are_dropped():
    s = store(device=1, host=3, disk=0)
    put(s, "A", k("a1"))
    s.release(S, s.acquire(S, "A", [k("a1")], Tier.DEVICE).lease_id)
    s.set_quotas({"A": Quota(max_host_pages=1)})
    # a1 leaves host (B fills it) and lives on the device only.
    put(s, "B", k("b1"), k("b2"), k("b3"))
    assert set(s.blocks[("A", k("a1"))].copies) == {Tier.DEVICE}
    put(s, "A", k("a2"))  # evicts B's oldest: A holds one host page, its maximum
    pinned = s.acquire(S, "A", [k("a2")])
    # Another device page for B pushes a1 off the device; A cannot take it into host.
    s.release(S, s.acquire(S, "B", [k("b3")], Tier.DEVICE).lease_id)
    assert ("A", k("a1")) not in s.blocks
    assert s.explain("A", [k("a1")]).blocks[0].tier is Tier.DEVICE
    s.release(S, pinned.lease_id)
    check_invariants(s)
    check_quotas_kept(s)


# -- set_quotas -------------------------------------------------------------------------
@pytest.mark.parametrize("quotas, message", [
    ({"A": Quota(max_host_pages=2, guaranteed_host_pages=3)}, "guaranteed host pages \\(3\\) exceed its maximum \\(2\\)"),
    ({"A": Quota(guaranteed_host_pages=3), "B": Quota(guaranteed_host_pages=2)}, "add up to 5, more than the tier's 4"),
    ({"A": Quota(guaranteed_disk_pages=5)}, "guaranteed disk pages add up to 5, more than the tier's 4"),
    ({"A": Quota(max_disk_pages=-1)}, "must be >= 0"),
])
def test_set_quotas_refuses_quotas_it_cannot_keep_and_keeps_the_old_ones(quotas, message):
    s = store(host=4, disk=4)
    s.set_quotas({"A": Quota(max_host_pages=3)})
    put(s, "A", k("a1"))
    with pytest.raises(ValueError, match=message):
        s.set_quotas(quotas)
    assert s.stats().namespace("A").tier(Tier.HOST).max_pages == 3


def test_a_tier_the_store_lacks_is_not_checked():
    s = store(host=4)
    s.set_quotas({"A": Quota(guaranteed_disk_pages=100)})


def test_lowering_a_quota_evicts_nothing_until_the_next_allocation():
    s = store(host=4)
    put(s, "A", k("a1"), k("a2"), k("a3"))
    s.set_quotas({"A": Quota(max_host_pages=1)})
    assert pages(s, "A") == 3
    put(s, "A", k("a4"))  # now A gives up three pages for one
    assert cached(s, "A") == {k("a4")}
    s.set_quotas({})  # no quotas at all: back to the plain policy
    put(s, "A", k("a5"), k("a6"), k("a7"))
    assert pages(s, "A") == 4


def test_stats_show_each_namespace_s_pages_quota_hits_and_evictions():
    s = store(host=2)
    s.set_quotas({"A": Quota(max_host_pages=2, guaranteed_host_pages=1)})
    put(s, "A", k("a1"), k("a2"))
    put(s, "B", k("b1"))
    s.lookup("A", [k("a2"), k("a1")])
    a, b = s.stats().namespace("A"), s.stats().namespace("B")
    host = a.tier(Tier.HOST)
    assert (host.pages, host.max_pages, host.guaranteed_pages, host.hits, host.evictions) == (1, 2, 1, 1, 1)
    assert (a.lookup_blocks, a.miss_blocks) == (2, 1)
    assert b.tier(Tier.HOST).pages == 1 and b.tier(Tier.HOST).max_pages == 0
    assert [n.namespace for n in s.stats().namespaces] == ["A", "B"]


# -- brute force: random sequences against a model of LRU with quotas -----------------
class Model:
    """LRU over one host tier with quotas, as docs/policies.md states the rules."""

    def __init__(self, capacity: int, quotas: dict[str, Quota]) -> None:
        self.capacity = capacity
        self.quotas = quotas
        self.order: list[tuple[str, bytes]] = []  # oldest first
        self.pinned: set[tuple[str, bytes]] = set()

    def count(self, ns: str) -> int:
        return sum(1 for n, _ in self.order if n == ns)

    def put(self, ns: str, keys: list[bytes]) -> bool:
        """Borrow len(keys) pages and commit them; False if refused (nothing changes)."""
        n, quota = len(keys), self.quotas.get(ns, Quota())
        victims: list[tuple[str, bytes]] = []
        over = self.count(ns) + n - quota.max_host_pages if quota.max_host_pages else 0
        if over > 0:
            victims = [r for r in self.order if r[0] == ns and r not in self.pinned][:over]
            if len(victims) < over:
                return False
        short = n - (self.capacity - len(self.order)) - len(victims)
        taken: dict[str, int] = {}
        for ref in self.order:
            if short <= 0:
                break
            other = ref[0]
            if ref in victims or ref in self.pinned:
                continue
            floor = self.quotas.get(other, Quota()).guaranteed_host_pages
            if other != ns and self.count(other) - taken.get(other, 0) <= floor:
                continue
            victims.append(ref)
            taken[other] = taken.get(other, 0) + 1
            short -= 1
        if short > 0:
            return False
        self.order = [r for r in self.order if r not in victims]
        for key in keys:
            ref = (ns, key)
            if ref in self.order:
                self.order.remove(ref)
            self.order.append(ref)
        return True

    def touch(self, ns: str, key: bytes) -> None:
        self.order.remove((ns, key))
        self.order.append((ns, key))


quota_st = st.builds(
    lambda mx, g: Quota(max_host_pages=mx, guaranteed_host_pages=min(g, mx) if mx else g),
    st.integers(0, 4), st.integers(0, 2),
)


@settings(max_examples=300, deadline=None)
@given(
    quotas=st.dictionaries(st.sampled_from("ABC"), quota_st, max_size=3),
    steps=st.lists(st.tuples(st.sampled_from("ABC"), st.lists(st.integers(0, 7), min_size=1, max_size=3, unique=True),
                             st.booleans()), max_size=40),
)
def test_lru_with_quotas_matches_the_model(quotas, steps):
    capacity = 6
    if sum(q.guaranteed_host_pages for q in quotas.values()) > capacity:
        return
    s = store(host=capacity)
    s.set_quotas(quotas)
    model = Model(capacity, quotas)
    leases = []
    for ns, ids, pin in steps:
        keys = [b"k%d" % i for i in ids]
        before = s.stats()
        try:
            lease = s.borrow(S, ns, len(keys))
        except CapacityError:
            assert not model.put(ns, keys), f"store refused what the model takes: {ns} {keys}"
            assert s.stats() == before
            continue
        s.commit(S, lease.lease_id, keys)
        assert model.put(ns, keys), "store took what the model refuses"
        check_invariants(s)
        check_quotas_kept(s)
        check_guarantees_kept(before, s.stats(), ns)
        policy = s.tiers[Tier.HOST].policy
        assert model.order == policy.victims(len(policy), lambda ref: False)
        if pin:  # a read lease on this namespace's oldest page pins it for the next steps
            oldest = next((r for r in model.order if r[0] == ns), None)
            if oldest is not None and oldest not in model.pinned:
                leases.append(s.acquire(S, ns, [oldest[1]]).lease_id)
                model.touch(*oldest)
                model.pinned.add(oldest)
        if len(leases) > 2:
            s.release(S, leases.pop(0))
            model.pinned = {ref for ref in model.pinned if ref in {r for lid in leases for r in s.leases[lid].refs}}


@pytest.mark.parametrize("policy", [LRUPolicy, PrefixLRUPolicy])
def test_random_traffic_keeps_quotas_and_guarantees(policy):
    rng = random.Random(7)
    s = store(host=8, disk=12, policy=policy)
    s.set_quotas({
        "A": Quota(max_host_pages=4, max_disk_pages=5, guaranteed_host_pages=2, guaranteed_disk_pages=3),
        "B": Quota(guaranteed_host_pages=3, guaranteed_disk_pages=4),
        "C": Quota(max_host_pages=3, max_disk_pages=3),
    })
    for step in range(600):
        ns = rng.choice("ABCD")
        keys = [b"%s%d" % (ns.encode(), rng.randrange(30)) for _ in range(rng.randint(1, 3))]
        keys = list(dict.fromkeys(keys))
        before = s.stats()
        if rng.random() < 0.3:
            cached_keys = [key for key in keys if (ns, key) in s.blocks]
            if cached_keys:
                try:
                    s.release(S, s.acquire(S, ns, cached_keys).lease_id)
                except CapacityError:
                    assert s.stats() == before
        else:
            try:
                lease = s.borrow(S, ns, len(keys))
            except CapacityError:
                assert s.stats() == before
                continue
            s.commit(S, lease.lease_id, keys, parent=b"%s-root" % ns.encode())
        check_invariants(s)
        check_quotas_kept(s)
        check_guarantees_kept(before, s.stats(), ns)


@pytest.mark.parametrize("policy", [LRUPolicy, PrefixLRUPolicy])
@pytest.mark.parametrize("guarantee", [8, 0])
def test_a_flooding_namespace_leaves_a_guaranteed_one_its_hot_set(policy, guarantee):
    """A commits page after page; B, guaranteed 8 host pages, keeps its 8 hot pages (its
    colder ones may go) and hits on them every time. Without the guarantee it loses them."""
    s = store(host=32, disk=16, policy=policy)
    if guarantee:
        s.set_quotas({"B": Quota(guaranteed_host_pages=guarantee)})
    for i in range(4):
        put(s, "B", b"cold%d" % i)
    hot = [b"hot%d" % i for i in range(8)]
    put(s, "B", *hot)
    hits = 0
    for i in range(1500):
        put(s, "A", b"flood%d" % i)
        if i % 50 == 49:
            found = s.lookup("B", hot).hit_blocks
            hits += found
            if found:  # B uses what it found
                s.release(S, s.acquire(S, "B", hot[:found]).lease_id)
            assert pages(s, "B") >= guarantee
    usage = s.stats().namespace("B").tier(Tier.HOST)
    if guarantee:
        assert hits == 8 * 30 and usage.hits == 8 * 30
        assert cached(s, "B") == set(hot) and usage.pages == guarantee
    else:
        assert hits < 8 * 30
