"""SGLang's host KV pool as kvtier pages: one HiCache page (page_size tokens, every layer)
is one kvtier page, and each is seen through a strided view of the pool's buffer in
kvtier's order, so a page is copied once, straight between the pool and the daemon's arena.

kvtier stores a page in one order whatever engine layout it came from (`page_first`:
[layers, K/V, tokens, heads, head_dim]; `latent` for MLA: [layers, tokens, 1, dim]), so its
codecs can read it and a page written from one SGLang host layout reads back into another.
The buffer shapes below are those SGLang 0.5.23's host pools allocate
(`MHATokenToKVPoolHost.init_kv_buffer`, `MLATokenToKVPoolHost.init_kv_buffer`). Axis
letters: K (K then V), L layer, S token slot, P page, T token within a page, H head, D
head_dim.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtier_client.layout import DTYPE_BYTES, PageLayout

if TYPE_CHECKING:
    import torch

#: SGLang host layout -> the axes of its KV buffer, for pools with K and V (MHA).
MHA_AXES = {"layer_first": "KLSHD", "page_first": "KSLHD", "page_first_direct": "KPLTHD", "page_head": "KPHTLD"}
#: The same for MLA pools (one latent vector per token: H is 1).
MLA_AXES = {"layer_first": "LSHD", "page_first": "SLHD", "page_first_direct": "PLTHD"}
#: kvtier's page order (kvtier_client.layout) in the same letters.
KVTIER_AXES = {False: "LKTHD", True: "LTHD"}


@dataclass(frozen=True)
class HostPages:
    """Views of a host pool's pages in kvtier's order; `layout` is the kvtier page layout."""

    buffer: torch.Tensor
    axes: str  # the buffer's axes (MHA_AXES / MLA_AXES)
    page_axes: str  # the axes of one page as SGLang slices it (get_data_page)
    page_tokens: int
    mla: bool
    layout: PageLayout

    @classmethod
    def of(cls, pool: Any, *, mla: bool) -> HostPages:
        """Read a host pool's layout; ValueError naming what is supported otherwise."""
        name = getattr(pool, "layout", None)
        table = MLA_AXES if mla else MHA_AXES
        kind = "MLA" if mla else "MHA"
        if name not in table:
            raise ValueError(
                f"kvtier HiCache backend: the {kind} host pool's layout {name!r} is not supported; use "
                f"--hicache-mem-layout {' or '.join(table)}")
        buffer, page_tokens = pool.kv_buffer, int(pool.page_size)
        axes = table[name]
        if buffer.dim() != len(axes):
            raise ValueError(f"kvtier HiCache backend: a {kind} {name} host buffer has {len(axes)} dimensions "
                             f"({axes}); this pool's has shape {tuple(buffer.shape)}")
        size = dict(zip(axes, buffer.shape))
        if "T" in size and size["T"] != page_tokens:
            raise ValueError(f"kvtier HiCache backend: pages of {size['T']} tokens in a pool of page_size {page_tokens}")
        if mla and size["H"] != 1:
            raise ValueError(f"kvtier HiCache backend: an MLA pool holds one latent per token, not {size['H']}")
        dtype = str(buffer.dtype).removeprefix("torch.")
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"kvtier HiCache backend: KV dtype {dtype} has no kvtier page layout; "
                             f"kvtier pages hold {', '.join(DTYPE_BYTES)}")
        layout = PageLayout(layers=int(size["L"]), kv_heads=int(size["H"]), head_dim=int(size["D"]),
                            block_tokens=page_tokens, dtype=dtype, order="latent" if mla else "page_first")
        page_axes = axes.replace("S", "T").replace("P", "")
        return cls(buffer, axes, page_axes, page_tokens, mla, layout)

    @property
    def _order(self) -> list[int]:
        return [self.page_axes.index(axis) for axis in KVTIER_AXES[self.mla]]

    def page(self, index: int) -> torch.Tensor:
        """The page starting at token slot `index` (page-aligned, as SGLang's host_indices
        give it), as a strided view in kvtier's order."""
        if index % self.page_tokens:
            raise ValueError(f"host index {index} is not at a page boundary (page_size {self.page_tokens})")
        if "S" in self.axes:
            data = self.buffer.narrow(self.axes.index("S"), index, self.page_tokens)
        else:
            data = self.buffer.select(self.axes.index("P"), index // self.page_tokens)
        return data.permute(self._order)

    def flat_page(self, flat: torch.Tensor) -> torch.Tensor:
        """A flat data page (SGLang's `get_data_page(flat=True)` / `get_dummy_flat_data_page`:
        one page as SGLang slices it, flattened) as a view in kvtier's order."""
        size = dict(zip(self.axes, self.buffer.shape), T=self.page_tokens)
        return flat.view([size[axis] for axis in self.page_axes]).permute(self._order)
