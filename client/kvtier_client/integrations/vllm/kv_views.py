"""vLLM's paged KV on one worker as kvtier pages: per KV cache group, a view of each layer
shaped like that layer of this worker's part of a page, so a copy between them is a plain
(strided) tensor copy.

    full attention   [num_blocks, 2, block, heads, head_dim]   a page layer is [2, block, kv_heads, head_dim]
    MLA              [num_blocks, block, 1, latent_dim]          a page layer is [block, 1, latent_dim]

vLLM 0.32's per-layer tensor is [num_blocks, heads, block_size, 2 * head_dim] (head-major):
CPU_ATTN keeps, per block and head, block_size rows of K then block_size rows of V; the GPU
backends (FlashAttention, Triton, FlexAttention) keep K and V side by side in the last
dimension. MLA's is [num_blocks, block_size, latent_dim] (or [num_blocks, 1, block_size,
latent_dim]).

On a GPU the copies are not done through these views but by kvtier_client.kernels_vllm, one
kernel launch per direction for every layer and page (`cuda`: the group's KV is on a GPU;
`raw`: vLLM's tensors as they are). The kernel reads and writes the host arena's pages over
the bus, so the worker page-locks its mapping of each arena once (`register_arena`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvtier_client.integrations.vllm.kv_groups import KVGroup
from kvtier_client.integrations.vllm.link import DaemonLink
from kvtier_client.integrations.vllm.shapes import WorkerSlice
from kvtier_client.layout import PageLayout

if TYPE_CHECKING:
    from vllm.config import VllmConfig

#: Attention backends whose per-layer KV [num_blocks, kv_heads, block_size, 2 * head_dim]
#: holds K in [..., :head_dim] and V in [..., head_dim:] (read in vLLM 0.32's sources).
KV_LAST_DIM_BACKENDS = frozenset({"FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION"})
#: Backends that view a block of one head as block_size rows of K then block_size rows of V.
CPU_BACKENDS = frozenset({"CPU_ATTN"})


class GroupViews:
    """One KV cache group's layers on this worker (`views`, after `register`), its pool's
    client and this worker's part of the group's pages."""

    def __init__(self, group: KVGroup, part: WorkerSlice, link: DaemonLink) -> None:
        self.group, self.part, self.link, self.kv = group, part, link, link.kv
        self.layout = group.layout
        self.views: list[torch.Tensor] = []
        self.raw: list[torch.Tensor] = []  # vLLM's per-layer tensors (the GPU kernel's input)
        self.kv_format = ""
        lay = self.layout
        #: Bytes of this worker's part of a page.
        self.part_bytes = lay.page_bytes * len(part.page_layers) * part.heads // (lay.layers * lay.kv_heads)

    def register(self, kv_caches: dict[str, torch.Tensor], kv_format: str) -> None:
        missing = [name for name in self.group.layer_names if name not in kv_caches]
        if missing:
            raise ValueError(f"kvtier connector: no KV cache tensor for layers {missing}")
        self.kv_format = "mla" if self.layout.order == "latent" else kv_format
        self.raw = [_latent(kv_caches[name]) if self.kv_format == "mla" else kv_caches[name]
                    for name in self.group.layer_names]
        self.views = [page_view(name, kv, self.layout, self.part.heads, self.kv_format, self.group.block_size)
                      for name, kv in zip(self.group.layer_names, self.raw)]
        if self.cuda:
            register_arena(self.kv)

    @property
    def cuda(self) -> bool:
        """The group's KV is on a GPU and a page is one vLLM block: kernels_vllm copies it.
        (Pages of several blocks go through the views, with torch copies, on a GPU too.)"""
        return bool(self.raw) and self.raw[0].is_cuda and self.group.blocks_per_page == 1

    def parts(self, page: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
        """This worker's part of a page, per vLLM block of the page (one unless page_tokens
        says more) and per local layer: its heads of that layer's tokens of that block."""
        heads = slice(self.part.head_start, self.part.head_start + self.part.heads)
        block, latent = self.group.block_size or self.layout.block_tokens, self.layout.order == "latent"
        layers = [page[layer][..., heads, :] for layer in self.part.page_layers]
        tokens = [slice(i * block, (i + 1) * block) for i in range(self.group.blocks_per_page)]
        return [tuple(layer[t] if latent else layer[:, t] for layer in layers) for t in tokens]


def _latent(kv: torch.Tensor) -> torch.Tensor:
    """An MLA layer's KV as [num_blocks, block_size, latent_dim]: some backends (vLLM 0.32's
    CPU AMX_MLA) keep a heads dimension of 1, [num_blocks, 1, block_size, latent_dim]."""
    return kv.select(1, 0) if kv.dim() == 4 and kv.shape[1] == 1 else kv


def detect_format(vllm_config: VllmConfig, layer_names: list[str]) -> str:
    """"cpu" or "kv_last_dim" from the layers' attention backends, or ValueError saying
    which kv_cache_format to set."""
    names = set()
    context = vllm_config.compilation_config.static_forward_context
    for name in layer_names:
        backend = getattr(context.get(name), "attn_backend", None)
        names.add(backend.get_name() if backend is not None else "unknown")
    if names <= CPU_BACKENDS:
        return "cpu"
    if names <= KV_LAST_DIM_BACKENDS:
        return "kv_last_dim"
    if names <= {"CPU_MLA"} or all("MLA" in n for n in names):
        return "mla"
    raise ValueError(
        f"kvtier connector: attention backend(s) {sorted(names)} are not known to the connector. If the backend "
        "keeps K and V side by side in the last dimension of [num_blocks, kv_heads, block_size, 2 * head_dim], set "
        "kv_connector_extra_config kv_cache_format='kv_last_dim'; if it stores block_size rows of K then of V per "
        "head (as CPU_ATTN), set 'cpu'"
    )


def page_view(name: str, kv: torch.Tensor, layout: PageLayout, heads: int, kv_format: str,
              block: int = 0) -> torch.Tensor:
    """A view of one layer's paged KV (vLLM blocks of `block` tokens; default a page's) in
    the order of that layer of a page (module docstring)."""
    if str(kv.dtype).removeprefix("torch.") != layout.dtype:
        raise ValueError(f"kvtier connector: layer {name} KV dtype {kv.dtype} is not the page dtype {layout.dtype}")
    block, dim = block or layout.block_tokens, layout.head_dim
    if kv_format == "mla":
        if kv.dim() != 3 or tuple(kv.shape[1:]) != (block, dim):
            raise ValueError(f"kvtier connector: MLA layer {name} KV tensor has shape {tuple(kv.shape)}, expected "
                             f"[num_blocks, {block}, {dim}]")
        return kv.unsqueeze(2)
    if kv.dim() != 4 or tuple(kv.shape[1:]) != (heads, block, 2 * dim):
        raise ValueError(f"kvtier connector: layer {name} KV tensor has shape {tuple(kv.shape)}, expected "
                         f"[num_blocks, {heads}, {block}, {2 * dim}]")
    blocks = kv.shape[0]
    if kv_format == "cpu":
        # CPU_ATTN reads a block of one head as [2 * block_size, head_dim]: K rows, then V rows.
        if kv.stride()[1:] != (block * 2 * dim, 2 * dim, 1):
            raise ValueError(f"kvtier connector: layer {name} KV strides {kv.stride()} are not head-major dense")
        return kv.view(blocks, heads, 2, block, dim).permute(0, 2, 3, 1, 4)
    if kv.stride(-1) != 1:
        raise ValueError(f"kvtier connector: layer {name} KV last dimension is not contiguous")
    return kv.unflatten(-1, (2, dim)).permute(0, 3, 2, 1, 4)  # [B, H, N, 2, D] -> [B, 2, N, H, D]


_REGISTERED: set[int] = set()  # arena mappings this process page-locked


def register_arena(kv) -> None:
    """Page-lock this process's mapping of a client's host arena for the GPU kernels
    (cudaHostRegisterPortable | cudaHostRegisterMapped), once per mapping."""
    import cupy

    arena = kv.host_arena
    if arena is None:
        raise RuntimeError("kvtier connector: the worker's client does not map the host arena")
    base = arena.raw(0, writable=False).ctypes.data
    if base not in _REGISTERED:
        cupy.cuda.runtime.hostRegister(base, arena.slots * arena.slot_bytes, 1 | 2)
        _REGISTERED.add(base)
