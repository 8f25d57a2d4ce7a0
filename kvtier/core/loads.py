"""The load life cycle: every page brought into host from a lower tier (disk, the cluster
tier, any later source) goes through the same four steps here, whatever its source, and
every port call is routed by the job's source (`Mechanism.source`).

    begin     a loading host copy with one LoadJob and one waiter, handed to its source's
              port (`PageSource.load`); room was made first, for the namespace's quota
    join      another request waits on a copy already loading (one transfer per page);
              an Acquire boosts the job ahead of prefetches on that job's own source
    finish    the source reports (on its thread): publish the page, or drop it (a disk page
              that fails is corrupt and leaves disk too; a cluster page is just a miss)
    withdraw  a queued job is cancelled (its session ended, shutdown): dropped like a
              failure, nothing counted corrupt; waiting acquires return what is ready

    start(ns, blocks, HOST)   cached blocks: join their host copies, copy device-only ones
                              down, begin a disk load for each disk-only one
    start_new(ns, keys, src)  blocks this node lacks, read from `src` (the cluster room,
                              kvtier.core.cluster, decides which keys)
    wait_ready(blocks)        the lock released, until the pages are loaded or time is up
    promote(ns, blocks)       host -> device in one copy-engine submission; returns at once
                              with the transfer the engine waits on; `finish_promote` when it lands

Every call but the two `finish_*` callbacks runs with the store's lock held; those take it.
The `loaded` condition (on that same lock) is notified whenever a load, a promotion or a
disk write ends. `start` and `start_new` may raise WriteOut (kvtier.core.disk_writes) like
CapacityError, with nothing of their own left behind: the store writes the pages and starts
again.
"""
from __future__ import annotations

import threading
import time
from dataclasses import replace

from kvtier_client.errors import CapacityError, NotFound, Unavailable
from kvtier_client.ids import SessionId
from kvtier_client.layout import PageLayout
from kvtier_client.tiers import Tier

from kvtier.core.capacity import Capacity
from kvtier.core.index import Block, BlockIndex, Copy
from kvtier.core.ports import LoadJob, LoadKind, Mechanism, PageRecord, Transfer
from kvtier.core.rounds import Rounds


class Loads:
    def __init__(self, index: BlockIndex, capacity: Capacity, rounds: Rounds, ports: Mechanism, layout: PageLayout,
                 lock: threading.RLock, prefetch_hold: float) -> None:
        self.index = index
        self.capacity = capacity
        self.ports = ports
        self.page_bytes = layout.page_bytes
        self.prefetch_hold = prefetch_hold
        self._lock = lock
        self.rounds = rounds
        #: Notified as loads end (and disk writes and deletions: one condition for every waiter).
        self.loaded = rounds.changed

    # -- into host ------------------------------------------------------------
    def start(self, session: SessionId, namespace: str, blocks: list[Block], tier: Tier, kind: LoadKind,
              priority: int = 0) -> None:
        """Register one waiter on each block's copy in `tier` (blocks of `namespace`), joining
        a load in flight where there is one and beginning a disk load for each disk-only block.

        Raises CapacityError when room for the loads cannot be made, with no waiter or load
        left behind; device-only pages may have been given a host copy by then (a copy
        added, none lost).
        """
        index = self.index
        # Protect everything involved while room is made: the copies here (as waiters,
        # which they stay), device-only pages copied down first, and the disk copies about
        # to be read.
        present = [b for b in blocks if tier in b.copies]
        index.wait_on(present, tier)
        down = [b for b in blocks if tier not in b.copies and Tier.DISK not in b.copies]
        try:
            self.capacity.copy_down(down, namespace)
        except BaseException:  # CapacityError or WriteOut
            index.stop_waiting(present, tier)
            raise
        index.wait_on(down, tier)
        present += down
        missing = [b for b in blocks if tier not in b.copies]
        index.wait_on(missing, Tier.DISK)
        try:
            self.capacity.make_room(tier, len(missing), namespace, hint=kind is LoadKind.PREFETCH)
        except BaseException:  # CapacityError or WriteOut
            index.stop_waiting(present, tier)
            raise
        finally:
            index.stop_waiting(missing, Tier.DISK)
        if kind is LoadKind.ACQUIRE:
            self._boost(present)
        for b in missing:
            source = b.copies[Tier.DISK]
            source.readers += 1  # the disk slot must not be reused while we read it; `_end` lets go
            job, copy = self._job(session, namespace, source.record, Tier.DISK, kind, priority)
            index.add_copy(b, tier, copy)
            self._begin(job)

    def start_new(self, session: SessionId, namespace: str, keys: list[bytes], parent: bytes | None,
                  source: Tier, kind: LoadKind, priority: int = 0) -> list[Block]:
        """File a new block per key (none of them in the index), chained from `parent`, each
        with a loading host copy and one waiter (the caller's), read from `source`.
        Raises CapacityError (or WriteOut) when room cannot be made, with nothing filed."""
        index = self.index
        self.capacity.make_room(Tier.HOST, len(keys), namespace, hint=kind is LoadKind.PREFETCH)
        prev = (namespace, parent) if parent is not None else None
        blocks = []
        for key in keys:
            record = PageRecord(namespace, key, -1, prev[1] if prev else None)  # names no slot of `source`
            job, copy = self._job(session, namespace, record, source, kind, priority)
            ref = (namespace, key)
            blocks.append(index.add_block(ref, prev, Tier.HOST, copy))
            prev = ref
            self._begin(job)
        return blocks

    def _job(self, session: SessionId, namespace: str, record: PageRecord, source: Tier, kind: LoadKind,
             priority: int) -> tuple[LoadJob, Copy]:
        """A host slot (room was made) and the loading copy whose job fills it."""
        slot = self.index.tiers[Tier.HOST].slots.alloc()
        # The slot holds this namespace's bytes from the read on, even if the page then fails.
        self.capacity.own_host(slot, namespace)
        job = LoadJob(record, slot, kind, session, self.finish_load, priority, source=source)
        return job, Copy(slot, loading=True, waiters=1, job=job)

    def _begin(self, job: LoadJob) -> None:
        self.index.requests.loads_in_flight += 1
        self.ports.source(job.source).load(job)

    def _boost(self, blocks: list[Block]) -> None:
        """An Acquire now waits on these host copies: their queued loads go first, each on
        the port of its own source."""
        for b in blocks:
            job = b.copies[Tier.HOST].job
            if job is not None:
                self.ports.source(job.source).boost(job)

    def _end(self, job: LoadJob) -> Block:
        """What every ended job undoes, finished or withdrawn: returns its block."""
        block = self.index.block_of(job)
        if job.source is Tier.DISK:
            block.copies[Tier.DISK].readers -= 1
        block.copies[Tier.HOST].job = None
        self.index.requests.loads_in_flight -= 1
        return block

    def _fail(self, block: Block) -> None:
        """Drop a host copy whose load did not land. Waiting acquires see it gone and stop
        their ready prefix before it."""
        self.index.loaded(block, Tier.HOST, False)
        block.copies[Tier.HOST].waiters = 0
        self.capacity.drop([block], Tier.HOST)

    def finish_load(self, job: LoadJob, ok: bool) -> None:
        """A load ended: publish or drop the page. A dropped disk copy's index entry is
        deleted, and a page the reader did not verify is hashed, after the lock is
        released. (The ports call this from their I/O threads; the bookkeeping ports, which
        move no bytes, call it at once, inside the request that started the load.)"""
        with self.rounds.held():
            index = self.index
            block = self._end(job)
            from_disk = job.source is Tier.DISK
            if ok:
                index.loaded(block, Tier.HOST, True)
                block.in_cluster = block.in_cluster or job.source is Tier.CLUSTER
                index.hold(block, Tier.HOST, time.monotonic() + (job.hold or self.prefetch_hold))
                state = index.tiers[Tier.HOST]
                state.counters.promotions += 1
                state.counters.bytes_in += self.page_bytes
                entry = block.entry(Tier.HOST)
                if job.record.length:  # the reader verified the page against this checksum: not hashed again
                    entry = replace(entry, length=job.record.length, checksum=job.record.checksum)
                self.rounds.staged += self.ports.host.stage([entry])
            else:
                self._fail(block)
                if from_disk:  # the disk's bytes are bad: that copy goes too
                    self.capacity.drop([block], Tier.DISK)
                    index.corrupted(block)
            self.loaded.notify_all()

    def wait_ready(self, blocks: list[Block], timeout: float | None) -> int:
        """Wait (releasing the lock) until every host copy of `blocks` is loaded or failed,
        or the time is up; returns how many leading blocks have a loaded host copy.

        Our waiter count keeps each copy from eviction meanwhile, and a page, once loaded
        or dropped, stays so: the scan only moves forward, linear in the pages.
        """
        end = None if timeout is None else time.monotonic() + timeout
        settled = 0
        while True:
            while settled < len(blocks) and not self.index.is_loading(blocks[settled], Tier.HOST):
                settled += 1
            if settled == len(blocks):
                break
            remaining = None if end is None else end - time.monotonic()
            if remaining is not None and remaining <= 0:
                break
            self.loaded.wait(remaining)
        # A failed load dropped its block's copies; `is_current` also guards against a new
        # block committed under the same key meanwhile.
        ready = 0
        for b in blocks:
            if not self.index.is_current(b) or Tier.HOST not in b.copies or b.copies[Tier.HOST].loading:
                break
            ready += 1
        return ready

    def wait_idle(self, timeout: float | None) -> bool:
        return self.loaded.wait_for(lambda: self.index.requests.loads_in_flight == 0, timeout)

    # -- withdrawing ----------------------------------------------------------
    def cancel_session(self, session: SessionId) -> None:
        """Withdraw a session's queued prefetches that no Acquire waits for."""
        unwaited = lambda job: self.index.block_of(job).copies[Tier.HOST].waiters == 0  # noqa: E731
        self._withdraw([job for port in self.ports.sources() for job in port.cancel(session, unwaited)])

    def cancel_all(self) -> None:
        """Withdraw every queued load (shutdown): waiting acquires return what is ready."""
        self._withdraw([job for port in self.ports.sources() for job in port.cancel(None, lambda job: True)])

    def _withdraw(self, jobs: list[LoadJob]) -> None:
        for job in jobs:
            self._fail(self._end(job))
        if jobs:
            self.loaded.notify_all()

    def raise_not_loaded(self, keys: list[bytes], blocks: list[Block], ready: int) -> None:
        """Why the page after the ready prefix is missing, as the caller's error."""
        first = keys[ready]
        if self.index.is_current(blocks[ready]):  # still cached: its load was withdrawn
            raise Unavailable(
                f"the load of key {ready} ({first.hex()}) was withdrawn because the pool is shutting down; "
                "retry against the restarted daemon"
            )
        raise NotFound(
            f"the page of key {ready} ({first.hex()}) could not be loaded (it failed its checksum, or the cluster "
            "tier no longer holds it) and was dropped; recompute and commit it again"
        )

    # -- into device ----------------------------------------------------------
    def promote(self, namespace: str, blocks: list[Block]) -> Transfer | None:
        """Copy the blocks (of `namespace`) without a device copy from host (loaded,
        protected by our waiters) to the device in one submission. Returns the transfer
        after which every one of `blocks` is readable on the device, None if all already are.

        Raises CapacityError when the device cannot make room (having changed nothing) or
        has no memory to give the slots to `namespace` (its evictions done, no copy added).
        """
        device = self.index.tiers[Tier.DEVICE]
        missing = [b for b in blocks if Tier.DEVICE not in b.copies]
        present = [b for b in blocks if Tier.DEVICE in b.copies]
        in_flight = any(b.copies[Tier.DEVICE].loading for b in present)
        if not missing:
            return self.ports.device.marker() if in_flight else None
        # Copies that arrived while we waited (another acquire's) must not be chosen for room.
        self.index.wait_on(present, Tier.DEVICE)
        try:
            self.capacity.make_room(Tier.DEVICE, len(missing), namespace)
        finally:
            self.index.stop_waiting(present, Tier.DEVICE)
        slots = [device.slots.alloc() for _ in missing]
        try:
            self.ports.device.give(slots, namespace)
        except CapacityError:
            for slot in slots:
                device.slots.free(slot)
            raise
        pairs = []
        for b, slot in zip(missing, slots):
            b.copies[Tier.HOST].readers += 1  # the source stays until the copy lands
            self.index.add_copy(b, Tier.DEVICE, Copy(slot, loading=True))
            pairs.append((b.copies[Tier.HOST].slot, slot))
        # The promotion stream runs in order: this transfer also covers earlier ones in flight.
        return self.ports.device.promote(pairs, lambda transfer, ok: self.finish_promote(missing, ok))

    def finish_promote(self, blocks: list[Block], ok: bool) -> None:
        """A promotion landed (on the copy engine's thread, or at once in replay)."""
        with self._lock:
            device = self.index.tiers[Tier.DEVICE]
            for b in blocks:
                b.copies[Tier.HOST].readers -= 1
                self.index.loaded(b, Tier.DEVICE, ok)
                if ok:
                    device.counters.promotions += 1
                    device.counters.bytes_in += self.page_bytes
            if not ok:
                # A failed CUDA copy leaves the context unusable; drop what nobody holds.
                self.capacity.drop([b for b in blocks if not b.copies[Tier.DEVICE].pins], Tier.DEVICE)
            self.loaded.notify_all()
