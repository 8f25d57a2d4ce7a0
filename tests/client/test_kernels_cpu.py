"""CPU references of the page kernels against per-element loops, on random data, poisoned outputs."""
from __future__ import annotations

import numpy as np
import pytest

from kvtier_client.kernels import copy_pages_cpu, gather_cpu, scatter_cpu

# (layers, block_tokens, kv_heads, head_dim): vector-friendly, odd sizes, one layer.
SHAPES = [(2, 16, 4, 64), (3, 5, 3, 7), (1, 1, 1, 16)]
# bfloat16 has no numpy dtype: its bits travel as uint16, which is all the kernels see.
DTYPES = [np.float16, np.uint16, np.float32, np.uint8]
POISON = 0xA5


def random_array(rng: np.random.Generator, shape: tuple[int, ...], dtype: type) -> np.ndarray:
    """Random bytes of `dtype` (never all zero), so a missed copy cannot go unnoticed."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return rng.integers(1, 256, size=nbytes, dtype=np.uint8).view(dtype).reshape(shape)


def poisoned(shape: tuple[int, ...], dtype: type) -> np.ndarray:
    return np.full(int(np.prod(shape)) * np.dtype(dtype).itemsize, POISON, np.uint8).view(dtype).reshape(shape)


def engine(rng, layers, num_blocks, bt, heads, dim, dtype) -> list[np.ndarray]:
    return [random_array(rng, (num_blocks, 2, bt, heads, dim), dtype) for _ in range(layers)]


@pytest.mark.parametrize("page_bytes", [16, 48, 4096])
def test_copy_pages_matches_a_byte_loop(page_bytes: int) -> None:
    rng = np.random.default_rng(page_bytes)
    src = random_array(rng, (7 * page_bytes,), np.uint8)
    dst = poisoned((5 * page_bytes,), np.uint8)
    pairs = [(6, 0), (0, 3), (6, 4), (2, 1)]  # a source read twice; page 2 of dst left alone
    expected = dst.copy()
    for s, d in pairs:
        for b in range(page_bytes):
            expected[d * page_bytes + b] = src[s * page_bytes + b]
    copy_pages_cpu(src, dst, pairs, page_bytes)
    np.testing.assert_array_equal(dst, expected)
    assert (dst[2 * page_bytes : 3 * page_bytes] == POISON).all()


def test_copy_pages_takes_typed_arenas_of_pages() -> None:
    rng = np.random.default_rng(1)
    src = random_array(rng, (4, 2, 3, 8), np.float16)  # 96-byte pages
    dst = poisoned((3, 2, 3, 8), np.float16)
    copy_pages_cpu(src, dst, np.array([[3, 0], [1, 2]]), 96)
    np.testing.assert_array_equal(dst[0].view(np.uint16), src[3].view(np.uint16))
    np.testing.assert_array_equal(dst[2].view(np.uint16), src[1].view(np.uint16))
    assert (dst[1].view(np.uint8) == POISON).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_gather_matches_an_element_loop(shape, dtype) -> None:
    layers, bt, heads, dim = shape
    rng = np.random.default_rng(7)
    tensors = engine(rng, layers, 6, bt, heads, dim, dtype)
    pages = poisoned((5, layers, 2, bt, heads, dim), dtype)
    pairs = [(5, 2), (0, 0), (5, 4), (3, 1)]  # block 5 gathered twice; page 3 untouched
    expected = pages.copy()
    for block, page in pairs:
        for layer in range(layers):
            for kv in range(2):
                for t in range(bt):
                    for h in range(heads):
                        for d in range(dim):
                            expected[page, layer, kv, t, h, d] = tensors[layer][block, kv, t, h, d]
    gather_cpu(tensors, pages, pairs)
    np.testing.assert_array_equal(pages.view(np.uint8), expected.view(np.uint8))
    assert (pages[3].view(np.uint8) == POISON).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_scatter_matches_an_element_loop(shape, dtype) -> None:
    layers, bt, heads, dim = shape
    rng = np.random.default_rng(11)
    pages = random_array(rng, (4, layers, 2, bt, heads, dim), dtype)
    tensors = [poisoned((6, 2, bt, heads, dim), dtype) for _ in range(layers)]
    pairs = [(4, 1), (0, 3), (2, 1)]  # page 1 scattered twice; blocks 1, 3, 5 untouched
    expected = [t.copy() for t in tensors]
    for block, page in pairs:
        for layer in range(layers):
            for kv in range(2):
                for t in range(bt):
                    for h in range(heads):
                        for d in range(dim):
                            expected[layer][block, kv, t, h, d] = pages[page, layer, kv, t, h, d]
    scatter_cpu(pages, tensors, pairs)
    for got, want in zip(tensors, expected):
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
        assert (got[[1, 3, 5]].view(np.uint8) == POISON).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_gather_then_scatter_round_trips(shape, dtype) -> None:
    layers, bt, heads, dim = shape
    rng = np.random.default_rng(3)
    original = engine(rng, layers, 9, bt, heads, dim, dtype)
    page_bytes = layers * 2 * bt * heads * dim * np.dtype(dtype).itemsize
    arena = poisoned((9 * page_bytes,), np.uint8)  # a raw byte arena, as a tier holds it
    blocks = rng.permutation(9)
    pairs = np.stack([blocks, np.arange(9)], axis=1)
    gather_cpu(original, arena, pairs)
    restored = [poisoned(t.shape, dtype) for t in original]
    scatter_cpu(arena, restored, pairs[::-1])
    for got, want in zip(restored, original):
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


def test_empty_pairs_change_nothing() -> None:
    rng = np.random.default_rng(0)
    tensors = engine(rng, 2, 3, 4, 2, 8, np.float16)
    pages = poisoned((2, 2, 2, 4, 2, 8), np.float16)
    gather_cpu(tensors, pages, [])
    assert (pages.view(np.uint8) == POISON).all()


def test_pairs_out_of_range_raise_and_write_nothing() -> None:
    rng = np.random.default_rng(0)
    tensors = engine(rng, 2, 3, 4, 2, 8, np.float16)
    pages = poisoned((2, 2, 2, 4, 2, 8), np.float16)
    with pytest.raises(ValueError, match=r"block id 3 out of range: there are 3 \(valid 0\.\.2\)"):
        gather_cpu(tensors, pages, [(0, 0), (3, 1)])
    with pytest.raises(ValueError, match=r"page index 2 out of range: there are 2"):
        gather_cpu(tensors, pages, [(0, 2)])
    with pytest.raises(ValueError, match=r"page index -1 out of range"):
        scatter_cpu(pages, tensors, [(0, -1)])
    assert (pages.view(np.uint8) == POISON).all()
    src, dst = random_array(rng, (64,), np.uint8), poisoned((32,), np.uint8)
    with pytest.raises(ValueError, match=r"source page 4 out of range: there are 4"):
        copy_pages_cpu(src, dst, [(4, 0)], 16)
    with pytest.raises(ValueError, match=r"destination page 2 out of range: there are 2"):
        copy_pages_cpu(src, dst, [(0, 2)], 16)
    assert (dst == POISON).all()


def test_a_destination_written_twice_raises() -> None:
    rng = np.random.default_rng(0)
    tensors = engine(rng, 1, 3, 4, 2, 8, np.float16)
    pages = poisoned((2, 1, 2, 4, 2, 8), np.float16)
    with pytest.raises(ValueError, match="page index 1 appears twice"):
        gather_cpu(tensors, pages, [(0, 1), (2, 1)])
    with pytest.raises(ValueError, match="block id 0 appears twice"):
        scatter_cpu(pages, tensors, [(0, 0), (0, 1)])
    src, dst = random_array(rng, (64,), np.uint8), poisoned((32,), np.uint8)
    with pytest.raises(ValueError, match="destination page 1 appears twice"):
        copy_pages_cpu(src, dst, [(0, 1), (2, 1)], 16)
    arena = random_array(rng, (64,), np.uint8)
    with pytest.raises(ValueError, match="page 1 is both a source and a destination"):
        copy_pages_cpu(arena, arena, [(1, 2), (3, 1)], 16)


def test_pages_not_matching_the_layout_raise() -> None:
    rng = np.random.default_rng(0)
    tensors = engine(rng, 2, 3, 4, 2, 8, np.float16)  # 2 * 2 * 4 * 2 * 8 * 2 = 512-byte pages
    with pytest.raises(ValueError, match=r"pages has 256 bytes per page .* the layout's page is 512 bytes"):
        gather_cpu(tensors, poisoned((2, 1, 2, 4, 2, 8), np.float16), [(0, 0)])
    with pytest.raises(ValueError, match=r"pages holds 1000 bytes, not a whole number of 512-byte pages"):
        gather_cpu(tensors, poisoned((1000,), np.uint8), [(0, 0)])
    with pytest.raises(ValueError, match=r"dst arena has 32 bytes per page .* the layout's page is 16 bytes"):
        copy_pages_cpu(random_array(rng, (64,), np.uint8), poisoned((2, 32), np.uint8), [(0, 0)], 16)
    with pytest.raises(ValueError, match="page_bytes must be a multiple of 16, got 24"):
        copy_pages_cpu(random_array(rng, (48,), np.uint8), poisoned((48,), np.uint8), [(0, 0)], 24)


def test_layers_that_disagree_raise() -> None:
    rng = np.random.default_rng(0)
    tensors = engine(rng, 2, 3, 4, 2, 8, np.float16)
    tensors[1] = tensors[1].astype(np.float32)
    with pytest.raises(ValueError, match="layer 1 is .* float32, layer 0 is .* float16; every layer must match"):
        gather_cpu(tensors, poisoned((2048,), np.uint8), [(0, 0)])
    with pytest.raises(ValueError, match=r"must be \[num_blocks, 2, block_tokens, kv_heads, head_dim\]"):
        gather_cpu([tensors[0][:, 0]], poisoned((2048,), np.uint8), [(0, 0)])
