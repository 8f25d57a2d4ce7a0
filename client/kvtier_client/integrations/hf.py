"""Hugging Face transformers: keep a causal LM's prompt KV in kvtier and restore it.

After a prefill, `HFPrefixCache.store` copies the model's cache, one full block of
`block_tokens` tokens per page, into kvtier pages (only blocks the daemon does not hold
yet). For a new prompt, `HFPrefixCache.restore` looks the prompt's block keys up, asks the
load planner how many of the cached blocks are worth loading (never slower than recomputing
them), copies those pages into the `transformers.DynamicCache` the model would build and
returns it, so `forward()` / `generate()` prefill only the missing suffix:

    from kvtier_client import KVTierClient
    from kvtier_client.integrations.hf import HFPrefixCache

    with KVTierClient("unix:///tmp/kvtier/kvtier.sock") as kv:
        cache = HFPrefixCache(kv, model, salt=b"tenant-a")       # registers the model's namespace
        out = cache.generate(input_ids, max_new_tokens=64)        # restore -> generate -> store
        print(out.restored.tokens, "prompt tokens came from kvtier", out.restored.tiers)

or step by step: ``r = cache.restore(ids)``; ``model(ids[:, r.tokens:], cache=r.cache)``;
``cache.store(ids, r.cache)``.

What it supports: batch size 1 (one sequence per call); decoder-only models whose cache
layers are full attention (Llama, Qwen2, GPT-NeoX), sliding-window or chunked attention
(Mistral with `sliding_window`, Gemma 2 and 3, Llama 4), linear attention or Mamba beside
attention (Granite 4.0-H, Bamba, Falcon-H1, Qwen3-Next): each kind of layer is a group with
its own page layout and keys (kvtier_client.integrations.hf_groups). A window group needs
only the blocks inside the window that ends where the restore ends; a recurrent (Mamba /
linear-attention) group needs its state at exactly that point, so such models restore to a
block boundary where a state page was kept: `prefill` and `generate` keep one at the last
block boundary of what they stored (and every `state_every` blocks if set), running the
forward in pieces that end there. A restore is all or nothing: every group gets what it
needs, or the restore stops at an earlier point, or nothing is restored. Models whose
layers all keep a recurrent state only (Mamba), and cache layers of any other class, are
refused with an explanation when the helper is built. Pages are host pages: a model on a
GPU works, its KV is copied through host memory.

Clients: a `KVTierClient` holds one registration (one layout), so a model with several
layouts (a hybrid) needs `connect`, a function returning a new client, called once per
further layout; the helper registers those in the same namespace and closes them in
`close()`.

Names: the page layouts come from the model config (`page_layout`, `cache_groups`); the
namespace from the model's identity (`model_namespace`: its model type, and a fingerprint
of its config's content and a sample of its weights, so two checkpoints, or two random
initialisations, never share pages, while one checkpoint mounted at two paths does: the
load path never enters it); `salt` (per tenant) enters every block key, so tenants with
different salts never share pages even in one namespace. torch and transformers are
imported on first use only.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from kvtier_client.client import KVTierClient
from kvtier_client.errors import CapacityError, FailedPrecondition, NotFound
from kvtier_client.integrations import hf_pages as pages
from kvtier_client.integrations.hf_groups import (
    DEFAULT_BLOCK_TOKENS, CacheGroup, GroupKind, GroupSearch, Need, cache_groups, layer_kinds, new_cache, page_layout,
    probe_states, restored_tokens,
)
from kvtier_client.integrations.hf_model import cache_argument, forward_parameters, model_fingerprint, model_namespace
from kvtier_client.integrations.hf_results import GenerateResult, GroupPages, PrefillResult, RestoreResult, StoreResult
from kvtier_client.integrations.hf_states import StateHook, run_in_pieces
from kvtier_client.integrations.planner import LoadPlan, Planner
from kvtier_client.keys import BlockKey
from kvtier_client.layout import PageLayout
from kvtier_client.results import LookupResult
from kvtier_client.tiers import Tier

if TYPE_CHECKING:
    import numpy as np
    import torch

log = logging.getLogger("kvtier_client.hf")

__all__ = [
    "GenerateResult",
    "GroupPages",
    "HFPrefixCache",
    "LoadEverything",
    "PlannerLike",
    "PrefillResult",
    "RestoreResult",
    "StoreResult",
    "cache_groups",
    "model_fingerprint",
    "model_namespace",
    "page_layout",
]

#: Most pages moved by one borrow or acquire (also at most half the host tier).
DEFAULT_BATCH_BLOCKS = 1024


class PlannerLike(Protocol):
    """What the helper needs from a planner (kvtier_client.integrations.planner.Planner)."""

    def plan(self, lookup: LookupResult) -> LoadPlan: ...

    def observe_prefill(self, tokens: int, seconds: float) -> None: ...


class LoadEverything:
    """A planner that loads every cached block: for exactness checks, or where an engine
    knows loading always wins. It ignores prefill measurements."""

    def plan(self, lookup: LookupResult) -> LoadPlan:
        n = lookup.hit_blocks
        return LoadPlan(n, n, 0.0, 0.0, "LoadEverything: loading every cached block" if n else "nothing cached")

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        pass


def _token_list(tokens: Any) -> list[int]:
    """A sequence's token ids as ints: a list, a 1-D array or tensor, or a [1, T] tensor."""
    shape = getattr(tokens, "shape", None)
    if shape is not None and len(shape) == 2:
        if shape[0] != 1:
            raise ValueError(f"batch size {shape[0]}: kvtier's transformers helper handles one sequence (batch size 1)")
        tokens = tokens[0]
    elif shape is not None and len(shape) != 1:
        raise ValueError(f"token ids must have shape [T] or [1, T], got {tuple(shape)}")
    ids = tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)
    if any(isinstance(t, list) for t in ids):
        raise ValueError("token ids must be one sequence (batch size 1), not a list of lists")
    return [int(t) for t in ids]


def _salt_bytes(salt: bytes | str) -> bytes:
    return salt.encode() if isinstance(salt, str) else bytes(salt)


# -- the helper -----------------------------------------------------------------
class HFPrefixCache:
    """Stores and restores one transformers causal LM's prompt KV through kvtier clients.

    `client` is a `KVTierClient` for the primary group's layout (`layout`); if it is not
    registered yet it is registered for `namespace` (default `model_namespace(model,
    model_id=model_id)`); if it is, its layout must be the primary group's (else
    ValueError). A model with several layouts needs `connect` (a function returning a new,
    unregistered client; see the module docstring). `salt` (bytes or str, per tenant) goes
    into every block key; each call may override it. `planner` decides how many cached
    blocks to load (default: a `Planner` on `client`, fed with every prefill this helper
    times; `LoadEverything()` loads all). `state_every` (blocks): for models with recurrent
    layers, also keep the state every that many blocks (a shared system prompt restores
    from one), not only at the last block boundary. Batch size 1.
    """

    def __init__(
        self,
        client: KVTierClient,
        model: Any,
        *,
        salt: bytes | str = b"",
        namespace: str | None = None,
        model_id: str | None = None,
        block_tokens: int | None = None,
        planner: PlannerLike | None = None,
        batch_blocks: int = DEFAULT_BATCH_BLOCKS,
        connect: Callable[[], KVTierClient] | None = None,
        state_every: int | None = None,
    ) -> None:
        if batch_blocks <= 0:
            raise ValueError(f"batch_blocks must be positive, got {batch_blocks}")
        if state_every is not None and state_every <= 0:
            raise ValueError(f"state_every must be a positive number of blocks, got {state_every}")
        self.client = client
        self.model = model
        self.salt = _salt_bytes(salt)
        self.batch_blocks = batch_blocks
        self.state_every = state_every
        self._cache_arg = cache_argument(model)
        self._positions = "position_ids" in forward_parameters(model)
        try:
            registered = client.pool
        except FailedPrecondition:
            registered = None
        if block_tokens is None:
            block_tokens = registered.layout.block_tokens if registered else DEFAULT_BLOCK_TOKENS
        recurrent = any(kind is GroupKind.STATE for _, kind, _ in layer_kinds(model.config))
        self._states = probe_states(model, self._cache_arg) if recurrent else None
        self.groups: tuple[CacheGroup, ...] = cache_groups(model, block_tokens=block_tokens, states=self._states)
        self.layout: PageLayout = self.groups[0].layout
        others = sorted({g.layout for g in self.groups} - {self.layout}, key=str)
        if others and connect is None:
            raise ValueError(
                f"this model keeps {len(self.groups)} cache groups ({', '.join(g.name for g in self.groups)}) in "
                f"{len(others) + 1} page layouts, and a kvtier client holds one: pass connect= (a function returning a "
                "new KVTierClient, e.g. lambda: KVTierClient(target)) so the helper can open one per further layout"
            )
        if registered is None:
            self.namespace = namespace or model_namespace(model, model_id=model_id)
            client.register(self.namespace, self.layout)
        else:
            if registered.layout != self.layout:
                raise ValueError(
                    f"model config mismatch: the client is registered for {registered.layout}, but this model "
                    f"({type(model).__name__}) needs {self.layout}; register a client for this model's layout"
                )
            if namespace is not None and namespace != registered.namespace:
                raise ValueError(f"the client is registered for namespace {registered.namespace!r}, not {namespace!r}")
            self.namespace = registered.namespace
        self._clients: dict[PageLayout, KVTierClient] = {self.layout: client}
        self._opened: list[KVTierClient] = []
        try:
            for layout in others:
                extra = connect()  # type: ignore[misc]  (checked above)
                self._opened.append(extra)
                extra.register(self.namespace, layout)
                self._clients[layout] = extra
        except BaseException:
            self.close()
            raise
        self.planner: PlannerLike = planner if planner is not None else Planner(client)

    def __repr__(self) -> str:
        groups = ", ".join(f"{g.name}: {g.layout}" for g in self.groups)
        return f"HFPrefixCache({type(self.model).__name__}, namespace={self.namespace!r}, {groups})"

    def close(self) -> None:
        """Close the clients this helper opened with `connect` (not the one it was given)."""
        while self._opened:
            self._opened.pop().close()

    def __enter__(self) -> HFPrefixCache:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- helpers ------------------------------------------------------------------
    @property
    def block_tokens(self) -> int:
        return self.layout.block_tokens

    def client_for(self, group: CacheGroup) -> KVTierClient:
        """The client registered for `group`'s layout."""
        return self._clients[group.layout]

    @property
    def _state_group(self) -> CacheGroup | None:
        return next((g for g in self.groups if g.kind is GroupKind.STATE), None)

    def _batch(self, client: KVTierClient) -> int:
        """Pages per borrow / acquire: at most half the host tier, so one batch always fits."""
        host = client.pool.capacity(Tier.HOST)
        return max(1, min(self.batch_blocks, host // 2 if host > 1 else 1))

    def _keys(self, tokens: list[int], salt: bytes | str | None) -> dict[str, list[BlockKey]]:
        """Each group's keys of every full block of `tokens`."""
        salt_bytes = self.salt if salt is None else _salt_bytes(salt)
        return {g.name: g.keys(self.client_for(g).block_keys, tokens, salt_bytes) for g in self.groups}

    def _run(self, ids: torch.Tensor, start: int, end: int, cache: Any, taken: dict[int, np.ndarray] | None,
             **forward_kwargs) -> Any:
        """The model over ids[:, start:end], taking recurrent states on the way (hf_states)."""
        return run_in_pieces(self.model, ids, start, end, cache=cache, cache_arg=self._cache_arg,
                             positions=self._positions, group=self._state_group, taken=taken, every=self.state_every,
                             **forward_kwargs)

    def _device(self) -> torch.device:
        import torch

        device = getattr(self.model, "device", None)
        return device if isinstance(device, torch.device) else torch.device("cpu")

    def cache_kwargs(self, cache: Any) -> dict[str, Any]:
        """``{name: cache}`` for forward() / generate() of this model (`cache` or `past_key_values`)."""
        return {self._cache_arg: cache}

    def _check_model(self) -> None:
        """The model still has the layouts this helper registered (e.g. not cast to another dtype since)."""
        now = cache_groups(self.model, block_tokens=self.block_tokens, states=self._states)
        if [g.layout for g in now] != [g.layout for g in self.groups]:
            raise ValueError(
                f"model config mismatch: the model now needs {[str(g.layout) for g in now]}, but this helper uses "
                f"{[str(g.layout) for g in self.groups]}"
            )

    # -- restore --------------------------------------------------------------------
    def restore(
        self, input_ids: Any, *, salt: bytes | str | None = None, max_blocks: int | None = None
    ) -> RestoreResult:
        """The longest cached prefix of `input_ids` worth loading, in a fresh DynamicCache.

        At least one prompt token is left to prefill (its logits are the next token's): when
        the prompt is whole blocks and all are restored, the last token's KV is left out (a
        model with recurrent layers restores one block less: its state exists at block
        boundaries only). A prefix that vanished between lookup and acquire, or does not
        fit the host tier, is recomputed instead (the result's `note` says so); bad input
        raises ValueError. The cache's window layers keep every token they are given until
        the next `store` (prefill and generate then trim them to their window).
        """
        import torch

        start = time.perf_counter()
        self._check_model()
        tokens = _token_list(input_ids)
        if not tokens:
            raise ValueError("the prompt is empty")
        B = self.block_tokens
        usable = len(tokens) // B
        if max_blocks is not None:
            usable = min(usable, max(0, max_blocks))
        keys = self._keys(tokens[: usable * B], salt)
        search = GroupSearch(self.groups, keys, self.client_for(self.groups[0]).lookup_groups, len(tokens))
        cached, needs = search.point(usable)
        plan = self.planner.plan(search.plan_input(cached, needs))
        n = min(plan.load_blocks, cached)
        if n < cached:
            n, needs = search.point(n)
        cache = new_cache(self.model.config)
        note, promoted = "", 0
        if n:
            try:
                with torch.no_grad():
                    promoted = self._fill(cache, needs, keys, restored_tokens(n, len(tokens), B))
            except (NotFound, CapacityError) as exc:
                # Evicted meanwhile, or no room to pin them: the cache is an optimisation, recompute.
                note = f"planned {n} blocks but could not load them ({type(exc).__name__}: {exc}); recomputing"
                log.warning("kvtier restore: %s", note)
                n, needs, cache = 0, (), new_cache(self.model.config)
        return RestoreResult(
            cache=cache, prompt_tokens=len(tokens), tokens=restored_tokens(n, len(tokens), B), blocks=n,
            cached_blocks=cached, tiers=tuple(t for need in needs for t in need.tiers), promoted=promoted, plan=plan,
            seconds=time.perf_counter() - start, note=note,
            groups=tuple(GroupPages(need.group.name, need.end - need.first, tiers=need.tiers) for need in needs),
        )

    def _fill(self, cache: Any, needs: Sequence[Need], keys: dict[str, list[BlockKey]], tokens: int) -> int:
        """Read what each group needs into `cache` (restoring `tokens` tokens); the pages promoted."""
        device, promoted = self._device(), 0
        for need in needs:
            group, client = need.group, self.client_for(need.group)
            group_keys = keys[group.name][need.first : need.end]
            if not group_keys:
                continue
            if group.kind is GroupKind.STATE:
                page, loaded = pages.read_state(client, group_keys[0])
                pages.fill_state(cache, group, page, tokens, device)
            else:
                first_token = need.first * self.block_tokens
                kv, loaded = pages.read_kv(client, group_keys, group.layout, tokens - first_token, self._batch(client))
                pages.fill_kv(cache, group, kv, tokens, device)
            promoted += loaded
        return promoted

    # -- store ----------------------------------------------------------------------
    def store(self, token_ids: Any, cache: Any, *, salt: bytes | str | None = None,
              states: dict[int, np.ndarray] | None = None) -> StoreResult:
        """Put every full block of `token_ids` that `cache` holds into kvtier.

        `token_ids` are the tokens whose KV is at the start of `cache` (the prompt, or the
        prompt plus generated tokens: blocks beyond the cache's length are left out).
        Blocks already cached are skipped; new ones are committed with their parent key. A
        window layer gives the blocks it still holds. A recurrent group gives its state
        when the cache ends on a block boundary, and `states` (block count -> state page,
        taken on the way by prefill / generate). When a tier has no room, what did not fit
        is skipped (`note` says so).
        """
        start = time.perf_counter()
        tokens = _token_list(token_ids)
        get_len = getattr(cache, "get_seq_length", None)
        if get_len is None:
            raise ValueError(f"expected a transformers DynamicCache, got {type(cache).__name__}")
        held = int(get_len())
        B = self.block_tokens
        full = min(len(tokens), held) // B
        if full == 0:
            return StoreResult(0, 0, 0, B, time.perf_counter() - start)
        keys = self._keys(tokens[: full * B], salt)
        done, notes = [], []
        for group in self.groups:
            client = self.client_for(group)
            if group.kind is GroupKind.STATE:
                taken = {blocks: page for blocks, page in (states or {}).items() if blocks <= full}
                if held % B == 0 and held // B <= full:
                    taken[held // B] = pages.encode_state(cache, group)
                stored, cached, note = pages.write_states(client, keys[group.name], taken)
            else:
                kv, offset, seen = pages.held_kv(cache, group)
                first, end = -(-offset // B), min(full, seen // B)  # the blocks the layers still hold
                group_keys = keys[group.name]
                cached = client.lookup(group_keys[:end]).hit_blocks
                if cached < first < end:  # a window layer no longer holds [cached, first): skipped
                    cached += client.lookup(group_keys[first:end]).hit_blocks
                begin = max(first, min(cached, end)) if cached < first else cached
                stored, dup, note = pages.write_kv(client, group_keys, tokens, kv, offset, begin, max(begin, end),
                                                   self._batch(client), token_ids=group is self.groups[0])
                cached += dup
            if note:
                notes.append(f"{group.name}: {note}")
                log.warning("kvtier store: %s", notes[-1])
            done.append(GroupPages(group.name, stored, cached))
        return StoreResult(full, done[0].pages, done[0].already_cached, B, time.perf_counter() - start,
                           "; ".join(notes), groups=tuple(done))

    # -- one call -------------------------------------------------------------------
    def prefill(
        self, input_ids: Any, *, salt: bytes | str | None = None, store: bool = True, **forward_kwargs
    ) -> PrefillResult:
        """restore -> forward over the suffix (timed, reported to the planner) -> store.
        `forward_kwargs` go to the model (e.g. ``logits_to_keep=1``)."""
        import torch

        ids = self._ids_tensor(input_ids)
        restored = self.restore(ids, salt=salt)
        forward_kwargs.setdefault("use_cache", True)
        taken: dict[int, np.ndarray] | None = {} if store else None
        with torch.no_grad():
            t0 = time.perf_counter()
            output = self._run(ids, restored.tokens, ids.shape[1], restored.cache, taken, **forward_kwargs)
            seconds = time.perf_counter() - t0
        self.planner.observe_prefill(ids.shape[1] - restored.tokens, seconds)
        stored = self.store(ids, restored.cache, salt=salt, states=taken) if store else None
        pages.settle(restored.cache)
        return PrefillResult(output, restored.cache, restored, stored, seconds)

    def generate(
        self, input_ids: Any, *, salt: bytes | str | None = None, store: bool = True, **generate_kwargs
    ) -> GenerateResult:
        """restore -> prefill the suffix but its last token (timed, reported to the planner) ->
        model.generate() (which then feeds only that last token) -> store prompt and reply.
        `generate_kwargs` go to generate() (max_new_tokens, do_sample, ...)."""
        import torch
        from transformers import LogitsProcessorList

        ids = self._ids_tensor(input_ids)
        if self._cache_arg in generate_kwargs or "past_key_values" in generate_kwargs or "cache" in generate_kwargs:
            raise ValueError("do not pass a cache: HFPrefixCache.generate builds it from kvtier")
        restored = self.restore(ids, salt=salt)
        cache, head = restored.cache, ids.shape[1] - 1
        taken: dict[int, np.ndarray] | None = {} if store else None
        seconds = 0.0
        if head > restored.tokens:
            with torch.no_grad():
                t0 = time.perf_counter()
                self._run(ids, restored.tokens, head, cache, taken, use_cache=True, logits_to_keep=1)
                seconds = time.perf_counter() - t0
            self.planner.observe_prefill(head - restored.tokens, seconds)
        generate_kwargs.setdefault("attention_mask", torch.ones_like(ids))
        if taken is not None and (group := self._state_group) is not None:
            hook = StateHook(cache, group, taken, self.state_every, after=head)
            theirs = generate_kwargs.get("logits_processor") or ()
            generate_kwargs["logits_processor"] = LogitsProcessorList([*theirs, hook])
        output = self.model.generate(ids, **self.cache_kwargs(cache), **generate_kwargs)
        sequences = output if isinstance(output, torch.Tensor) else output.sequences
        stored = self.store(sequences, cache, salt=salt, states=taken) if store else None
        pages.settle(cache)
        return GenerateResult(sequences, output, cache, restored, stored, ids.shape[1], seconds)

    def _ids_tensor(self, input_ids: Any) -> torch.Tensor:
        import torch

        if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2:
            if input_ids.shape[0] != 1:
                raise ValueError(
                    f"batch size {input_ids.shape[0]}: kvtier's transformers helper handles one sequence (batch size 1)"
                )
            ids = input_ids
        else:
            ids = torch.tensor([_token_list(input_ids)], dtype=torch.long)
        if ids.shape[1] == 0:
            raise ValueError("the prompt is empty")
        return ids.to(self._device())
