"""vLLM's KV cache groups as kvtier page layouts, and what each needs of a cached prefix.

A model whose layers all use full attention (or MLA) has one group. A hybrid model (Gemma
2/3's sliding and global layers, Llama 4's chunked layers) has several: each gets its own
page layout (a page holds that group's layers), its own block keys (salted with the group,
so groups with equal layouts never share a page) and its own rule for restoring a prefix of
e pages (kvtier_client.groups; a page is `page_tokens` tokens, one vLLM block unless the
configuration says more):

    full attention, MLA           FULL     every page [0, e)
    sliding window of w tokens    WINDOW   the trailing ceil(w / page) pages
    chunked local attention of c  WINDOW   the trailing ceil(c / page) pages (at most a chunk)

A window one token wider than the tokens strictly read is asked for (vLLM keeps
ceil((w - 1) / block) blocks), so a restore point inside the last page (vLLM computes a cached
prompt's last token itself) is covered too. Mamba and linear-attention groups are refused
with the reason: their state per block exists in vLLM only with prefix caching's "align"
mode, which the connector does not read yet.

A single-group model keeps the keys it always had (no group salt) and pages indexed by model
layer, so pipeline stages each write their layers; a hybrid model's pages are indexed by
position in the group, which pipeline stages do not share: refused for PP > 1.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier_client.groups import GroupMode
from kvtier_client.integrations.vllm.shapes import layer_index
from kvtier_client.layout import DTYPE_BYTES, PageLayout

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec


@dataclass(frozen=True)
class KVGroup:
    """One KV cache group as kvtier stores it."""

    index: int  # vLLM's group index
    mode: GroupMode
    window: int  # WINDOW: trailing pages a restore needs; else 0
    layout: PageLayout
    layer_names: tuple[str, ...]  # this process's layers of the group
    page_layers: tuple[int, ...]  # the page layer of each of them
    local_heads: int  # KV heads this worker holds (of layout.kv_heads)
    salt: bytes  # mixed into the group's block keys (b"" for a single-group model)
    block_size: int = 0  # vLLM's block: a page holds layout.block_tokens // block_size of them
    sliding: int = 0  # tokens of a sliding window (vLLM frees the blocks behind it)
    chunk: int = 0  # tokens of a local-attention chunk (vLLM frees the chunks before the current one)
    spec_kind: str = ""  # vLLM's KVCacheSpecKind of the group, as KV events name it
    spec_window: int | None = None  # vLLM's sliding window of the group, as KV events name it

    @property
    def blocks_per_page(self) -> int:
        return self.layout.block_tokens // (self.block_size or self.layout.block_tokens)

    def kept_from(self, computed: int) -> int:
        """The first token whose block vLLM still holds once `computed` tokens are computed:
        a window group's older blocks are freed (and reused) as the request goes on."""
        if self.sliding:
            return max(0, computed - self.sliding + 1)
        if self.chunk:
            return computed // self.chunk * self.chunk
        return 0


def kv_groups(kv_cache_config: KVCacheConfig, vllm_config: VllmConfig, page_tokens: int | None = None) -> list[KVGroup]:
    """The engine's KV cache groups as kvtier groups with pages of `page_tokens` tokens (a
    multiple of vLLM's block size; default one block), or ValueError saying what is not
    supported and why."""
    groups = kv_cache_config.kv_cache_groups
    if not groups:
        raise ValueError("kvtier connector: this model has no KV cache (attention-free): nothing to store")
    single = len(groups) == 1
    if not single and vllm_config.parallel_config.pipeline_parallel_size > 1:
        raise ValueError("kvtier connector: a hybrid model (several KV cache groups) with pipeline parallelism is not "
                         "supported yet: each stage holds part of each group; run it with tensor parallelism")
    block_size = vllm_config.cache_config.block_size
    page = page_tokens or block_size
    if page % block_size:
        raise ValueError(f"kvtier connector: page_tokens={page} is not a multiple of vLLM's block size {block_size}")
    out = []
    for index, group in enumerate(groups):
        spec = group.kv_cache_spec
        mode, window = _need(spec, block_size, page)
        sliding = getattr(spec, "sliding_window", None) or 0
        chunk = getattr(spec, "attention_chunk_size", None) or 0
        names = tuple(group.layer_names)
        layers = vllm_config.model_config.get_total_num_hidden_layers() if single else len(names)
        layout = _layout(spec, vllm_config, layers, page)
        page_layers = tuple(layer_index(n) for n in names) if single else tuple(range(len(names)))
        if len(set(page_layers)) != len(page_layers) or any(not 0 <= i < layers for i in page_layers):
            raise ValueError(f"kvtier connector: attention layers {list(names)} do not map one to one onto the "
                             f"{layers} layers of a page")
        # The group's rule is in its keys: one checkpoint run with and without its sliding
        # window computes different KV.
        salt = b"" if single and mode is GroupMode.FULL else f"|kv group {index} {mode.name} {sliding} {chunk}".encode()
        kind, spec_window = _event_identity(spec)
        out.append(KVGroup(index, mode, window, layout, names, page_layers, spec.num_kv_heads, salt, block_size,
                           sliding, chunk, kind, spec_window))
    return out


def _event_identity(spec: KVCacheSpec) -> tuple[str, int | None]:
    """How vLLM's own KV events describe a group (kv_cache_spec_kind and _sliding_window),
    so a router reads kvtier's events of every group as it reads vLLM's."""
    from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window

    return get_kv_cache_spec_kind(spec).value, get_kv_cache_spec_sliding_window(spec)


def _need(spec: KVCacheSpec, block_size: int, page: int) -> tuple[GroupMode, int]:
    """What a restore needs of the group, in pages of `page` tokens."""
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    if isinstance(spec, MambaSpec):
        raise ValueError("kvtier connector: Mamba / linear-attention layers are not supported yet: vLLM keeps their "
                         "state per block only with prefix caching's 'align' mode, which the connector does not read")
    if spec.block_size != block_size:
        raise ValueError(f"kvtier connector: KV group block size {spec.block_size} differs from the cache block "
                         f"size {block_size}")
    if isinstance(spec, SlidingWindowSpec):
        return GroupMode.WINDOW, -(-spec.sliding_window // page)
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return GroupMode.WINDOW, -(-spec.attention_chunk_size // page)
    if isinstance(spec, FullAttentionSpec):
        if getattr(spec, "sliding_window", None):
            return GroupMode.WINDOW, -(-spec.sliding_window // page)
        if getattr(spec, "attention_chunk_size", None):
            return GroupMode.WINDOW, -(-spec.attention_chunk_size // page)
        return GroupMode.FULL, 0
    raise ValueError(f"kvtier connector: KV cache spec {type(spec).__name__} is not supported (full attention, "
                     "MLA, sliding window and chunked local attention are)")


def _layout(spec: KVCacheSpec, vllm_config: VllmConfig, layers: int, page: int) -> PageLayout:
    """A page of `layers` layers with every KV head of the model (not one rank's)."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    mla = isinstance(spec, MLAAttentionSpec)
    head_v = getattr(spec, "head_size_v", None) or spec.head_size
    if not mla and head_v != spec.head_size:
        raise ValueError(f"kvtier connector: K head size {spec.head_size} differs from V head size {head_v}; "
                         "kvtier pages hold K and V of one head size")
    dtype = str(spec.dtype).removeprefix("torch.")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"kvtier connector: KV cache dtype {dtype} has no kvtier page dtype ({', '.join(DTYPE_BYTES)})")
    return PageLayout(
        layers=layers, kv_heads=1 if mla else vllm_config.model_config.get_total_num_kv_heads(),
        head_dim=spec.head_size, block_tokens=page, dtype=dtype, order="latent" if mla else "page_first",
    )


def single_group(layout: PageLayout, layer_names: list[str], local_heads: int | None = None,
                 block_size: int | None = None) -> KVGroup:
    """The one group of a full-attention model whose local layer i is page layer i (for tools
    and tests that build the connector's halves without an engine)."""
    from vllm.v1.kv_cache_interface import KVCacheSpecKind

    return KVGroup(0, GroupMode.FULL, 0, layout, tuple(layer_names), tuple(range(len(layer_names))),
                   layout.kv_heads if local_heads is None else local_heads, b"", block_size or layout.block_tokens,
                   spec_kind=KVCacheSpecKind.FULL_ATTENTION.value)
