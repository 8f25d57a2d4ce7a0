"""What the Hugging Face helper's calls return (kvtier_client.integrations.hf)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtier_client.integrations.planner import LoadPlan
from kvtier_client.tiers import Tier

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class GroupPages:
    """One cache group's pages in a restore (read) or a store (newly committed)."""

    group: str  # CacheGroup.name: "full", "window-4096", "state"
    pages: int
    already_cached: int = 0  # store: pages the daemon held already
    tiers: tuple[Tier, ...] = ()  # restore: where each page read was at lookup time


@dataclass(frozen=True)
class RestoreResult:
    """A prompt's cached prefix, restored. `cache` (a transformers DynamicCache, empty when
    nothing was restored) holds the KV (and recurrent state) of the first `tokens` prompt
    tokens; prefill ``input_ids[:, tokens:]`` with it."""

    cache: Any
    prompt_tokens: int
    tokens: int  # prompt tokens restored: min(blocks * block_tokens, prompt_tokens - 1)
    blocks: int  # blocks restored
    cached_blocks: int  # the longest prefix, in blocks, every group could restore (before the planner)
    tiers: tuple[Tier, ...]  # where each page read was at lookup time (fastest copy), group after group
    promoted: int  # pages the daemon loaded from a slower tier for this restore
    plan: LoadPlan  # the planner's decision (plan.load_blocks may exceed `blocks` if pages vanished meanwhile)
    seconds: float  # lookup + plan + acquire + copy into `cache`
    note: str = ""  # why fewer blocks than planned were restored, if so
    groups: tuple[GroupPages, ...] = ()  # what each cache group read

    @property
    def suffix_tokens(self) -> int:
        """Prompt tokens left to prefill."""
        return self.prompt_tokens - self.tokens

    def blocks_from(self, tier: Tier) -> int:
        """Pages read that were in `tier` (one per block for a model of full-attention layers)."""
        return sum(1 for t in self.tiers if t == tier)


@dataclass(frozen=True)
class StoreResult:
    """What `store` put in kvtier for one sequence. The block counts are the primary group's
    (full attention, else the first window group); `groups` has every group's pages."""

    full_blocks: int  # full blocks of the sequence whose KV the cache held
    stored_blocks: int  # pages newly committed
    already_cached: int  # blocks that were cached already (found by lookup, or by another writer meanwhile)
    block_tokens: int
    seconds: float
    note: str = ""  # why some blocks were not stored (e.g. no room in the host tier)
    groups: tuple[GroupPages, ...] = ()

    @property
    def stored_tokens(self) -> int:
        return self.stored_blocks * self.block_tokens

    @property
    def skipped_blocks(self) -> int:
        """Blocks not stored: no room, or a window layer no longer held them."""
        return self.full_blocks - self.stored_blocks - self.already_cached


@dataclass(frozen=True)
class PrefillResult:
    """`HFPrefixCache.prefill`: the model output for the suffix, the full cache, and what kvtier did."""

    output: Any  # the model's output for the suffix tokens (output.logits[:, -1] is the next token's)
    cache: Any  # DynamicCache with the whole prompt
    restored: RestoreResult
    stored: StoreResult | None
    prefill_seconds: float  # the suffix forward only

    @property
    def logits(self) -> torch.Tensor:
        return self.output.logits


@dataclass(frozen=True)
class GenerateResult:
    """`HFPrefixCache.generate`: generate()'s sequences (prompt + new tokens) and what kvtier did."""

    sequences: torch.Tensor  # [1, prompt + new]
    output: Any  # what generate() returned (a tensor, or a GenerateOutput with return_dict_in_generate)
    cache: Any
    restored: RestoreResult
    stored: StoreResult | None
    prompt_tokens: int
    prefill_seconds: float  # the forward over the suffix before generate() (the last prompt token excluded)

    @property
    def new_tokens(self) -> list[int]:
        return self.sequences[0, self.prompt_tokens:].tolist()
