"""Host tier: fixed slots of pinnable RAM, one memory file per namespace.

Every namespace of a layout has its own memfd (anonymous shared memory, no path) spanning
the whole slot range; slot i starts at ``i * layout.slot_bytes`` (a multiple of 4096, so
direct I/O can read a disk page straight into it). The slots are shared: the core hands
each slot to one namespace at a time (`give`), and only that namespace's file has memory
behind it. When a slot passes to another namespace, its range is cut out of the previous
holder's file (MADV_REMOVE frees it), so the new holder's file reads zeros there and the
old one's bytes are gone from memory. A client is given its own namespace's file over the
Unix socket (kvtier.server.handoff): it can map that and nothing else, and whatever it
writes outside its leases lands in its own namespace's file only.

The files are sealed against shrinking and growing (a client cannot truncate them under
the daemon) and are handed to the arena keeper (kvtier.mechanism.keeper) as they are made,
with the slot table, so a crashed daemon's successor finds them again.

Warm restart: the slot table (kvtier.mechanism.slottable) names the cached page in each
slot with its namespace and checksum. A daemon that gets a crashed one's files back from
the keeper *adopts* them: every slot whose table entry is complete and whose bytes (in its
namespace's file) match the entry's checksum is cached again (`adopted`); every other slot
is cut out of every file (docs/tiers.md, "Warm restart").
"""
from __future__ import annotations

import fcntl
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import xxhash
from kvtier_client.ids import Slot
from kvtier_client.layout import PageLayout
from kvtier_client.shm import populate

from kvtier.core.ports import PageRecord
from kvtier.mechanism.formats import FormatRefused
from kvtier.mechanism.keeper import KeeperClient, KeptFile
from kvtier.mechanism.slottable import SlotTable

log = logging.getLogger(__name__)

_SEALS = 0x0001 | 0x0002 | 0x0004  # F_SEAL_SEAL | F_SEAL_SHRINK | F_SEAL_GROW
_F_ADD_SEALS = 1033
_HUGE_PAGE = 2 << 20
#: Pages hashed at once by `HostArena.publish` outside the store lock (xxh3 releases the GIL).
_HASH_THREADS = max(1, min(4, os.cpu_count() or 1))
_PARALLEL_HASH_BYTES = 4 << 20  # smaller batches are hashed in the caller's thread


@dataclass(eq=False)
class NamespaceMemory:
    """One namespace's memory file, mapped in the daemon."""

    namespace: str
    fd: int
    mm: mmap.mmap
    bytes: np.ndarray
    #: Page-locked for DMA by the device tier: its pages cannot be freed while the GPU
    #: holds their physical addresses, so a cut zeroes them instead.
    pinned: bool = False

    @property
    def address(self) -> int:
        return self.bytes.ctypes.data

    def cut(self, start: int, length: int) -> None:
        """Free the memory behind [start, start + length): the file reads zeros there.

        A pinned file is zeroed in place instead: freeing pinned pages would leave the GPU
        copying to and from pages the file no longer has (the next holder's bytes would
        never reach the device, and the old bytes would)."""
        if self.pinned:
            self.bytes[start : start + length] = 0
        else:
            self.mm.madvise(mmap.MADV_REMOVE, start, length)

    def populate(self, start: int, length: int) -> None:
        """Allocate and map [start, start + length) now, in one call, so that the first
        write does not take a page fault per 4 KiB (what pre-touching the arena did)."""
        populate(self.mm, start, length)

    def close(self) -> None:
        del self.bytes
        try:
            self.mm.close()
        except BufferError:
            log.debug("host memory of namespace %s still has exported views at close", self.namespace)
        os.close(self.fd)


def _memfd(name: str, size: int) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, _F_ADD_SEALS, _SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


class HostArena:
    """The daemon's side of one layout's host tier: the namespaces' memory files, which
    namespace holds each slot, and the slot table."""

    def __init__(
        self, name: str, layout: PageLayout, pages: int, *, keeper: KeeperClient | None = None,
        kept: Iterable[KeptFile] = (),
    ) -> None:
        """`keeper` holds every file made here for a successor; `kept` are the files a
        crashed predecessor left with it for this layout (adopted when they fit)."""
        if pages <= 0:
            raise ValueError(f"host arena needs at least one page, got {pages}")
        self.name = name
        self.layout = layout
        self.pages = pages
        self.slot_bytes = layout.slot_bytes
        self.page_bytes = layout.page_bytes
        self.size = pages * self.slot_bytes
        #: Pages found again in a crashed daemon's arena (empty for a new arena).
        self.adopted: list[PageRecord] = []
        self.adopt_seconds = 0.0
        self._keeper = keeper
        self._lock = threading.Lock()  # the memory table: the handoff thread asks for files too
        self._table_lock = threading.Lock()  # entries written outside the store lock (`publish`)
        #: Pages staged for the slot table whose checksum is not known yet, by slot (`stage`).
        self._staged: dict[int, PageRecord] = {}
        self._hashers = ThreadPoolExecutor(_HASH_THREADS, thread_name_prefix=f"{name}-hash")
        self._memory: dict[str, NamespaceMemory] = {}
        self._owner: list[str | None] = [None] * pages
        self._on_map: list[Callable[[NamespaceMemory], None]] = []
        self._seq = 0
        kept = list(kept)
        table_fd, adopting = self._table_file(kept)
        try:
            self._table = SlotTable(table_fd, layout, pages, keep=adopting)
            if self._table.matched:
                self._adopt(kept)
            else:
                self._drop_kept(kept)
        except FormatRefused:  # a newer kvtier's host tier: left with the keeper, for that kvtier
            for fd in (table_fd, *(file.fd for file in kept)):
                os.close(fd)
            raise
        except BaseException:
            os.close(table_fd)
            self._drop_kept(kept)
            raise
        self._table_fd = table_fd

    # -- files ------------------------------------------------------------------------
    def _keeper_name(self, part: str) -> str:
        return f"{self.layout.layout_id}/{part}"

    def _table_file(self, kept: list[KeptFile]) -> tuple[int, bool]:
        """The kept slot table (True), else a new one, kept from now on (False). Taken out
        of `kept`."""
        for file in kept:
            if file.meta.get("kind") == "slots":
                kept.remove(file)
                return file.fd, True
        fd = os.memfd_create(f"{self.name}-slots", os.MFD_CLOEXEC)
        if self._keeper is not None:
            self._keeper.keep(self._keeper_name("slots"), fd, layout_meta(self.layout))
        return fd, False

    def memory(self, namespace: str) -> NamespaceMemory:
        """The namespace's memory file, made (and given to the keeper) on first use."""
        with self._lock:
            memory = self._memory.get(namespace)
            if memory is None:
                memory = self._map(namespace, _memfd(f"{self.name}-ns", self.size))
                if self._keeper is not None:
                    self._keeper.keep(self._keeper_name(f"ns/{namespace}"), memory.fd,
                                      {"kind": "namespace", "namespace": namespace})
            return memory

    def _map(self, namespace: str, fd: int) -> NamespaceMemory:
        mm = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        if self.slot_bytes % _HUGE_PAGE == 0:
            # Each slot is whole 2 MiB pages, so no huge page is shared by two namespaces'
            # slots. Where the kernel gives shared memory huge pages on request
            # (/sys/kernel/mm/transparent_hugepage/shmem_enabled: advise), a slot is then
            # populated and mapped in one fault instead of 512; elsewhere this does nothing.
            mm.madvise(mmap.MADV_HUGEPAGE)
        memory = self._memory[namespace] = NamespaceMemory(namespace, fd, mm, np.frombuffer(mm, dtype=np.uint8))
        for listener in self._on_map:
            listener(memory)
        return memory

    def file_for(self, namespace: str) -> int:
        """The descriptor to hand a client of `namespace` (the caller must not close it)."""
        return self.memory(namespace).fd

    def on_map(self, listener: Callable[[NamespaceMemory], None]) -> list[NamespaceMemory]:
        """Call `listener` for every namespace file mapped from now on; returns those mapped
        already (the device tier pins each for DMA)."""
        with self._lock:
            self._on_map.append(listener)
            return list(self._memory.values())

    # -- slots ------------------------------------------------------------------------
    def give(self, slot: int, namespace: str) -> None:
        """Slot `slot` now holds `namespace`'s bytes: cut it out of its previous holder's
        file, so nothing of that namespace can show through the new holder's. Called under
        the store lock, so it does not populate: `populate` does, after the lock is released."""
        previous = self._owner[slot]
        if previous == namespace:
            return
        if previous is not None:
            self._memory[previous].cut(slot * self.slot_bytes, self.slot_bytes)
        self.memory(namespace)  # made (and kept) now: the slot's holder always has a file
        self._owner[slot] = namespace

    def populate(self, slots: Sequence[int], namespace: str) -> None:
        """Fault in the memory behind slots given to `namespace`, outside the store lock,
        before its writer touches them. A slot given to another namespace meanwhile is cut
        again afterwards, so no file keeps memory for a slot it does not hold."""
        memory = self.memory(namespace)
        for slot in slots:
            if self._owner[slot] != namespace:
                continue
            memory.populate(slot * self.slot_bytes, self.slot_bytes)
            if self._owner[slot] != namespace:
                memory.cut(slot * self.slot_bytes, self.slot_bytes)

    def holder(self, slot: int) -> NamespaceMemory:
        namespace = self._owner[slot]
        if namespace is None:
            raise RuntimeError(f"host slot {slot} was never given to a namespace: the core must give it first")
        return self._memory[namespace]

    def view(self, slot: int) -> memoryview:
        """The whole slot (slot_bytes, page plus alignment padding), writable."""
        start = slot * self.slot_bytes
        return memoryview(self.holder(slot).mm)[start : start + self.slot_bytes]

    def page(self, slot: int) -> np.ndarray:
        """The page's bytes (page_bytes) as a writable uint8 array, zero copy."""
        start = slot * self.slot_bytes
        return self.holder(slot).bytes[start : start + self.page_bytes]

    def slot_address(self, slot: int) -> int:
        """Where the slot is mapped in this process (for DMA)."""
        return self.holder(slot).address + slot * self.slot_bytes

    # -- warm restart -----------------------------------------------------------------
    def _adopt(self, kept: list[KeptFile]) -> None:
        """Map the kept namespace files, keep every slot whose table entry and bytes agree,
        clear the other entries and cut every other slot out of every file."""
        start = time.monotonic()
        for file in kept:
            namespace = file.meta.get("namespace")
            if file.meta.get("kind") == "namespace" and os.fstat(file.fd).st_size == self.size and namespace:
                self._map(namespace, file.fd)
            else:
                self._forget(file)
        keep, bad = [], []
        for record in self._table.entries():
            memory = self._memory.get(record.namespace)
            at = record.slot * self.layout.slot_bytes
            if (memory is not None and record.length == self.layout.page_bytes
                    and xxhash.xxh3_64_intdigest(memory.mm[at : at + record.length]) == record.checksum):
                keep.append(record)
                self._owner[record.slot] = record.namespace
            else:
                bad.append(record.slot)
        self._table.clear(bad)
        for namespace, memory in list(self._memory.items()):
            self._cut_all_but(memory)
            if namespace not in self._owner:
                self._close_memory(namespace)
        self.adopted = keep
        self._seq = max((r.seq for r in keep), default=0)
        self.adopt_seconds = time.monotonic() - start
        log.warning(
            "adopted host arena %s left by a daemon that exited uncleanly: %d pages found again, %d dropped, %.3f s",
            self.name, len(keep), len(bad), self.adopt_seconds,
        )

    def _cut_all_but(self, memory: NamespaceMemory) -> None:
        """Free every run of slots this namespace does not hold."""
        slot_bytes, run = self.layout.slot_bytes, None
        for slot, owner in enumerate([*self._owner, None]):
            if owner != memory.namespace and slot < self.pages:
                run = slot if run is None else run
            elif run is not None:
                memory.cut(run * slot_bytes, (slot - run) * slot_bytes)
                run = None

    def _forget(self, file: KeptFile) -> None:
        if self._keeper is not None:
            self._keeper.drop(file.name)
        os.close(file.fd)

    def _drop_kept(self, kept: list[KeptFile]) -> None:
        """Kept files that do not fit this arena (another size, a table of another shape)."""
        for file in kept:
            self._forget(file)

    # -- the slot table ---------------------------------------------------------------
    def stage(self, records: Sequence[PageRecord]) -> list[PageRecord]:
        """Enter cached pages in the slot table, under the store lock: those whose checksum
        is known (`length` set: a load verified it) now; the others are staged and returned,
        for `publish` to hash outside the lock. From its entry on, a crash keeps a page.
        The bytes must be final (committed, loaded, demoted)."""
        staged = []
        with self._table_lock:
            for record in records:
                if record.length:
                    self._enter(record, record.checksum)
                else:
                    self._staged[record.slot] = record
                    staged.append(record)
        return staged

    def publish(self, records: Sequence[PageRecord]) -> None:
        """Hash staged pages, in up to `_HASH_THREADS` threads for large batches (xxh3
        releases the GIL), and enter each whose slot still holds it: one unpublished
        meanwhile (evicted, its slot reused) is skipped."""
        if not records:
            return
        share = -(-len(records) // _HASH_THREADS)
        if len(records) * self.page_bytes < _PARALLEL_HASH_BYTES or share == len(records):
            sums = self._hash(records)
        else:
            parts = [self._hashers.submit(self._hash, records[i : i + share]) for i in range(share, len(records), share)]
            sums = self._hash(records[:share])
            for part in parts:
                sums += part.result()
        with self._table_lock:
            for record, checksum in zip(records, sums):
                if self._staged.get(record.slot) is record:
                    del self._staged[record.slot]
                    self._enter(record, checksum)

    def _hash(self, records: Sequence[PageRecord]) -> list[int]:
        return [xxhash.xxh3_64_intdigest(self.page(r.slot)) for r in records]

    def publish_staged(self) -> None:
        """Publish whatever is still staged (at a stop that leaves the arena to a successor:
        requests publish what they stage as they end)."""
        with self._table_lock:
            records = list(self._staged.values())
        self.publish(records)

    def _enter(self, record: PageRecord, checksum: int) -> None:
        self._seq += 1
        self._table.write(record, self.page_bytes, checksum, self._seq)

    def checksum(self, slot: Slot) -> int | None:
        """The xxh3-64 a published page's bytes had when they were published (None: not
        published), so whoever copies the page on need not hash it again."""
        return self._table.checksum(slot)

    def unpublish(self, slots: Sequence[Slot]) -> None:
        """Take slots out of the slot table (and out of `publish`'s reach) before they can be reused."""
        with self._table_lock:
            for slot in slots:
                self._staged.pop(slot, None)
            self._table.clear(slots)

    # -- the end ----------------------------------------------------------------------
    def _close_memory(self, namespace: str) -> None:
        memory = self._memory.pop(namespace)
        if self._keeper is not None:
            self._keeper.drop(self._keeper_name(f"ns/{namespace}"))
        memory.close()

    def close(self, *, keep: bool = False) -> None:
        """Unmap and free the arena and its slot table (with `keep`, leave both with the
        keeper for the next daemon to adopt). Clients that still map a file keep their
        mapping until they unmap."""
        if self._table_fd < 0:
            return
        if keep:
            self.publish_staged()  # the successor adopts what this daemon committed
        self._hashers.shutdown()
        self._table.close()
        if not keep and self._keeper is not None:
            self._keeper.drop(self._keeper_name("slots"))
        os.close(self._table_fd)
        self._table_fd = -1
        with self._lock:
            for namespace in list(self._memory):
                if keep:
                    self._memory.pop(namespace).close()
                else:
                    self._close_memory(namespace)


def layout_meta(layout: PageLayout) -> dict:
    """What a successor needs to rebuild the pool of a kept slot table."""
    return {"kind": "slots", "layout": {
        "layers": layout.layers, "kv_heads": layout.kv_heads, "head_dim": layout.head_dim,
        "block_tokens": layout.block_tokens, "dtype": layout.dtype, "order": layout.order,
    }}
