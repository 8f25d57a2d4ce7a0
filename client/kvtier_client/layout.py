"""Page layouts: what one fixed-size KV page holds, and how many bytes that is.

A page holds the K and V of every layer for `block_tokens` consecutive tokens: in order
`page_first` its shape is ``[layers, 2, block_tokens, kv_heads, head_dim]`` (2 = K then V);
in order `latent` (MLA, whose cache is one compressed vector per token) it is ``[layers,
block_tokens, kv_heads, head_dim]``. Either is contiguous, so one page is one slot in every
tier.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

#: dtype name -> bytes per element. Names follow torch/numpy spelling.
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}

#: Known orders of dimensions inside a page. `page_first`: [layers, 2, block_tokens, kv_heads,
#: head_dim], K then V. `latent`: [layers, block_tokens, kv_heads, head_dim], one vector per
#: token and head with no K/V split (MLA's compressed latent: kv_heads 1).
ORDERS = ("page_first", "latent")

#: Slots in every tier start on this boundary, so direct I/O can read straight into a host page.
SLOT_ALIGN = 4096


@dataclass(frozen=True)
class PageLayout:
    """The shape of one KV page. Frozen and hashable: it names an arena."""

    layers: int
    kv_heads: int
    head_dim: int
    block_tokens: int
    dtype: str = "float16"
    order: str = "page_first"

    def __post_init__(self) -> None:
        for name in ("layers", "kv_heads", "head_dim", "block_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"page layout: {name} must be a positive integer, got {value!r}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(
                f"page layout: unknown dtype {self.dtype!r}; use one of {', '.join(DTYPE_BYTES)}"
            )
        if self.order not in ORDERS:
            raise ValueError(f"page layout: unknown order {self.order!r}; use one of {', '.join(ORDERS)}")

    @property
    def kv_parts(self) -> int:
        """2 (K and V) for `page_first`, 1 for `latent`."""
        return 1 if self.order == "latent" else 2

    @property
    def shape(self) -> tuple[int, ...]:
        """Dimensions of one page, outermost first."""
        if self.order == "latent":
            return (self.layers, self.block_tokens, self.kv_heads, self.head_dim)
        return (self.layers, 2, self.block_tokens, self.kv_heads, self.head_dim)

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def page_bytes(self) -> int:
        """Bytes of KV in one page."""
        return self.layers * self.kv_parts * self.block_tokens * self.kv_heads * self.head_dim * self.itemsize

    @property
    def slot_bytes(self) -> int:
        """Stride between pages in an arena: page_bytes rounded up to SLOT_ALIGN."""
        return -(-self.page_bytes // SLOT_ALIGN) * SLOT_ALIGN

    @property
    def layout_id(self) -> str:
        """A short stable name for this layout, used in arena and file names."""
        text = f"{self.layers}/{self.kv_heads}/{self.head_dim}/{self.block_tokens}/{self.dtype}/{self.order}"
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    def pages_in(self, capacity_bytes: int, tier: str) -> int:
        """How many pages fit in `capacity_bytes`; refuses a tier too small for one page."""
        if capacity_bytes < self.slot_bytes:
            raise ValueError(
                f"{tier} tier of {capacity_bytes} bytes cannot hold one page of {self.slot_bytes} bytes; "
                f"give the {tier} tier at least {self.slot_bytes} bytes or use a smaller layout"
            )
        return capacity_bytes // self.slot_bytes
