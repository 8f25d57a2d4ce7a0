"""The one-tier replay through a policy alone (kvtier.replay.policy) gives exactly the
figures of the replay through a real BlockStore, for every policy."""
from __future__ import annotations

import pytest

from kvtier_bench.shapes import generate
from kvtier.policy import POLICIES
from kvtier.replay.mooncake import replay
from kvtier.replay.policy import replay_policy


@pytest.fixture(scope="module")
def requests() -> list[list[int]]:
    return [ids for _, ids in generate("sessions", seed=3, scale=0.08)] + [ids for _, ids in generate("scan", seed=3, scale=0.05)]


@pytest.mark.parametrize("policy", POLICIES.builtin)
def test_policy_alone_matches_the_store(requests, policy):
    for pages, start in ((64, 0), (300, len(requests) // 2)):
        alone = replay_policy(requests, pages=pages, policy=policy, measure_from=start)
        stored = replay(requests, host_pages=pages, policy=policy, measure_from=start)
        assert (alone.requests, alone.blocks, alone.hit_blocks) == (stored.requests, stored.blocks, stored.hit_blocks)
        assert 0 < alone.hit_blocks < alone.blocks


def test_policy_replay_refuses_what_it_cannot_measure():
    with pytest.raises(ValueError, match="at least one page"):
        replay_policy([[1]], pages=0, policy="lru")
    with pytest.raises(ValueError, match="none from request 1 on"):
        replay_policy([[1]], pages=4, policy="lru", measure_from=1)
