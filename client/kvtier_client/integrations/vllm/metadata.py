"""What the two roles tell each other, through vLLM, once per step.

    scheduler --KVTierConnectorMetadata--> worker     (loads and saves to do this step)
    worker  --KVTierWorkerMetadata--> scheduler       (how long the forward pass took)

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
    """Store vLLM blocks `block_ids` as the pages of `keys`; `parent` is the key before keys[0]."""

    req_id: str
    block_ids: list[int]
    keys: list[BlockKey]
    parent: BlockKey | None


@dataclass
class KVTierConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadOp] = field(default_factory=list)
    saves: list[SaveOp] = field(default_factory=list)
    step_tokens: int = 0  # tokens the forward pass of this step computes
    prefill_tokens: int = 0  # of which prompt tokens


@dataclass
class KVTierWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler after a step: how long the forward pass took, for the planner."""

    step_tokens: int = 0
    prefill_tokens: int = 0
    forward_seconds: float = 0.0

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KVTierWorkerMetadata):
            return self
        return KVTierWorkerMetadata(
            max(self.step_tokens, other.step_tokens), max(self.prefill_tokens, other.prefill_tokens),
            max(self.forward_seconds, other.forward_seconds),
        )
