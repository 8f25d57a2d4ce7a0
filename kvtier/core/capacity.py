"""Capacity: making room in a tier, and where evicted pages go. Decisions and bookkeeping
only: no disk write starts here.

    make_room(tier, n, ns)   the tier's policy proposes victims (it never changes anything);
                             too few -> CapacityError with every structure untouched;
                             dirty host victims not yet tried -> WriteOut (nothing changed);
                             enough -> evict them
    evict(tier, blocks, ns)  device copies with no host copy are demoted to host; then the
                             copies go: device -> host -> disk -> gone (a host copy that
                             reaches this with no disk copy was refused or failed to write)
    prepare / file           a disk write's two halves under the lock, around the store
                             that kvtier.core.writes runs with the lock released

Every allocation is for a namespace (`ns`), and quotas (kvtier.core.quotas) shape the room
made for it: a namespace at its maximum evicts its own pages first, and no other namespace
is evicted below its guarantee. Demotions allocate for the demoted block's namespace.
Without quotas the namespace decides nothing.

Called with the store's lock held. A host eviction that needs pages written prepares
them and raises `WriteOut`; the request's runner (kvtier.core.writes) writes them with the
lock released and runs the request again. Disk index deletions are queued in `forgets`, and host pages
demoted from the device in `staged` (their slot table entries need a hash): the caller
hands both to the mechanism after releasing the lock. Device demotions are synchronous
port calls.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvtier_client.errors import CapacityError
from kvtier_client.ids import Slot
from kvtier_client.layout import PageLayout
from kvtier_client.tiers import Tier

from kvtier.core.chunks import size_of, split
from kvtier.core.index import Block, BlockIndex, Copy
from kvtier.core.ports import Mechanism, PageRecord
from kvtier.core.quotas import Quota, VictimPicker
from kvtier.policy import Admission, AdmitAll, Ref

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
    """Not an error: the request must wait for host pages to reach disk before it can evict
    them. `batch`: pages prepared for this request to write (outside the lock); `saved`:
    pages others are writing now. The caller does that, then runs the request again from
    the start (kvtier.core.writes.Writes.run)."""

    def __init__(self, batch: WriteBatch | None, saved: list[Block] = ()) -> None:
        super().__init__("host pages must reach disk before they are evicted")
        self.batch = batch
        self.saved = list(saved)


class Capacity:
    def __init__(self, index: BlockIndex, ports: Mechanism, layout: PageLayout, admission: Admission | None = None) -> None:
        self.index = index
        self.ports = ports
        #: Which host pages leaving host are written to disk (kvtier.policy.admission).
        self.admission = admission or AdmitAll()
        self.page_bytes = layout.page_bytes
        #: Quotas by namespace (the store sets them); a namespace missing here has none.
        self.quotas: dict[str, Quota] = {}
        #: Host pages the request in progress already had written to disk, or tried to
        #: (kvtier.core.writes.Writes.run starts each request with an empty set): an
        #: eviction drops these if they are still dirty, instead of asking for them again.
        self.tried: set[Ref] = set()
        #: Disk index entries to delete, handed to the disk port outside the lock.
        self.forgets: list[PageRecord] = []
        #: Of those, taken and not yet deleted: gone from the index, still in the disk's.
        self.forgetting: set[PageRecord] = set()
        #: Disk writes in flight, by block: the record each will be filed with.
        self.saving: dict[Ref, PageRecord] = {}
        #: Host pages demoted from the device, staged for the slot table (`take_staged`).
        self.staged: list[PageRecord] = []

    def take_staged(self) -> list[PageRecord]:
        """Demoted host pages staged for the slot table: the caller publishes them after
        releasing the lock (hashing reads the bytes)."""
        staged, self.staged = self.staged, []
        return staged

    def take_forgets(self) -> list[PageRecord]:
        """The queued deletions, now in flight until `forgotten`."""
        forgets, self.forgets = self.forgets, []
        self.forgetting.update(forgets)
        return forgets

    def forgotten(self, records: list[PageRecord]) -> None:
        """The disk port deleted these index entries."""
        self.forgetting.difference_update(records)

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
        if n <= free and (not self.quotas or self.over_quota(tier, namespace, n) <= 0):
            return
        # Host copies being saved are evictable once their write lands: the request waits
        # for it rather than evicting hotter pages.
        saves = tier is not Tier.HOST
        victims, allowed = self.choose(tier, n, free, namespace, last_resort=not hint, saves=saves)
        if allowed < n:
            raise CapacityError(self.quota_message(tier, n, namespace))
        if free + len(victims) < n:
            rest = "the rest leased or in use" + (" or guaranteed to other namespaces" if self.quotas else "")
            raise CapacityError(
                f"{tier.label} tier is full: {n} pages needed, {free} free, "
                f"{len(victims)} evictable, {rest}; release leases or give the tier more capacity"
            )
        blocks = [self.index.blocks[ref] for ref in victims]
        if not saves:
            self.write_out_first(blocks)
        self.evict(tier, blocks, namespace)

    def write_out_first(self, victims: list[Block]) -> None:
        """Raise WriteOut if host victims must reach disk first: some are being saved, or
        some dirty ones (no disk copy) that this request has not tried to write yet fit on
        disk (their batch prepared now, while the request's own pages are protected).
        Dirty victims it already tried (the write failed, or the disk had no room) are
        dropped by the eviction, as when the disk is full."""
        saved = [b for b in victims if b.copies[Tier.HOST].saved]
        if saved:
            raise WriteOut(None, saved)
        if Tier.DISK not in self.index.tiers:
            return
        tried, admit = self.tried, self.admission.admit
        dirty = [b for b in victims if Tier.DISK not in b.copies and b.ref not in tried and admit(b.ref)]
        if not dirty:
            return
        tried.update(b.ref for b in dirty)
        # The disk copies of this eviction's clean victims are what make them clean: keep them.
        going, protected = {b.ref for b in victims}, self.index.protected(Tier.DISK)
        batch = self.prepare(dirty, keep=lambda ref: ref in going or protected(ref))
        if batch:
            raise WriteOut(batch)

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
        picker = VictimPicker(policy, namespace, self.spare(tier, namespace))
        fallback = self.index.protected(tier, holds=False, saves=saves) if last_resort else None
        allowed = n
        over = self.over_quota(tier, namespace, n)
        if over > 0:
            picker.take(over, keep, fallback, own=True)
            allowed = max(0, n - (over - len(picker.chosen)))
        picker.take(allowed - free - len(picker.chosen), keep, fallback)
        return picker.chosen, allowed

    def spare(self, tier: Tier, namespace: str) -> dict[str, int]:
        """How far above its guarantee in `tier` every other namespace with one is."""
        return {
            ns: self.usage(ns, tier) - quota.guaranteed_pages(tier)
            for ns, quota in self.quotas.items()
            if ns != namespace and quota.guaranteed_pages(tier)
        }

    def usage(self, namespace: str, tier: Tier) -> int:
        counters = self.index.namespaces.get(namespace)
        return counters.pages[tier] if counters else 0

    def over_quota(self, tier: Tier, namespace: str, n: int) -> int:
        """How many of its own pages `namespace` must give up in `tier` before n more fit its
        quota (<= 0: none)."""
        quota = self.quotas.get(namespace)
        limit = quota.max_pages(tier) if quota else 0
        return self.usage(namespace, tier) + n - limit if limit else 0

    def quota_message(self, tier: Tier, n: int, namespace: str) -> str:
        return (
            f"namespace {namespace!r} is at its {tier.label} quota of {self.quotas[namespace].max_pages(tier)} pages: "
            f"{self.usage(namespace, tier)} in use, {n} more needed, too few of its own evictable; "
            "release its leases or raise its quota"
        )

    def by_namespace(self, blocks: list[Block]) -> list[tuple[str, list[Block]]]:
        """`blocks` in one batch per namespace, as quotas are kept per namespace; without
        quotas in one batch (the namespace decides nothing then)."""
        if not self.quotas:
            return [(blocks[0].ref[0], blocks)] if blocks else []
        groups: dict[str, list[Block]] = {}
        for b in blocks:
            groups.setdefault(b.ref[0], []).append(b)
        return list(groups.items())

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

    # -- disk writes: prepared and filed here, stored by kvtier.core.writes ------
    def prepare(self, blocks: list[Block], keep: Callable[[Ref], bool] | None = None) -> WriteBatch:
        """Take disk slots and chunks for host pages, as many as the disk and their namespaces' disk
        quotas can take (blocks already on disk or being saved are skipped). Disk pages for
        which `keep` is true (default: protected ones) are never evicted for room. Each
        page taken is `saved` (protected) and its disk slot `writing` until `file`."""
        disk = self.index.tiers[Tier.DISK]
        blocks = [b for b in blocks if Tier.DISK not in b.copies and not b.copies[Tier.HOST].saved]
        batch = WriteBatch()
        for namespace, group in self.by_namespace(blocks):
            def room() -> int:  # a raw page's chunks a page; what its encoding leaves comes back at `file`
                return min(disk.slots.free_count, disk.chunks.free_count // disk.space.reserve)

            victims, allowed = self.choose(Tier.DISK, len(group), room(), namespace, keep=keep)
            while victims:  # victims stored in fewer chunks than a reserve free less room than a page each
                self.evict(Tier.DISK, [self.index.blocks[ref] for ref in victims], namespace)
                victims = self.choose(Tier.DISK, allowed, room(), namespace, keep=keep)[0] if room() < allowed else []
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
            for namespace, group in self.by_namespace(blocks):
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
        self.staged += self.ports.host.stage([b.entry(Tier.HOST) for b in blocks])
        host.counters.demotions += len(blocks)
        host.counters.bytes_in += len(blocks) * self.page_bytes

    def drop(self, blocks: list[Block], tier: Tier) -> None:
        """Drop each block's copy in `tier`: host copies leave the slot table before their
        slots can be reused; disk copies' index entries are queued in `forgets`, deleted
        outside the lock (the disk tier keeps a reused slot safe: kvtier.mechanism.disk)."""
        if tier == Tier.HOST:
            self.ports.host.unpublish([b.copies[Tier.HOST].slot for b in blocks])
        self.forgets += [r for b in blocks if (r := self.index.drop_copy(b, tier)) is not None]

    def unsaved(self) -> int:
        """Cached blocks with no disk copy: what a clean stop cannot keep on disk."""
        return sum(1 for b in self.index.blocks.values() if Tier.DISK not in b.copies)
