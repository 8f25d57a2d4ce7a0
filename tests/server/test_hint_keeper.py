"""Hints with a TTL outlive a restart (kvtier.server.hint_keeper): real pools, a real keeper
holding the host arena (warm restart), real LMDB disk tiers, the real hints file."""
from __future__ import annotations

import json
import time

from kvtier_client.steering import PinMode, Priority
from rpc import wait_for
from kvtier_client.tiers import Tier

from kvtier.core import Quota
from kvtier.core.invariants import check_invariants
from kvtier.policy.classes import Rank


def _put(pool, namespace: str, keys: list[bytes]) -> None:
    lease = pool.store.borrow("s", namespace, len(keys))
    for i, slot in enumerate(lease.slots):
        pool.host.page(slot)[:] = i + 1
    pool.store.commit("s", lease.lease_id, keys)


def test_a_warm_restart_keeps_ttl_hints_and_ends_the_sessions_ones(make_kept_pool):
    pool = make_kept_pool(host_pages=4, disk_pages=8)
    pool.store.set_quotas({"ns": Quota(guaranteed_host_pages=1)})
    _put(pool, "ns", [b"k0", b"k1", b"k2"])
    control = pool.store.control
    control.pin("s", "ns", [b"k0"], PinMode.HARD, 600)
    control.pin("s", "ns", [b"k1"], PinMode.SOFT, 0)  # lasts as long as session s: not kept
    control.retain("s", "ns", [b"k2"], Priority.HIGH, 600)
    make_kept_pool.close(pool, deadline=time.monotonic() - 1)  # the arena stays with the keeper

    saved = json.loads(open(pool.hints.path).read())
    assert saved["format"] == 1 and sorted(h["rank"] for h in saved["hints"]) == ["HARD_PIN", "HIGH"]
    again = make_kept_pool(host_pages=4, disk_pages=8, kept=make_kept_pool.keeper.kept(pool.layout))
    again.store.set_quotas({"ns": Quota(guaranteed_host_pages=1)})
    assert again.hints.restore() == 2
    ranks = again.store.control.hints
    assert [ranks.rank(("ns", k)) for k in (b"k0", b"k1", b"k2")] == [Rank.HARD_PIN, Rank.NORMAL, Rank.HIGH]
    assert "hard pin" in again.store.explain("ns", [b"k0"]).blocks[0].hint
    check_invariants(again.store)


def test_a_cold_restart_from_disk_keeps_hints_within_the_new_quotas(make_pool):
    pool = make_pool(host_pages=4, disk_pages=8)
    pool.store.set_quotas({"ns": Quota(guaranteed_host_pages=2)})
    _put(pool, "ns", [b"a", b"b"])
    pool.store.control.pin("s", "ns", [b"a", b"b"], PinMode.HARD, 600)
    make_pool.close(pool)  # a clean stop: pages to disk, the hints file written

    again = make_pool(host_pages=4, disk_pages=8)
    again.store.set_quotas({"ns": Quota(guaranteed_host_pages=1)})  # the operator lowered it meanwhile
    assert again.hints.restore() == 2
    usage = again.store.control.usage("ns")
    assert (usage.hard, usage.soft) == (1, 1)
    # The hard pin that stayed loads into host with no client asking (the keeper's first
    # sweep, kvtier.core.pin_loads); the one turned soft stays on disk.
    wait_for(lambda: again.store.control.usage("ns").hard_in_host == 1, 10, "the hard-pinned block in host")
    assert sorted(again.store.lookup("ns", [b"a", b"b"]).tiers) == [Tier.HOST, Tier.DISK]
    check_invariants(again.store)


def test_expired_hints_leave_the_file_and_a_broken_file_costs_only_the_hints(make_pool):
    pool = make_pool(host_pages=4, disk_pages=8)
    _put(pool, "ns", [b"a"])
    pool.hints.restore()
    pool.store.control.pin("s", "ns", [b"a"], PinMode.SOFT, 0.3)
    pool.hints.tick()
    assert len(json.loads(open(pool.hints.path).read())["hints"]) == 1
    time.sleep(0.4)
    pool.hints.tick()
    assert json.loads(open(pool.hints.path).read())["hints"] == [] and not pool.store.control.hints.hints
    path = pool.hints.path
    make_pool.close(pool)

    with open(path, "w") as f:
        f.write('{"format": 9, "hints": []}')  # a newer kvtier's: ignored, logged
    again = make_pool(host_pages=4, disk_pages=8)
    assert again.hints.restore() == 0 and again.store.lookup("ns", [b"a"]).hit_blocks == 1
