"""Page codecs for the lower tiers (disk, cluster): which exist, and which one a
namespace's pages are written with.

    identity  0  as they are (the default)
    zstd      1  lossless: byte planes + zstd
    k16v8     2  lossy: keys as they are, values FP8
    fp8       3  lossy: keys and values FP8
    int4      4  lossy: KIVI-style 4-bit
    int8      5  lossy: 8-bit keys per channel, values per token

A daemon's `codec` option names the default; a namespace's `codec` key in the tokens file
overrides it. A lossy codec is never the default, and applies to float pages only: for any
other dtype it falls back to identity (`CodecChoice.for_namespace`). docs/tiers.md, "Codecs",
has the ratios and the quality each gives.
"""
from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum

from kvtier_client.layout import PageLayout

from kvtier.codecs.base import Encoded, IdentityCodec, PageCodec
from kvtier.codecs.int8 import Int8Codec
from kvtier.codecs.lossless import PlanesZstdCodec
from kvtier.codecs.quant import Fp8Codec, Int4Codec, K16V8Codec, lossy_applies

__all__ = ["CODECS", "CodecChoice", "CodecName", "Encoded", "PageCodec", "codec_named", "decoder"]

#: Every codec, by name, in id order.
CODECS: dict[str, type] = {c.name: c for c in (IdentityCodec, PlanesZstdCodec, K16V8Codec, Fp8Codec, Int4Codec,
                                                 Int8Codec)}

class CodecName(str, Enum):
    """What the `codec` option and a namespace's `codec` key may name."""

    IDENTITY = "identity"
    ZSTD = "zstd"
    K16V8 = "k16v8"
    FP8 = "fp8"
    INT4 = "int4"
    INT8 = "int8"


_BY_ID: dict[int, type] = {c.id: c for c in CODECS.values()}
_built: dict[tuple[int, PageLayout], PageCodec] = {}
_built_lock = threading.Lock()


def _build(cls: type, layout: PageLayout) -> PageCodec:
    """One codec object per (codec, layout). Every page's encode and decode asks: the lookup
    takes no lock (a dict read is atomic), only the first build of a pair does."""
    codec = _built.get((cls.id, layout))
    if codec is None:
        with _built_lock:
            codec = _built.setdefault((cls.id, layout), cls(layout))
    return codec


def decoder(codec_id: int, layout: PageLayout) -> PageCodec | None:
    """The codec that reads pages stored with `codec_id`; None if this kvtier does not know
    it (a newer kvtier's: the page is a miss) or it does not apply to the layout."""
    cls = _BY_ID.get(codec_id)
    if cls is None or (cls.lossy and not lossy_applies(layout)):
        return None
    return _build(cls, layout)


def codec_named(name: str, layout: PageLayout) -> PageCodec:
    """The codec `name` for pages of `layout`: identity where a lossy codec does not apply."""
    if name not in CODECS:
        raise ValueError(f"unknown codec {name!r}; use one of {', '.join(CODECS)}")
    cls = CODECS[name]
    if cls.lossy and not lossy_applies(layout):
        cls = IdentityCodec
    return _build(cls, layout)


@dataclass(frozen=True)
class CodecChoice:
    """Which codec writes each namespace's pages: `by_namespace`, else `default`."""

    default: str = "identity"
    by_namespace: Mapping[str, str] = field(default_factory=dict)

    def name_for(self, namespace: str) -> str:
        return self.by_namespace.get(namespace, self.default)

    def for_namespace(self, namespace: str, layout: PageLayout) -> PageCodec:
        return codec_named(self.name_for(namespace), layout)

    def names(self) -> set[str]:
        return {self.default, *self.by_namespace.values()}

    def densest(self, layout: PageLayout) -> int:
        """The fewest bytes a page of `layout` can take under any codec chosen here (a
        lossless codec is counted at half the page: pages that shrink more leave the
        room unused)."""
        sizes = []
        for name in self.names():
            codec = codec_named(name, layout)
            sizes.append(codec.bound() // 2 if codec.id and not codec.lossy else codec.bound())
        return max(1, min(sizes))
