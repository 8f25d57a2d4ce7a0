"""Every disk write: host pages to disk, with the I/O outside the lock.

A disk write goes in three steps. Under the lock, `prepare` marks each host copy `saved`
(protected: readable and acquirable, never a victim, never dropped), makes disk room and
takes a disk slot per page (`writing` on disk, counted for its namespace). With the lock
released, the disk port stores the batch (`write`). Under the lock again, `file` files the
disk copies, or on an OSError frees the slots and counts `io_errors` (the pages stay
host-only). Until then the disk index does not name the new pages.

Who writes:
    eviction      host victims without a disk copy must be written before they go:
                  `write_out_first` prepares them and raises WriteOut, the request's runner
                  (kvtier.core.writes.Writes.run) writes them and runs it again, which then
                  finds them clean. Each round writes pages the request did not try before
                  (kvtier.core.rounds), so it ends. Making room (kvtier.core.capacity) and a
                  client's demote to disk (kvtier.core.control) both ask here.
    write-through a commit prepares its new pages and writes them after releasing the lock
    cleaning      the write-back thread keeps `clean_reserve(host pages)` pages that need
                  no write (free slots plus clean pages at the eviction end of the host
                  policy), so a borrow usually evicts without writing
    stop          `persist` copies host-only (and device-only) pages to disk, in batches
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtier_client.tiers import Tier

from kvtier.core.capacity import Capacity
from kvtier.core.chunks import size_of, split
from kvtier.core.cluster import ClusterCopies, ClusterWrite
from kvtier.core.index import Block, BlockIndex, Copy
from kvtier.core.ports import Mechanism, PageRecord
from kvtier.core.rounds import Rounds
from kvtier.policy import Ref

#: Pages per write batch of the write-back thread.
WRITE_BACK_BATCH = 64
#: Pages per durable step of the stop-time copy to disk: a kill during the stop keeps every
#: batch written before it.
PERSIST_BATCH = 64
#: Below this many host pages write-back keeps no clean reserve: 64 pages would be over a
#: quarter of host, so it would write pages that are never evicted.
MIN_HOST_FOR_RESERVE = 256


def clean_reserve(host_pages: int) -> int:
    """How many host pages the write-back thread keeps evictable without a write: a
    borrow's worth of slack, max(64 pages, host/32), on hosts of at least 256 pages (so at
    most a quarter of host); none on smaller ones."""
    return max(64, host_pages // 32) if host_pages >= MIN_HOST_FOR_RESERVE else 0


@dataclass(eq=False)
class WriteBatch:
    """Host pages on their way to disk slots, prepared under the store's lock."""

    entries: list[tuple[Block, PageRecord]] = field(default_factory=list)

    @property
    def moves(self) -> list[tuple[int, PageRecord]]:
        return [(block.copies[Tier.HOST].slot, record) for block, record in self.entries]

    def __len__(self) -> int:
        return len(self.entries)


class WriteOut(Exception):
    """Not an error: the request must wait for host pages to reach disk before they can
    leave host. `batch`: pages prepared for this request to write (outside the lock);
    `saved`: pages others are writing now. The caller does that, then runs the request
    again from the start (kvtier.core.writes.Writes.run)."""

    def __init__(self, batch: WriteBatch | None, saved: list[Block] = ()) -> None:
        super().__init__("host pages must reach disk before they leave host")
        self.batch = batch
        self.saved = list(saved)


class DiskWrites:
    def __init__(self, index: BlockIndex, capacity: Capacity, rounds: Rounds, ports: Mechanism,
                 lock: threading.RLock, page_bytes: int, cluster: ClusterCopies | None,
                 cluster_write: ClusterWrite) -> None:
        self.index = index
        self.capacity = capacity
        self.rounds = rounds
        self.ports = ports
        self.page_bytes = page_bytes
        self.cluster = cluster
        self.cluster_write = cluster_write if cluster is not None else ClusterWrite.OFF
        self._lock = lock
        #: Disk writes in flight, by block: the record each will be filed with.
        self.saving: dict[Ref, PageRecord] = {}
        #: Set when write-back may have work (a commit, a borrow); its thread waits on `_wanted`.
        self.wanted = False
        self._wanted = threading.Condition(lock)

    # -- before host pages leave host -----------------------------------------------
    def write_out_first(self, blocks: list[Block], *, admitted_only: bool = True) -> None:
        """Raise WriteOut if host pages about to leave host must reach disk first: some are
        being saved, or some dirty ones (no disk copy) that this request has not tried to
        write yet fit on disk (their batch prepared now, while the request's own pages are
        protected). Dirty pages it already tried (the write failed, or the disk had no room)
        leave host unwritten, as when the disk is full. With `admitted_only` (an eviction)
        only pages the admission policy admits are written; a client's demote to disk asks
        for every page it names."""
        saved = [b for b in blocks if b.copies[Tier.HOST].saved]
        if saved:
            raise WriteOut(None, saved)
        if Tier.DISK not in self.index.tiers:
            return
        tried, admit = self.rounds.tried, self.capacity.admission.admit
        dirty = [b for b in blocks if Tier.DISK not in b.copies and b.ref not in tried
                 and (not admitted_only or admit(b.ref))]
        if not dirty:
            return
        tried.update(b.ref for b in dirty)
        # The disk copies of the clean pages leaving are what make them clean: keep them.
        going, protected = {b.ref for b in blocks}, self.index.protected(Tier.DISK)
        batch = self.prepare(dirty, keep=lambda ref: ref in going or protected(ref))
        if batch:
            raise WriteOut(batch)

    # -- a write's two halves under the lock ------------------------------------------
    def prepare(self, blocks: list[Block], keep: Callable[[Ref], bool] | None = None) -> WriteBatch:
        """Take disk slots and chunks for host pages, as many as the disk and their namespaces' disk
        quotas can take (blocks already on disk or being saved are skipped). Disk pages for
        which `keep` is true (default: protected ones) are never evicted for room. Each
        page taken is `saved` (protected) and its disk slot `writing` until `file`."""
        disk, capacity = self.index.tiers[Tier.DISK], self.capacity
        blocks = [b for b in blocks if Tier.DISK not in b.copies and not b.copies[Tier.HOST].saved]
        batch = WriteBatch()
        for namespace, group in capacity.quotas.by_namespace(blocks):
            def room() -> int:  # a raw page's chunks a page; what its encoding leaves comes back at `file`
                return min(disk.slots.free_count, disk.chunks.free_count // disk.space.reserve)

            victims, allowed = capacity.choose(Tier.DISK, len(group), room(), namespace, keep=keep)
            while victims:  # victims stored in fewer chunks than a reserve free less room than a page each
                capacity.evict(Tier.DISK, [self.index.blocks[ref] for ref in victims], namespace)
                victims = capacity.choose(Tier.DISK, allowed, room(), namespace, keep=keep)[0] if room() < allowed else []
            for block in group[: min(allowed, room())]:
                ns, key = block.ref
                parent = block.parent[1] if block.parent else None
                record = PageRecord(ns, key, disk.slots.alloc(), parent, tokens=block.tokens,
                                    extent=disk.chunks.take(disk.space.reserve))
                block.copies[Tier.HOST].saved = True
                self.index.start_writing(ns, [record.slot], Tier.DISK)
                self.saving[block.ref] = record
                batch.entries.append((block, record))
        return batch

    def file(self, batch: WriteBatch, stored: list[PageRecord] | None) -> None:
        """A prepared write ended: file the disk copies it `stored`, or (None: the store
        failed, e.g. EIO or ENOSPC) free its disk slots and count the pages in the disk's
        `io_errors`; the pages stay host-only, as if the disk were full."""
        disk = self.index.tiers[Tier.DISK]
        for i, (block, record) in enumerate(batch.entries):
            block.copies[Tier.HOST].saved = False  # never dropped while saved: still filed
            del self.saving[block.ref]
            self.index.stop_writing(block.ref[0], [record.slot], Tier.DISK)
            if stored is None:
                disk.slots.free(record.slot)
                disk.chunks.give(record.extent)
            else:
                disk.chunks.give(split(record.extent, size_of(stored[i].extent))[1])  # what the encoding left
                self.index.add_copy(block, Tier.DISK, Copy(record.slot, record=stored[i]))
        if stored is None:
            disk.counters.io_errors += len(batch)
        else:
            disk.counters.demotions += len(batch)
            disk.counters.bytes_in += len(batch) * self.page_bytes

    # -- the store, outside the lock ----------------------------------------------------
    def write(self, batch: WriteBatch) -> bool:
        """Store a prepared batch outside the lock, then `file` it under the lock. False if
        the store failed (OSError). With `cluster_write = demote` the pages not yet in the
        cluster are copied for it too, while the batch still protects them."""
        stored = None
        try:
            stored = self.ports.disk.store(batch.moves)
            if self.cluster_write is ClusterWrite.DEMOTE:
                self.cluster.copy_demoted([block for block, _ in batch.entries])
        except OSError:
            pass  # `file` counts it; the mechanism logs the fault
        finally:
            with self._lock:
                self.file(batch, stored)
                self.rounds.changed.notify_all()
        return stored is not None

    def _prepare_and_write(self, blocks: list[Block], keep: Callable[[Ref], bool] | None = None) -> None:
        with self.rounds.held():  # the slots it evicts leave the index before they are written again
            blocks = [b for b in blocks if self.index.is_current(b) and Tier.HOST in b.copies]
            batch = self.prepare(blocks, keep)
        if batch:
            self.write(batch)

    def wait_saved(self, timeout: float | None = None) -> bool:
        with self._lock:
            return self.rounds.changed.wait_for(lambda: not self.saving and not self.rounds.forgetting, timeout)

    # -- write-back: the pool's thread drives it ----------------------------------------
    def write_back(self, reserve: int, limit: int = WRITE_BACK_BATCH) -> int:
        """Write one batch: the dirty pages among the next `reserve` minus free host pages
        the host policy would evict that the admission policy admits (the others leave
        host unwritten). Returns how many pages it wrote (0: nothing to do, or the write
        failed: the pages stay dirty, and write-back waits for new work)."""
        with self.rounds.held():
            batch = self._next_batch(reserve, limit)
        if batch is None:
            return 0
        if self.write(batch):
            return len(batch)
        with self._lock:
            self.wanted = False  # a failing disk: try again when new work comes
        return 0

    def _next_batch(self, reserve: int, limit: int) -> WriteBatch | None:
        index = self.index
        host = index.tiers[Tier.HOST]
        short = reserve - host.slots.free_count
        dirty: list[Block] = []
        if short > 0:
            # Copies being saved count as clean already: look no further than the reserve.
            admit = self.capacity.admission.admit
            for ref in host.policy.victims(short, index.protected(Tier.HOST, saves=False)):
                block = index.blocks[ref]
                if Tier.DISK not in block.copies and not block.copies[Tier.HOST].saved and admit(ref):
                    dirty.append(block)
                    if len(dirty) == limit:
                        break
        # Giving up the disk copy of a page still in host would dirty that page again.
        blocks, protected = index.blocks, index.protected(Tier.DISK)
        batch = self.prepare(dirty, keep=lambda ref: protected(ref) or Tier.HOST in blocks[ref].copies)
        if not batch:
            self.wanted = False
            return None
        return batch

    def want_write_back(self) -> None:
        if not self.wanted:
            self.wanted = True
            self._wanted.notify_all()

    def wait_write_back(self, timeout: float | None = None) -> bool:
        with self._lock:
            return self._wanted.wait_for(lambda: self.wanted, timeout)

    def wake_write_back(self) -> None:
        with self._lock:
            self.wanted = True
            self._wanted.notify_all()

    # -- the stop -----------------------------------------------------------------------
    def persist(self, run: Callable[[Callable[[], None]], None], deadline: float | None = None) -> int:
        """Copy host-only (and device-only, through host: in `run`, the request runner) pages
        to disk (clean shutdown), evicting colder disk-only pages if needed; returns how many.

        This keeps what the disk can hold. Pages go in commit order (the index's insertion
        order), so a prefix is saved before its suffixes, and no disk copy of a page that is
        also in host is given up for another. They go in batches of PERSIST_BATCH, each
        durable before the next starts (the disk tier commits its index per batch), and no
        batch starts after `deadline` (time.monotonic()).
        """
        tiers, blocks = self.index.tiers, self.index.blocks
        if Tier.DISK not in tiers:
            return 0
        with self._lock:
            device_only = [b for b in blocks.values() if set(b.copies) == {Tier.DEVICE}]
        if device_only:  # through host, as far as host can take them; the rest are not saved
            run(lambda: self.capacity.copy_down_each(device_only[: tiers[Tier.HOST].slots.capacity]))
        with self._lock:
            host_only = [b for b in blocks.values() if Tier.DISK not in b.copies and Tier.HOST in b.copies]
            host_only = host_only[: tiers[Tier.DISK].slots.capacity]
            before = tiers[Tier.DISK].counters.demotions
        protected = self.index.protected(Tier.DISK)
        for start in range(0, len(host_only), PERSIST_BATCH):
            if deadline is not None and time.monotonic() >= deadline:
                break
            self._prepare_and_write(host_only[start : start + PERSIST_BATCH],
                                    keep=lambda ref: protected(ref) or Tier.HOST in blocks[ref].copies)
        with self._lock:
            return tiers[Tier.DISK].counters.demotions - before
