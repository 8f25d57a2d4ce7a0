"""Found against served (docs/metrics.md, "Found and served"): what lookups asked of kvtier
beyond the blocks the engine held itself, what kvtier found of it in each tier, and what
it served, i.e. lent to acquires, by the tier each block was in when asked.

A lookup counts each key once: `engine_had` (one of the leading keys the engine said it
holds, LookupRequest.known), `found` (in kvtier's prefix beyond those, by its fastest
tier) or `missed`. So found + missed are the blocks looked up beyond the engine, the
denominator of the hit rate to read: served / (found + missed).
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping

from kvtier_client.tiers import Tier
from prometheus_client.core import CounterMetricFamily, Metric

from kvtier.core import NamespaceUsage, StoreUsage

#: The `tier` label of a count no tier owns (engine_had, missed): empty, i.e. absent to PromQL.
NO_TIER = ""


def _found(lookup_blocks: int, miss_blocks: int, hits: Mapping[Tier, int]) -> dict[Tier, int]:
    """Found blocks by tier. The cluster's are what the lookups' other counts leave (every
    looked-up block is a hit or a miss); its own `hits` also count prefetches' checks."""
    found = {tier: n for tier, n in hits.items() if tier is not Tier.CLUSTER}
    rest = lookup_blocks - miss_blocks - sum(found.values())
    if rest:
        found[Tier.CLUSTER] = rest
    return found


def _add(lookups: CounterMetricFamily, labels: list[str], engine: int, found: Mapping[Tier, int], missed: int) -> None:
    lookups.add_metric([*labels, "engine_had", NO_TIER], engine)
    for tier, n in sorted(found.items()):
        lookups.add_metric([*labels, "found", tier.label], n)
    lookups.add_metric([*labels, "missed", NO_TIER], missed)


def pool_families(pools: list[tuple[str, StoreUsage]]) -> Iterator[Metric]:
    """kvtier_lookup_blocks_total{pool,result,tier} and kvtier_served_blocks_total{pool,tier}."""
    lookups = CounterMetricFamily(
        "kvtier_lookup_blocks", "Looked-up blocks by result: engine_had (the engine held them already; no tier), "
        "found (kvtier held them beyond those, by fastest tier) or missed (no tier).", labels=["pool", "result", "tier"])
    served = CounterMetricFamily(
        "kvtier_served_blocks", "Blocks lent to acquires (what kvtier served), by the tier each was in when asked.",
        labels=["pool", "tier"])
    for pool_id, stats in pools:
        hits = {t.tier: t.counters.hits for t in stats.tiers}
        _add(lookups, [pool_id], stats.engine_blocks, _found(stats.lookup_blocks, stats.miss_blocks, hits),
             stats.miss_blocks)
        for tier in sorted({t.tier for t in stats.tiers} | set(stats.served)):
            served.add_metric([pool_id, tier.label], stats.served.get(tier, 0))
    yield from (lookups, served)


def namespace_families(namespaces: list[tuple[str, NamespaceUsage]]) -> Iterator[Metric]:
    """The same per namespace: kvtier_namespace_lookup_blocks_total and
    kvtier_namespace_served_blocks_total (label kvtier_namespace)."""
    lookups = CounterMetricFamily(
        "kvtier_namespace_lookup_blocks", "A namespace's looked-up blocks by result: engine_had, found (by tier), missed.",
        labels=["pool", "kvtier_namespace", "result", "tier"])
    served = CounterMetricFamily(
        "kvtier_namespace_served_blocks", "A namespace's blocks lent to acquires, by the tier each was in when asked.",
        labels=["pool", "kvtier_namespace", "tier"])
    for pool_id, ns in namespaces:
        labels = [pool_id, ns.namespace]
        hits = {t.tier: t.hits for t in ns.tiers}
        _add(lookups, labels, ns.engine_blocks, _found(ns.lookup_blocks, ns.miss_blocks, hits), ns.miss_blocks)
        for tier in sorted({t.tier for t in ns.tiers} | set(ns.served)):
            served.add_metric([*labels, tier.label], ns.served.get(tier, 0))
    yield from (lookups, served)
