"""Batched copies between vLLM's per-layer paged KV and kvtier pages, one launch per call.

    save_blocks(layers, pages, block_ids)   blocks block_ids[j] of every layer -> pages[j]
    load_blocks(layers, pages, block_ids)   pages[j] -> blocks block_ids[j] of every layer

`layers[i]` is the engine's raw KV tensor of its local layer i, one of three formats
(``kv_format``; vLLM 0.32):

    kv_last_dim  [num_blocks, heads, block_size, 2 * head_dim]   K in [..., :head_dim], V in
                 [..., head_dim:]  (FLASH_ATTN, TRITON_ATTN, FLEX_ATTENTION)
    cpu          [num_blocks, heads, block_size, 2 * head_dim]   one (block, head) is block_size
                 rows of K then block_size rows of V, head_dim each  (CPU_ATTN)
    mla          [num_blocks, block_size, latent_dim]            one latent vector per token

and `pages[j]` a contiguous kvtier page: ``[page_layers, 2, block_tokens, kv_heads_total,
head_dim]`` (order page_first, K then V) or, for mla, ``[page_layers, block_tokens,
latent_dim]`` or ``[page_layers, block_tokens, 1, latent_dim]`` (order latent). Both sides
are seen as rows of head_dim (latent_dim) contiguous elements indexed (kv, token, head)::

    engine layer i, block b                      page j, page layer page_layers[i]
    row (kv, t, h) at b*block_stride             row (kv, t, head_offset + h) at
        + kv*kv_stride + t*token_stride              ((kv*block_tokens + t)*kv_heads_total
        + h*head_stride                              + head_offset + h) * row_bytes
    kv_last_dim: kv_stride = head_dim            a worker's heads of one (kv, t): one run
    cpu:         kv_stride = block_size*head_dim

A worker of a tensor parallel engine holds heads [head_offset, head_offset + heads) of
kv_heads_total and copies only those: ranks saving their heads into the same pages leave
each page as one rank holding every head would. A pipeline stage holds some of the page's
layers: `page_layers[i]` is the page layer of its local layer i (default: all, in order).
Nothing else of a page is read or written. (MLA's latent is not split: every rank holds it
whole, so one rank saves it and every rank may load it.)

On CUDA tensors a call is one kernel launch (cuda/vllm_blocks.cu) over every layer, page,
K/V, token and head, on torch's current stream of the layers' device, without
synchronising: before the daemon reads saved pages (a commit), or before a load's pages are
released, the caller synchronises that stream (or an event recorded on it). A call cannot be
captured in a CUDA graph (it uploads its table from the host). The layers' and pages'
addresses go to the kernel as one uint64 table in device memory; accesses are 16
bytes wide where every address, stride and row allows it, narrower otherwise. Pages may be
device memory on the layers' device, or host memory CUDA has mapped: pinned memory
(``torch.empty(..., pin_memory=True)``, cudaHostAlloc) or memory page-locked with
cudaHostRegister (a kvtier host arena mapped in this process: register the mapping once
with cudaHostRegisterPortable | cudaHostRegisterMapped; the registration is per process,
the daemon's own does not count). The kernel then reads and writes the host pages over the
bus itself. Each host page's device address comes from cudaPointerGetAttributes; a page
CUDA cannot reach is refused with what to do.

On CPU tensors the same copies are torch strided copies (`_copy_cpu`): the reference the
kernel is tested against byte for byte (tests/client/test_kernels_vllm.py), and a working
path for CPU engines. Both check the arguments the same way and raise ValueError for a
caller's mistake before anything is written. CuPy and torch are imported on first use.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvtier_client.kernels import BLOCKS_PER_SM, THREADS, VECTOR_BYTES, kernel_function
from kvtier_client.views import import_torch

if TYPE_CHECKING:
    import torch

#: The engine tensor formats, as the connector names them (see the module docstring).
KV_FORMATS = ("kv_last_dim", "cpu", "mla")
#: The kernel source, in cuda/.
SOURCE = "vllm_blocks.cu"
#: Access width (bytes) -> kernel name.
KERNELS = {16: "kvtier_vllm_blocks_v16", 8: "kvtier_vllm_blocks_v8", 4: "kvtier_vllm_blocks_v4",
           2: "kvtier_vllm_blocks_v2", 1: "kvtier_vllm_blocks_v1"}
#: CUDA's largest grid y dimension.
GRID_Y_MAX = 65535
#: cudaPointerGetAttributes' type of page-locked host memory.
_HOST_MEMORY = 1
#: cudaDevAttrMultiProcessorCount.
_MULTIPROCESSOR_COUNT = 16


@dataclass(frozen=True)
class BlockGeometry:
    """One call's rows (see the module docstring). Strides in elements."""

    kv_parts: int      # 2 (K, V) or 1 (mla)
    tokens: int        # block_size == block_tokens
    heads: int         # the worker's heads (1 for mla)
    heads_total: int   # a page's heads (1 for mla)
    row: int           # elements per row: head_dim or latent_dim
    itemsize: int
    num_blocks: int
    page_layer_count: int
    block_stride: int
    kv_stride: int
    token_stride: int
    head_stride: int

    @property
    def row_bytes(self) -> int:
        return self.row * self.itemsize

    @property
    def page_layer_bytes(self) -> int:
        return self.kv_parts * self.tokens * self.heads_total * self.row_bytes


@dataclass(frozen=True)
class _Job:
    geometry: BlockGeometry
    head_offset: int
    page_layers: tuple[int, ...]
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class LaunchPlan:
    """What the CUDA path launches: kernel `kernel` on `grid` x THREADS with arguments
    (address of `table` in device memory, *args)."""

    kernel: str
    grid: tuple[int, int]
    table: np.ndarray  # uint64: engine[L] | layer offset[L] | page[P] | block offset[P], bytes
    args: tuple


def save_blocks(layers: Sequence[torch.Tensor], pages: Sequence[torch.Tensor], block_ids: Sequence[int], *,
                head_offset: int = 0, page_layers: Sequence[int] | None = None,
                kv_format: str = "kv_last_dim") -> None:
    """Copy block `block_ids[j]` of every layer into `pages[j]` (the worker's heads and layers
    of it), for every j. A block may go to several pages; a page may appear once."""
    _copy(layers, pages, block_ids, head_offset, page_layers, kv_format, save=True)


def load_blocks(layers: Sequence[torch.Tensor], pages: Sequence[torch.Tensor], block_ids: Sequence[int], *,
                head_offset: int = 0, page_layers: Sequence[int] | None = None,
                kv_format: str = "kv_last_dim") -> None:
    """Copy the worker's heads and layers of `pages[j]` into block `block_ids[j]` of every
    layer, for every j. A block may appear once; a page may be read for several blocks."""
    _copy(layers, pages, block_ids, head_offset, page_layers, kv_format, save=False)


def _copy(layers, pages, block_ids, head_offset, page_layers, kv_format, *, save: bool) -> None:
    job = _check(layers, pages, block_ids, head_offset, page_layers, kv_format, save=save)
    if job is None:
        return
    if layers[0].is_cuda:
        _copy_cuda(job, layers, pages, save=save)
    else:
        _copy_cpu(job, layers, pages, save=save)


# --------------------------------------------------------------------------- checks


def _engine_geometry(first: torch.Tensor, kv_format: str) -> tuple[int, ...]:
    """(num_blocks, heads, tokens, row, kv_parts, block, kv, token, head strides) of a layer."""
    strides = first.stride()
    if kv_format == "mla":
        if first.dim() != 3 or strides[2] != 1:
            raise ValueError("an mla layer tensor must be [num_blocks, block_size, latent_dim] with a contiguous last "
                             f"dimension, got shape {tuple(first.shape)} strides {strides}")
        blocks, tokens, row = first.shape
        return blocks, 1, tokens, row, 1, strides[0], 0, strides[1], 0
    if first.dim() != 4 or first.shape[3] % 2 or strides[3] != 1:
        raise ValueError(f"a {kv_format} layer tensor must be [num_blocks, kv_heads, block_size, 2 * head_dim] with a "
                         f"contiguous last dimension, got shape {tuple(first.shape)} strides {strides}")
    blocks, heads, tokens, two_rows = first.shape
    row = two_rows // 2
    if kv_format == "kv_last_dim":
        return blocks, heads, tokens, row, 2, strides[0], row, strides[2], strides[1]
    if strides[2] != two_rows:  # cpu: a (block, head) is [2 * block_size, head_dim], dense
        raise ValueError(f"a cpu layer tensor needs each (block, head) dense (stride {two_rows} over block_size), "
                         f"got strides {strides}")
    return blocks, heads, tokens, row, 2, strides[0], tokens * row, row, strides[1]


def _page_heads(page: torch.Tensor, kv_format: str, tokens: int, row: int) -> int | None:
    """kv_heads_total of a page of the right shape, else None."""
    shape = tuple(page.shape)
    if kv_format == "mla":
        if shape[1:] == (tokens, row) or shape[1:] == (tokens, 1, row):
            return 1
        return None
    if len(shape) == 5 and shape[1] == 2 and shape[2] == tokens and shape[4] == row:
        return shape[3]
    return None


def _check(layers, pages, block_ids, head_offset, page_layers, kv_format, *, save: bool) -> _Job | None:
    """The call's job, or None when there is nothing to copy; ValueError for a mistake."""
    if kv_format not in KV_FORMATS:
        raise ValueError(f"unknown kv_format {kv_format!r}; use one of {', '.join(KV_FORMATS)}")
    if len(layers) == 0:
        raise ValueError("layers is empty; pass the engine's KV tensor of each local layer")
    first = layers[0]
    for i, layer in enumerate(layers):
        if (tuple(layer.shape), layer.stride(), layer.dtype, layer.device) != (
                tuple(first.shape), first.stride(), first.dtype, first.device):
            raise ValueError(f"layer {i} is {tuple(layer.shape)} strides {layer.stride()} {layer.dtype} on "
                             f"{layer.device}, layer 0 is {tuple(first.shape)} strides {first.stride()} {first.dtype} "
                             f"on {first.device}; every layer must match")
    if first.element_size() not in _bit_dtypes() or first.is_complex():
        raise ValueError(f"layer dtype {first.dtype} is not copied here (1, 2, 4 or 8 byte real types)")
    blocks, heads, tokens, row, kv_parts, *strides = _engine_geometry(first, kv_format)
    block_ids = tuple(int(b) for b in block_ids)
    if len(pages) != len(block_ids):
        raise ValueError(f"{len(pages)} pages for {len(block_ids)} block ids; pass one page per block id")
    if not block_ids:
        return None
    shape = tuple(pages[0].shape)
    heads_total = _page_heads(pages[0], kv_format, tokens, row)
    if heads_total is None:
        want = (f"[layers, {tokens}, {row}] or [layers, {tokens}, 1, {row}]" if kv_format == "mla"
                else f"[layers, 2, {tokens}, kv_heads_total, {row}]")
        raise ValueError(f"pages are {shape}; for these {kv_format} layers a page is {want}")
    for j, page in enumerate(pages):
        if tuple(page.shape) != shape or page.dtype != first.dtype or not page.is_contiguous():
            raise ValueError(f"page {j} is {tuple(page.shape)} {page.dtype}"
                             f"{'' if page.is_contiguous() else ' not contiguous'}; pages must be contiguous "
                             f"{shape} {first.dtype} like page 0 and the layers")
        if first.is_cuda and page.is_cuda and page.device != first.device:
            raise ValueError(f"page {j} is on {page.device}, the layers on {first.device}")
        if not first.is_cuda and page.device.type != "cpu":
            raise ValueError(f"page {j} is on {page.device} but the layers are on the CPU")
    if isinstance(head_offset, bool) or not isinstance(head_offset, int) or head_offset < 0 \
            or head_offset + heads > heads_total:
        raise ValueError(f"head_offset {head_offset!r} with {heads} local heads is outside the page's "
                         f"{heads_total} heads (valid 0..{heads_total - heads})")
    page_layer_count = shape[0]
    if page_layers is None:
        if len(layers) != page_layer_count:
            raise ValueError(f"{len(layers)} layers for pages of {page_layer_count}; pass page_layers (local layer "
                             "-> page layer) when this worker holds some of the page's layers")
        page_layers = range(len(layers))
    page_layers = tuple(int(p) for p in page_layers)
    if len(page_layers) != len(layers):
        raise ValueError(f"page_layers has {len(page_layers)} entries for {len(layers)} layers")
    _check_indices(page_layers, page_layer_count, "page layer", unique=True)
    _check_indices(block_ids, blocks, "block id", unique=not save)
    if save and len({p.data_ptr() for p in pages}) != len(pages):
        raise ValueError("a page appears twice; each page may be written once per call")
    if not save and len({t.data_ptr() for t in layers}) != len(layers):
        raise ValueError("a layer tensor appears twice; pass a tensor shared by layers once")
    geometry = BlockGeometry(kv_parts, tokens, heads, heads_total, row, first.element_size(), blocks,
                             page_layer_count, *strides)
    return _Job(geometry, head_offset, page_layers, block_ids)


def _check_indices(values: tuple[int, ...], limit: int, what: str, *, unique: bool) -> None:
    for value in values:
        if not 0 <= value < limit:
            raise ValueError(f"{what} {value} out of range: there are {limit} (valid 0..{limit - 1})")
    if unique and len(set(values)) != len(values):
        twice = next(v for v in values if values.count(v) > 1)
        raise ValueError(f"{what} {twice} appears twice; each may be written once per call")


# --------------------------------------------------------------------------- CPU reference


@functools.cache
def _bit_dtypes() -> dict[int, torch.dtype]:
    """Element size -> the integer dtype its bits are copied as (a NaN's payload included)."""
    torch = import_torch()
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _copy_cpu(job: _Job, layers, pages, *, save: bool) -> None:
    """The reference: per layer, one `_foreach_copy_` of strided views over all pages."""
    torch = import_torch()
    g, h0 = job.geometry, job.head_offset
    bits = _bit_dtypes()[g.itemsize]
    rows = (g.num_blocks, g.kv_parts, g.tokens, g.heads, g.row)
    strides = (g.block_stride, g.kv_stride, g.token_stride, g.head_stride, 1)
    paged = [page.view(bits).view(g.page_layer_count, g.kv_parts, g.tokens, g.heads_total, g.row)[
        :, :, :, h0:h0 + g.heads] for page in pages]
    for layer, page_layer in zip(layers, job.page_layers):
        raw = layer.view(bits)
        engine = raw.as_strided(rows, strides, raw.storage_offset())
        blocks = [engine[b] for b in job.block_ids]
        parts = [page[page_layer] for page in paged]
        if save:
            torch._foreach_copy_(parts, blocks)
        else:
            torch._foreach_copy_(blocks, parts)


# --------------------------------------------------------------------------- CUDA


def launch_plan(layers, pages, block_ids, *, save: bool, sms: int, page_addresses: Sequence[int] | None = None,
                head_offset: int = 0, page_layers: Sequence[int] | None = None,
                kv_format: str = "kv_last_dim") -> LaunchPlan | None:
    """The launch `save_blocks`/`load_blocks` make for these arguments on a device of `sms`
    multiprocessors, with the pages at `page_addresses` (default: their data_ptr). Needs no
    GPU: the tests run it through the kernel source compiled for the CPU."""
    job = _check(layers, pages, block_ids, head_offset, page_layers, kv_format, save=save)
    if job is None:
        return None
    if page_addresses is None:
        page_addresses = [page.data_ptr() for page in pages]
    return _plan(job, [layer.data_ptr() for layer in layers], list(page_addresses), save=save, sms=sms)


def _plan(job: _Job, engine_addresses: list[int], page_addresses: list[int], *, save: bool, sms: int) -> LaunchPlan:
    g = job.geometry
    size = g.itemsize
    strides = [s * size for s in (g.block_stride, g.kv_stride, g.token_stride, g.head_stride)]
    bits = g.row_bytes
    for value in (*strides, *engine_addresses, *page_addresses):
        bits |= value
    unit = min(VECTOR_BYTES, bits & -bits)
    units_per_row = g.row_bytes // unit
    per_item = g.kv_parts * g.tokens * g.heads * units_per_row
    items = len(engine_addresses) * len(page_addresses)
    if per_item >= 2**31 or items >= 2**31:
        raise ValueError(f"{items} (layer, page) pairs of {per_item} accesses each: too many for one launch; split it")
    table = np.array(
        [*engine_addresses,
         *(p * g.page_layer_bytes + job.head_offset * g.row_bytes for p in job.page_layers),
         *page_addresses,
         *(b * strides[0] for b in job.block_ids)], dtype=np.uint64)
    cap = sms * BLOCKS_PER_SM
    grid_x = max(1, min(-(-per_item // THREADS), cap))
    grid_y = max(1, min(items, cap // grid_x, GRID_Y_MAX))
    i32, i64 = np.int32, np.int64
    args = (i32(len(engine_addresses)), i32(len(page_addresses)), i32(save), i32(g.kv_parts), i32(g.tokens),
            i32(g.heads), i32(g.heads_total), i32(units_per_row), i64(strides[1]), i64(strides[2]), i64(strides[3]),
            i64(g.row_bytes))
    return LaunchPlan(KERNELS[unit], (grid_x, grid_y), table, args)


@functools.cache
def _sm_count(device: int) -> int:
    import cupy

    return cupy.cuda.runtime.deviceGetAttribute(_MULTIPROCESSOR_COUNT, device)


def _device_addresses(pages) -> list[int]:
    """Each page's address as the current device sees it: a device page's own, a host page's
    mapping (page-locked host memory only)."""
    import cupy

    addresses = []
    for j, page in enumerate(pages):
        address = page.data_ptr()
        if not page.is_cuda:
            try:
                attributes = cupy.cuda.runtime.pointerGetAttributes(address)
            except cupy.cuda.runtime.CUDARuntimeError:  # before CUDA 11: unregistered memory is an error
                attributes = None
            if attributes is None or attributes.type != _HOST_MEMORY or not attributes.devicePointer:
                raise ValueError(
                    f"page {j} (host address {address:#x}) is host memory CUDA has not mapped: page-lock it first "
                    "(cudaHostRegister of the whole arena mapping with cudaHostRegisterPortable | "
                    "cudaHostRegisterMapped, once per process), or use pinned memory")
            address = attributes.devicePointer
        addresses.append(address)
    return addresses


def _copy_cuda(job: _Job, layers, pages, *, save: bool) -> None:
    import cupy

    torch = import_torch()
    device = layers[0].device
    stream = torch.cuda.current_stream(device)
    with cupy.cuda.Device(device.index):
        plan = _plan(job, [layer.data_ptr() for layer in layers], _device_addresses(pages), save=save,
                     sms=_sm_count(device.index))
        # From pageable memory the copy returns once CUDA has staged the table; the allocation
        # is stream-ordered, so it is not reused before the kernel has read it.
        table = torch.from_numpy(plan.table.view(np.int64)).to(device, non_blocking=True)
        with cupy.cuda.ExternalStream(stream.cuda_stream, device.index):
            kernel_function(SOURCE, plan.kernel)(plan.grid, (THREADS,), (np.uint64(table.data_ptr()), *plan.args))
