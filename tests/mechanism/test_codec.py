"""The codec seam of lower tiers (kvtier.mechanism.codec): a cluster value names the codec
that encoded its page, a reader decodes it with that codec, and checksums and seals stay
over the page itself. Identity today; a value naming a codec this node does not know is
corrupt, never served."""
from __future__ import annotations

import numpy as np
import pytest
import xxhash

from kvtier.mechanism import codec as codecs
from kvtier.mechanism.cluster.values import HEADER, Verdict, decode_into, header
from kvtier.mechanism.seal import PageIdentity, Sealer

PAGE_BYTES = 4096
LAYOUT = 0x1234
IDENTITY = PageIdentity("layout", "ns", b"key")


class Inverted:
    """A codec that stores every byte inverted: what it stores is not the page."""

    id = 7
    name = "inverted"

    def encode(self, page: memoryview) -> bytes:
        return np.bitwise_not(np.frombuffer(page, np.uint8)).tobytes()

    def decode(self, stored, page_bytes: int):
        return np.bitwise_not(np.frombuffer(stored, np.uint8)).tobytes() if len(stored) == page_bytes else None


def page(seed: int = 0) -> memoryview:
    return memoryview(np.random.default_rng(seed).integers(0, 255, PAGE_BYTES, dtype=np.uint8).tobytes())


def test_the_identity_codec_stores_the_page_itself_and_reads_it_back():
    src = page()
    assert codecs.IDENTITY.encode(src) is src  # no copy
    head = header(LAYOUT, IDENTITY, Sealer(), src)
    assert HEADER.unpack(head)[3] == codecs.IDENTITY.id == 0
    out = memoryview(bytearray(PAGE_BYTES))
    assert decode_into(LAYOUT, IDENTITY, Sealer(), head, bytes(src), out)[0] is Verdict.GOOD
    assert out == src


def test_a_page_is_decoded_with_the_codec_its_header_names(monkeypatch):
    monkeypatch.setitem(codecs.CODECS, Inverted.id, Inverted())
    src, codec = page(1), Inverted()
    stored = codec.encode(src)
    assert stored != bytes(src)
    head = header(LAYOUT, IDENTITY, Sealer(), src, codec=codec)
    out = memoryview(bytearray(PAGE_BYTES))
    assert decode_into(LAYOUT, IDENTITY, Sealer(), head, stored, out) == (Verdict.GOOD, xxhash.xxh3_64_intdigest(src))
    assert out == src
    # Checksum and seal are the page's, not its encoding's: the same value read as another
    # key is misbound, and the stored bytes as identity would fail the checksum.
    other = PageIdentity("layout", "ns", b"another")
    assert decode_into(LAYOUT, other, Sealer(), head, stored, out)[0] is Verdict.MISBOUND


@pytest.mark.parametrize("codec_id", [7, 255])
def test_a_codec_this_node_does_not_know_makes_the_value_corrupt(codec_id):
    src = page(2)
    head = bytearray(header(LAYOUT, IDENTITY, Sealer(), src))
    head[6] = codec_id
    out = memoryview(bytearray(b"\xee" * PAGE_BYTES))
    assert decode_into(LAYOUT, IDENTITY, Sealer(), bytes(head), bytes(src), out)[0] is Verdict.CORRUPT
    assert out == b"\xee" * PAGE_BYTES  # left alone


def test_a_value_that_does_not_decode_to_a_whole_page_is_corrupt():
    src = page(3)
    head = header(LAYOUT, IDENTITY, Sealer(), src)
    out = memoryview(bytearray(PAGE_BYTES))
    assert decode_into(LAYOUT, IDENTITY, Sealer(), head, bytes(src)[:-1], out)[0] is Verdict.CORRUPT
