"""Disk writes outside the store's lock: the batch a call prepares, and the write-back
that keeps host pages clean ahead of eviction.

A write goes in three steps. Under the lock, `Capacity.prepare` marks each host copy
`saved` (protected: readable and acquirable, never a victim, never dropped), makes disk
room and takes a disk slot per page (`writing` on disk, counted for its namespace). With
the lock released, the mover stores the batch. Under the lock again, `Capacity.file`
files the disk copies, or on an OSError frees the slots and counts `io_errors` (the pages
stay host-only). Until then the disk index does not name the new pages.

Who writes:
    eviction      a request that must evict dirty host pages (no disk copy) raises
                  `WriteOut` with their batch; the store writes it and runs the request
                  again, which then finds those pages clean and drops their host copies
    write-through a commit prepares its new pages and writes them after releasing the lock
    cleaning      the write-back thread keeps `clean_reserve(host pages)` pages that need
                  no write (free slots plus clean pages at the eviction end of the host
                  policy), so a borrow usually evicts without writing
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtier_client.tiers import Tier

from kvtier.core.index import Block, BlockIndex
from kvtier.core.ports import PageRecord

if TYPE_CHECKING:
    from kvtier.core.capacity import Capacity

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


#: Pages per write batch of the write-back thread.
WRITE_BACK_BATCH = 64


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
    """Not an error: the request must wait for pages to reach disk before it can evict
    them. `batch`: pages this request writes (outside the lock); `saved`: pages others are
    writing now. The store does that, then runs the request again from the start."""

    def __init__(self, batch: WriteBatch | None, saved: list[Block] = ()) -> None:
        super().__init__("host pages must reach disk before they are evicted")
        self.batch = batch
        self.saved = list(saved)


class WriteBack:
    """What the write-back thread writes next: the dirty pages among the next ones the host
    policy would evict that the admission policy admits (the others leave host unwritten)."""

    def __init__(self, index: BlockIndex, capacity: "Capacity") -> None:
        self.index = index
        self.capacity = capacity
        #: Set when something may need writing (a commit, a borrow); the thread waits on it.
        self.wanted = False

    def next_batch(self, reserve: int, limit: int = WRITE_BACK_BATCH) -> WriteBatch | None:
        """Prepare the next batch so that free host slots plus clean pages at the eviction
        end reach `reserve` (None: nothing to write now, and `wanted` is cleared)."""
        host = self.index.tiers[Tier.HOST]
        short = reserve - host.slots.free_count
        dirty: list[Block] = []
        if short > 0:
            # Copies being saved count as clean already: look no further than the reserve.
            admit = self.capacity.admission.admit
            for ref in host.policy.victims(short, self.index.protected(Tier.HOST, saves=False)):
                block = self.index.blocks[ref]
                copy = block.copies[Tier.HOST]
                if Tier.DISK not in block.copies and not copy.saved and admit(ref):
                    dirty.append(block)
                    if len(dirty) == limit:
                        break
        # Giving up the disk copy of a page still in host would dirty that page again.
        blocks, protected = self.index.blocks, self.index.protected(Tier.DISK)
        batch = self.capacity.prepare(dirty, keep=lambda ref: protected(ref) or Tier.HOST in blocks[ref].copies)
        if not batch:
            self.wanted = False
            return None
        return batch
