"""Explain: why each block of a prompt is, or is not, served.

The core answers for one pool (`BlockStore.explain`). Here a namespace's pools are read
together, because a namespace may use several page layouts: a block never stored in the
pool asked about but cached in another pool of the namespace is BLOCK_OTHER_LAYOUT (the
engine registered another layout than the one that wrote it). The hashings clients
registered with are kept too: keys hashed with another algorithm or block size never match,
and the operator asking "why a miss?" needs to see that.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence

from kvtier_client.layout import PageLayout
from kvtier_client.proto.v1 import kvtier_pb2 as pb
from kvtier_client.results import BLOCK_STATES, hashing
from kvtier_client.wire import tier_to_proto

from kvtier.core import BlockState, BlockStatus, Explanation, check_keys
from kvtier.server.pools import Pool, PoolRegistry

#: States in which a pool holds the block's bytes now.
_HELD = (BlockState.CACHED, BlockState.BEYOND_PREFIX)
#: How daemons before BLOCK_DROPPED named a drop (BLOCK_EVICTED by this "policy"): what a
#: client that does not read BLOCK_DROPPED (ExplainRequest.reads_dropped) is still told.
_DROPPED_AS_EVICTED = "a drop hint"


class Explainer:
    """Answers Explain over the registry's pools, and remembers per namespace the distinct
    hashings its clients registered with (since the daemon started)."""

    def __init__(self, pools: PoolRegistry) -> None:
        self._pools = pools
        self._hashings: dict[str, set[str]] = {}
        self._lock = threading.Lock()

    def saw_register(self, namespace: str, algorithm: str, layout: PageLayout) -> None:
        """Register accepted a client of `namespace` hashing keys this way."""
        with self._lock:
            self._hashings.setdefault(namespace, set()).add(hashing(algorithm, layout.block_tokens))

    def hashings(self, namespace: str) -> list[str]:
        with self._lock:
            return sorted(self._hashings.get(namespace, ()))

    def explain(self, namespace: str, keys: Sequence[bytes], asked: Pool | None,
                reads_dropped: bool) -> pb.ExplainResponse:
        """Explain `keys` in `asked`, or (None) in the pool that serves the longest prefix of
        them (ties: the one that knows most of them). Without `reads_dropped` (a client from
        before BLOCK_DROPPED) a dropped block is told as BLOCK_EVICTED, as it used to be."""
        check_keys(list(keys))
        pools = self._pools.all_pools()
        answers = {pool.pool_id: pool.store.explain(namespace, list(keys)) for pool in pools}
        reply = pb.ExplainResponse(hashings=self.hashings(namespace))
        primary = asked.pool_id if asked is not None else _best(answers)
        if primary is None:  # no pool yet: nothing was ever stored
            reply.blocks.extend(pb.BlockExplanation(index=i, state=pb.BLOCK_NEVER_STORED) for i in range(len(keys)))
            return reply
        reply.hit_blocks = answers[primary].hit_blocks
        reply.blocks.extend(_block(status, primary, answers, reads_dropped) for status in answers[primary].blocks)
        return reply


def _best(answers: dict[str, Explanation]) -> str | None:
    """The pool id whose answer has the most hit blocks, then the fewest never stored."""
    def score(pool_id: str) -> tuple[int, int]:
        known = sum(1 for b in answers[pool_id].blocks if b.state is not BlockState.NEVER_STORED)
        return answers[pool_id].hit_blocks, known

    return max(answers, key=score, default=None)


def _block(status: BlockStatus, pool_id: str, answers: dict[str, Explanation], reads_dropped: bool) -> pb.BlockExplanation:
    """One block's answer in `pool_id`; a block that pool never stored but another holds is
    BLOCK_OTHER_LAYOUT, about that other pool."""
    if status.state is BlockState.NEVER_STORED:
        for other_id, answer in answers.items():
            held = answer.blocks[status.index]
            if other_id != pool_id and held.state in _HELD:
                return pb.BlockExplanation(index=status.index, state=pb.BLOCK_OTHER_LAYOUT,
                                           tier=tier_to_proto(held.tier), pool_id=other_id)
    state, policy = BLOCK_STATES[status.state], status.policy
    if status.state is BlockState.DROPPED and not reads_dropped:
        state, policy = pb.BLOCK_EVICTED, _DROPPED_AS_EVICTED
    return pb.BlockExplanation(
        index=status.index, state=state,
        tier=tier_to_proto(status.tier) if status.tier is not None else pb.TIER_UNSPECIFIED,
        seconds_ago=status.seconds_ago, policy=policy, pool_id=pool_id, own_pressure=status.own_pressure,
        hint=status.hint,
    )
