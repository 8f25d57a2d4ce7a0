"""What the scheduler knows of one request (`RequestState`), and the salt of its block keys."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtier_client.keys import BlockKey
from kvtier_client.tiers import Tier

if TYPE_CHECKING:
    from vllm.v1.request import Request


@dataclass
class RequestState:
    request: Request
    group_keys: list[list[BlockKey]]  # per KV cache group (kv_groups.KVGroup.salt differs)
    prompt_tokens: int
    kvtier_blocks: int = 0  # leading blocks kvtier held at the last lookup
    found: tuple[int, int] = (0, 0)  # at the last lookup: cached blocks beyond vLLM's hit, of which to load
    candidate: tuple[int, int, int] | None = None  # (vLLM's computed tokens, end page, external tokens) offered
    candidate_tiers: tuple[Tier, ...] = ()
    candidate_async: bool = False  # the candidate load runs in the background (async_loads)
    local_blocks: int = 0  # vLLM blocks its own prefix cache served at the last lookup (not loaded again)
    load: tuple[int, int] | None = None  # blocks to load in the next step
    load_tiers: tuple[Tier, ...] = ()
    load_needs: tuple[range, ...] = ()
    block_ids: list[list[int]] = field(default_factory=list)  # per group
    save_upto: int = 0  # blocks before this one are in kvtier, in vLLM's cache, or already sent to be stored
    storing: list[BlockKey] = field(default_factory=list)  # keys this request put in Saves.storing
    loaded_tokens: int = 0
    stored_blocks: int = 0
    plan_reason: str = ""
    epoch: bytes = b""  # the scheduler's key epoch when the keys were made (reset_cache)
    load_failed: bool = False  # a background load of it failed: it is recomputed, not loaded again

    @property
    def keys(self) -> list[BlockKey]:
        """The first group's keys: they name the request's blocks (one chain per prompt)."""
        return self.group_keys[0]


def request_salt(base: bytes, request: Request) -> bytes:
    """The block-key salt of a request: the configured salt, vLLM's per-request cache_salt
    and the LoRA adapter (name, id and path), each length-prefixed so no two combinations
    collide."""
    parts = [base, (request.cache_salt or "").encode()]
    lora = getattr(request, "lora_request", None)
    parts.append(f"{lora.lora_name}:{lora.lora_int_id}:{getattr(lora, 'lora_path', '')}".encode()
                 if lora is not None else b"")
    return b"".join(len(p).to_bytes(4, "little") + p for p in parts)
