"""GPU page kernels against their CPU references, on fresh random data with poisoned outputs.

Run on a GPU machine with ``pytest -m gpu`` (or scripts/gpu_check.sh); skipped elsewhere.
"""
from __future__ import annotations

import numpy as np
import pytest

from kvtier_client import kernels

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not kernels.is_available(), reason="needs CuPy and a CUDA device"),
]

SHAPES = [(2, 16, 4, 64), (3, 5, 3, 7), (1, 1, 1, 16), (4, 16, 8, 128)]
DTYPES = [np.float16, np.uint16, np.float32, np.uint8]  # uint16 carries bfloat16 bits
POISON = 0xA5


def random_array(rng: np.random.Generator, shape: tuple[int, ...], dtype: type) -> np.ndarray:
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return rng.integers(1, 256, size=nbytes, dtype=np.uint8).view(dtype).reshape(shape)


def poisoned(shape: tuple[int, ...], dtype: type) -> np.ndarray:
    return np.full(int(np.prod(shape)) * np.dtype(dtype).itemsize, POISON, np.uint8).view(dtype).reshape(shape)


def as_bytes(array) -> np.ndarray:
    import cupy

    host = cupy.asnumpy(array) if isinstance(array, cupy.ndarray) else array
    return host.reshape(-1).view(np.uint8)


@pytest.mark.parametrize("page_bytes", [16, 4096, 65536 + 48])
def test_copy_pages_gpu_equals_cpu(page_bytes: int) -> None:
    import cupy

    rng = np.random.default_rng(page_bytes)
    src = random_array(rng, (40 * page_bytes,), np.uint8)
    dst = poisoned((33 * page_bytes,), np.uint8)
    pairs = np.stack([rng.integers(0, 40, 30), rng.permutation(33)[:30]], axis=1)
    d_src, d_dst = cupy.asarray(src), cupy.asarray(dst)
    kernels.copy_pages_cpu(src, dst, pairs, page_bytes)
    kernels.copy_pages_gpu(d_src, d_dst, pairs, page_bytes)
    cupy.cuda.get_current_stream().synchronize()
    np.testing.assert_array_equal(as_bytes(d_dst), dst)
    # Random bytes can equal the poison: count whole untouched pages instead.
    assert (as_bytes(d_dst).reshape(33, page_bytes) == POISON).all(axis=1).sum() == 3


def _engine_and_pairs(rng, shape, dtype, num_blocks=12, n_pages=10):
    layers, bt, heads, dim = shape
    tensors = [random_array(rng, (num_blocks, 2, bt, heads, dim), dtype) for _ in range(layers)]
    pairs = np.stack([rng.integers(0, num_blocks, 8), rng.permutation(n_pages)[:8]], axis=1)
    return tensors, pairs


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_gather_and_scatter_gpu_equal_cpu(shape, dtype) -> None:
    import cupy

    layers, bt, heads, dim = shape
    rng = np.random.default_rng([*shape, np.dtype(dtype).num])
    tensors, pairs = _engine_and_pairs(rng, shape, dtype)
    pages = poisoned((10, layers, 2, bt, heads, dim), dtype)
    d_tensors = [cupy.asarray(t) for t in tensors]
    d_pages = cupy.asarray(pages)
    kernels.gather_cpu(tensors, pages, pairs)
    kernels.gather_gpu(d_tensors, d_pages, pairs)
    cupy.cuda.get_current_stream().synchronize()
    np.testing.assert_array_equal(as_bytes(d_pages), as_bytes(pages))

    # Scatter fresh random pages into poisoned engine tensors, each block written once.
    pages = random_array(rng, (10, layers, 2, bt, heads, dim), dtype)
    back = np.stack([rng.permutation(12)[:8], rng.integers(0, 10, 8)], axis=1)
    targets = [poisoned(t.shape, dtype) for t in tensors]
    d_pages = cupy.asarray(pages)
    d_targets = [cupy.asarray(t) for t in targets]
    kernels.scatter_cpu(pages, targets, back)
    kernels.scatter_gpu(d_pages, d_targets, back)
    cupy.cuda.get_current_stream().synchronize()
    for got, want in zip(d_targets, targets):
        np.testing.assert_array_equal(as_bytes(got), as_bytes(want))


@pytest.mark.parametrize("dtype", [np.float16, np.uint8], ids=lambda d: np.dtype(d).name)
def test_unaligned_tensors_take_the_byte_kernel_and_still_match(dtype) -> None:
    """Layer tensors that start 1 element into a buffer are not 16-byte aligned."""
    import cupy

    shape = (2, 16, 4, 64)
    layers, bt, heads, dim = shape
    rng = np.random.default_rng(5)
    tensors, pairs = _engine_and_pairs(rng, shape, dtype)
    d_tensors = []
    for t in tensors:
        buffer = cupy.empty(t.size + 1, dtype)
        view = buffer[1:].reshape(t.shape)
        view[...] = cupy.asarray(t)
        assert view.data.ptr % 16
        d_tensors.append(view)
    pages = poisoned((10, layers, 2, bt, heads, dim), dtype)
    d_pages = cupy.asarray(pages)
    kernels.gather_cpu(tensors, pages, pairs)
    kernels.gather_gpu(d_tensors, d_pages, pairs)
    cupy.cuda.get_current_stream().synchronize()
    np.testing.assert_array_equal(as_bytes(d_pages), as_bytes(pages))


def test_gpu_launchers_reject_bad_pairs_before_writing() -> None:
    import cupy

    rng = np.random.default_rng(0)
    tensors, _ = _engine_and_pairs(rng, (2, 4, 2, 8), np.float16, num_blocks=3, n_pages=8)
    d_tensors = [cupy.asarray(t) for t in tensors]
    d_pages = cupy.asarray(poisoned((2, 2, 2, 4, 2, 8), np.float16))
    with pytest.raises(ValueError, match="block id 3 out of range"):
        kernels.gather_gpu(d_tensors, d_pages, [(3, 0)])
    with pytest.raises(ValueError, match="destination page 2 out of range"):
        kernels.copy_pages_gpu(cupy.zeros(64, cupy.uint8), cupy.zeros(32, cupy.uint8), [(0, 2)], 16)
    assert (as_bytes(d_pages) == POISON).all()
