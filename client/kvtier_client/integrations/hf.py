"""Hugging Face transformers: keep a causal LM's prompt KV in kvtier and restore it.

After a prefill, `HFPrefixCache.store` copies the model's past keys and values, one full
block of `block_tokens` tokens per page, into kvtier pages (only blocks the daemon does not
hold yet). For a new prompt, `HFPrefixCache.restore` looks the prompt's block keys up, asks
the load planner how many of the cached blocks are worth loading (never slower than
recomputing them), copies those pages into a `transformers.DynamicCache` and returns it, so
`forward()` / `generate()` prefill only the missing suffix:

    from kvtier_client import KVTierClient
    from kvtier_client.integrations.hf import HFPrefixCache

    with KVTierClient("unix:///tmp/kvtier/kvtier.sock") as kv:
        cache = HFPrefixCache(kv, model, salt=b"tenant-a")       # registers the model's namespace
        out = cache.generate(input_ids, max_new_tokens=64)        # restore -> generate -> store
        print(out.restored.tokens, "prompt tokens came from kvtier", out.restored.tiers)

or step by step: ``r = cache.restore(ids)``; ``model(ids[:, r.tokens:], cache=r.cache)``;
``cache.store(ids, r.cache)``.

What it supports: batch size 1 (one sequence per call); decoder-only models whose cache is
the standard `DynamicCache` of full layers (per layer ``layers[i].keys`` / ``.values`` of
shape ``[1, kv_heads, seq, head_dim]``): Llama, Mistral without a sliding window, Qwen2,
GPT-NeoX and the like. Models with sliding-window, chunked or linear-attention layers (a
`layer_types` entry, or a config that sets `sliding_window` such as Mistral 7B v0.1) are
refused with an explanation when the helper is built; caches whose layers keep only a window
are refused at store time with the same one. Pages are host pages: a model on a GPU
works, its KV is copied through host memory.

Names: the page layout comes from the model config (`page_layout`); the namespace from the
model's identity (`model_namespace`: its model type, and a fingerprint of its config's content
and a sample of its weights, so two checkpoints, or two random initialisations, never share
pages, while one checkpoint mounted at two paths does: the load path never enters it);
`salt` (per tenant) enters every block key, so tenants with different salts never share
pages even in one namespace. torch and transformers are imported on first use only.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvtier_client.client import KVTierClient, Wait
from kvtier_client.errors import CapacityError, FailedPrecondition, NotFound
from kvtier_client.integrations.planner import LoadPlan, Planner
from kvtier_client.keys import BlockKey
from kvtier_client.layout import DTYPE_BYTES, PageLayout
from kvtier_client.results import LookupResult
from kvtier_client.tiers import Tier

if TYPE_CHECKING:
    import torch

log = logging.getLogger("kvtier_client.hf")

__all__ = [
    "GenerateResult",
    "HFPrefixCache",
    "LoadEverything",
    "PlannerLike",
    "PrefillResult",
    "RestoreResult",
    "StoreResult",
    "model_fingerprint",
    "model_namespace",
    "page_layout",
]

DEFAULT_BLOCK_TOKENS = 16
#: Most pages moved by one borrow or acquire (also at most half the host tier).
DEFAULT_BATCH_BLOCKS = 1024
#: Config keys that never change a model's keys and values (left out of the fingerprint).
_NOT_KV = frozenset({
    "transformers_version", "_name_or_path", "name_or_path", "_commit_hash", "use_cache", "output_attentions",
    "output_hidden_states", "return_dict", "torchscript", "_attn_implementation", "attn_implementation",
    "_attn_implementation_autoset", "architectures", "id2label", "label2id", "problem_type",
    "tokenizer_class", "task_specific_params", "finetuning_task", "prefix", "bos_token_id", "eos_token_id",
    "pad_token_id", "sep_token_id", "decoder_start_token_id", "dtype", "torch_dtype",
})


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


# -- results ------------------------------------------------------------------
@dataclass(frozen=True)
class RestoreResult:
    """A prompt's cached prefix, restored. `cache` (a transformers DynamicCache, empty when
    nothing was restored) holds the KV of the first `tokens` prompt tokens; prefill
    ``input_ids[:, tokens:]`` with it."""

    cache: Any
    prompt_tokens: int
    tokens: int  # prompt tokens whose KV is in `cache`: min(blocks * block_tokens, prompt_tokens - 1)
    blocks: int  # blocks restored
    cached_blocks: int  # leading full blocks of the prompt the daemon held
    tiers: tuple[Tier, ...]  # where each restored block was at lookup time (fastest copy)
    promoted: int  # pages the daemon loaded from a slower tier for this restore
    plan: LoadPlan  # the planner's decision (plan.load_blocks may exceed `blocks` if pages vanished meanwhile)
    seconds: float  # lookup + plan + acquire + copy into `cache`
    note: str = ""  # why fewer blocks than planned were restored, if so

    @property
    def suffix_tokens(self) -> int:
        """Prompt tokens left to prefill."""
        return self.prompt_tokens - self.tokens

    def blocks_from(self, tier: Tier) -> int:
        return sum(1 for t in self.tiers if t == tier)


@dataclass(frozen=True)
class StoreResult:
    """What `store` put in kvtier for one sequence."""

    full_blocks: int  # full blocks of the sequence whose KV the cache held
    stored_blocks: int  # pages newly committed
    already_cached: int  # blocks that were cached already (found by lookup, or by another writer meanwhile)
    block_tokens: int
    seconds: float
    note: str = ""  # why some blocks were not stored (e.g. no room in the host tier)

    @property
    def stored_tokens(self) -> int:
        return self.stored_blocks * self.block_tokens

    @property
    def skipped_blocks(self) -> int:
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


# -- model facts ----------------------------------------------------------------
def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    if get is None:
        return config
    try:
        return get(decoder=True)
    except TypeError:
        return get()


def _dtype_name(dtype: Any) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ValueError(f"model dtype {dtype} has no kvtier page dtype; use one of {', '.join(DTYPE_BYTES)}")
    return name


def _not_full_attention(what: str) -> ValueError:
    """The one refusal for KV that is not full attention, raised when the helper is built (from
    the config) and again at store time (from the cache's layers), so both read the same."""
    return ValueError(
        f"{what}: kvtier's transformers helper supports models whose every layer is full attention (a "
        "sliding-window, chunked or linear-attention layer keeps only part of the prefix, so its pages would not "
        "describe the prompt)"
    )


def _check_attention(config: Any) -> None:
    """Refuse a config whose cache would not be all full-attention layers. `layer_types`, when
    the config has it, is what transformers builds the cache from; without it transformers makes
    a layer sliding when the config sets `sliding_window` (Mistral) and chunked when it sets
    `attention_chunk_size`, so those are refused here, not first at store time."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        other = sorted({t for t in layer_types if t != "full_attention"})
        if other:
            raise _not_full_attention(f"model has {', '.join(other)} layers")
        return
    for field in ("sliding_window", "attention_chunk_size"):
        value = getattr(config, field, None)
        if value is not None:
            raise _not_full_attention(f"model config sets {field}={value}")


def page_layout(model_or_config: Any, *, block_tokens: int = DEFAULT_BLOCK_TOKENS, dtype: Any = None) -> PageLayout:
    """The page layout for a transformers model (or its config): num_hidden_layers,
    num_key_value_heads (else num_attention_heads), head_dim (else hidden_size /
    num_attention_heads) and the model's dtype (or `dtype`; a bare config without one
    needs it). Raises ValueError for a model whose KV does not fit a page."""
    config = getattr(model_or_config, "config", model_or_config)
    text = _text_config(config)
    _check_attention(text)
    try:
        layers = int(text.num_hidden_layers)
        heads = int(text.num_attention_heads)
    except (AttributeError, TypeError):
        raise ValueError(
            f"{type(config).__name__} has no num_hidden_layers / num_attention_heads: not a decoder config "
            "kvtier's transformers helper understands"
        ) from None
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None)
    if not head_dim:
        hidden = int(text.hidden_size)
        if hidden % heads:
            raise ValueError(f"hidden_size {hidden} is not a multiple of num_attention_heads {heads}; set head_dim")
        head_dim = hidden // heads
    if dtype is None:
        dtype = getattr(model_or_config, "dtype", None) if model_or_config is not config else None
        dtype = dtype or getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if dtype is None:
        raise ValueError("the config names no dtype; pass dtype= (e.g. 'float16'), or pass the model itself")
    return PageLayout(layers=layers, kv_heads=int(kv_heads), head_dim=int(head_dim), block_tokens=block_tokens,
                      dtype=_dtype_name(dtype))


def _kv_config(items: dict[str, Any]) -> dict[str, Any]:
    """A config dict's content that can change KV: without the keys in `_NOT_KV`, in nested
    configs too (a multimodal model's `text_config` carries its own `_name_or_path`)."""
    return {k: _kv_config(v) if isinstance(v, dict) else v for k, v in items.items() if k not in _NOT_KV}


def model_fingerprint(model: Any, *, samples: int = 64) -> str:
    """12 hex digits identifying a model's KV: its class, the config's content that changes KV,
    its dtype, and `samples` evenly spaced values of every parameter (cheap even for billions
    of weights). Different checkpoints, dtypes or random initialisations differ; where the
    weights were loaded from does not enter it (no `name_or_path`), so replicas that mount the
    same checkpoint at different paths agree."""
    import torch

    h = hashlib.sha256()
    h.update(type(model).__name__.encode())
    config = getattr(model, "config", None)
    if config is not None:
        h.update(json.dumps(_kv_config(config.to_dict()), sort_keys=True, default=str).encode())
    h.update(str(getattr(model, "dtype", "")).encode())
    with torch.no_grad():
        for name, param in model.named_parameters():
            h.update(f"{name}{tuple(param.shape)}{param.dtype}".encode())
            if param.device.type == "meta" or param.numel() == 0:
                continue
            flat = param.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // samples)][:samples]
            h.update(sample.to(device="cpu", dtype=torch.float32).numpy().tobytes())
    return h.hexdigest()[:12]


def model_namespace(model: Any, *, model_id: str | None = None) -> str:
    """``hf/<name>/<fingerprint>``: `model_id`, else the config's model_type (else the class
    name), and `model_fingerprint`. Never the path the model was loaded from: two replicas that
    mount the same weights at different paths share pages. At most 255 bytes (a long name is
    cut from the left)."""
    config = getattr(model, "config", None)
    name = model_id or getattr(config, "model_type", "") or type(model).__name__
    name = "-".join(str(name).split()).strip("/") or "model"
    fingerprint = model_fingerprint(model)
    room = 255 - len("hf//") - len(fingerprint)
    encoded = name.encode()
    if len(encoded) > room:
        name = encoded[-room:].decode(errors="ignore")
    return f"hf/{name}/{fingerprint}"


def _cache_argument(model: Any) -> str:
    """The keyword forward() takes a cache under: `cache` in newer transformers, else `past_key_values`."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


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


def _numpy_view(tensor: torch.Tensor, np_dtype: Any) -> Any:
    """A CPU tensor's memory as numpy, zero copy, as `np_dtype` (the page views' dtype: raw
    integer bits for bfloat16 and float8, which numpy lacks). Keeps the tensor's strides."""
    import torch

    if tensor.dtype.is_floating_point and tensor.dtype not in (torch.float16, torch.float32, torch.float64):
        tensor = tensor.view({1: torch.uint8, 2: torch.int16}[tensor.element_size()])
    return tensor.detach().numpy().view(np_dtype)


def _fill_layer(cache: Any, index: int, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Put restored [1, heads, tokens, dim] keys/values into layer `index` of a fresh DynamicCache.

    `update()` would copy them once more (it concatenates onto an empty tensor). A plain
    DynamicLayer, which keeps exactly the concatenation of what it was given in `.keys` and
    `.values`, adopts the tensors instead; any other layer class gets the documented update().
    """
    from transformers.cache_utils import DynamicLayer

    cache.update(keys[:, :, :0], values[:, :, :0], index)  # creates and initialises the layer
    layer = cache.layers[index]
    if type(layer) is DynamicLayer and layer.keys.shape[-2] == 0 and layer.values.shape[-2] == 0:
        layer.keys, layer.values = keys, values
    else:
        cache.update(keys, values, index)


def _salt_bytes(salt: bytes | str) -> bytes:
    return salt.encode() if isinstance(salt, str) else bytes(salt)


# -- the helper -----------------------------------------------------------------
class HFPrefixCache:
    """Stores and restores one transformers causal LM's prompt KV through a kvtier client.

    `client` is a `KVTierClient`; if it is not registered yet it is registered for
    `namespace` (default `model_namespace(model, model_id=model_id)`) and the model's page
    layout; if it is, its layout must be the model's (else ValueError). `salt` (bytes or
    str, per tenant) goes into every block key; each call may override it. `planner`
    decides how many cached blocks to load (default: a `Planner` on the client, fed with
    every prefill this helper times; `LoadEverything()` loads all). Batch size 1.
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
    ) -> None:
        if batch_blocks <= 0:
            raise ValueError(f"batch_blocks must be positive, got {batch_blocks}")
        self.client = client
        self.model = model
        self.salt = _salt_bytes(salt)
        try:
            registered = client.pool
        except FailedPrecondition:
            registered = None
        if block_tokens is None:
            block_tokens = registered.layout.block_tokens if registered else DEFAULT_BLOCK_TOKENS
        self.layout = page_layout(model, block_tokens=block_tokens)
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
        self.planner: PlannerLike = planner if planner is not None else Planner(client)
        self.batch_blocks = batch_blocks
        self._cache_arg = _cache_argument(model)

    def __repr__(self) -> str:
        return f"HFPrefixCache({type(self.model).__name__}, namespace={self.namespace!r}, layout={self.layout})"

    # -- helpers ------------------------------------------------------------------
    @property
    def block_tokens(self) -> int:
        return self.layout.block_tokens

    def _batch(self) -> int:
        """Pages per borrow / acquire: at most half the host tier, so one batch always fits."""
        host = self.client.pool.capacity(Tier.HOST)
        return max(1, min(self.batch_blocks, host // 2 if host > 1 else 1))

    def _keys(self, tokens: list[int], salt: bytes | str | None) -> list[BlockKey]:
        return self.client.block_keys(tokens, salt=self.salt if salt is None else _salt_bytes(salt))

    def _device(self) -> torch.device:
        import torch

        device = getattr(self.model, "device", None)
        return device if isinstance(device, torch.device) else torch.device("cpu")

    def cache_kwargs(self, cache: Any) -> dict[str, Any]:
        """``{name: cache}`` for forward() / generate() of this model (`cache` or `past_key_values`)."""
        return {self._cache_arg: cache}

    def _torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.layout.dtype)

    def _check_model(self) -> None:
        """The model still has the layout this helper registered (e.g. not cast to another dtype since)."""
        now = page_layout(self.model, block_tokens=self.block_tokens)
        if now != self.layout:
            raise ValueError(f"model config mismatch: the model now needs {now}, but this helper uses {self.layout}")

    def _check_cache(self, cache: Any, tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(keys, values) per layer, each [1, kv_heads, >= tokens, head_dim], or ValueError."""
        layers = getattr(cache, "layers", None)
        if layers is None:
            raise ValueError(f"expected a transformers DynamicCache with .layers, got {type(cache).__name__}")
        lay = self.layout
        if len(layers) != lay.layers:
            raise ValueError(
                f"model config mismatch: the cache has {len(layers)} layers but the layout has {lay.layers}"
            )
        out = []
        dtype = self._torch_dtype()
        for i, layer in enumerate(layers):
            if getattr(layer, "is_sliding", False):
                raise _not_full_attention(f"cache layer {i} is a sliding-window layer")
            k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
            if k is None or v is None or k.dim() != 4:
                raise ValueError(f"cache layer {i} holds no [batch, kv_heads, seq, head_dim] keys/values")
            want = (1, lay.kv_heads, lay.head_dim)
            for name, t in (("keys", k), ("values", v)):
                got = (t.shape[0], t.shape[1], t.shape[3])
                if got != want:
                    raise ValueError(
                        f"model config mismatch: cache layer {i} {name} have shape {tuple(t.shape)} "
                        f"([batch, kv_heads, seq, head_dim]) but the layout needs batch 1, {lay.kv_heads} kv heads, "
                        f"head_dim {lay.head_dim}"
                    )
                if t.dtype != dtype:
                    raise ValueError(
                        f"model config mismatch: cache layer {i} {name} are {t.dtype}, the layout {lay.dtype}"
                    )
                if t.shape[2] < tokens:
                    raise ValueError(f"cache layer {i} holds {t.shape[2]} tokens, fewer than the {tokens} expected")
            out.append((k, v))
        return out

    # -- restore --------------------------------------------------------------------
    def restore(
        self, input_ids: Any, *, salt: bytes | str | None = None, max_blocks: int | None = None
    ) -> RestoreResult:
        """The longest cached prefix of `input_ids` worth loading, in a fresh DynamicCache.

        At least one prompt token is left to prefill (its logits are the next token's): when
        the prompt is whole blocks and all are restored, the last token's KV is left out.
        A prefix that vanished between lookup and acquire, or does not fit the host tier, is
        recomputed instead (the result's `note` says so); bad input raises ValueError.
        """
        import torch
        from transformers import DynamicCache

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
        lookup = self.client.lookup(keys) if keys else LookupResult(0, ())
        plan = self.planner.plan(lookup)
        n = min(plan.load_blocks, lookup.hit_blocks)
        note = ""
        kv = None
        promoted = 0
        tiers: tuple[Tier, ...] = tuple(lookup.tiers[:n])
        if n:
            try:
                kv, promoted = self._read(keys[:n], min(n * B, len(tokens) - 1))
            except (NotFound, CapacityError) as exc:
                # Evicted meanwhile, or no room to pin them: the cache is an optimisation, recompute.
                note = f"planned {n} blocks but could not load them ({type(exc).__name__}: {exc}); recomputing"
                log.warning("kvtier restore: %s", note)
                n, tiers, kv = 0, (), None
        restored = min(n * B, len(tokens) - 1)
        cache = DynamicCache()
        if kv is not None:
            device = self._device()
            with torch.no_grad():
                for i in range(self.layout.layers):
                    k, v = kv[i, 0].unsqueeze(0).to(device), kv[i, 1].unsqueeze(0).to(device)  # [1, heads, tokens, dim]
                    _fill_layer(cache, i, k, v)
        return RestoreResult(
            cache=cache, prompt_tokens=len(tokens), tokens=restored, blocks=n, cached_blocks=lookup.hit_blocks,
            tiers=tiers, promoted=promoted, plan=plan, seconds=time.perf_counter() - start, note=note,
        )

    def _read(self, keys: Sequence[BlockKey], tokens: int) -> tuple[torch.Tensor, int]:
        """Acquire `keys`' pages (in batches, the next one prefetched) and copy their first
        `tokens` tokens into one CPU tensor [layers, 2 (K, V), kv_heads, tokens, head_dim];
        returns it and the pages promoted.

        The copy is numpy's, one per page, single-threaded: on a busy CPU every small torch
        copy would wake torch's intra-op threads and cost more than its bytes.
        """
        import numpy as np
        import torch

        from kvtier_client.views import RAW_IN_NUMPY, numpy_dtype

        lay = self.layout
        B = lay.block_tokens
        out = np.empty((lay.layers, 2, lay.kv_heads, tokens, lay.head_dim), dtype=numpy_dtype(lay.dtype))
        batch = self._batch()
        promoted = 0
        for start in range(0, len(keys), batch):
            chunk = keys[start : start + batch]
            following = keys[start + batch : start + 2 * batch]
            if following:
                self.client.prefetch(following)  # a hint: disk pages of the next batch start loading now
            with self.client.acquire(chunk, wait=Wait.ALL) as lease:
                if lease.ready != len(chunk):
                    raise NotFound(f"only {lease.ready} of {len(chunk)} pages were ready")
                promoted += lease.promoted
                for j, page in enumerate(lease.pages):  # page [layers, 2, B, heads, dim]
                    t0 = (start + j) * B
                    t1 = min(t0 + B, tokens)
                    np.copyto(out[:, :, :, t0:t1], page[:, :, : t1 - t0].transpose(0, 1, 3, 2, 4))
        tensor = torch.from_numpy(out)
        if lay.dtype in RAW_IN_NUMPY:  # numpy held the raw bits; torch has the real dtype
            tensor = tensor.view(self._torch_dtype())
        return tensor, promoted

    # -- store ----------------------------------------------------------------------
    def store(self, token_ids: Any, cache: Any, *, salt: bytes | str | None = None) -> StoreResult:
        """Put the KV of every full block of `token_ids` that `cache` holds into kvtier.

        `token_ids` are the tokens whose KV is at the start of `cache` (the prompt, or the
        prompt plus generated tokens: blocks beyond the cache's length are left out).
        Blocks already cached are skipped; new ones are committed with their parent key.
        When the host tier has no room, what did not fit is skipped (`note` says so).
        """
        import numpy as np
        import torch

        from kvtier_client.views import numpy_dtype

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
        layers = self._check_cache(cache, full * B)
        keys = self._keys(tokens[: full * B], salt)
        hit = self.client.lookup(keys).hit_blocks
        stored, duplicates, note = 0, 0, ""
        batch = self._batch()
        lay = self.layout
        np_dtype = numpy_dtype(lay.dtype)
        with torch.no_grad():
            for first in range(hit, full, batch):
                n = min(batch, full - first)
                try:
                    lease = self.client.borrow(n)
                except CapacityError as exc:
                    note = f"stored {stored} of {full - hit} new blocks: the host tier has no room ({exc})"
                    log.warning("kvtier store: %s", note)
                    break
                with lease:
                    # Per layer and K/V, one numpy copy of the [heads, n*B, dim] slice into the
                    # pages' order [n, B, heads, dim] (single-threaded, see _read).
                    t0, t1 = first * B, (first + n) * B
                    stage = np.empty((n, lay.layers, 2, B, lay.kv_heads, lay.head_dim), dtype=np_dtype)
                    for i, (k, v) in enumerate(layers):
                        for j, src in ((0, k), (1, v)):
                            part = _numpy_view(src[0, :, t0:t1, :].to("cpu"), np_dtype)  # [heads, n*B, dim]
                            part = part.reshape(lay.kv_heads, n, B, lay.head_dim).transpose(1, 2, 0, 3)
                            np.copyto(stage[:, i, j], part)
                    for j, block in enumerate(stage):  # copied and hashed in one pass: commit sends the sums
                        lease.write(j, block)
                    result = lease.commit(keys[first : first + n], parent=keys[first - 1] if first else None,
                                          token_ids=tokens[t0:t1])  # for the daemon's KV events
                stored += result.committed
                duplicates += len(result.duplicates)
        return StoreResult(full, stored, hit + duplicates, B, time.perf_counter() - start, note)

    # -- one call -------------------------------------------------------------------
    def prefill(
        self, input_ids: Any, *, salt: bytes | str | None = None, store: bool = True, **forward_kwargs
    ) -> PrefillResult:
        """restore -> forward over the suffix (timed, reported to the planner) -> store.
        `forward_kwargs` go to the model (e.g. ``logits_to_keep=1``)."""
        import torch

        ids = self._ids_tensor(input_ids)
        restored = self.restore(ids, salt=salt)
        suffix = ids[:, restored.tokens :]
        forward_kwargs.setdefault("use_cache", True)
        with torch.no_grad():
            t0 = time.perf_counter()
            output = self.model(input_ids=suffix, **self.cache_kwargs(restored.cache), **forward_kwargs)
            seconds = time.perf_counter() - t0
        self.planner.observe_prefill(suffix.shape[1], seconds)
        stored = self.store(ids, restored.cache, salt=salt) if store else None
        return PrefillResult(output, restored.cache, restored, stored, seconds)

    def generate(
        self, input_ids: Any, *, salt: bytes | str | None = None, store: bool = True, **generate_kwargs
    ) -> GenerateResult:
        """restore -> prefill the suffix but its last token (timed, reported to the planner) ->
        model.generate() (which then feeds only that last token) -> store prompt and reply.
        `generate_kwargs` go to generate() (max_new_tokens, do_sample, ...)."""
        import torch

        ids = self._ids_tensor(input_ids)
        if self._cache_arg in generate_kwargs or "past_key_values" in generate_kwargs or "cache" in generate_kwargs:
            raise ValueError("do not pass a cache: HFPrefixCache.generate builds it from kvtier")
        restored = self.restore(ids, salt=salt)
        cache = restored.cache
        head = ids[:, restored.tokens : -1]
        seconds = 0.0
        if head.shape[1]:
            with torch.no_grad():
                t0 = time.perf_counter()
                self.model(input_ids=head, use_cache=True, logits_to_keep=1, **self.cache_kwargs(cache))
                seconds = time.perf_counter() - t0
            self.planner.observe_prefill(head.shape[1], seconds)
        generate_kwargs.setdefault("attention_mask", torch.ones_like(ids))
        output = self.model.generate(ids, **self.cache_kwargs(cache), **generate_kwargs)
        sequences = output if isinstance(output, torch.Tensor) else output.sequences
        stored = self.store(sequences, cache, salt=salt) if store else None
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
