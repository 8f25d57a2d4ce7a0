"""Small helpers for the client tests: a layout, token ids and page contents."""
from __future__ import annotations

import numpy as np
from kvtier_client import PageLayout

#: The everyday test layout: page 2*2*16*2*32*2 = 8192 bytes, two OS pages.
LAYOUT = PageLayout(layers=2, kv_heads=2, head_dim=32, block_tokens=16, dtype="float16")


def kv_pages(n: int, layout: PageLayout, seed: int = 0) -> np.ndarray:
    """n pages of distinct random bytes, as uint8 [n, page_bytes]: compare pages bytewise."""
    return np.random.default_rng(seed).integers(0, 256, size=(n, layout.page_bytes), dtype=np.uint8)


def tokens(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 50_000, size=n).tolist()


def as_bytes(page: np.ndarray) -> np.ndarray:
    """A page view of any dtype as its page_bytes uint8, zero copy (read-only stays read-only)."""
    return page.reshape(-1).view(np.uint8)
