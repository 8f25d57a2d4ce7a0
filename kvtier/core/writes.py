"""The write path: borrow and commit, and `run`, the loop every request runs in.

A borrow makes host room (kvtier.core.capacity) and lends free host slots; a commit files
the pages written there as blocks, and with write-through prepares their disk write
(kvtier.core.disk_writes), run after the lock is released like its hashing and cluster copy.

`run` runs a request in rounds (kvtier.core.rounds): under the lock, then the hand-over.
A request that must write host pages out before they leave host gets WriteOut; `run`
writes them (or waits for the writes of others) with the lock released and runs the
request again from the start.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from kvtier_client.errors import InvalidArgument
from kvtier_client.ids import LeaseId, SessionId, Slot
from kvtier_client.layout import PageLayout
from kvtier_client.protocol import checked, split_token_ids
from kvtier_client.tiers import Tier

from kvtier.core.capacity import Capacity
from kvtier.core.cluster import ClusterCopies, ClusterWrite
from kvtier.core.disk_writes import DiskWrites, WriteOut
from kvtier.core.index import Block, BlockIndex, Copy, check_keys, check_namespace
from kvtier.core.leases import LeaseKind, LeaseTable
from kvtier.core.ports import Mechanism, PageRecord
from kvtier.core.results import CommitOutcome, WriteGrant
from kvtier.core.rounds import Rounds
from kvtier.policy import Ref

T = TypeVar("T")


class Writes:
    def __init__(self, index: BlockIndex, leases: LeaseTable, capacity: Capacity, rounds: Rounds,
                 disk_writes: DiskWrites, ports: Mechanism, layout: PageLayout, *, write_through: bool,
                 cluster: ClusterCopies | None) -> None:
        self.index = index
        self.leases = leases
        self.capacity = capacity
        self.rounds = rounds
        self.disk_writes = disk_writes
        self.ports = ports
        self.layout = layout
        self.write_through = write_through and Tier.DISK in index.tiers
        self.cluster = cluster

    # -- the loop every request runs in -----------------------------------------
    def run(self, call: Callable[[], T]) -> T:
        """Run `call` in a round under the lock. When it raises WriteOut, write its pages (or
        wait for the writes of others) with the lock released, then run it again from the
        start, with what it tried so far."""
        tried: set[Ref] = set()
        while True:
            batch = None
            with self.rounds.held(tried):
                try:
                    return call()
                except WriteOut as pending:
                    batch, saving, saved = pending.batch, self.disk_writes.saving, pending.saved
                    if saved:  # someone else is writing them: wait for that to land
                        self.rounds.changed.wait_for(lambda: not any(b.ref in saving for b in saved))
            if batch:
                self.disk_writes.write(batch)

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
        self.disk_writes.want_write_back()  # the clean reserve may be short now
        return WriteGrant(lease.lease_id, Tier.HOST, tuple(slots)), given

    def commit(self, session: SessionId, lease_id: LeaseId, keys: list[bytes], parent: bytes | None,
               token_ids: Sequence[int] | None, checksums: list[int] | None = None) -> CommitOutcome:
        """Publish a write lease's pages (kvtier.core.store.BlockStore.commit says how);
        their hashing, cluster and write-through copies run after the lock is released."""
        tokens = None if token_ids is None else checked(split_token_ids, token_ids, len(keys), self.layout.block_tokens)
        if checksums is not None and len(checksums) != len(keys):
            raise InvalidArgument(f"commit got {len(checksums)} checksums for {len(keys)} keys; pass one per key, or none")
        with self.rounds.held():  # hashed as it ends, before the engine hears back
            outcome, fresh = self._commit(session, lease_id, keys, parent, tokens, checksums)
            batch = self.disk_writes.prepare(fresh) if fresh and self.write_through else None
            to_cluster = fresh and self.disk_writes.cluster_write is ClusterWrite.COMMIT
            if to_cluster:
                self.cluster.hold(fresh)
        if to_cluster:
            self.cluster.write(fresh)
        if batch:
            self.disk_writes.write(batch)
        return outcome

    def _commit(self, session: SessionId, lease_id: LeaseId, keys: list[bytes], parent: bytes | None,
                tokens: list[tuple[int, ...]] | None,
                checksums: list[int] | None) -> tuple[CommitOutcome, list[Block]]:
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
        self.rounds.staged += self.ports.host.stage(entries)
        self.disk_writes.want_write_back()  # new dirty pages: the clean reserve may need them later
        return CommitOutcome(lease_id, len(fresh), tuple(duplicates)), fresh
