"""What the two roles tell each other, through vLLM, once per step.

    scheduler --KVTierConnectorMetadata--> worker     (loads and saves to do this step)
    worker  --KVTierWorkerMetadata--> scheduler       (forward and copy times, what each save became)

vLLM pickles both across the engine-core / worker process boundary: plain dataclasses only.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from kvtier_client.keys import BlockKey


#: In a LoadOp's block ids: a block of the page not to copy (vLLM holds it already).
SKIP = -1


@dataclass
class LoadOp:
    """Copy the cached pages of `keys` into vLLM blocks `block_ids` of KV cache group
    `group` (kvtier_client.integrations.vllm.kv_groups): a page holds blocks_per_page blocks,
    so block_ids has that many per key, in order (SKIP: not that block). `background`: the
    request waits for it (vLLM's asynchronous load), so it runs beside the step's forward
    pass and is reported finished (or failed) through vLLM's transfer results."""

    req_id: str
    block_ids: list[int]
    keys: list[BlockKey]
    group: int = 0
    background: bool = False


@dataclass
class SaveOp:
    """Write vLLM blocks `block_ids` into the scheduler's borrowed host pages `slots` (a
    page holds blocks_per_page consecutive ones): the request's prompt pages from page
    `first` on. Each worker writes its part
    of each page (kvtier_client.integrations.vllm.shapes); the scheduler commits the pages
    under their keys once every worker has reported its part written."""

    req_id: str
    first: int
    block_ids: list[int]
    slots: list[int]
    group: int = 0


@dataclass
class SaveOutcome:
    """What the workers did with one SaveOp: `ranks` reported, `ok` if every one of them
    wrote its part (the scheduler commits only when all the engine's workers did)."""

    req_id: str
    first: int
    group: int
    ok: bool
    ranks: frozenset[int]

    @property
    def key(self) -> tuple[str, int, int]:
        return self.req_id, self.first, self.group

    def merge(self, other: SaveOutcome) -> SaveOutcome:
        return SaveOutcome(self.req_id, self.first, self.group, self.ok and other.ok, self.ranks | other.ranks)


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
    the commit). vLLM merges the reports of all the engine's workers with `aggregate`."""

    step_tokens: int = 0
    prefill_tokens: int = 0
    forward_seconds: float = 0.0
    copy_bytes: int = 0
    copy_seconds: float = 0.0
    saves: list[SaveOutcome] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Workers run in lockstep: the step took as long as the slowest, copies add up, and
        each save's outcome is the merge of every worker's."""
        if not isinstance(other, KVTierWorkerMetadata):
            return self
        saves = {s.key: s for s in self.saves}
        for s in other.saves:
            saves[s.key] = saves[s.key].merge(s) if s.key in saves else s
        return KVTierWorkerMetadata(
            max(self.step_tokens, other.step_tokens), max(self.prefill_tokens, other.prefill_tokens),
            max(self.forward_seconds, other.forward_seconds), self.copy_bytes + other.copy_bytes,
            max(self.copy_seconds, other.copy_seconds), list(saves.values()),
        )
