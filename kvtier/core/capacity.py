"""Capacity: making room in a tier, and where evicted pages go. Decisions and bookkeeping
only: no disk write starts here.

    make_room(tier, n, ns)   the tier's policy proposes victims (it never changes anything);
                             too few -> CapacityError with every structure untouched;
                             host victims that must reach disk first -> WriteOut, from
                             `write_out` (kvtier.core.disk_writes, nothing changed);
                             enough -> evict them
    evict(tier, blocks, ns)  device copies with no host copy are demoted to host; then the
                             copies go: device -> host -> disk -> gone (a host copy that
                             reaches this with no disk copy was refused or failed to write)

Every allocation is for a namespace (`ns`), and quotas (kvtier.core.quotas.QuotaBook) shape
the room made for it: a namespace at its maximum evicts its own pages first, and no other
namespace is evicted below its guarantee. Demotions allocate for the demoted block's
namespace. Without quotas the namespace decides nothing.

Called with the store's lock held, in a round (kvtier.core.rounds): disk index deletions
and host pages demoted from the device (their slot table entries need a hash) are queued
there and handed to the mechanism as the lock is released. Device demotions are synchronous
port calls.
"""
from __future__ import annotations

from collections.abc import Callable

from kvtier_client.errors import CapacityError
from kvtier_client.ids import Slot
from kvtier_client.layout import PageLayout
from kvtier_client.tiers import Tier

from kvtier.core.index import Block, BlockIndex, Copy
from kvtier.core.ports import Mechanism
from kvtier.core.quotas import QuotaBook, VictimPicker
from kvtier.core.rounds import Rounds
from kvtier.policy import Admission, AdmitAll, Ref

class Capacity:
    def __init__(self, index: BlockIndex, ports: Mechanism, rounds: Rounds, layout: PageLayout,
                 admission: Admission | None = None) -> None:
        self.index = index
        self.ports = ports
        self.rounds = rounds
        #: Which host pages leaving host are written to disk (kvtier.policy.admission).
        self.admission = admission or AdmitAll()
        self.page_bytes = layout.page_bytes
        self.quotas = QuotaBook(index)
        #: What must happen before host victims can go: with a disk tier, write those that
        #: need it first (kvtier.core.disk_writes.DiskWrites.write_out_first, set by the store).
        self.write_out: Callable[[list[Block]], None] = lambda victims: None

    # -- host slots changing hands ---------------------------------------------
    def own_host(self, slot: Slot, namespace: str) -> bool:
        """Slot `slot` is about to hold `namespace`'s bytes: the mechanism hears of every
        change of holder, so nothing of the previous one shows through. True if it changed."""
        if self.index.host_owner[slot] == namespace:
            return False
        self.ports.host.give(slot, namespace)
        self.index.host_owner[slot] = namespace
        return True

    def take_host_slots(self, namespace: str, n: int) -> tuple[list[Slot], list[Slot]]:
        """n free host slots for a writer of `namespace` (the caller made room), and those
        of them that changed holder: the caller populates them after releasing the lock."""
        host = self.index.tiers[Tier.HOST]
        slots = [host.slots.alloc() for _ in range(n)]
        return slots, [slot for slot in slots if self.own_host(slot, namespace)]

    # -- making room ------------------------------------------------------------
    def make_room(self, tier: Tier, n: int, namespace: str, *, hint: bool = False) -> None:
        """Make n slots of `tier` free for `namespace`, or raise CapacityError having changed
        nothing.

        Held prefetched pages go last: only when nothing else can, and never to make room
        for a hint (`hint`). So prefetches cannot evict each other's held pages, and a
        host full of them never refuses a borrow or an acquire.
        """
        state = self.index.tiers[tier]
        free = state.slots.free_count
        if n <= free and (not self.quotas or self.quotas.over(tier, namespace, n) <= 0):
            return
        # Host copies being saved are evictable once their write lands: the request waits
        # for it rather than evicting hotter pages.
        saves = tier is not Tier.HOST
        victims, allowed = self.choose(tier, n, free, namespace, last_resort=not hint, saves=saves)
        if allowed < n:
            raise CapacityError(self.quotas.full_message(tier, n, namespace))
        if free + len(victims) < n:
            rest = "the rest leased or in use" + (" or guaranteed to other namespaces" if self.quotas else "")
            raise CapacityError(
                f"{tier.label} tier is full: {n} pages needed, {free} free, "
                f"{len(victims)} evictable, {rest}; release leases or give the tier more capacity"
            )
        blocks = [self.index.blocks[ref] for ref in victims]
        if not saves:
            self.write_out(blocks)
        self.evict(tier, blocks, namespace)

    def choose(self, tier: Tier, n: int, free: int, namespace: str, *, keep: Callable[[Ref], bool] | None = None,
               last_resort: bool = False, saves: bool = True) -> tuple[list[Ref], int]:
        """Victims in `tier` (with `free` slots free) for n new pages of `namespace`: its own
        pages beyond its quota first, then room, never another namespace's below its
        guarantee. Pages for which `keep` is true (default: protected ones; without
        `saves`, copies being saved are not) are never chosen; with `last_resort`, held
        prefetched pages are if nothing else is left. Returns the victims and how many of
        the n fit its quota once they go (the tier may still be short). Changes nothing."""
        policy = self.index.tiers[tier].policy
        if not self.quotas:  # the policy's order alone
            short = n - free
            if short <= 0:
                return [], n
            victims = policy.victims(short, keep or self.index.protected(tier, saves=saves))
            if len(victims) < short and last_resort:
                chosen, unheld = set(victims), self.index.protected(tier, holds=False, saves=saves)
                victims += policy.victims(short - len(victims), lambda ref: ref in chosen or unheld(ref))
            return victims, n
        keep = keep or self.index.protected(tier, saves=saves)
        picker = VictimPicker(policy, namespace, self.quotas.spare(tier, namespace))
        fallback = self.index.protected(tier, holds=False, saves=saves) if last_resort else None
        allowed = n
        over = self.quotas.over(tier, namespace, n)
        if over > 0:
            picker.take(over, keep, fallback, own=True)
            allowed = max(0, n - (over - len(picker.chosen)))
        picker.take(allowed - free - len(picker.chosen), keep, fallback)
        return picker.chosen, allowed

    # -- where evicted pages go -------------------------------------------------
    def evict(self, tier: Tier, victims: list[Block], namespace: str) -> None:
        """Remove victims' copies from `tier` to make room for `namespace`. Device copies
        with no host copy and host copies with no disk copy are demoted first where the
        next tier can take them (host copies only where the admission policy admits them);
        what it cannot take is dropped."""
        tiers = self.index.tiers
        if tier == Tier.HOST and Tier.DISK in tiers:
            dirty = [b for b in victims if Tier.DISK not in b.copies]
            admitted = [b for b in dirty if self.admission.admit(b.ref)]
            tiers[Tier.DISK].counters.refused += len(dirty) - len(admitted)
        if tier == Tier.DEVICE:
            also_host = [b for b in victims if Tier.HOST in b.copies]
            self.index.wait_on(also_host, Tier.HOST)  # their host copies survive: not room for the others
            try:
                self.copy_down_each([b for b in victims if Tier.HOST not in b.copies])
            finally:
                self.index.stop_waiting(also_host, Tier.HOST)
        self.drop(victims, tier)
        self.index.evicted(victims, tier, tiers[tier].policy.name, namespace)

    def copy_down(self, blocks: list[Block], namespace: str) -> None:
        """Give device-only blocks of `namespace` a host copy (a synchronous device -> host
        copy), so host acquires and prefetches find them there. Raises CapacityError,
        having changed nothing, when host cannot make room."""
        if not blocks:
            return
        self.index.wait_on(blocks, Tier.DEVICE)
        try:
            self.make_room(Tier.HOST, len(blocks), namespace)
        finally:
            self.index.stop_waiting(blocks, Tier.DEVICE)
        self.demote_to_host(blocks)

    def copy_down_each(self, blocks: list[Block]) -> None:
        """Give device-only blocks a host copy, each namespace's batch all or none, as far as
        host and the quotas allow; the rest keep only their device copy."""
        down: list[Block] = []
        try:
            for namespace, group in self.quotas.by_namespace(blocks):
                try:
                    self.copy_down(group, namespace)
                except CapacityError:
                    continue  # host is full of leased pages, or the namespace at its quota
                self.index.wait_on(group, Tier.HOST)  # not room for the next namespace's
                down += group
        finally:
            self.index.stop_waiting(down, Tier.HOST)

    def demote_to_host(self, blocks: list[Block]) -> None:
        """Copy device pages to free host slots (the caller made room) and file the copies."""
        host = self.index.tiers[Tier.HOST]
        slots = [host.slots.alloc() for _ in blocks]
        for b, slot in zip(blocks, slots):
            self.own_host(slot, b.ref[0])
        try:
            self.ports.device.demote([(b.copies[Tier.DEVICE].slot, slot) for b, slot in zip(blocks, slots)])
        except BaseException:
            for slot in slots:
                host.slots.free(slot)
            raise
        for b, slot in zip(blocks, slots):  # filed only once the bytes are there
            self.index.add_copy(b, Tier.HOST, Copy(slot))
        self.rounds.staged += self.ports.host.stage([b.entry(Tier.HOST) for b in blocks])
        host.counters.demotions += len(blocks)
        host.counters.bytes_in += len(blocks) * self.page_bytes

    def drop(self, blocks: list[Block], tier: Tier) -> None:
        """Drop each block's copy in `tier`: host copies leave the slot table before their
        slots can be reused; disk copies' index entries are queued in the round, deleted
        outside the lock (the disk tier keeps a reused slot safe: kvtier.mechanism.disk)."""
        if tier == Tier.HOST:
            self.ports.host.unpublish([b.copies[Tier.HOST].slot for b in blocks])
        self.rounds.forgets += [r for b in blocks if (r := self.index.drop_copy(b, tier)) is not None]

    def unsaved(self) -> int:
        """Cached blocks with no disk copy: what a clean stop cannot keep on disk."""
        return sum(1 for b in self.index.blocks.values() if Tier.DISK not in b.copies)
