"""Capacity: making room in a tier, and where evicted pages go.

    make_room(tier, n)   the tier's policy proposes victims (it never changes anything);
                         too few -> CapacityError with every structure untouched;
                         enough -> evict them
    evict(tier, blocks)  device copies with no host copy are demoted to host, host copies
                         with no disk copy are copied to disk, as far as the next tier can
                         take them; then the copies go: device -> host -> disk -> gone
    persist(deadline)    at a clean stop, host-only (and device-only) pages go to disk, in
                         batches that each become durable on their own

Called by the store with its lock held. Demotions are synchronous mover calls.
"""
from __future__ import annotations

import time
from collections.abc import Callable

from kvtier_client.errors import CapacityError
from kvtier_client.ids import Slot
from kvtier_client.layout import PageLayout
from kvtier_client.tiers import Tier

from kvtier.core.index import Block, BlockIndex, Copy
from kvtier.core.ports import PageMover, PageRecord
from kvtier.policy import Ref

#: Pages per durable step of the stop-time copy to disk: a kill during the stop keeps every
#: batch written before it.
PERSIST_BATCH = 64


class Capacity:
    def __init__(self, index: BlockIndex, mover: PageMover, layout: PageLayout) -> None:
        self.index = index
        self.mover = mover
        self.page_bytes = layout.page_bytes

    def take_host_slots(self, namespace: str, n: int) -> list[Slot]:
        """n free host slots for a writer of `namespace` (the caller made room), zeroed
        where another namespace's data was."""
        host = self.index.tiers[Tier.HOST]
        slots = [host.slots.alloc() for _ in range(n)]
        for slot in slots:
            if self.index.host_owner[slot] not in (None, namespace):
                self.mover.clear_host(slot)
            self.index.host_owner[slot] = namespace
        return slots

    def make_room(self, tier: Tier, n: int, *, hint: bool = False) -> None:
        """Make n slots of `tier` free, or raise CapacityError having changed nothing.

        Held prefetched pages go last: only when nothing else can, and never to make room
        for a hint (`hint`). So prefetches cannot evict each other's held pages, and a
        host full of them never refuses a borrow or an acquire.
        """
        state = self.index.tiers[tier]
        short = n - state.slots.free_count
        if short <= 0:
            return
        victims = state.policy.victims(short, self.index.protected(tier))
        if len(victims) < short and not hint:
            chosen, unheld = set(victims), self.index.protected(tier, holds=False)
            victims += state.policy.victims(short - len(victims), lambda ref: ref in chosen or unheld(ref))
        if len(victims) < short:
            raise CapacityError(
                f"{tier.label} tier is full: {n} pages needed, {state.slots.free_count} free, "
                f"{len(victims)} evictable, the rest leased or in use; release leases or give the tier more capacity"
            )
        self.evict(tier, [self.index.blocks[ref] for ref in victims])

    def evict(self, tier: Tier, victims: list[Block]) -> None:
        """Remove victims' copies from `tier`. Device copies with no host copy and host
        copies with no disk copy are demoted first where the next tier can take them; what
        it cannot take is dropped."""
        tiers = self.index.tiers
        if tier == Tier.HOST and Tier.DISK in tiers:
            self.copy_to_disk([b for b in victims if Tier.DISK not in b.copies])
        if tier == Tier.DEVICE:
            only_here = [b for b in victims if Tier.HOST not in b.copies]
            also_host = [b for b in victims if Tier.HOST in b.copies]
            self.index.wait_on(also_host, Tier.HOST)  # their host copies survive: not room for the others
            try:
                self.make_room(Tier.HOST, len(only_here))
            except CapacityError:
                only_here = []  # host is full of leased pages: these device pages are dropped
            finally:
                self.index.stop_waiting(also_host, Tier.HOST)
            if only_here:
                self.demote_to_host(only_here)
        self.drop(victims, tier)
        tiers[tier].counters.evictions += len(victims)

    def copy_to_disk(self, blocks: list[Block], keep: Callable[[Ref], bool] | None = None) -> None:
        """Copy host pages to disk (demotion, or write-through), as many as the disk can take.
        Disk pages for which `keep` is true (default: protected ones) are never evicted for room.

        A failing disk (the mover's store raises OSError: EIO, ENOSPC) takes none of the
        batch: its slots are freed, the pages counted in the disk's `io_errors`, and the
        caller goes on as if the disk were full (the mechanism logs the fault)."""
        if not blocks:
            return
        disk = self.index.tiers[Tier.DISK]
        short = len(blocks) - disk.slots.free_count
        if short > 0:
            room = disk.policy.victims(short, keep or self.index.protected(Tier.DISK))
            self.evict(Tier.DISK, [self.index.blocks[ref] for ref in room])
        fits = blocks[: disk.slots.free_count]
        moves = []
        for block in fits:
            ns, key = block.ref
            slot = disk.slots.alloc()
            parent = block.parent[1] if block.parent else None
            moves.append((block.copies[Tier.HOST].slot, PageRecord(ns, key, slot, parent)))
        try:
            stored = self.mover.store(moves)
        except OSError:
            for _, record in moves:
                disk.slots.free(record.slot)
            disk.counters.io_errors += len(moves)
            return
        for block, record in zip(fits, stored):
            self.index.add_copy(block, Tier.DISK, Copy(record.slot, record=record))
            disk.counters.demotions += 1
            disk.counters.bytes_in += self.page_bytes

    def copy_down(self, blocks: list[Block]) -> None:
        """Give device-only blocks a host copy (a synchronous device -> host copy), so host
        acquires and prefetches find them there. Raises CapacityError, having changed
        nothing, when host cannot make room."""
        if not blocks:
            return
        self.index.wait_on(blocks, Tier.DEVICE)
        try:
            self.make_room(Tier.HOST, len(blocks))
        finally:
            self.index.stop_waiting(blocks, Tier.DEVICE)
        self.demote_to_host(blocks)

    def demote_to_host(self, blocks: list[Block]) -> None:
        """Copy device pages to free host slots (the caller made room) and file the copies."""
        host = self.index.tiers[Tier.HOST]
        slots = [host.slots.alloc() for _ in blocks]
        try:
            self.mover.demote([(b.copies[Tier.DEVICE].slot, slot) for b, slot in zip(blocks, slots)])
        except BaseException:
            for slot in slots:
                host.slots.free(slot)
            raise
        for b, slot in zip(blocks, slots):  # filed only once the bytes are there
            self.index.host_owner[slot] = b.ref[0]
            self.index.add_copy(b, Tier.HOST, Copy(slot))
        self.mover.publish_host([b.entry(Tier.HOST) for b in blocks])
        host.counters.demotions += len(blocks)
        host.counters.bytes_in += len(blocks) * self.page_bytes

    def drop(self, blocks: list[Block], tier: Tier) -> None:
        """Drop each block's copy in `tier`; disk copies leave the persistent index in one
        batch, host copies the slot table, before their slots can be reused."""
        if tier == Tier.HOST:
            self.mover.unpublish_host([b.copies[Tier.HOST].slot for b in blocks])
        records = [r for b in blocks if (r := self.index.drop_copy(b, tier)) is not None]
        if records:
            self.mover.forget(records)

    def persist(self, deadline: float | None = None) -> int:
        """Copy host-only (and device-only, through host) pages to disk (clean shutdown),
        evicting colder disk-only pages if needed.

        This keeps what the disk can hold. Pages go in commit order (the index's insertion
        order), so a prefix is saved before its suffixes, and no disk copy of a page that is
        also in host is given up for another. They go in batches of PERSIST_BATCH, each
        durable before the next starts (the disk tier commits its index per batch), and no
        batch starts after `deadline` (time.monotonic()). Returns how many pages were copied.
        """
        tiers, blocks = self.index.tiers, self.index.blocks
        if Tier.DISK not in tiers:
            return 0
        device_only = [b for b in blocks.values() if set(b.copies) == {Tier.DEVICE}]
        if device_only:
            try:  # through host, as far as host can take them
                self.copy_down(device_only[: tiers[Tier.HOST].slots.capacity])
            except CapacityError:
                pass  # host is full of leased pages: the device-only pages are not saved
        host_only = [b for b in blocks.values() if Tier.DISK not in b.copies and Tier.HOST in b.copies]
        host_only = host_only[: tiers[Tier.DISK].slots.capacity]
        protected = self.index.protected(Tier.DISK)
        before = tiers[Tier.DISK].counters.demotions
        for start in range(0, len(host_only), PERSIST_BATCH):
            if deadline is not None and time.monotonic() >= deadline:
                break
            self.copy_to_disk(
                host_only[start : start + PERSIST_BATCH],
                keep=lambda ref: protected(ref) or Tier.HOST in blocks[ref].copies,
            )
        return tiers[Tier.DISK].counters.demotions - before

    def unsaved(self) -> int:
        """Cached blocks with no disk copy: what a clean stop cannot keep on disk."""
        return sum(1 for b in self.index.blocks.values() if Tier.DISK not in b.copies)
