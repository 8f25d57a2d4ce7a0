"""PageLayout arithmetic and validation."""
from __future__ import annotations

import pytest
from kvtier_client.layout import DTYPE_BYTES, SLOT_ALIGN, PageLayout


@pytest.mark.parametrize(
    "dims, dtype, page_bytes, slot_bytes",
    [
        # layers * 2 (K and V) * block_tokens * kv_heads * head_dim * itemsize
        ((32, 8, 128, 16), "float16", 32 * 2 * 16 * 8 * 128 * 2, 32 * 2 * 16 * 8 * 128 * 2),  # 2 MiB: aligned
        ((1, 1, 48, 16), "float16", 3072, 4096),
        ((1, 1, 1, 1), "float8_e4m3fn", 2, 4096),
        ((3, 5, 7, 11), "float32", 3 * 2 * 11 * 5 * 7 * 4, 12288),  # 9240 bytes -> 3 slots of 4 KiB
        ((2, 1, 64, 32), "bfloat16", 16384, 16384),
    ],
)
def test_page_and_slot_bytes(dims, dtype, page_bytes, slot_bytes):
    layout = PageLayout(*dims, dtype=dtype)
    assert layout.page_bytes == page_bytes
    assert layout.slot_bytes == slot_bytes
    assert layout.slot_bytes % SLOT_ALIGN == 0
    assert 0 <= layout.slot_bytes - layout.page_bytes < SLOT_ALIGN
    layers, kv_heads, head_dim, block_tokens = dims
    assert layout.shape == (layers, 2, block_tokens, kv_heads, head_dim)


def test_itemsizes():
    assert {name: PageLayout(1, 1, 1, 1, dtype=name).itemsize for name in DTYPE_BYTES} == {
        "float32": 4,
        "float16": 2,
        "bfloat16": 2,
        "float8_e4m3fn": 1,
        "float8_e5m2": 1,
        "int8": 1,
        "uint8": 1,
    }


@pytest.mark.parametrize("field", ["layers", "kv_heads", "head_dim", "block_tokens"])
@pytest.mark.parametrize("bad", [0, -1, True, False, 2.0, "4", None])
def test_dimensions_must_be_positive_integers(field, bad):
    dims = dict(layers=2, kv_heads=2, head_dim=64, block_tokens=16)
    dims[field] = bad
    with pytest.raises(ValueError, match=f"{field} must be a positive integer"):
        PageLayout(**dims)


def test_unknown_dtype_and_order():
    with pytest.raises(ValueError, match="unknown dtype 'float64'"):
        PageLayout(1, 1, 64, 16, dtype="float64")
    with pytest.raises(ValueError, match="unknown order 'layer_first'"):
        PageLayout(1, 1, 64, 16, order="layer_first")


def test_layout_is_frozen_hashable_and_named_by_content():
    a = PageLayout(2, 2, 64, 16)
    b = PageLayout(2, 2, 64, 16, dtype="float16", order="page_first")
    assert a == b and hash(a) == hash(b) and a.layout_id == b.layout_id
    assert len(a.layout_id) == 12 and int(a.layout_id, 16) >= 0
    assert PageLayout(2, 2, 64, 16, dtype="bfloat16").layout_id != a.layout_id
    assert PageLayout(2, 2, 64, 32).layout_id != a.layout_id
    with pytest.raises(AttributeError):
        a.layers = 3


def test_pages_in():
    layout = PageLayout(1, 1, 48, 16)  # 3072-byte pages in 4096-byte slots
    assert layout.pages_in(4096, "host") == 1
    assert layout.pages_in(4096 * 10 + 4095, "host") == 10
    for too_small in (0, 3072, 4095):
        with pytest.raises(ValueError, match=r"disk tier of \d+ bytes cannot hold one page of 4096 bytes"):
            layout.pages_in(too_small, "disk")
