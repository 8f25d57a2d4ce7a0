"""Where a recurrent (Mamba / linear-attention) layer's state is taken for kvtier.

A restore needs the state at exactly its end, a block boundary, but a forward leaves only
the state after its last token. So the helper runs a prefill in pieces that end on the
boundaries it keeps (`state_points`: the last one, and every `every` blocks if asked),
taking the state page after each (`run_in_pieces`); during generate() a logits processor
that only watches (`StateHook`) takes it when a decode step ends on a boundary.

Part of the Hugging Face helper (kvtier_client.integrations.hf).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvtier_client.integrations.hf_groups import CacheGroup
from kvtier_client.integrations.hf_pages import encode_state

if TYPE_CHECKING:
    import numpy as np
    import torch


def state_points(start: int, end: int, block_tokens: int, every: int | None) -> list[int]:
    """Token positions in (start, end] after which the state is kept: the last block
    boundary, and every `every` blocks."""
    first, last = start // block_tokens + 1, end // block_tokens
    blocks = {last} if last >= first else set()
    if every:
        blocks |= {b for b in range(first, last + 1) if b % every == 0}
    return sorted(b * block_tokens for b in blocks)


def run_in_pieces(model: Any, ids: torch.Tensor, start: int, end: int, *, cache: Any, cache_arg: str,
                  positions: bool, group: CacheGroup | None, taken: dict[int, np.ndarray] | None,
                  every: int | None, **forward_kwargs) -> Any:
    """model() over ids[:, start:end] with `cache` (under the keyword `cache_arg`); when
    `group` is the recurrent group and `taken` collects its pages (block count -> page), in
    pieces ending at the state points, the state page of each going into `taken`. Returns
    the last piece's output with every piece's logits (with `logits_to_keep`, the earlier
    pieces keep one, only the last piece's are returned). `positions`: pass position_ids
    (some hybrids, e.g. Bamba, count positions from 0 without them)."""
    import torch

    B = group.layout.block_tokens if group is not None else 0
    points = state_points(start, end, B, every) if group is not None and taken is not None else []
    keep = "logits_to_keep" in forward_kwargs
    output, logits, at = None, [], start
    for stop in sorted({*points, end}):
        if stop <= at:
            continue
        kwargs = forward_kwargs if stop == end or not keep else {**forward_kwargs, "logits_to_keep": 1}
        if positions:
            kwargs = {**kwargs, "position_ids": torch.arange(at, stop, device=ids.device).unsqueeze(0)}
        output = model(input_ids=ids[:, at:stop], **{cache_arg: cache}, **kwargs)
        if not keep:
            logits.append(output.logits)
        if stop in points:
            taken[stop // B] = encode_state(cache, group)  # type: ignore[index,arg-type]
        at = stop
    if len(logits) > 1:
        output.logits = torch.cat(logits, dim=1)
    return output


class StateHook:
    """A logits processor that only watches: generate() calls it after every forward, when
    the cache holds exactly `input_ids`. On a block boundary past `after` tokens it takes
    the state page: the latest boundary's, and every `every` blocks'."""

    def __init__(self, cache: Any, group: CacheGroup, taken: dict[int, np.ndarray], every: int | None,
                 after: int) -> None:
        self.cache, self.group, self.taken, self.every, self.after = cache, group, taken, every, after
        self._latest: int | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        seen, B = input_ids.shape[1], self.group.layout.block_tokens
        if seen > self.after and seen % B == 0:
            latest = self._latest
            if latest is not None and not (self.every and latest % self.every == 0):
                del self.taken[latest]  # superseded: only the latest boundary is kept
            self._latest = seen // B
            self.taken[self._latest] = encode_state(self.cache, self.group)
        return scores
