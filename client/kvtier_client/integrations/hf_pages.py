"""Copies between kvtier pages and transformers cache layers, one cache group at a time.

A full or window group's page is ``[layers, 2, block_tokens, kv_heads, head_dim]`` (its
layers in order); a cache layer holds ``[1, kv_heads, tokens, head_dim]`` keys and values.
A state page is raw bytes: each recurrent-state tensor of `CacheGroup.states` at its offset.
The copies are numpy's, one per page or layer, single-threaded: on a busy CPU every small
torch copy would wake torch's intra-op threads and cost more than its bytes.

Part of the Hugging Face helper (kvtier_client.integrations.hf).
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtier_client.client import KVTierClient, Wait
from kvtier_client.errors import CapacityError, NotFound
from kvtier_client.integrations.hf_groups import CacheGroup, GroupKind
from kvtier_client.keys import BlockKey
from kvtier_client.layout import PageLayout

if TYPE_CHECKING:
    import torch

log = logging.getLogger("kvtier_client.hf")


def _numpy_view(tensor: torch.Tensor, np_dtype: Any) -> Any:
    """A CPU tensor's memory as numpy, zero copy, as `np_dtype` (the page views' dtype: raw
    integer bits for bfloat16 and float8, which numpy lacks). Keeps the tensor's strides."""
    import torch

    if tensor.dtype.is_floating_point and tensor.dtype not in (torch.float16, torch.float32, torch.float64):
        tensor = tensor.view({1: torch.uint8, 2: torch.int16}[tensor.element_size()])
    return tensor.detach().numpy().view(np_dtype)


# -- K and V --------------------------------------------------------------------------
def read_kv(client: KVTierClient, keys: Sequence[BlockKey], layout: PageLayout, tokens: int,
            batch: int) -> tuple[torch.Tensor, int]:
    """Acquire `keys`' pages (in batches, the next one prefetched) and copy their first
    `tokens` tokens into one CPU tensor [layers, 2 (K, V), kv_heads, tokens, head_dim];
    returns it and the pages promoted. NotFound when a page is gone."""
    import torch

    from kvtier_client.views import RAW_IN_NUMPY, numpy_dtype

    B = layout.block_tokens
    out = np.empty((layout.layers, 2, layout.kv_heads, tokens, layout.head_dim), dtype=numpy_dtype(layout.dtype))
    promoted = 0
    for start in range(0, len(keys), batch):
        chunk = keys[start : start + batch]
        following = keys[start + batch : start + 2 * batch]
        if following:
            client.prefetch(following)  # a hint: disk pages of the next batch start loading now
        with client.acquire(chunk, wait=Wait.ALL) as lease:
            if lease.ready != len(chunk):
                raise NotFound(f"only {lease.ready} of {len(chunk)} pages were ready")
            promoted += lease.promoted
            for j, page in enumerate(lease.pages):  # page [layers, 2, B, heads, dim]
                t0 = (start + j) * B
                t1 = min(t0 + B, tokens)
                np.copyto(out[:, :, :, t0:t1], page[:, :, : t1 - t0].transpose(0, 1, 3, 2, 4))
    tensor = torch.from_numpy(out)
    if layout.dtype in RAW_IN_NUMPY:  # numpy held the raw bits; torch has the real dtype
        tensor = tensor.view(getattr(torch, layout.dtype))
    return tensor, promoted


def held_kv(cache: Any, group: CacheGroup) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int, int]:
    """A full or window group's (keys, values) per layer, each [1, kv_heads, tokens, head_dim],
    the position of their first token and the tokens seen; ValueError if they do not fit the
    group's layout. A window layer holds only its last tokens (all of them while recording)."""
    import torch

    layers = getattr(cache, "layers", None)
    if layers is None:
        raise ValueError(f"expected a transformers DynamicCache with .layers, got {type(cache).__name__}")
    lay = group.layout
    dtype = getattr(torch, lay.dtype)
    out, spans = [], set()
    for i in group.layers:
        if i >= len(layers):
            raise ValueError(f"model config mismatch: the cache has {len(layers)} layers, the model more")
        layer = layers[i]
        if bool(getattr(layer, "is_sliding", False)) != (group.kind is GroupKind.WINDOW):
            raise ValueError(f"model config mismatch: cache layer {i} is not a {group.name} layer")
        k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
        if k is None or v is None or k.dim() != 4:
            raise ValueError(f"cache layer {i} holds no [batch, kv_heads, seq, head_dim] keys/values")
        for name, t in (("keys", k), ("values", v)):
            if (t.shape[0], t.shape[1], t.shape[3]) != (1, lay.kv_heads, lay.head_dim):
                raise ValueError(
                    f"model config mismatch: cache layer {i} {name} have shape {tuple(t.shape)} "
                    f"([batch, kv_heads, seq, head_dim]) but the layout needs batch 1, {lay.kv_heads} kv heads, "
                    f"head_dim {lay.head_dim}"
                )
            if t.dtype != dtype:
                raise ValueError(f"model config mismatch: cache layer {i} {name} are {t.dtype}, the layout {lay.dtype}")
        seen = int(layer.get_seq_length())
        spans.add((seen - k.shape[2], seen))
        out.append((k, v))
    if len(spans) != 1:
        raise ValueError(f"the {group.name} layers of the cache hold different token spans {sorted(spans)}")
    start, seen = spans.pop()
    return out, start, seen


def write_kv(client: KVTierClient, keys: Sequence[BlockKey], tokens: Sequence[int], kv: list[tuple[Any, Any]],
             offset: int, first: int, end: int, batch: int, *, token_ids: bool) -> tuple[int, int, str]:
    """Commit blocks [first, end) (their `keys`, chained by parent) from `kv`, whose tensors
    hold tokens from position `offset`. `token_ids`: send each block's tokens (for the
    daemon's KV events). Returns (committed, already cached, why some were not stored)."""
    import torch

    from kvtier_client.views import numpy_dtype

    lay = client.layout
    B = lay.block_tokens
    np_dtype = numpy_dtype(lay.dtype)
    stored, duplicates = 0, 0
    with torch.no_grad():
        for at in range(first, end, batch):
            n = min(batch, end - at)
            try:
                lease = client.borrow(n)
            except CapacityError as exc:
                why = f"stored {stored} of {end - first} new blocks: the host tier has no room ({exc})"
                return stored, duplicates, why
            with lease:
                # Per layer and K/V, one numpy copy of the [heads, n*B, dim] slice into the
                # pages' order [n, B, heads, dim].
                t0, t1 = at * B, (at + n) * B
                stage = np.empty((n, lay.layers, 2, B, lay.kv_heads, lay.head_dim), dtype=np_dtype)
                for i, (k, v) in enumerate(kv):
                    for j, src in ((0, k), (1, v)):
                        part = _numpy_view(src[0, :, t0 - offset : t1 - offset, :].to("cpu"), np_dtype)
                        np.copyto(stage[:, i, j], part.reshape(lay.kv_heads, n, B, lay.head_dim).transpose(1, 2, 0, 3))
                for j, block in enumerate(stage):  # copied and hashed in one pass: commit sends the sums
                    lease.write(j, block)
                result = lease.commit(keys[at : at + n], parent=keys[at - 1] if at else None,
                                      token_ids=tokens[t0:t1] if token_ids else None)
            stored += result.committed
            duplicates += len(result.duplicates)
    return stored, duplicates, ""


def fill_kv(cache: Any, group: CacheGroup, kv: torch.Tensor, seen: int, device: Any) -> None:
    """Put restored K/V ([layers, 2, heads, tokens, dim], the group's layers in order; the
    last `tokens` of the `seen` tokens restored) into a fresh cache's layers.

    A plain DynamicLayer adopts the tensors (update() would copy them once more, concatenating
    onto an empty tensor); any other layer gets the documented update(). A window layer then
    counts every token the prefix had (`cumulative_length`), as if it had seen them."""
    from transformers.cache_utils import DynamicLayer

    for j, i in enumerate(group.layers):
        layer = cache.layers[i]
        k, v = kv[j, 0].unsqueeze(0).to(device), kv[j, 1].unsqueeze(0).to(device)  # [1, heads, tokens, dim]
        if type(layer) is DynamicLayer:
            layer.update(k[:, :, :0], v[:, :, :0])  # initialises the layer
            layer.keys, layer.values = k, v
        else:
            layer.update(k, v)
        if group.kind is GroupKind.WINDOW:
            layer.cumulative_length = seen


def settle(cache: Any) -> None:
    """Window layers back to what transformers keeps (the last window - 1 tokens, no more
    recording), once their blocks are stored."""
    for layer in cache.layers:
        recording = getattr(layer, "record_past", False) and getattr(layer, "is_initialized", False)
        if getattr(layer, "is_sliding", False) and recording:
            layer.crop(0)
            layer.record_past = False


# -- recurrent state ------------------------------------------------------------------
def _state_tensor(cache: Any, entry: Any) -> torch.Tensor:
    layer = cache.layers[entry.layer]
    ready = layer.is_conv_states_initialized if entry.part == "conv" else layer.is_recurrent_states_initialized
    if not ready[entry.index]:
        raise ValueError(f"cache layer {entry.layer} holds no {entry.part} state {entry.index}")
    tensors = layer.conv_states if entry.part == "conv" else layer.recurrent_states
    t = tensors[entry.index]
    if tuple(t.shape) != entry.shape or str(t.dtype).removeprefix("torch.") != entry.dtype:
        raise ValueError(
            f"model config mismatch: cache layer {entry.layer} {entry.part} state is {tuple(t.shape)} {t.dtype}, "
            f"the helper was built for {entry.shape} {entry.dtype}"
        )
    return t


def encode_state(cache: Any, group: CacheGroup) -> np.ndarray:
    """The cache's recurrent states now, as one state page (a copy)."""
    import torch

    page = np.zeros(group.layout.page_bytes, dtype=np.uint8)
    with torch.no_grad():
        for entry in group.states:
            raw = _state_tensor(cache, entry).detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            page[entry.offset : entry.offset + entry.nbytes] = raw.numpy()
    return page


def read_state(client: KVTierClient, key: BlockKey) -> tuple[np.ndarray, int]:
    """A state page's bytes (a copy) and the pages promoted; NotFound when it is gone."""
    with client.acquire([key], wait=Wait.ALL) as lease:
        if lease.ready != 1:
            raise NotFound("the state page was not ready")
        return np.array(lease.pages[0]).reshape(-1).view(np.uint8), lease.promoted


def fill_state(cache: Any, group: CacheGroup, page: np.ndarray, seen: int, device: Any) -> None:
    """Put a state page (the state after `seen` tokens) into a fresh cache's linear-attention
    layers, through their own update_conv_state / update_recurrent_state (which initialise
    them as a forward would). Since transformers 5.25 such a layer also counts its tokens
    (`cumulative_length_linear`, what get_seq_length answers); the conv update counted the
    kernel's width, so the count is set to `seen`."""
    import torch

    for entry in group.states:
        raw = torch.from_numpy(page[entry.offset : entry.offset + entry.nbytes].copy())
        t = raw.view(getattr(torch, entry.dtype)).reshape(entry.shape).to(device)
        layer = cache.layers[entry.layer]
        if entry.part == "conv":
            layer.update_conv_state(t, state_idx=entry.index, conv_kernel_size=entry.kernel)
        else:
            layer.update_recurrent_state(t, state_idx=entry.index)
    for i in {entry.layer for entry in group.states}:
        count = getattr(cache.layers[i], "cumulative_length_linear", None)
        if isinstance(count, torch.Tensor):
            count.fill_(seen)


def write_states(client: KVTierClient, keys: Sequence[BlockKey], pages: dict[int, np.ndarray]) -> tuple[int, int, str]:
    """Commit each state page `pages[blocks]` under keys[blocks - 1], unless cached. One
    page per lease, no parent: a state page stands alone. Returns (committed, already
    cached, why some were not stored)."""
    stored, cached = 0, 0
    for blocks in sorted(pages):
        key = keys[blocks - 1]
        if client.lookup([key]).hit_blocks:
            cached += 1
            continue
        try:
            lease = client.borrow(1)
        except CapacityError as exc:
            return stored, cached, f"stored {stored} of {len(pages) - cached} new state pages: no room ({exc})"
        with lease:
            lease.write(0, pages[blocks])
            result = lease.commit([key])
        stored += result.committed
        cached += len(result.duplicates)
    return stored, cached, ""
