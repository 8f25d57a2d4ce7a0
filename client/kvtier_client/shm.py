"""Mapping a daemon's host arena (POSIX shared memory under /dev/shm) into this process.

We open /dev/shm directly instead of multiprocessing.shared_memory: on Python < 3.13 the
latter registers every attached segment with a resource tracker that unlinks it when the
*client* exits, which would delete the daemon's arena.
"""
from __future__ import annotations

import mmap
import os

SHM_DIR = "/dev/shm"


def shm_path(name: str) -> str:
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"invalid shared-memory name {name!r}")
    return os.path.join(SHM_DIR, name)


def map_arena(name: str, size: int) -> mmap.mmap:
    """Map an existing arena read-write. Raises FileNotFoundError if the daemon has not created it."""
    fd = os.open(shm_path(name), os.O_RDWR)
    try:
        actual = os.fstat(fd).st_size
        if actual < size:
            raise ValueError(f"arena {name} has {actual} bytes, expected at least {size}: daemon and client disagree")
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
