"""How a lower tier encodes a page it stores, and decodes it back: the seam where a tier
can keep pages in fewer bytes (compressed lower tiers, issue 28). Identity today.

A codec is named in what it stores (the cluster tier's value header carries its id), so a
reader decodes each value with the codec that wrote it, and one it does not know is
corrupt: dropped, never served. Checksums and seals are taken over the page as the engine
wrote it, never over its encoding, so a codec cannot change what a reader verifies.
(The disk tier's slab has fixed-size slots and stores pages as they are.)
"""
from __future__ import annotations

from typing import Protocol


class PageCodec(Protocol):
    #: The id stored with each encoded page (0: identity).
    id: int
    name: str

    def encode(self, page: memoryview) -> memoryview | bytes:
        """The bytes to store for `page` (the page itself where nothing changes: no copy)."""

    def decode(self, stored: memoryview | bytes, page_bytes: int) -> memoryview | bytes | None:
        """The page `stored` encodes, or None if it does not decode to `page_bytes` bytes."""


class IdentityCodec:
    """Pages stored as they are."""

    id = 0
    name = "identity"

    def encode(self, page: memoryview) -> memoryview | bytes:
        return page

    def decode(self, stored: memoryview | bytes, page_bytes: int) -> memoryview | bytes | None:
        return stored if len(stored) == page_bytes else None


IDENTITY = IdentityCodec()
#: Every codec a reader can decode, by id.
CODECS: dict[int, PageCodec] = {IDENTITY.id: IDENTITY}
