"""What identifies a transformers model's KV: its namespace, its fingerprint, its KV shape.

Part of the Hugging Face helper (kvtier_client.integrations.hf). torch is imported on
first use only.
"""
from __future__ import annotations

import hashlib
import inspect
import json
from typing import Any

from kvtier_client.layout import DTYPE_BYTES

#: Config keys that never change a model's keys and values (left out of the fingerprint).
_NOT_KV = frozenset({
    "transformers_version", "_name_or_path", "name_or_path", "_commit_hash", "use_cache", "output_attentions",
    "output_hidden_states", "return_dict", "torchscript", "_attn_implementation", "attn_implementation",
    "_attn_implementation_autoset", "architectures", "id2label", "label2id", "problem_type",
    "tokenizer_class", "task_specific_params", "finetuning_task", "prefix", "bos_token_id", "eos_token_id",
    "pad_token_id", "sep_token_id", "decoder_start_token_id", "dtype", "torch_dtype",
})


def text_config(config: Any) -> Any:
    """The decoder's config (a multimodal model's text_config; the config itself otherwise)."""
    get = getattr(config, "get_text_config", None)
    if get is None:
        return config
    try:
        return get(decoder=True)
    except TypeError:
        return get()


def dtype_name(dtype: Any) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ValueError(f"model dtype {dtype} has no kvtier page dtype; use one of {', '.join(DTYPE_BYTES)}")
    return name


def kv_dtype(model_or_config: Any, dtype: Any = None) -> str:
    """The KV's dtype: `dtype`, else the model's, else the config's; a bare config without one
    needs `dtype`."""
    config = getattr(model_or_config, "config", model_or_config)
    if dtype is None:
        dtype = getattr(model_or_config, "dtype", None) if model_or_config is not config else None
        dtype = dtype or getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if dtype is None:
        raise ValueError("the config names no dtype; pass dtype= (e.g. 'float16'), or pass the model itself")
    return dtype_name(dtype)


def kv_shape(config: Any) -> tuple[int, int]:
    """(kv_heads, head_dim) of an attention layer: num_key_value_heads (else
    num_attention_heads), head_dim (else hidden_size / num_attention_heads)."""
    text = text_config(config)
    try:
        int(text.num_hidden_layers)
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
    return int(kv_heads), int(head_dim)


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


def forward_parameters(model: Any) -> frozenset[str]:
    """The keyword names model.forward() takes (empty when it cannot be inspected)."""
    try:
        return frozenset(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return frozenset()


def cache_argument(model: Any) -> str:
    """The keyword forward() takes a cache under: `cache` in newer transformers, else `past_key_values`."""
    return "cache" if "cache" in forward_parameters(model) else "past_key_values"
