"""Page kernels: batched page copies and engine-tensor <-> page conversion, on GPU and CPU.

Three operations, each given as a list of index pairs so one call (one launch on a GPU)
moves a whole batch:

    copy_pages   (src page, dst page)    arena -> arena, page_bytes per pair
    gather       (block id, page index)  per-layer engine KV tensors -> page-first pages
    scatter      (block id, page index)  page-first pages -> per-layer engine KV tensors

Engine tensors are one per layer, ``[num_blocks, 2, block_tokens, kv_heads, head_dim]``;
a page is ``[layers, 2, block_tokens, kv_heads, head_dim]`` (kvtier_client.layout). For
one (layer, k/v half) both hold the same contiguous run of ``row_bytes = block_tokens *
kv_heads * head_dim * itemsize`` bytes, so a pair is ``2 * layers`` row copies::

    engine layer l           block b                       page p
    [blk 0][blk 1]..[blk b: K row | V row]..    ->    [l0 K | l0 V | l1 K | l1 V | ...]
                              \\______ row_bytes ______/       ^ (l * 2 + kv) * row_bytes

The ``*_cpu`` functions work on numpy arrays and are the oracle the GPU kernels are tested
against (tests/client/test_kernels_gpu.py); they are plain vectorised numpy. The
``*_gpu`` functions take CuPy arrays and launch the kernels in ``cuda/`` on the current
stream, without synchronising. Both sides check their arguments the same way and raise
ValueError for a caller's mistake (an index out of range, a destination written twice,
pages that do not match the layout), before anything is written.

This is the engine's side of the data plane, so it lives in the client: an engine (or its
connector) converts between its own KV tensors and the pages it borrowed or acquired. The
daemon never calls it. The kernels are CUDA C sources in the repository's top-level
``cuda/``, shipped inside this package (``kvtier_client/cuda/*.cu``; client/setup.py copies
them into the build), compiled at run time by CuPy's RawModule (no build step). CuPy is imported only inside the GPU functions: importing this module needs
numpy alone.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

#: Threads per block for every kernel here.
THREADS = 256
#: Blocks per SM the grid is capped at; the kernels are grid-stride, so any count is correct.
BLOCKS_PER_SM = 32
#: Bytes moved by one vector access in the kernels.
VECTOR_BYTES = 16

#: Where the kernel sources are looked for, in order: inside the installed package (a wheel;
#: client/setup.py copies the repository's cuda/*.cu there), then the repository's top-level
#: cuda/ (a checkout, or an editable install of client/, where nothing is copied).
_CUDA_DIRS = (
    Path(__file__).resolve().parent / "cuda",
    Path(__file__).resolve().parents[2] / "cuda",
)


def cuda_source_dir() -> Path:
    """The directory holding the kernel sources: the package's own, else the checkout's cuda/."""
    for directory in _CUDA_DIRS:
        if (directory / "page_copy.cu").is_file():
            return directory
    raise FileNotFoundError(
        f"kvtier CUDA kernel sources not found in {' or '.join(map(str, _CUDA_DIRS))}; "
        "reinstall kvtier-client (its wheel ships kvtier_client/cuda/*.cu)"
    )


def is_available() -> bool:
    """True when CuPy imports and at least one CUDA device is present."""
    try:
        import cupy
    except ImportError:
        return False
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except cupy.cuda.runtime.CUDARuntimeError:  # no driver, or no device
        return False


# --------------------------------------------------------------------------- checks


def _pairs_array(pairs: Any) -> np.ndarray:
    """`pairs` as an int64 host array of shape [n, 2]."""
    if type(pairs).__module__.startswith("cupy"):
        pairs = pairs.get()
    array = np.asarray(pairs, dtype=np.int64)
    if array.size == 0:
        return array.reshape(0, 2)
    if array.ndim != 2 or array.shape[1] != 2:
        raise ValueError(f"pairs must be a sequence of (source, destination) pairs, got shape {array.shape}")
    return array


def _check_range(values: np.ndarray, limit: int, what: str) -> None:
    if values.size and (values.min() < 0 or values.max() >= limit):
        bad = values[(values < 0) | (values >= limit)]
        raise ValueError(f"{what} {int(bad[0])} out of range: there are {limit} (valid 0..{limit - 1})")


def _check_unique(values: np.ndarray, what: str) -> None:
    unique, counts = np.unique(values, return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"{what} {int(unique[counts > 1][0])} appears twice; each may be written once per call")


def _check_page_bytes(page_bytes: int) -> None:
    if not isinstance(page_bytes, int) or isinstance(page_bytes, bool) or page_bytes <= 0:
        raise ValueError(f"page_bytes must be a positive integer, got {page_bytes!r}")
    if page_bytes % VECTOR_BYTES:
        raise ValueError(f"page_bytes must be a multiple of {VECTOR_BYTES}, got {page_bytes}")


def _page_count(array: Any, page_bytes: int, what: str) -> int:
    """Pages in an arena-like array: a flat buffer, or [pages, ...] with page_bytes per page."""
    if not array.flags.c_contiguous:
        raise ValueError(f"{what} must be C-contiguous")
    if array.ndim == 1:
        if array.nbytes % page_bytes:
            raise ValueError(
                f"{what} holds {array.nbytes} bytes, not a whole number of {page_bytes}-byte pages"
            )
        return array.nbytes // page_bytes
    per_page = array.nbytes // array.shape[0] if array.shape[0] else array.itemsize * int(np.prod(array.shape[1:]))
    if per_page != page_bytes:
        raise ValueError(
            f"{what} has {per_page} bytes per page (shape {tuple(array.shape)}, {array.dtype}), "
            f"but the layout's page is {page_bytes} bytes"
        )
    return array.shape[0]


def _check_copy(src: Any, dst: Any, pairs: Any, page_bytes: int) -> np.ndarray:
    _check_page_bytes(page_bytes)
    src_pages = _page_count(src, page_bytes, "src arena")
    dst_pages = _page_count(dst, page_bytes, "dst arena")
    pairs = _pairs_array(pairs)
    _check_range(pairs[:, 0], src_pages, "source page")
    _check_range(pairs[:, 1], dst_pages, "destination page")
    _check_unique(pairs[:, 1], "destination page")
    if _same_buffer(src, dst) and np.intersect1d(pairs[:, 0], pairs[:, 1]).size:
        page = int(np.intersect1d(pairs[:, 0], pairs[:, 1])[0])
        raise ValueError(f"page {page} is both a source and a destination in one arena; split the call")
    return pairs


def _same_buffer(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray):
        return np.shares_memory(a, b)
    return a.data.ptr == b.data.ptr


class _KVLayout:
    """What a list of per-layer engine tensors says about the pages they convert to."""

    def __init__(self, layer_tensors: Sequence[Any]) -> None:
        if len(layer_tensors) == 0:
            raise ValueError("layer_tensors is empty; pass one KV tensor per layer")
        first = layer_tensors[0]
        if first.ndim != 5 or first.shape[1] != 2:
            raise ValueError(
                "each layer tensor must be [num_blocks, 2, block_tokens, kv_heads, head_dim], "
                f"got shape {tuple(first.shape)}"
            )
        for i, tensor in enumerate(layer_tensors):
            if tuple(tensor.shape) != tuple(first.shape) or tensor.dtype != first.dtype:
                raise ValueError(
                    f"layer {i} is {tuple(tensor.shape)} {tensor.dtype}, layer 0 is "
                    f"{tuple(first.shape)} {first.dtype}; every layer must match"
                )
            if not tensor.flags.c_contiguous:
                raise ValueError(f"layer {i} tensor must be C-contiguous")
        self.layers = len(layer_tensors)
        self.num_blocks = first.shape[0]
        self.row_bytes = int(np.prod(first.shape[2:])) * first.itemsize
        self.page_bytes = self.layers * 2 * self.row_bytes


def _check_convert(layer_tensors: Sequence[Any], pages: Any, pairs: Any, scatter: bool) -> tuple[_KVLayout, int, np.ndarray]:
    kv = _KVLayout(layer_tensors)
    n_pages = _page_count(pages, kv.page_bytes, "pages")
    pairs = _pairs_array(pairs)
    _check_range(pairs[:, 0], kv.num_blocks, "block id")
    _check_range(pairs[:, 1], n_pages, "page index")
    if scatter:
        _check_unique(pairs[:, 0], "block id")
    else:
        _check_unique(pairs[:, 1], "page index")
    return kv, n_pages, pairs


# --------------------------------------------------------------------------- CPU references


def _byte_pages(array: np.ndarray, n_pages: int) -> np.ndarray:
    return array.reshape(-1).view(np.uint8).reshape(n_pages, -1)


def copy_pages_cpu(src: np.ndarray, dst: np.ndarray, pairs: Any, page_bytes: int) -> None:
    """Copy page ``pairs[i][0]`` of `src` to page ``pairs[i][1]`` of `dst`, for every i."""
    pairs = _check_copy(src, dst, pairs, page_bytes)
    src_pages = _byte_pages(src, src.nbytes // page_bytes)
    dst_pages = _byte_pages(dst, dst.nbytes // page_bytes)
    dst_pages[pairs[:, 1]] = src_pages[pairs[:, 0]]


def gather_cpu(layer_tensors: Sequence[np.ndarray], pages: np.ndarray, pairs: Any) -> None:
    """For every (block id, page index) pair, write that block of every layer into the page."""
    kv, n_pages, pairs = _check_convert(layer_tensors, pages, pairs, scatter=False)
    rows = _byte_pages(pages, n_pages).reshape(n_pages, kv.layers, 2 * kv.row_bytes)
    for layer, tensor in enumerate(layer_tensors):
        blocks = tensor.reshape(-1).view(np.uint8).reshape(kv.num_blocks, 2 * kv.row_bytes)
        rows[pairs[:, 1], layer] = blocks[pairs[:, 0]]


def scatter_cpu(pages: np.ndarray, layer_tensors: Sequence[np.ndarray], pairs: Any) -> None:
    """For every (block id, page index) pair, write the page back into that block of every layer."""
    kv, n_pages, pairs = _check_convert(layer_tensors, pages, pairs, scatter=True)
    rows = _byte_pages(pages, n_pages).reshape(n_pages, kv.layers, 2 * kv.row_bytes)
    for layer, tensor in enumerate(layer_tensors):
        blocks = tensor.reshape(-1).view(np.uint8).reshape(kv.num_blocks, 2 * kv.row_bytes)
        blocks[pairs[:, 0]] = rows[pairs[:, 1], layer]


# --------------------------------------------------------------------------- GPU launchers


@functools.cache
def _module(source: str) -> Any:
    """One RawModule per source file per process; CuPy compiles it on first use per device."""
    import cupy

    code = (cuda_source_dir() / source).read_text()
    return cupy.RawModule(code=code, options=("--std=c++14",))


def kernel_function(source: str, name: str) -> Any:
    """Kernel `name` of `source` (a file in cuda/), compiled for the current CuPy device."""
    return _module(source).get_function(name)


def _grid(total: int) -> int:
    import cupy

    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    return max(1, min(-(-total // THREADS), sms * BLOCKS_PER_SM))


def _device_pairs(pairs: np.ndarray) -> Any:
    import cupy

    return cupy.asarray(np.ascontiguousarray(pairs, dtype=np.int64))


def copy_pages_gpu(src: Any, dst: Any, pairs: Any, page_bytes: int) -> None:
    """GPU `copy_pages_cpu`: one launch on the current stream; CuPy arrays on the current device."""
    import cupy

    pairs = _check_copy(src, dst, pairs, page_bytes)
    if src.data.ptr % VECTOR_BYTES or dst.data.ptr % VECTOR_BYTES:
        raise ValueError(f"src and dst arenas must start on a {VECTOR_BYTES}-byte boundary")
    if len(pairs) == 0:
        return
    total = len(pairs) * (page_bytes // VECTOR_BYTES)
    kernel_function("page_copy.cu", "kvtier_copy_pages")(
        (_grid(total),),
        (THREADS,),
        (src, dst, _device_pairs(pairs), cupy.int64(len(pairs)), cupy.int64(page_bytes)),
    )


def _convert_gpu(layer_tensors: Sequence[Any], pages: Any, pairs: Any, scatter: bool) -> None:
    import cupy

    kv, _, pairs = _check_convert(layer_tensors, pages, pairs, scatter=scatter)
    if len(pairs) == 0:
        return
    pointers = [int(t.data.ptr) for t in layer_tensors] + [int(pages.data.ptr)]
    vector = kv.row_bytes % VECTOR_BYTES == 0 and all(p % VECTOR_BYTES == 0 for p in pointers)
    unit = VECTOR_BYTES if vector else 1
    name = f"kvtier_{'scatter' if scatter else 'gather'}_{'v16' if vector else 'b1'}"
    layer_ptrs = cupy.asarray(np.array(pointers[:-1], dtype=np.uint64))
    total = len(pairs) * kv.layers * 2 * (kv.row_bytes // unit)
    kernel_function("kv_gather_scatter.cu", name)(
        (_grid(total),),
        (THREADS,),
        (layer_ptrs, pages, _device_pairs(pairs), cupy.int64(len(pairs)), cupy.int32(kv.layers), cupy.int64(kv.row_bytes)),
    )


def gather_gpu(layer_tensors: Sequence[Any], pages: Any, pairs: Any) -> None:
    """GPU `gather_cpu`: one launch on the current stream; all arrays on the current device."""
    _convert_gpu(layer_tensors, pages, pairs, scatter=False)


def scatter_gpu(pages: Any, layer_tensors: Sequence[Any], pairs: Any) -> None:
    """GPU `scatter_cpu`: one launch on the current stream; all arrays on the current device."""
    _convert_gpu(layer_tensors, pages, pairs, scatter=True)
