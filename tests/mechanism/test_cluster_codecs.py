"""Cluster values and codecs (kvtier.mechanism.cluster.values, kvtier.codecs): a value names
the codec that wrote it and a reader decodes it with that codec; checksum and seal are over
the stored bytes; a codec this node does not know is a miss left in place, never corrupt."""
from __future__ import annotations

import numpy as np
import pytest
from kvtier_client.layout import PageLayout

from kvtier.codecs import CodecChoice, codec_named
from kvtier.mechanism.cluster import ClusterTier, FaultKind, open_backend
from kvtier.mechanism.cluster.values import HEADER, UNHASHED, Verdict, cluster_key, decode_into, header, layout_hash
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


@pytest.mark.parametrize("name", ["zstd", "k16v8", "fp8", "int4", "int8"])
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


# -- through a real Redis Cluster ---------------------------------------------------------
@pytest.fixture
def cluster_tier(redis_cluster):
    tier = ClusterTier(open_backend(redis_cluster.url, timeout=5.0), layout=LAYOUT, codecs=CodecChoice("fp8"))
    yield tier
    tier.close()


def read_all(tier: ClusterTier, keys: list[bytes]) -> tuple[list[int | None], list[bytes]]:
    views = [memoryview(bytearray(LAYOUT.page_bytes)) for _ in keys]
    return tier.read_checked("ns", keys, views), [bytes(v) for v in views]


def test_a_cluster_holds_pages_of_two_codecs_after_a_change_and_leaves_an_unknown_one(redis_cluster, cluster_tier):
    first, second = [b"f0", b"f1"], [b"i0", b"i1"]
    pages = {k: bytes(page(10 + i)) for i, k in enumerate(first + second)}
    assert cluster_tier.write("ns", [(k, memoryview(pages[k])) for k in first]) == 2
    stats = cluster_tier.stats()
    assert stats.bytes_written == 2 * LAYOUT.page_bytes and 1.9 < stats.bytes_written / stats.stored_bytes_written <= 2
    assert cluster_tier.value_bytes < LAYOUT.page_bytes  # the cluster row of `kvtier stats` counts encoded values
    cluster_tier.codecs = CodecChoice("identity")  # a reload changed the namespace's codec
    assert cluster_tier.write("ns", [(k, memoryview(pages[k])) for k in second]) == 2
    sums, got = read_all(cluster_tier, first + second)
    assert sums[:2] == [UNHASHED, UNHASHED] and all(isinstance(c, int) and c >= 0 for c in sums[2:])
    assert got[2:] == [pages[k] for k in second]  # identity: every byte
    for k, data in zip(first, got[:2]):
        want = np.frombuffer(pages[k], np.float16).astype(np.float32)
        assert np.all(np.abs(np.frombuffer(data, np.float16).astype(np.float32) - want) <= np.abs(want) / 16 + 2.0**-9)
    store = redis_cluster.client()
    newer = cluster_key("kvtier", LAYOUT.layout_id, "ns", b"f1")
    head = bytearray(store.hget(newer, b"h"))
    head[6] = 99  # a codec of a newer kvtier
    store.hset(newer, b"h", bytes(head))
    sums, _ = read_all(cluster_tier, first)
    assert sums[0] == UNHASHED and sums[1] is None  # a miss...
    assert store.exists(newer) and cluster_tier.stats().faults == {FaultKind.VERSION: 1}  # ...left for its readers
