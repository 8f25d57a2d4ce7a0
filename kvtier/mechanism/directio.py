"""Direct I/O helpers: open a file bypassing the page cache where the filesystem allows,
and page-aligned buffers that O_DIRECT can read into and write from."""
from __future__ import annotations

import errno
import mmap
import os

DIRECT_ALIGN = 4096


def open_direct(path: str, flags: int) -> tuple[int, bool]:
    """Open with O_DIRECT if the filesystem supports it, else buffered (some filesystems, and
    tmpfs before Linux 6.6, refuse O_DIRECT at open with EINVAL).

    Returns (fd, direct).
    """
    direct_flag = getattr(os, "O_DIRECT", 0)
    if direct_flag:
        try:
            return os.open(path, flags | direct_flag, 0o640), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return os.open(path, flags, 0o640), False


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """An anonymous mapping: page aligned, so usable with O_DIRECT. Size rounded up to 4 KiB."""
    size = -(-nbytes // DIRECT_ALIGN) * DIRECT_ALIGN
    return mmap.mmap(-1, size, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
