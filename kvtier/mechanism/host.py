"""Host tier: a POSIX shared-memory arena of fixed slots that clients map by name.

Slot i starts at ``i * layout.slot_bytes`` (a multiple of 4096, so direct I/O can read a
disk page straight into it). The daemon holds an exclusive flock on the arena file for its
whole life; that is how a second daemon, or a restarted one, tells a live arena from a
stale one left by a crash (see docs/tiers.md, "Stale arenas").
"""
from __future__ import annotations

import fcntl
import logging
import mmap
import os

import numpy as np
from kvtier_client.layout import PageLayout
from kvtier_client.shm import shm_path

log = logging.getLogger(__name__)


class ArenaInUse(RuntimeError):
    """Another live daemon owns an arena of this name."""


class HostArena:
    """The daemon's side of a host arena: creates, pre-touches, owns and removes it."""

    def __init__(self, name: str, layout: PageLayout, pages: int) -> None:
        if pages <= 0:
            raise ValueError(f"host arena needs at least one page, got {pages}")
        self.name = name
        self.layout = layout
        self.pages = pages
        self.size = pages * layout.slot_bytes
        self.stale_removed = False
        self._fd = self._create_exclusive(shm_path(name))
        try:
            os.ftruncate(self._fd, self.size)
            self._mm = mmap.mmap(self._fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            self._unlink_and_close()
            raise
        self._bytes = np.frombuffer(self._mm, dtype=np.uint8)
        self._pretouch()

    def _create_exclusive(self, path: str) -> int:
        """Create the arena file and lock it; replace a stale one, refuse a live one."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o660)
        except FileExistsError:
            fd = os.open(path, os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise ArenaInUse(
                    f"host arena {self.name} is owned by a running daemon; stop it or give this one another name"
                ) from None
            # Nobody holds the lock: a daemon crashed and left it. Its pages have no index
            # (host residency is not persisted) and may be half written, so remove it.
            log.warning("removing stale host arena %s left by a daemon that exited uncleanly", self.name)
            os.unlink(path)
            os.close(fd)
            self.stale_removed = True
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o660)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd

    def _pretouch(self) -> None:
        """Fault every OS page in now, so the first borrow does not pay for it."""
        self._bytes[:: mmap.PAGESIZE] = 0

    def view(self, slot: int) -> memoryview:
        """The whole slot (slot_bytes, page plus alignment padding), writable."""
        start = slot * self.layout.slot_bytes
        return memoryview(self._mm)[start : start + self.layout.slot_bytes]

    def page(self, slot: int) -> np.ndarray:
        """The page's bytes (page_bytes) as a writable uint8 array, zero copy."""
        start = slot * self.layout.slot_bytes
        return self._bytes[start : start + self.layout.page_bytes]

    def clear(self, slot: int) -> None:
        """Zero a slot, so a page handed to a new namespace carries none of the old one's data."""
        self.page(slot).fill(0)

    def close(self) -> None:
        """Unmap and remove the arena. Clients that still map it keep their mapping until they unmap."""
        if self._fd < 0:
            return
        del self._bytes
        try:
            self._mm.close()
        except BufferError:
            # A view is still exported (a test holding a page); the mapping goes with the process.
            log.debug("host arena %s still has exported views at close", self.name)
        self._unlink_and_close()

    def _unlink_and_close(self) -> None:
        try:
            os.unlink(shm_path(self.name))
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = -1
