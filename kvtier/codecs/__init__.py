"""Page codecs for the lower tiers (disk, cluster): which exist, and which one a
namespace's pages are written with.

    identity  0  as they are (the default)
    zstd      1  lossless: byte planes + zstd
    k16v8     2  lossy: keys as they are, values FP8
    fp8       3  lossy: keys and values FP8
    int4      4  lossy: KIVI-style 4-bit
    int8      5  lossy: 8-bit keys per channel, values per token

`CODECS` is the one list of them, by name (kvtier.registry): the `codec` option, a
namespace's `codec` key in the tokens file (which overrides the option), the CLIs and the
docs take their names from it. A codec from outside kvtier is named by its module path
(`codec = "mypkg.codecs:Zfp"`) or registered under the entry point group `kvtier.codecs`;
it needs an id of its own from `OUT_OF_TREE_IDS` (ids below are kvtier's), and one id is
never two codecs: a page records the id that wrote it (PageRecord.codec on disk, the
header's codec byte in the cluster), and is read by that id whatever the option is now.
docs/tiers.md, "Adding a codec", says what a codec must provide.

A lossy codec is never the default, and applies to float pages only: for any other dtype
it falls back to identity (`CodecChoice.for_namespace`). docs/tiers.md, "Codecs", has the
ratios and the quality each gives.
"""
from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvtier_client.layout import PageLayout

from kvtier.codecs.base import Encoded, IdentityCodec, PageCodec
from kvtier.codecs.int8 import Int8Codec
from kvtier.codecs.lossless import PlanesZstdCodec
from kvtier.codecs.quant import Fp8Codec, Int4Codec, K16V8Codec, lossy_applies
from kvtier.registry import Registry, RegistryError

__all__ = ["CODECS", "OUT_OF_TREE_IDS", "CodecChoice", "Encoded", "PageCodec", "codec_named", "decoder"]

#: The ids a codec from outside kvtier may take (a page stores its codec's id in one byte).
OUT_OF_TREE_IDS = range(128, 256)
_BUILTIN = (IdentityCodec, PlanesZstdCodec, K16V8Codec, Fp8Codec, Int4Codec, Int8Codec)
_BY_ID: dict[int, type] = {c.id: c for c in _BUILTIN}
_TRIED_IDS: set[int] = set()  # unknown ids the entry points were searched for once


def _admit(name: str, cls: type) -> None:
    """Check a codec from outside kvtier and index it by id (under the registry's lock)."""
    missing = [a for a in ("id", "name", "lossy", "bound", "encode", "decode_into") if not hasattr(cls, a)]
    if missing or not callable(cls):
        raise RegistryError(f"codec {name!r} is not a codec class: it lacks {', '.join(missing) or '__init__'} "
                            "(kvtier.codecs.base.PageCodec says what one provides)")
    if not isinstance(cls.id, int) or cls.id not in OUT_OF_TREE_IDS:
        raise RegistryError(f"codec {name!r} has id {cls.id!r}: a codec from outside kvtier takes an id from "
                            f"{OUT_OF_TREE_IDS.start} to {OUT_OF_TREE_IDS.stop - 1} (lower ids are kvtier's)")
    holder = _BY_ID.get(cls.id)
    if holder is not None and holder is not cls:
        raise RegistryError(f"codec {name!r} has id {cls.id}, which {holder.__module__}.{holder.__qualname__} "
                            "already has: pages record the id that wrote them, so give it another")
    _BY_ID[cls.id] = cls


#: Every codec, by name: the built-ins in id order, then those from outside kvtier.
CODECS: Registry[type] = Registry("codec", "kvtier.codecs", 'docs/tiers.md, "Adding a codec"',
                                  {c.name: c for c in _BUILTIN}, admit=_admit)

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
    it (a newer kvtier's, or a plugin's that is not installed: the page is a miss) or it
    does not apply to the layout. An id from outside kvtier that no option named is
    looked for once among the `kvtier.codecs` entry points."""
    cls = _BY_ID.get(codec_id)
    if cls is None and codec_id in OUT_OF_TREE_IDS and codec_id not in _TRIED_IDS:
        _TRIED_IDS.add(codec_id)  # a plugin's, not named in this daemon's options: search once
        CODECS.load_group()
        cls = _BY_ID.get(codec_id)
    if cls is None or (cls.lossy and not lossy_applies(layout)):
        return None
    return _build(cls, layout)


def codec_named(name: str, layout: PageLayout) -> PageCodec:
    """The codec `name` for pages of `layout`: identity where a lossy codec does not apply.
    RegistryError (a ValueError) for a name that is not a codec's."""
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
