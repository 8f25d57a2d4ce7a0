"""Mapping a host arena the daemon handed over (a memfd received on the handoff socket,
kvtier_client.handoff) into this process."""
from __future__ import annotations

import mmap
import os


_MADV_POPULATE_WRITE = 23  # Linux 5.14


def populate(mm: mmap.mmap, start: int, length: int) -> None:
    """Allocate and map [start, start + length) of a shared mapping in one call, so that the
    first write does not take a page fault per 4 KiB (the daemon and the client both do
    this for slots about to be written). On an older kernel the writes fault instead."""
    try:
        mm.madvise(_MADV_POPULATE_WRITE, start, length)
    except OSError:
        pass


def map_fd(fd: int, size: int) -> mmap.mmap:
    """Map `size` bytes of the arena in `fd` read-write (the caller may close `fd` after)."""
    actual = os.fstat(fd).st_size
    if actual < size:
        raise ValueError(f"arena has {actual} bytes, expected at least {size}: daemon and client disagree")
    return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
