"""Host tier: a POSIX shared-memory arena of fixed slots that clients map by name.

Slot i starts at ``i * layout.slot_bytes`` (a multiple of 4096, so direct I/O can read a
disk page straight into it). The daemon holds an exclusive flock on the arena file for its
whole life; that is how a second daemon, or a restarted one, tells a live arena from a
stale one left by a crash.

Warm restart: beside the arena, a slot table (kvtier.mechanism.slottable) names the cached
page in each slot with its checksum. A daemon that finds a stale arena of its own layout
and size *adopts* it: every slot whose table entry is complete and whose bytes match the
entry's checksum is cached again (`adopted`); every other slot is free, and the arena is
marked `reused` so that the core zeroes a free slot before a writer of any namespace gets
it (docs/tiers.md, "Warm restart").
"""
from __future__ import annotations

import fcntl
import logging
import mmap
import os
import secrets
import time
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import xxhash
from kvtier_client.ids import Slot
from kvtier_client.layout import PageLayout
from kvtier_client.shm import shm_path

from kvtier.core.ports import PageRecord
from kvtier.mechanism.slottable import SlotTable, table_path

log = logging.getLogger(__name__)


class ArenaInUse(RuntimeError):
    """Another live daemon owns an arena of this name."""


class ArenaNoSpace(RuntimeError):
    """/dev/shm cannot hold the arena."""


class HostArena:
    """The daemon's side of a host arena: creates (or adopts), pre-touches, owns and removes
    it, and keeps its slot table."""

    def __init__(self, name: str, layout: PageLayout, pages: int) -> None:
        if pages <= 0:
            raise ValueError(f"host arena needs at least one page, got {pages}")
        self.name = name
        self.layout = layout
        self.pages = pages
        self.size = pages * layout.slot_bytes
        self.stale_removed = False
        #: Pages found again in a stale arena of a crashed daemon (empty for a new arena).
        self.adopted: list[PageRecord] = []
        #: True when the arena was adopted: its free slots may hold any namespace's bytes.
        self.reused = False
        self.adopt_seconds = 0.0
        self._seq = 0
        self._table: SlotTable | None = None
        self._fd = self._create_exclusive(shm_path(name))
        try:
            self._mm = mmap.mmap(self._fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            self._bytes = np.frombuffer(self._mm, dtype=np.uint8)
            if self.reused:
                self._adopt()
            else:
                self._table = SlotTable(table_path(shm_path(name)), layout, pages, keep=False)
                self._pretouch()
        except BaseException:
            self._unlink_and_close()
            raise

    def _create_exclusive(self, path: str) -> int:
        """Create, size and lock the arena under a private name, then rename it into place.

        Nobody ever sees an arena that is unlocked or not yet sized, so a daemon starting at
        the same moment cannot mistake ours for a stale one. An existing arena whose lock is
        free was left by a crashed daemon: it is adopted when it has our size and a slot
        table of our layout (`reused`), replaced otherwise.
        """
        stale = self._lock_stale(path)
        try:
            if stale >= 0 and self._adoptable(path, stale):
                self.reused = True  # keep the stale arena, and its lock: no second arena is reserved
                return stale
        except BaseException:
            os.close(stale)
            raise
        tmp = f"{path}.creating-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o660)
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
                if stale >= 0:
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

    def _lock_stale(self, path: str) -> int:
        """The existing arena at `path`, locked by us (-1 when there is none); ArenaInUse when
        a live daemon holds it."""
        try:
            stale = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            return -1
        try:
            fcntl.flock(stale, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(stale)
            raise ArenaInUse(
                f"host arena {self.name} is owned by a running daemon; stop it or give this one another arena prefix"
            ) from None
        return stale

    def _adoptable(self, path: str, fd: int) -> bool:
        """A stale arena is ours to adopt if it has our size and a slot table of our shape."""
        if os.fstat(fd).st_size != self.size:
            return False
        table = SlotTable(table_path(path), self.layout, self.pages, keep=True)
        if table.matched:
            self._table = table
            return True
        table.close(remove=True)
        return False

    def _adopt(self) -> None:
        """Keep every slot whose table entry and bytes agree; clear the other entries."""
        start = time.monotonic()
        keep, bad = [], []
        arena, slot_bytes = memoryview(self._mm), self.layout.slot_bytes
        for record in self._table.entries():
            at = record.slot * slot_bytes
            page = arena[at : at + record.length]
            if record.length == self.layout.page_bytes and xxhash.xxh3_64_intdigest(page) == record.checksum:
                keep.append(record)
            else:
                bad.append(record.slot)
        arena.release()
        self._table.clear(bad)
        self.adopted = keep
        self._seq = max((r.seq for r in keep), default=0)
        self.adopt_seconds = time.monotonic() - start
        log.warning(
            "adopted host arena %s left by a daemon that exited uncleanly: %d pages found again, %d dropped, %.3f s",
            self.name, len(keep), len(bad), self.adopt_seconds,
        )

    def publish(self, records: Sequence[PageRecord]) -> list[PageRecord]:
        """Enter cached pages in the slot table, each with the checksum of its bytes now:
        from here a crash keeps them. The bytes must be final (committed, loaded, demoted)."""
        published = []
        for record in records:
            self._seq += 1
            checksum = xxhash.xxh3_64_intdigest(self.page(record.slot))
            published.append(replace(record, length=self.layout.page_bytes, checksum=checksum, seq=self._seq))
            self._table.write(published[-1])
        return published

    def unpublish(self, slots: Sequence[Slot]) -> None:
        """Take slots out of the slot table before they can be reused."""
        self._table.clear(slots)

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

    def give(self, slot: int, namespace: str) -> None:
        """Slot `slot` now holds `namespace`'s bytes: nothing of its previous holder may show."""
        self.clear(slot)

    def clear(self, slot: int) -> None:
        """Zero a slot, so a page handed to a new namespace carries none of the old one's data."""
        self.page(slot).fill(0)

    def close(self, *, keep: bool = False) -> None:
        """Unmap and remove the arena and its slot table (with `keep`, leave both for the next
        daemon to adopt). Clients that still map it keep their mapping until they unmap."""
        if self._fd < 0:
            return
        if self._table is not None:
            self._table.close(remove=not keep)
            self._table = None
        del self._bytes
        try:
            self._mm.close()
        except BufferError:
            # A view is still exported (a test holding a page); the mapping goes with the process.
            log.debug("host arena %s still has exported views at close", self.name)
        if keep:
            os.close(self._fd)  # the lock goes with it: the arena is stale from now on
            self._fd = -1
            return
        self._unlink_and_close()

    def _unlink_and_close(self) -> None:
        if self._table is not None:
            self._table.close(remove=True)
            self._table = None
        try:
            os.unlink(shm_path(self.name))
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = -1
