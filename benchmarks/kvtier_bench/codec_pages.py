"""Pages through kvtier's codecs, and synthetic KV with outlier key channels: the parts of
`kvtier bench codec-quality` (kvtier_bench.codec_quality) that need no model."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvtier.codecs import codec_named, decoder
from kvtier_client.layout import PageLayout

CODECS = ("zstd", "k16v8", "fp8", "int4", "int8")
BLOCK = 16


@dataclass
class SyntheticRow:
    codec: str
    ratio: float
    k_max: float
    k_mean: float
    k_rel: float  # mean |error| / mean |K|
    v_max: float
    v_mean: float
    attn_max: float
    attn_rel: float  # ||softmax(qK')V - restored|| / ||softmax(qK')V||


# -- pages through a codec -------------------------------------------------------------
def roundtrip(pages: np.ndarray, layout: PageLayout, name: str) -> tuple[np.ndarray, float]:
    """Every page (uint8 rows of page_bytes) encoded with codec `name` and decoded again,
    as kvtier's disk and cluster tiers do; and encoded bytes / page bytes."""
    if name == "identity":
        return pages, 1.0
    codec = codec_named(name, layout)
    out = np.empty_like(pages)
    stored = 0
    for i in range(len(pages)):
        enc = codec.encode(memoryview(pages[i]))
        stored += len(enc.data)
        reader = decoder(enc.codec, layout)
        if reader is None or not reader.decode_into(enc.data, memoryview(out[i])):
            raise RuntimeError(f"codec {name} could not decode its own page {i} of layout {layout}")
    return out, stored / pages.size


def _errors(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    d = np.abs(a.astype(np.float32) - b.astype(np.float32))
    return float(np.nan_to_num(d, nan=np.inf).max()), float(d.mean())


# -- synthetic KV with outlier channels ------------------------------------------------
def synthetic(tokens: int = 1024, layers: int = 4, heads: int = 8, dim: int = 128, outliers: int = 4,
              dtype: str = "bfloat16", seed: int = 0) -> list[SyntheticRow]:
    """Keys N(0, 1) with `outliers` channels per head 10-50x larger (fixed per channel, as
    KIVI and KVQuant find in real models' keys) and a per-token scale; values N(0, 1) without
    outliers; 16 N(0, 1) queries per head. Attention over the whole context, per layer and head."""
    import ml_dtypes

    rng = np.random.default_rng(seed)
    np_dtype = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}[dtype]
    scale = np.ones((layers, 1, heads, dim), np.float32)
    for l in range(layers):
        for h in range(heads):
            scale[l, 0, h, rng.choice(dim, outliers, replace=False)] = rng.uniform(10, 50, outliers)
    token_scale = rng.uniform(0.5, 1.5, (layers, tokens, 1, 1)).astype(np.float32)
    k = (rng.standard_normal((layers, tokens, heads, dim), np.float32) * scale * token_scale).astype(np_dtype)
    v = rng.standard_normal((layers, tokens, heads, dim), np.float32).astype(np_dtype)
    q = rng.standard_normal((layers, heads, 16, dim), np.float32)
    layout = PageLayout(layers, heads, dim, BLOCK, dtype)
    kv = np.stack([k, v], axis=1)  # [L, 2, T, H, D]
    pages = kv.reshape(layers, 2, tokens // BLOCK, BLOCK, heads, dim).transpose(2, 0, 1, 3, 4, 5)
    raw = np.ascontiguousarray(pages).view(np.uint8).reshape(tokens // BLOCK, -1)

    def attention(k: np.ndarray, v: np.ndarray) -> np.ndarray:
        kf, vf = k.astype(np.float32).transpose(0, 2, 1, 3), v.astype(np.float32).transpose(0, 2, 1, 3)
        s = q @ kf.transpose(0, 1, 3, 2) / math.sqrt(dim)
        p = np.exp(s - s.max(-1, keepdims=True))
        return (p / p.sum(-1, keepdims=True)) @ vf

    ref = attention(k, v)
    rows = []
    for name in ("identity", *CODECS):
        back, ratio = roundtrip(raw, layout, name)
        got = back.view(np_dtype).reshape(tokens // BLOCK, layers, 2, BLOCK, heads, dim)
        got = got.transpose(1, 2, 0, 3, 4, 5).reshape(layers, 2, tokens, heads, dim)
        out = attention(got[:, 0], got[:, 1])
        k_max, k_mean = _errors(k, got[:, 0])
        v_max, v_mean = _errors(v, got[:, 1])
        a_max, _ = _errors(ref, out)
        rel = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
        rows.append(SyntheticRow(name, ratio, k_max, k_mean, k_mean / float(np.abs(k.astype(np.float32)).mean()),
                                 v_max, v_mean, a_max, rel))
    return rows
