"""What the two roles tell each other, through vLLM, once per step.

    scheduler --KVTierConnectorMetadata--> worker     (loads and saves to do this step)
    worker  --KVTierWorkerMetadata--> scheduler       (forward and copy times, what each save became)

vLLM pickles both across the engine-core / worker process boundary: plain dataclasses only.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from kvtier_client.keys import BlockKey


@dataclass
class LoadOp:
    """Copy the cached pages of `keys` into vLLM blocks `block_ids` (same length)."""

    req_id: str
    block_ids: list[int]
    keys: list[BlockKey]


@dataclass
class SaveOp:
    """Store vLLM blocks `block_ids` as the pages of `keys`: the request's prompt blocks from
    block `first` on. `parent` is the key before keys[0]; `token_ids` are the blocks' tokens,
    which the daemon carries in its own KV events (docs/events.md)."""

    req_id: str
    first: int
    block_ids: list[int]
    keys: list[BlockKey]
    parent: BlockKey | None
    token_ids: list[int]


@dataclass
class SaveOutcome:
    """What became of one SaveOp: `new` holds the indices (into its keys) of the pages the
    daemon took; the others were cached already. None: nothing was stored (no free pages,
    daemon unreachable)."""

    req_id: str
    first: int
    new: tuple[int, ...] | None


@dataclass
class KVTierConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadOp] = field(default_factory=list)
    saves: list[SaveOp] = field(default_factory=list)
    step_tokens: int = 0  # tokens the forward pass of this step computes
    prefill_tokens: int = 0  # of which prompt tokens


@dataclass
class KVTierWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler after a step: how long the forward pass took and how fast loaded
    pages were copied into vLLM's blocks (for the planner), and what each save became (for
    the request's counts and the KV events)."""

    step_tokens: int = 0
    prefill_tokens: int = 0
    forward_seconds: float = 0.0
    copy_bytes: int = 0
    copy_seconds: float = 0.0
    saves: list[SaveOutcome] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        # One worker per engine (config.check_parallel): there is nothing to merge but timings.
        if not isinstance(other, KVTierWorkerMetadata):
            return self
        return KVTierWorkerMetadata(
            max(self.step_tokens, other.step_tokens), max(self.prefill_tokens, other.prefill_tokens),
            max(self.forward_seconds, other.forward_seconds), self.copy_bytes + other.copy_bytes,
            max(self.copy_seconds, other.copy_seconds), self.saves or other.saves,
        )
