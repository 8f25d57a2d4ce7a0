"""Cluster values and codecs (kvtier.mechanism.cluster.values, kvtier.codecs): a value names
the codec that wrote it and a reader decodes it with that codec; checksum and seal are over
the stored bytes; a codec this node does not know is a miss left in place, never corrupt."""
from __future__ import annotations

import numpy as np
import pytest
from kvtier_client.layout import PageLayout

from kvtier.codecs import codec_named
from kvtier.mechanism.cluster.values import HEADER, UNHASHED, Verdict, decode_into, header, layout_hash
from kvtier.mechanism.seal import PageIdentity, Sealer

LAYOUT = PageLayout(2, 2, 64, 16, "float16")
HASH = layout_hash(LAYOUT.layout_id)
WHO = PageIdentity(LAYOUT.layout_id, "ns", b"key")


def page(seed: int = 0) -> memoryview:
    values = np.random.default_rng(seed).standard_normal(LAYOUT.page_bytes // 2).astype(np.float16)
    return memoryview(values.view(np.uint8))


def value(name: str, src: memoryview, sealer: Sealer = Sealer()) -> tuple[bytes, bytes]:
    encoded = codec_named(name, LAYOUT).encode(src)
    return header(HASH, WHO, sealer, len(src), encoded), bytes(encoded.data)


def test_identity_stores_the_page_itself_and_gives_its_checksum():
    src = page()
    head, stored = value("identity", src)
    assert stored == src and HEADER.unpack(head)[3] == 0
    out = memoryview(bytearray(LAYOUT.page_bytes))
    verdict, checksum = decode_into(HASH, LAYOUT, WHO, Sealer(), head, stored, out)
    assert verdict is Verdict.GOOD and checksum == HEADER.unpack(head)[6] and out == src


@pytest.mark.parametrize("name", ["zstd", "k16v8", "fp8", "int4"])
def test_an_encoded_value_is_smaller_and_decodes_with_the_codec_its_header_names(name):
    src = page(1)
    head, stored = value(name, src)
    assert HEADER.unpack(head)[3] == codec_named(name, LAYOUT).id
    assert len(stored) < len(src)
    out = memoryview(bytearray(LAYOUT.page_bytes))
    verdict, checksum = decode_into(HASH, LAYOUT, WHO, Sealer(), head, stored, out)
    assert verdict is Verdict.GOOD and checksum == UNHASHED  # the host tier hashes the decoded page
    restored = np.frombuffer(out, np.float16).astype(np.float32)
    error = np.abs(restored - np.frombuffer(src, np.float16).astype(np.float32)).max()
    assert error == 0 if name == "zstd" else 0 < error < 1.0


@pytest.mark.parametrize("codec_id", [9, 255])
def test_a_codec_this_node_does_not_know_is_a_miss_not_corruption(codec_id):
    src = page(2)
    head = bytearray(value("fp8", src)[0])
    head[6] = codec_id
    out = memoryview(bytearray(b"\xee" * LAYOUT.page_bytes))
    assert decode_into(HASH, LAYOUT, WHO, Sealer(), bytes(head), value("fp8", src)[1], out)[0] is Verdict.CODEC
    assert out == b"\xee" * LAYOUT.page_bytes  # left alone


def test_a_flipped_byte_of_the_encoding_is_corrupt_and_the_seal_binds_the_stored_bytes():
    src = page(3)
    head, stored = value("fp8", src, Sealer(b"k" * 32))
    out = memoryview(bytearray(LAYOUT.page_bytes))
    flipped = bytearray(stored)
    flipped[100] ^= 0x40
    assert decode_into(HASH, LAYOUT, WHO, Sealer(b"k" * 32), head, bytes(flipped), out)[0] is Verdict.CORRUPT
    other = PageIdentity(LAYOUT.layout_id, "ns", b"other")
    assert decode_into(HASH, LAYOUT, other, Sealer(b"k" * 32), head, stored, out)[0] is Verdict.MISBOUND


def test_an_encoding_cut_short_is_corrupt():
    src = page(4)
    head, stored = value("int4", src)
    out = memoryview(bytearray(LAYOUT.page_bytes))
    assert decode_into(HASH, LAYOUT, WHO, Sealer(), head, stored[:-1], out)[0] is Verdict.CORRUPT
