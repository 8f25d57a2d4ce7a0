"""The write path: borrow and commit, and every disk write, with the I/O outside the lock.

A disk write goes in three steps. Under the lock, `Capacity.prepare` marks each host copy
`saved` (protected: readable and acquirable, never a victim, never dropped), makes disk
room and takes a disk slot per page (`writing` on disk, counted for its namespace). With
the lock released, the disk port stores the batch (`write`). Under the lock again,
`Capacity.file` files the disk copies, or on an OSError frees the slots and counts
`io_errors` (the pages stay host-only). Until then the disk index does not name the new
pages.

Who writes:
    eviction      a request that must evict dirty host pages (no disk copy) gets WriteOut
                  from capacity, with their batch prepared; `run`, the loop every request runs in, writes them and
                  runs the request again, which then finds those pages clean and drops
                  their host copies. Each round writes pages the request did not try
                  before (`Capacity.tried`), so it ends.
    write-through a commit prepares its new pages and writes them after releasing the lock
    cleaning      the write-back thread keeps `clean_reserve(host pages)` pages that need
                  no write (free slots plus clean pages at the eviction end of the host
                  policy), so a borrow usually evicts without writing
    stop          `persist` copies host-only (and device-only) pages to disk, in batches

After the lock is released, a request also hands the mechanism what it queued meanwhile:
disk index deletions (`Capacity.forgets`) and pages to hash for the slot table (staged).
"""
from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from kvtier_client.errors import InvalidArgument
from kvtier_client.ids import LeaseId, SessionId, Slot
from kvtier_client.layout import PageLayout
from kvtier_client.protocol import checked, split_token_ids
from kvtier_client.tiers import Tier

from kvtier.core.capacity import Capacity, WriteBatch, WriteOut
from kvtier.core.cluster import ClusterCopies
from kvtier.core.index import Block, BlockIndex, Copy, check_keys, check_namespace
from kvtier.core.leases import LeaseKind, LeaseTable
from kvtier.core.loads import Loads
from kvtier.core.ports import Mechanism, PageRecord
from kvtier.core.results import CommitOutcome, WriteGrant
from kvtier.policy import Ref

T = TypeVar("T")

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


class ClusterWrite(str, enum.Enum):
    """When pages are copied to the cluster tier: each page at its commit (every page, as
    soon as another node could want it), when it is demoted from host to disk (only pages
    that lived long enough to leave host, so what the node is about to forget), or never
    (the node only reads the cluster)."""

    COMMIT = "commit"
    DEMOTE = "demote"
    OFF = "off"

    def __str__(self) -> str:
        return self.value


class Writes:
    def __init__(self, index: BlockIndex, leases: LeaseTable, capacity: Capacity, loads: Loads, ports: Mechanism,
                 layout: PageLayout, lock: threading.RLock, *, write_through: bool,
                 cluster: ClusterCopies | None, cluster_write: ClusterWrite) -> None:
        self.index = index
        self.leases = leases
        self.capacity = capacity
        self.loads = loads
        self.ports = ports
        self.layout = layout
        self.write_through = write_through and Tier.DISK in index.tiers
        self.cluster = cluster
        self.cluster_write = cluster_write if cluster is not None else ClusterWrite.OFF
        self._lock = lock
        #: Set when write-back may have work (a commit, a borrow); its thread waits on `_wanted`.
        self.wanted = False
        self._wanted = threading.Condition(lock)

    # -- the loop every request runs in -----------------------------------------
    def run(self, call: Callable[[], T]) -> T:
        """Run `call` under the lock. When it raises WriteOut, write its pages (or wait for
        the writes of others) with the lock released, then run it again from the start.
        What it queued for the mechanism (index deletions, pages to hash) is handed over
        after the lock is released, each round."""
        tried: set[Ref] = set()
        while True:
            batch, forgets, staged = None, [], []
            try:
                with self._lock:
                    self.capacity.tried = tried  # this request's, whichever ran in between
                    try:
                        return call()
                    except WriteOut as pending:
                        batch, saving, saved = pending.batch, self.capacity.saving, pending.saved
                        if saved:  # someone else is writing them: wait for that to land
                            self.loads.loaded.wait_for(lambda: not any(b.ref in saving for b in saved))
                    finally:
                        forgets, staged = self.capacity.take_forgets(), self.capacity.take_staged()
            finally:
                self.ports.host.publish(staged)
                self.loads.forget(forgets)
            if batch:
                self.write(batch)

    # -- borrow and commit --------------------------------------------------------
    def borrow(self, session: SessionId, namespace: str, n: int) -> tuple[WriteGrant, list[Slot]]:
        """A write lease on n free host pages, evicting or demoting cached pages if needed
        (in `run`); also the slots that changed holder, to populate after the lock."""
        check_namespace(namespace)
        host = self.index.tiers[Tier.HOST]
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            raise InvalidArgument(f"borrow needs a positive page count, got {n!r}")
        if n > host.slots.capacity:
            raise InvalidArgument(
                f"borrow of {n} pages exceeds the host tier's {host.slots.capacity} pages; borrow in smaller batches"
            )
        self.capacity.make_room(Tier.HOST, n, namespace)
        slots, given = self.capacity.take_host_slots(namespace, n)
        self.index.start_writing(namespace, slots)
        lease = self.leases.open(session, namespace, LeaseKind.WRITE, Tier.HOST, slots)
        self.want_write_back()  # the clean reserve may be short now
        return WriteGrant(lease.lease_id, Tier.HOST, tuple(slots)), given

    def commit(self, session: SessionId, lease_id: LeaseId, keys: list[bytes], parent: bytes | None,
               token_ids: Sequence[int] | None, checksums: list[int] | None = None) -> CommitOutcome:
        """Publish a write lease's pages (kvtier.core.store.BlockStore.commit says how);
        their hashing, cluster and write-through copies run after the lock is released."""
        tokens = None if token_ids is None else checked(split_token_ids, token_ids, len(keys), self.layout.block_tokens)
        if checksums is not None and len(checksums) != len(keys):
            raise InvalidArgument(f"commit got {len(checksums)} checksums for {len(keys)} keys; pass one per key, or none")
        with self._lock:
            outcome, fresh, staged = self._commit(session, lease_id, keys, parent, tokens, checksums)
            batch = self.capacity.prepare(fresh) if fresh and self.write_through else None
            forgets = self.capacity.take_forgets()
            to_cluster = fresh and self.cluster_write is ClusterWrite.COMMIT
            if to_cluster:
                self.cluster.hold(fresh)
        self.ports.host.publish(staged)  # hashed here, before the engine hears back
        self.loads.forget(forgets)
        if to_cluster:
            self.cluster.write(fresh)
        if batch:
            self.write(batch)
        return outcome

    def _commit(self, session: SessionId, lease_id: LeaseId, keys: list[bytes], parent: bytes | None,
                tokens: list[tuple[int, ...]] | None,
                checksums: list[int] | None) -> tuple[CommitOutcome, list[Block], list[PageRecord]]:
        lease = self.leases.get(session, lease_id, LeaseKind.WRITE)
        check_keys(keys)
        if parent is not None:
            check_keys([parent])
            if parent in keys:
                # A block cannot follow itself: the cycle has no hash-chain meaning, and the
                # prefix policy would never see the block as a leaf (never evictable).
                raise InvalidArgument(
                    f"parent key {parent.hex()} is also one of the keys committed after it; "
                    "pass the key of the block before keys[0]"
                )
        if len(keys) > len(lease.slots):
            raise InvalidArgument(
                f"commit of {len(keys)} keys to lease {lease_id} which holds {len(lease.slots)} pages; "
                "borrow enough pages first"
            )
        index = self.index
        host = index.tiers[Tier.HOST]
        ns = lease.namespace
        prev: Ref | None = (ns, parent) if parent is not None else None
        duplicates: list[int] = []
        fresh: list[Block] = []
        entries: list[PageRecord] = []
        page_bytes = self.layout.page_bytes
        index.stop_writing(ns, lease.slots)
        for i, (slot, key) in enumerate(zip(lease.slots, keys)):
            ref = (ns, key)
            existing = index.blocks.get(ref)
            if existing is not None:
                duplicates.append(i)
                host.slots.free(slot)
                if Tier.HOST in existing.copies:
                    host.policy.touch(ref)
            else:
                fresh.append(index.add_block(ref, prev, Tier.HOST, Copy(slot), tokens[i] if tokens else None))
                # The slot table entry (Block.entry, with the client's checksum when it sent one).
                entries.append(PageRecord(ns, key, slot, prev[1] if prev else None,
                                          *((page_bytes, checksums[i]) if checksums else (0, 0))))
            prev = ref
        for slot in lease.slots[len(keys) :]:
            host.slots.free(slot)
        self.leases.close(lease)
        staged = self.ports.host.stage(entries)
        self.want_write_back()  # new dirty pages: the clean reserve may need them later
        return CommitOutcome(lease_id, len(fresh), tuple(duplicates)), fresh, staged

    # -- disk writes ----------------------------------------------------------------
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
                self.capacity.file(batch, stored)
                self.loads.loaded.notify_all()
        return stored is not None

    def _prepare_and_write(self, blocks: list[Block], keep: Callable[[Ref], bool] | None = None) -> None:
        with self._lock:
            blocks = [b for b in blocks if self.index.is_current(b) and Tier.HOST in b.copies]
            batch = self.capacity.prepare(blocks, keep)
            forgets = self.capacity.take_forgets()
        self.loads.forget(forgets)  # the slots it evicted leave the index before they are written again
        if batch:
            self.write(batch)

    # -- write-back: the pool's thread drives it --------------------------------------
    def write_back(self, reserve: int, limit: int = WRITE_BACK_BATCH) -> int:
        """Write one batch: the dirty pages among the next `reserve` minus free host pages
        the host policy would evict that the admission policy admits (the others leave
        host unwritten). Returns how many pages it wrote (0: nothing to do, or the write
        failed: the pages stay dirty, and write-back waits for new work)."""
        with self._lock:
            batch = self._next_batch(reserve, limit)
            forgets = self.capacity.take_forgets()
        self.loads.forget(forgets)
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
        batch = self.capacity.prepare(dirty, keep=lambda ref: protected(ref) or Tier.HOST in blocks[ref].copies)
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

    def wait_saved(self, timeout: float | None = None) -> bool:
        with self._lock:
            return self.loads.loaded.wait_for(lambda: not self.capacity.saving and not self.capacity.forgetting, timeout)

    # -- the stop -----------------------------------------------------------------------
    def persist(self, deadline: float | None = None) -> int:
        """Copy host-only (and device-only, through host) pages to disk (clean shutdown),
        evicting colder disk-only pages if needed; returns how many.

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
            self.run(lambda: self.capacity.copy_down_each(device_only[: tiers[Tier.HOST].slots.capacity]))
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
