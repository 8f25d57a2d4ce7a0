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
import secrets

import numpy as np
from kvtier_client.layout import PageLayout
from kvtier_client.shm import shm_path

log = logging.getLogger(__name__)


class ArenaInUse(RuntimeError):
    """Another live daemon owns an arena of this name."""


class ArenaNoSpace(RuntimeError):
    """/dev/shm cannot hold the arena."""


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
            self._mm = mmap.mmap(self._fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            self._unlink_and_close()
            raise
        self._bytes = np.frombuffer(self._mm, dtype=np.uint8)
        self._pretouch()

    def _create_exclusive(self, path: str) -> int:
        """Create, size and lock the arena under a private name, then rename it into place.

        Nobody ever sees an arena that is unlocked or not yet sized, so a daemon starting at
        the same moment cannot mistake ours for a stale one. An existing arena whose lock is
        free was left by a crashed daemon: its pages have no index (host residency is not
        persisted) and may be half written, so it is replaced, not adopted.
        """
        tmp = f"{path}.creating-{os.getpid()}-{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o660)
        stale = -1
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            try:
                # Reserve the memory now: a full /dev/shm fails here with ENOSPC instead of
                # a SIGBUS on first touch.
                os.posix_fallocate(fd, 0, self.size)
            except OSError as exc:
                raise ArenaNoSpace(
                    f"cannot reserve {self.size >> 20} MiB of shared memory for host arena {self.name} "
                    f"({exc.strerror}); enlarge /dev/shm or lower host_size"
                ) from None
            try:
                stale = os.open(path, os.O_RDWR)
            except FileNotFoundError:
                pass
            else:
                try:
                    fcntl.flock(stale, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise ArenaInUse(
                        f"host arena {self.name} is owned by a running daemon; stop it or give this one another arena prefix"
                    ) from None
                log.warning("replacing stale host arena %s left by a daemon that exited uncleanly", self.name)
                self.stale_removed = True
            os.rename(tmp, path)  # atomic; we still hold the stale one's lock, so no one else replaces it too
        except BaseException:
            os.unlink(tmp)
            os.close(fd)
            raise
        finally:
            if stale >= 0:
                os.close(stale)
        return fd

    def _pretouch(self) -> None:
        """Fault every OS page in now, so the first borrow does not pay for it."""
        self._bytes[:: mmap.PAGESIZE] = 0

    @property
    def address(self) -> int:
        """Where the arena is mapped in this process (for cudaHostRegister and DMA)."""
        return self._bytes.ctypes.data

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
