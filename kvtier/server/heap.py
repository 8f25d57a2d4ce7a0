"""What the C allocator gives back after large requests.

gRPC reads each request whole into C memory and hands Python a copy, so a client that sends
messages of megabytes (legal, or refused once read) makes the daemon allocate and free
buffers that size. glibc's malloc keeps what was freed: it raises its mmap threshold (up to
32 MiB) each time a large mmapped block is freed, so later large buffers come from its
arenas (one per thread that allocates, and gRPC has dozens) and stay there as free but
resident memory; measured, a few dozen hostile 1 to 16 MiB requests left a fresh daemon 50
to 160 MiB larger.

Two measures, both glibc only (elsewhere nothing is done): a fixed mmap threshold (glibc's
initial 128 KiB; set explicitly, glibc no longer raises it), so every large buffer is its
own mapping, unmapped when freed; and `malloc_trim(0)` when, shortly after a call, the
arenas hold more than TRIM_FREE_BYTES free, which hands their free pages back. The check
(`mallinfo2`) and the trim run on their own thread, at most once per TRIM_DELAY_S, and only
after calls: an idle daemon does nothing.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
import time

log = logging.getLogger(__name__)

#: glibc's initial threshold; fixed, every allocation this large or larger is an mmap.
MMAP_THRESHOLD_BYTES = 128 << 10
#: Free bytes in the arenas above which a check trims (a busy daemon's churn stays below).
TRIM_FREE_BYTES = 4 << 20
#: How long after a call the check runs: the calls of a burst have ended and freed by then.
TRIM_DELAY_S = 0.5
_M_MMAP_THRESHOLD = -3  # malloc.h


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.gnu_get_libc_version  # noqa: B018 - only glibc has it
    except (OSError, AttributeError, TypeError):
        return None
    return libc


class Trimmer:
    """Tunes glibc's malloc at construction; `called()` after every call schedules a check.
    Without glibc both are no-ops."""

    def __init__(self) -> None:
        self._libc = _glibc()
        self._wanted = threading.Event()
        self.trims = 0
        if self._libc is None:
            log.info("not glibc: the daemon's C heap is left as it is (see kvtier.server.heap)")
            return
        if not self._libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES):
            log.warning("mallopt(M_MMAP_THRESHOLD) failed: memory of large requests may stay resident")
        info = getattr(self._libc, "mallinfo2", None)  # glibc >= 2.33; before it, every check trims
        if info is not None:
            info.restype = _MallInfo2
        self._info = info
        threading.Thread(target=self._run, name="kvtier-heap-trim", daemon=True).start()

    def called(self) -> None:
        self._wanted.set()

    def _run(self) -> None:
        while self._wanted.wait():
            time.sleep(TRIM_DELAY_S)  # a debounce: one check for a burst of calls
            self._wanted.clear()
            if self._info is None or self._info().fordblks > TRIM_FREE_BYTES:
                self._libc.malloc_trim(0)
                self.trims += 1
