"""vLLM KV events for the blocks kvtier took: a BlockStored per run of consecutive prompt
blocks of each KV cache group, in vLLM's own format and with vLLM's own block hashes and
group description (group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window), for vLLM's
KV event publisher (when the engine enables KV events). The payload is taken when the save is sent,
while the request is alive; the events are made once the commit says which pages were new.
Later changes of those pages' tiers are tier_events.py's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import BlockStored
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    resolve_block_hashes,
    to_event_extra_keys,
)

from kvtier_client.event_media import DEFAULT_MEDIA, OWNERSHIP
from kvtier_client.tiers import Tier

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_utils import BlockHash, ExternalBlockHash
    from vllm.v1.request import Request

    from kvtier_client.integrations.vllm.kv_groups import KVGroup
#: KV events: committed pages land in kvtier's host tier, node-local memory: vLLM's CPU
#: medium (as its own offloading connector names host RAM), LOCAL, owned by "kvtier".
EVENT_MEDIUM = DEFAULT_MEDIA[Tier.HOST]
EVENT_LOCALITY = "LOCAL"


@dataclass
class BlockPayload:
    """What a BlockStored event says about consecutive prompt blocks of one request."""

    hashes: list[BlockHash]
    parent: BlockHash | None
    token_ids: list[int]
    extra_keys: list[tuple[Any, ...] | None]
    lora_id: int | None
    lora_name: str | None
    session_id: str | None

    def events(self, new: tuple[int, ...], block_size: int, group: KVGroup) -> list[BlockStored]:
        """One BlockStored per run of consecutive blocks in `new` (the pages kvtier took of
        `group`), naming the group as vLLM's own events do."""
        runs: list[list[int]] = []
        for i in new:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        out = []
        for run in runs:
            first, end = run[0], run[-1] + 1
            parent = self.parent if first == 0 else self.hashes[first - 1]
            out.append(BlockStored(
                block_hashes=[maybe_convert_block_hash(h) for h in self.hashes[first:end]],
                parent_block_hash=maybe_convert_block_hash(parent) if parent is not None else None,
                token_ids=self.token_ids[first * block_size : end * block_size],
                block_size=block_size, lora_id=self.lora_id, medium=EVENT_MEDIUM, lora_name=self.lora_name,
                extra_keys=to_event_extra_keys(self.extra_keys[first:end]), group_idx=group.index,
                kv_cache_spec_kind=group.spec_kind or None, kv_cache_spec_sliding_window=group.spec_window,
                locality=EVENT_LOCALITY, ownership=OWNERSHIP, session_id=self.session_id,
            ))
        return out

    def page_hashes(self, page: int, per_page: int) -> tuple[ExternalBlockHash, ...]:
        """The hashes events carry for page `page` of this payload (`per_page` blocks each)."""
        return tuple(maybe_convert_block_hash(h) for h in self.hashes[page * per_page : (page + 1) * per_page])


def block_payload(request: Request, first: int, end: int, block_size: int,
                  hash_block_size: int) -> BlockPayload | None:
    """The BlockStored payload of prompt blocks [first, end), if vLLM hashed the prompt (it
    does with prefix caching enabled)."""
    hashes = resolve_block_hashes(request.block_hashes, hash_block_size, block_size)
    if len(hashes) < end:
        return None
    B = block_size
    lora = request.lora_request
    return BlockPayload(
        hashes=list(hashes[first:end]), parent=hashes[first - 1] if first else None,
        token_ids=list(request.prompt_token_ids[first * B : end * B]),
        extra_keys=[generate_block_hash_extra_keys(request, i * B, (i + 1) * B, 0)[0] for i in range(first, end)],
        lora_id=lora.adapter_id if lora else None, lora_name=lora.name if lora else None,
        session_id=request.session_id,
    )


def page_hashes(request: Request, first: int, end: int, per_page: int, block_size: int,
                hash_block_size: int) -> list[tuple[ExternalBlockHash, ...]] | None:
    """The hashes events carry for pages [first, end) of a request (`per_page` blocks each),
    if vLLM hashed the prompt."""
    hashes = resolve_block_hashes(request.block_hashes, hash_block_size, block_size)
    if len(hashes) < end * per_page:
        return None
    return [tuple(maybe_convert_block_hash(h) for h in hashes[p * per_page : (p + 1) * per_page])
            for p in range(first, end)]
