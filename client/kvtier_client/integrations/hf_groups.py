"""Which cache layers keep what, and what restoring a prefix needs from each (hybrid models).

transformers builds a model's cache from its config, one layer object per decoder layer
(``DynamicCache(config=model.config)``, as the model itself does): a full-attention layer
keeps every token's K and V; a sliding-window or chunked layer only the last ``window - 1``
tokens; a linear-attention or Mamba layer a fixed-size recurrent state (conv and SSM
states); a hybrid layer (Falcon-H1) both; a dummy layer (KV shared with another layer)
nothing. kvtier keeps each kind as a *group* of layers with its own page layout:

    group     one page per block holds            a restore of P blocks (T tokens) needs
    full      K, V of its layers for the block    every block [0, ceil(T/B))
    window-W  K, V of its layers for the block    the blocks holding tokens [T-W+1, T)
    state     the recurrent state after block i   the page of block P-1, and T == P*B

A window group stores every block it sees, but a restore reads only the trailing window;
a state page exists only where one was taken (a block boundary), so the restore point is
such a boundary. `GroupSearch` finds the longest prefix for which every group has what
it needs, in one LookupGroups call; pages missing inside a window or a state missing at the
end make it stop earlier.

Keys: the primary group (the full-attention one, else the first window group) uses plain
block keys, so a plain transformer's keys are what any client computes; every other group's
keys carry one extra naming the group (docs/block-keys.md), so two groups never share a
key even when their layouts, and so their pools, are equal.
"""
from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvtier_client.groups import GroupLookup, GroupMode, GroupQuery
from kvtier_client.integrations.hf_model import kv_dtype, kv_shape
from kvtier_client.keys import BlockKey
from kvtier_client.layout import PageLayout
from kvtier_client.results import LookupResult
from kvtier_client.tiers import Tier

DEFAULT_BLOCK_TOKENS = 16
#: State tensors start on this boundary inside a state page, so each can be viewed in place.
STATE_ALIGN = 64


class GroupKind(enum.Enum):
    FULL = "full"
    WINDOW = "window"
    STATE = "state"


@dataclass(frozen=True)
class StateEntry:
    """One recurrent-state tensor of one layer, and where it sits in a state page."""

    layer: int
    part: str  # "conv" or "recurrent": LinearAttentionLayer.conv_states / .recurrent_states
    index: int  # the layer's state index (most layers have one)
    shape: tuple[int, ...]
    dtype: str  # torch dtype name
    kernel: int  # conv: the layer's conv_kernel_size (0 for recurrent)
    offset: int  # bytes into the page

    @property
    def nbytes(self) -> int:
        import torch

        count = 1
        for n in self.shape:
            count *= n
        return count * getattr(torch, self.dtype).itemsize


@dataclass(frozen=True)
class CacheGroup:
    """Layers of one kind, kept in one page layout under keys of their own."""

    kind: GroupKind
    layers: tuple[int, ...]
    layout: PageLayout
    window: int = 0  # WINDOW: the layers' sliding_window (tokens)
    states: tuple[StateEntry, ...] = ()  # STATE: what a page holds
    tag: bytes = b""  # the extra in every block key; b"" for the primary group

    @property
    def name(self) -> str:
        return f"window-{self.window}" if self.kind is GroupKind.WINDOW else self.kind.value

    def keys(self, block_keys: Callable[..., list[BlockKey]], tokens: Sequence[int], salt: bytes) -> list[BlockKey]:
        """This group's key of every full block of `tokens` (`block_keys`: a client's)."""
        if not self.tag:
            return block_keys(tokens, salt=salt)
        blocks = len(tokens) // self.layout.block_tokens
        return block_keys(tokens, salt=salt, extras=[[self.tag]] * blocks)

    def needs(self, blocks: int, tokens: int) -> tuple[int, int]:
        """Blocks [first, end) this group reads to restore `tokens` tokens of a `blocks`-block prefix."""
        B = self.layout.block_tokens
        if self.kind is GroupKind.STATE:
            return blocks - 1, blocks
        end = -(-tokens // B)
        if self.kind is GroupKind.FULL:
            return 0, end
        return max(0, tokens - self.window + 1) // B, end


def _layer_classes() -> dict[str, type]:
    """The transformers cache-layer classes this module knows (older versions lack some)."""
    from transformers import cache_utils

    names = ("DynamicLayer", "DynamicSlidingWindowLayer", "LinearAttentionLayer",
             "LinearAttentionAndFullAttentionLayer", "LinearAttentionAndSlidingWindowAttentionLayer",
             "LinearAttentionCacheLayerMixin", "DummyLayer")
    return {name: getattr(cache_utils, name) for name in names if hasattr(cache_utils, name)}


def new_cache(config: Any) -> Any:
    """The DynamicCache the model would build for itself, with its window layers keeping every
    token they see (transformers' past recording) so `store` can write every block; attention
    reads the same trailing window either way."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False):
            layer.activate_past_recording()
    return cache


def layer_kinds(config: Any) -> list[tuple[int, GroupKind, int]]:
    """(layer, kind, window) for every piece of state the model's cache layers keep, from
    the layer classes transformers builds for `config`; ValueError for a layer it cannot restore."""
    known = _layer_classes()
    linear = known.get("LinearAttentionCacheLayerMixin")
    out: list[tuple[int, GroupKind, int]] = []
    for i, layer in enumerate(new_cache(config).layers):
        cls = type(layer)
        if cls is known.get("DummyLayer"):
            continue
        if cls not in known.values():
            raise ValueError(
                f"cache layer {i} is a {cls.__name__}: kvtier's transformers helper restores full-attention, "
                "sliding-window (or chunked) and linear-attention (Mamba) cache layers only"
            )
        if linear is not None and isinstance(layer, linear):
            out.append((i, GroupKind.STATE, 0))
        if isinstance(layer, known["DynamicLayer"]):
            window = int(getattr(layer, "sliding_window", 0) or 0) if getattr(layer, "is_sliding", False) else 0
            out.append((i, GroupKind.WINDOW if window else GroupKind.FULL, window))
    return out


def probe_states(model: Any, cache_arg: str) -> tuple[StateEntry, ...]:
    """Every recurrent-state tensor the model's cache keeps (offsets not yet assigned), from
    a one-token forward: their shapes do not depend on the sequence, and only a forward says
    which each architecture keeps."""
    import torch

    cache = new_cache(model.config)
    device = getattr(model, "device", None)
    with torch.no_grad():
        model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device), use_cache=True, **{cache_arg: cache})
    linear = _layer_classes().get("LinearAttentionCacheLayerMixin")
    found = []
    for i, layer in enumerate(cache.layers):
        if linear is None or not isinstance(layer, linear):
            continue
        for s in range(layer.number_of_states):
            for part, ready, tensors in (("conv", layer.is_conv_states_initialized, layer.conv_states),
                                         ("recurrent", layer.is_recurrent_states_initialized, layer.recurrent_states)):
                if ready[s]:
                    t = tensors[s]
                    kernel = int(layer.conv_kernel_size[s]) if part == "conv" else 0
                    found.append(StateEntry(i, part, s, tuple(t.shape), str(t.dtype).removeprefix("torch."), kernel, 0))
    return tuple(found)


def _state_group(found: Sequence[StateEntry], block_tokens: int) -> CacheGroup:
    """The state group: one page of raw bytes (uint8) holding every state tensor, aligned."""
    entries, offset = [], 0
    for entry in found:
        entries.append(replace(entry, offset=offset))
        offset += -(-entry.nbytes // STATE_ALIGN) * STATE_ALIGN
    head_dim = max(1, -(-offset // (2 * block_tokens)))  # page_first: 2 * block_tokens * head_dim bytes
    layout = PageLayout(layers=1, kv_heads=1, head_dim=head_dim, block_tokens=block_tokens, dtype="uint8")
    layers = tuple(sorted({e.layer for e in entries}))
    return CacheGroup(GroupKind.STATE, layers, layout, states=tuple(entries), tag=b"kvtier-hf/state")


def cache_groups(model_or_config: Any, *, block_tokens: int, dtype: Any = None,
                 states: Sequence[StateEntry] | None = None) -> tuple[CacheGroup, ...]:
    """The model's groups, the primary one first (then windows by size, then the state).
    `states` (from `probe_states`) is needed when the model has linear-attention layers."""
    config = getattr(model_or_config, "config", model_or_config)
    kinds = layer_kinds(config)
    by_kind: dict[tuple[GroupKind, int], list[int]] = {}
    for layer, kind, window in kinds:
        by_kind.setdefault((kind, window), []).append(layer)
    attention = sorted((k for k in by_kind if k[0] is not GroupKind.STATE),
                       key=lambda k: (k[0] is GroupKind.WINDOW, k[1]))  # full first, then windows by size
    if not attention:
        raise ValueError(
            "the model has no attention layer (every layer keeps a recurrent state only, e.g. Mamba): kvtier's "
            "transformers helper restores transformers and attention/recurrent hybrids, not pure recurrent models"
        )
    kv_heads, head_dim = kv_shape(config)
    dtype_name = kv_dtype(model_or_config, dtype)
    groups = []
    for n, (kind, window) in enumerate(attention):
        layout = PageLayout(layers=len(by_kind[kind, window]), kv_heads=kv_heads, head_dim=head_dim,
                            block_tokens=block_tokens, dtype=dtype_name)
        tag = b"" if n == 0 else f"kvtier-hf/{kind.value}/{window}".encode()
        groups.append(CacheGroup(kind, tuple(by_kind[kind, window]), layout, window=window, tag=tag))
    if (GroupKind.STATE, 0) in by_kind:
        if not states:
            raise ValueError("the model has linear-attention layers: pass states= (from probe_states)")
        groups.append(_state_group(states, block_tokens))
    return tuple(groups)


def page_layout(model_or_config: Any, *, block_tokens: int = DEFAULT_BLOCK_TOKENS, dtype: Any = None) -> PageLayout:
    """The page layout of a model whose cache is one group (all full attention, or all one
    sliding window): num_hidden_layers, num_key_value_heads (else num_attention_heads),
    head_dim (else hidden_size / num_attention_heads) and the model's dtype (or `dtype`; a
    bare config without one needs it). A model with several groups has one layout per group
    (`cache_groups`): ValueError."""
    config = getattr(model_or_config, "config", model_or_config)
    kinds = layer_kinds(config)
    distinct = sorted({(kind.value, window) for _, kind, window in kinds})
    if len(distinct) > 1:
        names = ", ".join(f"window-{w}" if w else k for k, w in distinct)
        raise ValueError(
            f"the model's cache has several kinds of layers ({names}), one page layout each: see "
            "kvtier_client.integrations.hf_groups.cache_groups (HFPrefixCache registers one per group)"
        )
    groups = cache_groups(model_or_config, block_tokens=block_tokens, dtype=dtype)
    return groups[0].layout


@dataclass(frozen=True)
class Need:
    """What one group reads for a restore point: blocks [first, end), each in `tiers[i]`."""

    group: CacheGroup
    first: int
    end: int
    tiers: tuple[Tier, ...]


def restored_tokens(blocks: int, prompt_tokens: int, block_tokens: int) -> int:
    """Tokens a `blocks`-block restore gives: at least one prompt token is left to prefill."""
    return min(blocks * block_tokens, prompt_tokens - 1) if blocks else 0


class GroupSearch:
    """The longest prefix for which every group has what it needs, in one daemon call
    (KVTierClient.lookup_groups: the daemon applies kvtier_client.groups' rules over every
    group's pool), and what each group then reads.

    The daemon reasons in blocks: a window group asks for its trailing ceil(window / B)
    blocks, which cover the tokens its layers read at any point, and a state group for the
    page at the prefix's end. A state exists only at a block boundary, so with a state group
    the candidate points stop where at least one prompt token is still left to prefill.
    """

    def __init__(self, groups: Sequence[CacheGroup], keys: dict[str, list[BlockKey]],
                 lookup_groups: Callable[[list[GroupQuery]], GroupLookup], prompt_tokens: int) -> None:
        self.groups = groups
        self.keys = keys
        self.lookup_groups = lookup_groups
        self.prompt_tokens = prompt_tokens

    def point(self, upper: int) -> tuple[int, tuple[Need, ...]]:
        """The largest restore point <= `upper` blocks every group can serve, and what each reads."""
        B = self.groups[0].layout.block_tokens
        if any(g.kind is GroupKind.STATE for g in self.groups):
            upper = min(upper, (self.prompt_tokens - 1) // B)  # then every point restores whole blocks
        if upper <= 0:
            return 0, ()
        found = self.lookup_groups([GroupQuery(self.keys[g.name][:upper], GroupMode[g.kind.name],
                                               -(-g.window // B) if g.kind is GroupKind.WINDOW else 0, g.layout)
                                    for g in self.groups])
        blocks = found.hit_blocks
        if not blocks:
            return 0, ()
        tokens = restored_tokens(blocks, self.prompt_tokens, B)
        needs = []
        for group, hit in zip(self.groups, found.groups):
            first, end = group.needs(blocks, tokens)  # within the blocks the daemon found for it
            first = min(first, end)
            needs.append(Need(group, first, end, hit.tiers[first - hit.first_block : end - hit.first_block]))
        return blocks, tuple(needs)

    @staticmethod
    def plan_input(blocks: int, needs: Sequence[Need]) -> LookupResult:
        """What a planner weighs for a `blocks` restore: the primary group's tier per block. A
        primary window group reads only its window: every block counts at its slowest tier
        (an over-estimate, so the planner errs towards recomputing)."""
        if not blocks:
            return LookupResult(0, ())
        primary = needs[0]
        if primary.group.kind is GroupKind.FULL:
            return LookupResult(blocks, tuple(primary.tiers[:blocks]))
        return LookupResult(blocks, (max(primary.tiers, default=Tier.HOST),) * blocks)
