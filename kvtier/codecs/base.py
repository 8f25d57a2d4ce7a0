"""What a page codec is: how a lower tier (disk, cluster) keeps a page in fewer bytes.

A codec is bound to one page layout (it knows where K and V are, and their dtype). Each
stored page names the codec that wrote it (`Encoded.codec`), so a reader decodes every page
with its own codec whatever the tier's codec is now; a page whose codec this kvtier does
not know is a miss, never an error and never misread. Checksums and seals are taken over
the encoded bytes: what is verified is what was stored.

The host tier never encodes: engines map its pages directly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvtier_client.layout import PageLayout


@dataclass(frozen=True)
class Encoded:
    """A page as stored: the id of the codec that wrote it, and its bytes."""

    codec: int
    data: memoryview | bytes


class PageCodec(Protocol):
    #: The id stored with each page it encodes (0: identity). Never reused for another codec:
    #: kvtier's own take ids below 128, a codec from outside kvtier one of 128-255
    #: (kvtier.codecs.OUT_OF_TREE_IDS; a taken id is refused).
    id: int
    #: What the codec calls itself (logs, benchmarks); operators name it as it is registered
    #: (kvtier.codecs.CODECS): a built-in's name, an entry point's, or a module path.
    name: str
    #: Whether a decoded page can differ from the page encoded (never the default).
    lossy: bool
    layout: PageLayout

    def bound(self) -> int:
        """The most bytes `encode` returns for one page of the layout."""

    def encode(self, page: memoryview) -> Encoded:
        """The page as stored. A codec may answer with another id (a lossless codec stores
        a page it cannot shrink as it is, under identity)."""

    def decode_into(self, data: memoryview | bytes, out: memoryview) -> bool:
        """Write the page `data` encodes into `out` (page_bytes long); False if `data` is
        not a whole encoding for this layout (then `out` may be overwritten)."""


class IdentityCodec:
    """Pages stored as they are."""

    id = 0
    name = "identity"
    lossy = False

    def __init__(self, layout: PageLayout) -> None:
        self.layout = layout

    def bound(self) -> int:
        return self.layout.page_bytes

    def encode(self, page: memoryview) -> Encoded:
        return Encoded(self.id, page)

    def decode_into(self, data: memoryview | bytes, out: memoryview) -> bool:
        if len(data) != len(out):
            return False
        out[:] = data
        return True
