"""Zero-copy views of host-arena pages: numpy always, torch when it is installed.

A page is ``page_bytes`` bytes at ``slot * slot_bytes`` in the daemon's shared-memory arena,
shaped ``layout.shape`` = [layers, 2, block_tokens, kv_heads, head_dim] (2 = K then V).

numpy has no bfloat16 or float8 dtype, so for those the numpy view holds the raw bits in
an unsigned integer of the same width (bfloat16 -> uint16, float8 -> uint8), same shape;
the torch view has the real dtype. torch is imported on first use only: the SDK works
without it.
"""
from __future__ import annotations

import mmap
from typing import TYPE_CHECKING

import numpy as np

from kvtier_client.ids import Slot
from kvtier_client.layout import PageLayout
from kvtier_client.shm import map_fd, populate

if TYPE_CHECKING:
    import torch

#: Layout dtype -> the numpy dtype of a page view (raw bits where numpy has no such type).
NUMPY_DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "int8": np.dtype(np.int8),
    "uint8": np.dtype(np.uint8),
    "bfloat16": np.dtype(np.uint16),
    "float8_e4m3fn": np.dtype(np.uint8),
    "float8_e5m2": np.dtype(np.uint8),
}

#: dtypes whose numpy view is raw bits rather than numbers.
RAW_IN_NUMPY = frozenset({"bfloat16", "float8_e4m3fn", "float8_e5m2"})


def numpy_dtype(dtype: str) -> np.dtype:
    """The dtype numpy views of pages of this layout dtype have."""
    try:
        return NUMPY_DTYPES[dtype]
    except KeyError:
        raise ValueError(f"no numpy view for dtype {dtype!r}; use one of {', '.join(NUMPY_DTYPES)}") from None


def torch_dtype(dtype: str) -> "torch.dtype":
    """The torch dtype of a layout dtype (every layout dtype has one)."""
    torch = import_torch()
    return getattr(torch, dtype)


def import_torch():
    """Import torch on demand, with an install hint instead of a bare ModuleNotFoundError."""
    try:
        import torch
    except ImportError:
        raise ImportError("torch views need torch; install it with: pip install 'kvtier-client[torch]'") from None
    return torch


def page_array(raw: np.ndarray, layout: PageLayout) -> np.ndarray:
    """Shape a page's bytes (a 1-D uint8 array of page_bytes) as a numpy page, zero copy."""
    return raw.view(numpy_dtype(layout.dtype)).reshape(layout.shape)


def page_tensor(raw: np.ndarray, layout: PageLayout) -> "torch.Tensor":
    """Shape a page's bytes (a 1-D uint8 array of page_bytes) as a torch page, zero copy.

    torch has no read-only tensors: a tensor over a read lease's page must not be written.
    """
    torch = import_torch()
    if not raw.flags.writeable:
        # torch.frombuffer would warn on every call; the page memory itself is writable.
        raise ValueError("page_tensor needs a writable byte view")
    return torch.frombuffer(raw, dtype=torch_dtype(layout.dtype)).view(layout.shape)


class HostArenaView:
    """This process's mapping of a daemon's host arena, and views of its pages.

    Closing drops the mapping; views handed out earlier keep their memory alive (the
    kernel unmaps when the last view goes), so closing never invalidates a page in use.
    """

    def __init__(self, buffer: mmap.mmap, layout: PageLayout, page_bytes: int, slot_bytes: int) -> None:
        if page_bytes != layout.page_bytes:
            raise ValueError(
                f"daemon says a page holds {page_bytes} bytes but layout {layout} needs {layout.page_bytes}: "
                "client and daemon disagree on the layout"
            )
        if slot_bytes < page_bytes:
            raise ValueError(f"slot stride {slot_bytes} is smaller than a page ({page_bytes} bytes)")
        self.layout = layout
        self.page_bytes = page_bytes
        self.slot_bytes = slot_bytes
        self.slots = len(buffer) // slot_bytes
        self._mm: mmap.mmap | None = buffer
        self._bytes: np.ndarray | None = np.frombuffer(buffer, dtype=np.uint8)
        self._mapped = np.zeros(self.slots, dtype=bool)  # slots `map_slot` mapped here

    def map_slot(self, slot: Slot) -> None:
        """Map a slot's memory in this process in one call before it is touched the first
        time (read or written), instead of one page fault per 4 KiB as a copy goes: a fresh
        arena's first fill, and a process's first read of pages another process wrote. Later
        calls cost a look-up; a slot the daemon took away meanwhile just faults."""
        if self._mm is None or self._mapped[slot]:
            return
        self._mapped[slot] = True
        populate(self._mm, slot * self.slot_bytes, self.slot_bytes)

    @classmethod
    def from_fd(cls, fd: int, size: int, layout: PageLayout, page_bytes: int, slot_bytes: int) -> "HostArenaView":
        """Map `size` bytes of the arena in `fd` (the descriptor the daemon handed over when
        the session attached; the caller still owns it)."""
        return cls(map_fd(fd, size), layout, page_bytes, slot_bytes)

    def raw(self, slot: Slot, *, writable: bool) -> np.ndarray:
        """The page in `slot` as page_bytes uint8, zero copy."""
        if self._bytes is None:
            raise ValueError("host arena view is closed")
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} is outside the arena's {self.slots} slots")
        start = slot * self.slot_bytes
        view = self._bytes[start : start + self.page_bytes]
        if not writable:
            view = view.view()
            view.flags.writeable = False
        return view

    def numpy(self, slot: Slot, *, writable: bool) -> np.ndarray:
        return page_array(self.raw(slot, writable=writable), self.layout)

    def torch(self, slot: Slot) -> "torch.Tensor":
        return page_tensor(self.raw(slot, writable=True), self.layout)

    def close(self) -> None:
        self._bytes = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # pages still viewed by the caller; the mapping goes with the last view
            self._mm = None
