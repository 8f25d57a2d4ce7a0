"""What names a block besides its tokens: vLLM's extra keys (multimodal inputs, LoRA, cache
salt, prompt embeddings), as kvtier block-key extras.

An image or audio clip becomes placeholder tokens that are the same for every image: two
prompts with equal token ids but different images must never share a block, so each block's
key takes, as vLLM's own prefix-cache hash does, the hash of every multimodal input that
overlaps it and where it starts (`generate_block_hash_extra_keys`). A text-only prompt has
no extras, and its keys are what they always were.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

if TYPE_CHECKING:
    from vllm.v1.request import Request


def block_extras(request: Request, block_size: int) -> list[list[bytes]] | None:
    """Per full prompt block, vLLM's extra keys as bytes (their repr: strings, ints and
    bytes, stable across processes); None when no block has any beyond the LoRA adapter
    and cache salt, which the connector puts in the key's salt already
    (request_state.request_salt)."""
    if not request.mm_features and getattr(request, "prompt_embeds", None) is None:
        return None
    extras: list[list[bytes]] = []
    mm_index = 0
    for start in range(0, len(request.prompt_token_ids) // block_size * block_size, block_size):
        keys, mm_index = generate_block_hash_extra_keys(request, start, start + block_size, mm_index)
        extras.append([repr(key).encode() for key in keys or ()])
    return extras
