"""The load planner: the decision on fixed figures, then against a real daemon's measured
bandwidths (the prefix the planner declines when the disk is slower than the prefill), and
the engine's measured copy rate folded into the host step."""
from __future__ import annotations

import pytest
from client_helpers import LAYOUT, kv_pages, tokens
from kvtier_client import KVTierClient, Tier
from kvtier_client.integrations.planner import (
    COPY_ALPHA,
    Planner,
    effective_bandwidth,
    load_seconds_per_block,
    plan_load,
)

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


def test_a_cluster_page_is_fetched_into_host_without_passing_through_disk():
    rates = {**FAST_HOST_SLOW_DISK, Tier.CLUSTER: 1e9}
    cluster = load_seconds_per_block(Tier.CLUSTER, page_bytes=MiB, bandwidth=rates, into=Tier.HOST)
    assert cluster == pytest.approx(MiB / 10e9 + MiB / 1e9)


def test_the_engine_copy_rate_replaces_a_faster_daemon_host_figure_never_adds_to_it():
    # Both figures describe the same step (host memory -> engine KV): the slower one counts, once.
    slow_copy = effective_bandwidth(FAST_HOST_SLOW_DISK, into=Tier.HOST, copy_bytes_per_second=2e9)
    assert slow_copy == {Tier.HOST: 2e9, Tier.DISK: 100e6}
    fast_copy = effective_bandwidth(FAST_HOST_SLOW_DISK, into=Tier.HOST, copy_bytes_per_second=40e9)
    assert fast_copy[Tier.HOST] == 10e9
    unmeasured_host = effective_bandwidth({Tier.DISK: 100e6}, into=Tier.HOST, copy_bytes_per_second=2e9)
    assert unmeasured_host[Tier.HOST] == 2e9
    assert effective_bandwidth(FAST_HOST_SLOW_DISK, into=Tier.HOST, copy_bytes_per_second=None) == FAST_HOST_SLOW_DISK
    # A disk page pays the disk read and the engine's copy.
    disk = load_seconds_per_block(Tier.DISK, page_bytes=MiB, bandwidth=slow_copy, into=Tier.HOST)
    assert disk == pytest.approx(MiB / 2e9 + MiB / 100e6)


def test_a_slow_engine_copy_turns_a_host_load_into_a_recompute():
    # 16 tokens prefill in 0.4 ms at 40,000 tok/s. A 1 MiB host page: 0.1 ms at the daemon's
    # memcpy figure (load), 1.05 ms at an engine copy of 1 GB/s (recompute).
    tiers = [Tier.HOST] * 4
    daemon_only = plan_load(tiers, page_bytes=MiB, block_tokens=16, bandwidth=FAST_HOST_SLOW_DISK,
                            prefill_tokens_per_second=40_000)
    assert daemon_only.load_blocks == 4
    with_copy = plan_load(tiers, page_bytes=MiB, block_tokens=16, bandwidth=FAST_HOST_SLOW_DISK,
                          prefill_tokens_per_second=40_000, copy_bytes_per_second=1e9)
    assert with_copy.load_blocks == 0 and "recomputing is faster" in with_copy.reason
    assert with_copy.recompute_seconds == pytest.approx(4 * 16 / 40_000)


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


def test_the_planner_learns_the_engine_copy_rate_as_a_moving_average(daemon):
    with KVTierClient(daemon.target) as kv:
        kv.register("planner/copy", LAYOUT)
        keys = kv.block_keys(tokens(64, seed=8))
        with kv.borrow(len(keys)) as lease:
            lease.commit(keys)
        lookup = kv.lookup(keys)
        planner = Planner(kv)
        assert planner.copy_bytes_per_second is None
        planner.observe_copy(0, 1.0)  # nothing copied: no measurement
        planner.observe_copy(100, 0.0)
        assert planner.copy_bytes_per_second is None
        planner.observe_copy(4_000, 1.0)
        planner.observe_copy(2_000, 1.0)
        assert planner.copy_bytes_per_second == pytest.approx((1 - COPY_ALPHA) * 4_000 + COPY_ALPHA * 2_000)

        # A prefill rate at which loading at the daemon's host figure pays, but not at 3.4 kB/s.
        planner.observe_prefill(16, 1.0)
        plan = planner.plan(lookup)
        assert plan.load_blocks == 0 and plan.declined_blocks == len(keys), plan
        fresh = Planner(kv)
        fresh.observe_prefill(16, 1.0)
        assert fresh.plan(lookup).load_blocks == len(keys)
