"""How much more a lower tier holds under a codec: its ratio, for a replay's disk capacity.

A replay moves no bytes, so a codec enters it only as capacity: a disk of D raw pages
holds D x ratio encoded ones (the host tier never encodes). The ratio is page_bytes over
the encoded length, measured here by encoding sample pages of a layout with the codec
itself (kvtier.codecs). The lossy codecs' encodings have a fixed size per layout, so any
page gives their exact ratio; zstd's depends on the bytes. The samples are synthetic KV
(no model runs here; see `synthetic_pages`), and `CodecRatio.source` says so wherever a
ratio is printed: a ratio measured on real KV elsewhere is given as `disk_ratio`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from kvtier_client.layout import PageLayout

from kvtier.codecs import CODECS, codec_named

__all__ = ["CODECS", "DEFAULT_LAYOUT", "CodecRatio", "codec_ratio", "describe", "measure_ratio", "parse_layout"]

#: A Llama-3-8B-like page: 32 layers, 8 KV heads of 128, 16 tokens, float16 (2 MiB).
DEFAULT_LAYOUT = PageLayout(layers=32, kv_heads=8, head_dim=128, block_tokens=16, dtype="float16")
IDENTITY = "identity"
SAMPLE_PAGES = 4
_LAYOUT_FIELDS = ("layers", "kv_heads", "head_dim", "block_tokens", "dtype", "order")
_NUMPY = {"float16": np.float16, "float32": np.float32}


@dataclass(frozen=True)
class CodecRatio:
    """The codec a lower tier writes with, how many times more pages it then holds, and
    where that figure comes from (printed beside every figure that uses it)."""

    codec: str
    ratio: float
    source: str

    def pages(self, raw_pages: int) -> int:
        """Encoded pages in the bytes of `raw_pages` raw ones (0 stays 0: no tier)."""
        return math.floor(raw_pages * self.ratio + 1e-9)

    def as_dict(self) -> dict:
        return {"codec": self.codec, "ratio": self.ratio, "source": self.source}


def describe(layout: PageLayout) -> str:
    text = ",".join(f"{f}={getattr(layout, f)}" for f in _LAYOUT_FIELDS[:5])
    return text + ("" if layout.order == "page_first" else f",order={layout.order}")


def parse_layout(text: str) -> PageLayout:
    """'layers=32,kv_heads=8,head_dim=128,block_tokens=16,dtype=float16'; fields left out
    keep DEFAULT_LAYOUT's."""
    fields = {f: getattr(DEFAULT_LAYOUT, f) for f in _LAYOUT_FIELDS}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, eq, value = item.partition("=")
        name = name.strip()
        if not eq or name not in fields:
            raise ValueError(f"layout {text!r}: {item!r} is not one of {', '.join(f + '=...' for f in _LAYOUT_FIELDS)}")
        if name in ("dtype", "order"):
            fields[name] = value.strip()
        else:
            try:
                fields[name] = int(value)
            except ValueError:
                raise ValueError(f"layout {text!r}: {name} must be an integer, got {value.strip()!r}") from None
    return PageLayout(**fields)


def synthetic_pages(layout: PageLayout, n: int = SAMPLE_PAGES, seed: int = 0) -> list[bytes]:
    """n pages of KV-like values: normal noise whose scale grows with depth, and in the keys
    a few outlier channels (about 2% of (layer, head, channel)) twelve times larger, as
    real keys have. Float dtypes only get these values; other dtypes get random bytes."""
    rng = np.random.default_rng(seed)
    shape = layout.shape
    if layout.dtype not in _NUMPY and layout.dtype != "bfloat16":
        return [rng.integers(0, 256, layout.page_bytes, dtype=np.uint8).tobytes() for _ in range(n)]
    depth = np.linspace(0.5, 2.0, layout.layers, dtype=np.float32).reshape((-1,) + (1,) * (len(shape) - 1))
    channels = np.ones((layout.layers, layout.kv_heads, layout.head_dim), np.float32)
    channels[rng.random(channels.shape) < 0.02] = 12.0
    pages = []
    for _ in range(n):
        x = rng.standard_normal(shape, dtype=np.float32) * depth
        if layout.order == "page_first":
            x[:, 0] *= channels[:, None]  # keys: [layers, tokens, heads, dim]
        pages.append(_as_dtype(x, layout.dtype).tobytes())
    return pages


def _as_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        import ml_dtypes

        return x.astype(ml_dtypes.bfloat16)
    return x.astype(_NUMPY[dtype])


def measure_ratio(codec: str, layout: PageLayout = DEFAULT_LAYOUT, pages: int = SAMPLE_PAGES) -> CodecRatio:
    """`codec`'s ratio on `pages` synthetic pages of `layout`: their bytes over their encodings'."""
    CODECS[codec]  # an unknown name: RegistryError (a ValueError) names the known ones
    if codec == IDENTITY:
        return CodecRatio(IDENTITY, 1.0, "identity: pages stored as they are")
    chosen = codec_named(codec, layout)
    if chosen.id == 0:  # a lossy codec on pages it does not apply to
        return CodecRatio(codec, 1.0, f"{codec} does not apply to {layout.dtype} pages: they are stored as they are")
    samples = synthetic_pages(layout, pages)
    encoded = sum(len(chosen.encode(memoryview(page)).data) for page in samples)
    ratio = len(samples) * layout.page_bytes / encoded
    what = "fixed size per page" if chosen.lossy else "depends on the bytes"
    return CodecRatio(codec, ratio, f"measured on {len(samples)} synthetic (not model) KV pages of {describe(layout)} "
                                    f"({layout.page_bytes:,} bytes; {what})")


def given_ratio(ratio: float, codec: str | None = None) -> CodecRatio:
    """A ratio given by hand (one measured on real KV elsewhere)."""
    if not ratio > 0:
        raise ValueError(f"a disk ratio must be positive, got {ratio}")
    return CodecRatio(codec or "given", ratio, "given: --disk-ratio")


def codec_ratio(codec: str = IDENTITY, disk_ratio: float | None = None,
                layout: PageLayout = DEFAULT_LAYOUT) -> CodecRatio:
    """The ratio a replay's disk is scaled by: `disk_ratio` when given, else `codec`'s measured."""
    if disk_ratio is not None:
        CODECS[codec]
        return given_ratio(disk_ratio, codec)
    return measure_ratio(codec, layout)
