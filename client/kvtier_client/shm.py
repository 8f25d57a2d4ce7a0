"""Mapping a host arena the daemon handed over (a memfd received on the handoff socket,
kvtier_client.handoff) into this process."""
from __future__ import annotations

import mmap
import os


def map_fd(fd: int, size: int) -> mmap.mmap:
    """Map `size` bytes of the arena in `fd` read-write (the caller may close `fd` after)."""
    actual = os.fstat(fd).st_size
    if actual < size:
        raise ValueError(f"arena has {actual} bytes, expected at least {size}: daemon and client disagree")
    return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
