"""The load planner: the decision on fixed figures, then against a real daemon's measured
bandwidths (the prefix the planner declines when the disk is slower than the prefill)."""
from __future__ import annotations

import pytest
from client_helpers import LAYOUT, kv_pages, tokens
from kvtier_client import KVTierClient, Tier
from kvtier_client.integrations.planner import Planner, load_seconds_per_block, plan_load

MiB = 1 << 20
FAST_HOST_SLOW_DISK = {Tier.HOST: 10e9, Tier.DISK: 100e6}


def test_loads_everything_until_the_prefill_rate_is_known():
    plan = plan_load([Tier.DISK] * 3, page_bytes=MiB, block_tokens=16, bandwidth=FAST_HOST_SLOW_DISK,
                     prefill_tokens_per_second=None)
    assert (plan.load_blocks, plan.cached_blocks) == (3, 3)
    assert "not measured" in plan.reason


def test_nothing_cached_loads_nothing():
    plan = plan_load([], page_bytes=MiB, block_tokens=16, bandwidth=FAST_HOST_SLOW_DISK, prefill_tokens_per_second=1e3)
    assert plan.load_blocks == plan.cached_blocks == 0


def test_a_page_climbs_every_tier_between_its_own_and_the_engine():
    host = load_seconds_per_block(Tier.HOST, page_bytes=MiB, bandwidth=FAST_HOST_SLOW_DISK, into=Tier.HOST)
    disk = load_seconds_per_block(Tier.DISK, page_bytes=MiB, bandwidth=FAST_HOST_SLOW_DISK, into=Tier.HOST)
    assert host == pytest.approx(MiB / 10e9)
    assert disk == pytest.approx(MiB / 10e9 + MiB / 100e6)


def test_cuts_the_prefix_where_the_slow_tier_begins():
    # 16 tokens prefill in 8 ms at 2,000 tok/s; a 1 MiB page from disk takes ~10.5 ms, from host 0.1 ms.
    tiers = [Tier.HOST] * 4 + [Tier.DISK] * 4
    plan = plan_load(tiers, page_bytes=MiB, block_tokens=16, bandwidth=FAST_HOST_SLOW_DISK, prefill_tokens_per_second=2000)
    assert plan.load_blocks == 4 and plan.declined_blocks == 4
    assert plan.recompute_seconds == pytest.approx(4 * 16 / 2000)
    assert "disk" in plan.reason


def test_a_slow_engine_loads_from_disk_too():
    tiers = [Tier.HOST] * 4 + [Tier.DISK] * 4
    plan = plan_load(tiers, page_bytes=MiB, block_tokens=16, bandwidth=FAST_HOST_SLOW_DISK, prefill_tokens_per_second=100)
    assert plan.load_blocks == 8


def test_a_fast_host_block_behind_a_slow_one_is_loaded_only_if_the_pair_pays():
    # disk, host: loading both costs ~10.6 ms; recomputing both 16 ms at 2,000 tok/s -> load both.
    plan = plan_load([Tier.DISK, Tier.HOST], page_bytes=MiB, block_tokens=16, bandwidth=FAST_HOST_SLOW_DISK,
                     prefill_tokens_per_second=2000)
    assert plan.load_blocks == 2
    # At 20,000 tok/s a block recomputes in 0.8 ms: nothing is worth loading.
    plan = plan_load([Tier.DISK, Tier.HOST], page_bytes=MiB, block_tokens=16, bandwidth=FAST_HOST_SLOW_DISK,
                     prefill_tokens_per_second=20000)
    assert plan.load_blocks == 0 and "recomputing is faster" in plan.reason


def test_fixed_cost_of_a_load_declines_a_tiny_prefix():
    plan = plan_load([Tier.HOST], page_bytes=4096, block_tokens=16, bandwidth=FAST_HOST_SLOW_DISK,
                     prefill_tokens_per_second=1e6, fixed_seconds=0.001)
    assert plan.load_blocks == 0


def test_daemon_reports_measured_bandwidths_and_the_planner_uses_them(daemon):
    with KVTierClient(daemon.target) as kv:
        kv.register("planner/a", LAYOUT)
        planner = Planner(kv)
        bandwidth = planner.bandwidth()
        assert bandwidth[Tier.HOST] > 0 and bandwidth[Tier.DISK] > 0

        keys = kv.block_keys(tokens(64, seed=7))
        with kv.borrow(len(keys)) as lease:
            for page, data in zip(lease.pages, kv_pages(len(keys), LAYOUT)):
                page.reshape(-1).view("uint8")[:] = data
            lease.commit(keys)
        lookup = kv.lookup(keys)
        assert lookup.hit_blocks == len(keys)

        # No prefill measured yet: load everything cached.
        assert planner.plan(lookup).load_blocks == len(keys)
        # An engine that prefills 16 tokens far faster than a host round trip: load nothing.
        planner.observe_prefill(10**9, 1.0)
        plan = planner.plan(lookup)
        assert plan.load_blocks == 0 and plan.declined_blocks == len(keys), plan
        # A slow engine: load everything.
        slow = Planner(kv)
        slow.observe_prefill(16, 1.0)
        assert slow.plan(lookup).load_blocks == len(keys)
