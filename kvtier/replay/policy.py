"""Replay a trace through one eviction policy object alone: one tier, no store.

Policies are pure decisions over references (kvtier.policy), so a single tier's hit rate
needs nothing else: per request, count the leading blocks cached at arrival, then touch
each cached block or make room (`victims(1)`, `remove`) and `add` a new one, in request
order, exactly as `kvtier.replay.mooncake.replay` drives them through a real BlockStore
(acquire+release, borrow+commit). The figures are the same (tests check it for every
policy); this runs several times faster, so the benchmark's one-tier lines use it.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

from kvtier.policy import POLICIES
from kvtier.replay.mooncake import ReplayResult

_NAMESPACE = "trace"


def _never(ref) -> bool:
    return False


def replay_policy(requests: Sequence[list[int]], *, pages: int, policy: str,
                  measure_from: int = 0) -> ReplayResult:
    """One tier of `pages` managed by `policy`; requests before `measure_from` only warm it.
    `policy_seconds` is the whole measured loop: the policy's calls and this loop's own
    set operations, so its speed is a lower bound of the policy's."""
    if pages <= 0:
        raise ValueError(f"a tier needs at least one page, got {pages}")
    if len(requests) <= measure_from:
        raise ValueError(f"the trace has {len(requests)} requests: none from request {measure_from} on to measure")
    chosen = POLICIES[policy](pages)
    cached: set = set()
    hits = blocks = 0
    start = time.perf_counter()
    for i, ids in enumerate(requests):
        if i == measure_from:  # the warm-up is not timed, as it is not counted
            start = time.perf_counter()
        refs = [(_NAMESPACE, block.to_bytes(8, "little")) for block in ids]
        if i >= measure_from:
            blocks += len(refs)
            for ref in refs:
                if ref not in cached:
                    break
                hits += 1
        parent = None
        for ref in refs:
            if ref in cached:
                chosen.touch(ref)
            else:
                if len(cached) >= pages:
                    victim = chosen.victims(1, _never)[0]
                    chosen.remove(victim)
                    cached.discard(victim)
                chosen.add(ref, parent)
                cached.add(ref)
            parent = ref
    seconds = time.perf_counter() - start
    return ReplayResult(requests=len(requests) - measure_from, blocks=blocks, hit_blocks=hits, host_hit_blocks=hits,
                        disk_hit_blocks=0, host_pages=pages, disk_pages=0, policy=policy,
                        policy_seconds=seconds)
