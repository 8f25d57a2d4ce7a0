"""The disk's published read rate includes decoding (kvtier.mechanism.bandwidth.with_decode):
what a load planner weighs against recompute is what a load of encoded pages costs."""
from __future__ import annotations

import pytest
from kvtier_client.layout import PageLayout

from kvtier.codecs import codec_named
from kvtier.mechanism.bandwidth import with_decode

LAYOUT = PageLayout(8, 4, 64, 16, "float16")


def test_identity_leaves_the_read_rate_alone():
    assert with_decode(1e9, codec_named("identity", LAYOUT), 4) == 1e9


@pytest.mark.parametrize("name", ["zstd", "k16v8", "fp8", "int4", "int8"])
def test_a_codec_makes_reads_cheaper_per_page_and_decoding_bounds_them(name):
    codec = codec_named(name, LAYOUT)
    ratio_bound = LAYOUT.page_bytes / codec.bound() if codec.lossy else 2.0
    slow_disk = with_decode(1e6, codec, 2)  # 1 MB/s: reading dominates, fewer bytes per page win
    assert 1e6 < slow_disk <= 1e6 * ratio_bound
    endless = with_decode(1e15, codec, 1)  # reading is free: one thread's decode rate is the bound
    assert endless < 1e12 and with_decode(1e15, codec, 4) > endless  # more threads decode more
