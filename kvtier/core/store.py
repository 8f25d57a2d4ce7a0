"""The block store: the one owner of residency state for one page layout.

Every slot of every tier is exactly one of

    free     in the tier's SlotAllocator
    writing  held by a write lease (borrowed, not yet committed)
    cached   holding a copy of a block; may be pinned by read leases, or still loading

and the three counts add up to the tier's capacity (kvtier.core.invariants checks it).

The engine's path to a page, in four hops:

    borrow(n)   -> _make_room(HOST, n) -> policy.victims -> _evict (demote to disk / drop)
                -> n host slots, leased for writing
    commit(keys)-> each slot becomes a cached copy of its key (or is freed as a duplicate)
    acquire(keys, HOST) -> _start_loads: a loading host copy per disk-only block (one per
                page however many callers), read by the mover's I/O workers; waits per
                the wait policy, then pins the ready prefix
    release     -> unpins (read) or frees what was never committed (write)

Loads finish on I/O worker threads (`_finish_load`), which take the same lock and wake
waiting acquires through `_loaded`.

On a GPU daemon a device tier sits above host. `acquire(keys, DEVICE)` first brings every
page without a device copy into host exactly as above, then promotes the ready prefix
host -> device in one copy-engine submission and returns at once: the lease carries the
submission's interprocess CUDA event, which the engine waits on (on its own stream or the
host) before reading. The source host copies stay protected until the copy lands
(`_finish_promote`). Evicting a device page demotes it to host when host has no copy
(synchronously), and host evictions go on to disk as before: device -> host -> disk.

Capacity failures are decided before anything changes: `victims` only proposes, so a
request that cannot be met raises CapacityError with every structure untouched.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from functools import wraps

from kvtier_client.errors import CapacityError, FailedPrecondition, InvalidArgument, NotFound, Unavailable
from kvtier_client.layout import PageLayout
from kvtier_client.tiers import Tier

from kvtier.core.slots import SlotAllocator
from kvtier.mechanism.device import Transfer
from kvtier.mechanism.disk import DiskRecord
from kvtier.mechanism.io import LoadJob, LoadKind
from kvtier.mechanism.mover import PageMover
from kvtier.policy import EvictionPolicy, LRUPolicy, Ref

MAX_KEY_BYTES = 64
MAX_NAMESPACE_BYTES = 255


class LeaseKind(Enum):
    WRITE = "write"
    READ = "read"


@dataclass
class Copy:
    """One copy of a block in one tier."""

    slot: int
    pins: int = 0  # read leases holding this copy
    record: DiskRecord | None = None  # disk copies: the persisted index entry
    loading: bool = False  # bytes still on their way (host: from disk; device: from host)
    waiters: int = 0  # acquires waiting on it, or loads reading from it (disk copies)
    held_until: float = 0.0  # a loaded page is kept (monotonic time) until acquired or this passes
    job: LoadJob | None = None  # the queued or running load, while loading


@dataclass(eq=False)
class Block:
    ref: Ref
    parent: Ref | None
    copies: dict[Tier, Copy] = field(default_factory=dict)

    @property
    def best_tier(self) -> Tier:
        return min(self.copies)


@dataclass
class TierCounters:
    hits: int = 0  # looked-up blocks whose fastest copy was here
    evictions: int = 0  # copies removed from this tier to make room
    promotions: int = 0  # copies made here from a slower tier
    demotions: int = 0  # copies made here from a faster tier
    bytes_in: int = 0  # bytes copied into this tier by promotions and demotions
    corrupt_pages: int = 0  # copies dropped here because they failed its checksum


@dataclass
class TierState:
    tier: Tier
    slots: SlotAllocator
    policy: EvictionPolicy
    writing: set[int] = field(default_factory=set)
    cached: int = 0
    pinned: int = 0  # cached copies held by at least one read lease
    counters: TierCounters = field(default_factory=TierCounters)


@dataclass
class LeaseRecord:
    lease_id: int
    session: str
    namespace: str
    kind: LeaseKind
    tier: Tier
    slots: list[int]
    refs: list[Ref] = field(default_factory=list)  # read leases: the pinned blocks
    transfer: Transfer | None = None  # device read leases: the copy the engine must wait for


@dataclass(frozen=True)
class PrefixMatch:
    """`hit_blocks` leading keys are cached; `tiers[i]` is the fastest tier holding key i."""

    hit_blocks: int
    tiers: tuple[Tier, ...]


@dataclass(frozen=True)
class WriteGrant:
    lease_id: int
    tier: Tier
    slots: tuple[int, ...]


@dataclass(frozen=True)
class CommitOutcome:
    """`duplicates` are indices of keys that were already cached: the cached page was kept
    and the lease's page for that key was freed. The lease has ended."""

    lease_id: int
    committed: int
    duplicates: tuple[int, ...]


@dataclass(frozen=True)
class ReadGrant:
    lease_id: int
    tier: Tier
    slots: tuple[int, ...]  # the ready prefix: pages pinned and readable
    promoted: int  # how many of the requested pages were not ready on arrival
    ready: int
    transfer: Transfer | None = None  # device: readable once this copy completes


@dataclass(frozen=True)
class TierUsage:
    tier: Tier
    capacity: int
    free: int
    writing: int
    cached: int
    pinned: int
    counters: TierCounters


@dataclass(frozen=True)
class StoreUsage:
    tiers: tuple[TierUsage, ...]
    lookup_blocks: int
    miss_blocks: int
    leases: int
    sessions: int
    acquired_pages: int = 0  # pages asked for by acquires
    ready_on_arrival: int = 0  # of those, already in the target tier and loaded
    loading: int = 0  # host pages whose load is in flight or queued

    def tier(self, tier: Tier) -> TierUsage | None:
        return next((t for t in self.tiers if t.tier == tier), None)


def _locked(method):
    @wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper


class BlockStore:
    """Index, leases and sessions for one layout's host tier and optional device and disk tiers."""

    def __init__(
        self,
        layout: PageLayout,
        *,
        host_pages: int,
        mover: PageMover,
        disk_pages: int = 0,
        device_pages: int = 0,
        policy: Callable[[], EvictionPolicy] = LRUPolicy,
        write_through: bool = False,
        prefetch_hold: float = 10.0,
        recovered: Iterable[DiskRecord] = (),
    ) -> None:
        if host_pages <= 0:
            raise ValueError("the host tier needs at least one page: it is where engines read and write pages")
        self.layout = layout
        self.mover = mover
        self.write_through = write_through
        self.prefetch_hold = prefetch_hold
        self.blocks: dict[Ref, Block] = {}
        self.leases: dict[int, LeaseRecord] = {}
        self.sessions: dict[str, set[int]] = {}
        self.tiers: dict[Tier, TierState] = {}
        if device_pages > 0:
            self.tiers[Tier.DEVICE] = TierState(Tier.DEVICE, SlotAllocator(device_pages), policy())
        self.tiers[Tier.HOST] = TierState(Tier.HOST, SlotAllocator(host_pages), policy())
        self._host_owner: list[str | None] = [None] * host_pages  # namespace whose data a host slot last held
        self._next_lease = 1
        self._lookup_blocks = 0
        self._miss_blocks = 0
        self._lock = threading.RLock()
        self._loaded = threading.Condition(self._lock)  # notified whenever a load ends
        self._acquired_pages = 0
        self._ready_on_arrival = 0
        self._loading = 0  # host copies whose bytes are on their way
        if disk_pages > 0:
            self._recover_disk(disk_pages, policy, recovered)

    def _recover_disk(self, pages: int, policy: Callable[[], EvictionPolicy], records: Iterable[DiskRecord]) -> None:
        ordered = sorted(records, key=lambda r: r.seq)
        state = TierState(Tier.DISK, SlotAllocator(pages, used=[r.slot for r in ordered]), policy())
        self.tiers[Tier.DISK] = state
        for record in ordered:
            ref = (record.namespace, record.key)
            parent = (record.namespace, record.parent) if record.parent else None
            block = self.blocks[ref] = Block(ref, parent)
            block.copies[Tier.DISK] = Copy(record.slot, record=record)
            state.policy.add(ref, parent)
            state.cached += 1

    # -- queries --------------------------------------------------------------
    @_locked
    def lookup(self, namespace: str, keys: list[bytes]) -> PrefixMatch:
        """The longest cached prefix of `keys` and the fastest tier of each of its blocks."""
        check_namespace(namespace)
        check_keys(keys)
        tiers: list[Tier] = []
        for key in keys:
            block = self.blocks.get((namespace, key))
            if block is None:
                break
            tiers.append(block.best_tier)
        for tier in tiers:
            self.tiers[tier].counters.hits += 1
        self._lookup_blocks += len(keys)
        self._miss_blocks += len(keys) - len(tiers)
        return PrefixMatch(len(tiers), tuple(tiers))

    @_locked
    def stats(self) -> StoreUsage:
        tiers = []
        for state in self.tiers.values():
            tiers.append(
                TierUsage(
                    state.tier,
                    state.slots.capacity,
                    state.slots.free_count,
                    len(state.writing),
                    state.cached,
                    state.pinned,
                    TierCounters(**vars(state.counters)),
                )
            )
        return StoreUsage(
            tuple(tiers), self._lookup_blocks, self._miss_blocks, len(self.leases), len(self.sessions),
            self._acquired_pages, self._ready_on_arrival, self._loading,
        )

    # -- write path -----------------------------------------------------------
    @_locked
    def borrow(self, session: str, namespace: str, n: int) -> WriteGrant:
        """A write lease on n free host pages, evicting or demoting cached pages if needed."""
        check_namespace(namespace)
        host = self.tiers[Tier.HOST]
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            raise InvalidArgument(f"borrow needs a positive page count, got {n!r}")
        if n > host.slots.capacity:
            raise InvalidArgument(
                f"borrow of {n} pages exceeds the host tier's {host.slots.capacity} pages; borrow in smaller batches"
            )
        self._make_room(Tier.HOST, n)
        slots = [host.slots.alloc() for _ in range(n)]
        for slot in slots:
            if self._host_owner[slot] not in (None, namespace):
                self.mover.clear_host(slot)
            self._host_owner[slot] = namespace
        host.writing.update(slots)
        lease = self._open_lease(session, namespace, LeaseKind.WRITE, Tier.HOST, slots)
        return WriteGrant(lease.lease_id, Tier.HOST, tuple(slots))

    @_locked
    def commit(self, session: str, lease_id: int, keys: list[bytes], parent: bytes | None = None) -> CommitOutcome:
        """Publish a write lease's pages: page i becomes the cached copy of keys[i].

        `parent` is the key of the block before keys[0] in its prefix, if there is one. Pages
        beyond len(keys) are freed. The lease ends.
        """
        lease = self._get_lease(session, lease_id, LeaseKind.WRITE)
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
        host = self.tiers[Tier.HOST]
        ns = lease.namespace
        prev: Ref | None = (ns, parent) if parent is not None else None
        duplicates: list[int] = []
        fresh: list[Block] = []
        for i, (slot, key) in enumerate(zip(lease.slots, keys)):
            ref = (ns, key)
            host.writing.discard(slot)
            existing = self.blocks.get(ref)
            if existing is not None:
                duplicates.append(i)
                host.slots.free(slot)
                if Tier.HOST in existing.copies:
                    host.policy.touch(ref)
            else:
                block = self.blocks[ref] = Block(ref, prev)
                self._add_copy(block, Tier.HOST, Copy(slot))
                fresh.append(block)
            prev = ref
        for slot in lease.slots[len(keys) :]:
            host.writing.discard(slot)
            host.slots.free(slot)
        self._close_lease(lease)
        if self.write_through and Tier.DISK in self.tiers:
            self._copy_to_disk(fresh)
        return CommitOutcome(lease_id, len(fresh), tuple(duplicates))

    # -- read path ------------------------------------------------------------
    @_locked
    def acquire(
        self, session: str, namespace: str, keys: list[bytes], tier: Tier = Tier.HOST, timeout: float | None = None
    ) -> ReadGrant:
        """A read lease pinning the ready prefix of `keys` in `tier`, loading disk-only pages.

        `timeout` is the wait policy: None waits for every page (and raises NotFound if a
        page fails its checksum: it is dropped, nothing is held); 0 returns what is ready
        now; t > 0 waits up to t seconds. Pages still loading when the call returns keep
        loading and are held for `prefetch_hold` seconds, like a prefetch. Every key must
        be cached (look up first and acquire the hit prefix). Into DEVICE, the wait covers
        the disk -> host part; the host -> device copy is the lease's `transfer`.
        """
        check_namespace(namespace)
        check_keys(keys)
        if not keys:
            raise InvalidArgument("acquire needs at least one key; look up first and acquire the hit prefix")
        if tier not in self.tiers or tier == Tier.DISK:
            lendable = " and ".join(t.label for t in self.tiers if t != Tier.DISK)
            raise InvalidArgument(f"acquire into {tier.label} is not available: this daemon lends {lendable} pages")
        if len(set(keys)) != len(keys):
            raise InvalidArgument("acquire got the same key twice; pass each block once")
        if timeout is not None and timeout < 0:
            raise InvalidArgument(f"acquire timeout must be >= 0 seconds, got {timeout}")
        blocks = []
        for i, key in enumerate(keys):
            block = self.blocks.get((namespace, key))
            if block is None:
                raise NotFound(f"key {i} ({key.hex()}) is not cached; look up again and acquire only the hit prefix")
            blocks.append(block)
        state = self.tiers[tier]
        if len(keys) > state.slots.capacity:
            raise InvalidArgument(f"acquire of {len(keys)} pages exceeds the {tier.label} tier's {state.slots.capacity}")
        # Device copies already there are kept (as waiters) while the rest reach host.
        on_device = [b for b in blocks if tier == Tier.DEVICE and Tier.DEVICE in b.copies]
        for b in on_device:
            b.copies[Tier.DEVICE].waiters += 1
        via_host = [b for b in blocks if tier == Tier.HOST or Tier.DEVICE not in b.copies]
        try:
            self._start_loads(session, via_host, Tier.HOST, LoadKind.ACQUIRE)
        except CapacityError:
            self._stop_waiting(on_device, Tier.DEVICE)
            raise
        ready_on_arrival = len(on_device) + sum(1 for b in via_host if not b.copies[Tier.HOST].loading)
        self._acquired_pages += len(blocks)
        self._ready_on_arrival += ready_on_arrival
        host_ready = self._wait_loaded(via_host, timeout)
        # The ready prefix: device copies count as ready, host pages up to the first not loaded.
        ready_ids = set(map(id, on_device)) | set(map(id, via_host[:host_ready]))
        ready = 0
        for b in blocks:
            if id(b) not in ready_ids:
                break
            ready += 1
        transfer = None
        try:
            if timeout is None and ready < len(blocks):
                self._raise_not_loaded(keys, blocks, ready)
            if tier == Tier.DEVICE:
                transfer = self._promote(blocks[:ready])
        finally:
            self._stop_waiting([b for b in via_host if self.blocks.get(b.ref) is b], Tier.HOST)
            self._stop_waiting(on_device, Tier.DEVICE)
        for b in blocks[:ready]:
            self._pin(b, tier)
            b.copies[tier].held_until = 0.0  # pinned now; after release it ages like any page
            state.policy.touch(b.ref)
        slots = [b.copies[tier].slot for b in blocks[:ready]]
        lease = self._open_lease(session, namespace, LeaseKind.READ, tier, slots, [b.ref for b in blocks[:ready]])
        lease.transfer = transfer
        return ReadGrant(lease.lease_id, tier, tuple(slots), len(blocks) - ready_on_arrival, ready, transfer)

    def _wait_loaded(self, blocks: list[Block], timeout: float | None) -> int:
        """Wait (releasing the lock) until every host copy of `blocks` is loaded or failed,
        or the time is up; returns how many leading blocks have a loaded host copy.

        Our waiter count keeps each copy from eviction meanwhile, and a page, once loaded
        or dropped, stays so: the scan only moves forward, linear in the pages.
        """
        end = None if timeout is None else time.monotonic() + timeout
        settled = 0
        while True:
            while settled < len(blocks) and not self._is_loading(blocks[settled], Tier.HOST):
                settled += 1
            if settled == len(blocks):
                break
            remaining = None if end is None else end - time.monotonic()
            if remaining is not None and remaining <= 0:
                break
            self._loaded.wait(remaining)
        # A failed load dropped its block's copies; `is b` also guards against a new block
        # committed under the same key meanwhile.
        ready = 0
        for b in blocks:
            if self.blocks.get(b.ref) is not b or Tier.HOST not in b.copies or b.copies[Tier.HOST].loading:
                break
            ready += 1
        return ready

    def _stop_waiting(self, blocks: list[Block], tier: Tier) -> None:
        for b in blocks:
            if tier in b.copies:
                b.copies[tier].waiters -= 1

    def _raise_not_loaded(self, keys: list[bytes], blocks: list[Block], ready: int) -> None:
        first = keys[ready]
        if self.blocks.get(blocks[ready].ref) is blocks[ready]:  # still cached: its load was withdrawn
            raise Unavailable(
                f"the load of key {ready} ({first.hex()}) was withdrawn because the pool is shutting down; "
                "retry against the restarted daemon"
            )
        raise NotFound(
            f"the page of key {ready} ({first.hex()}) failed its checksum on disk and was dropped; "
            "recompute and commit it again"
        )

    def _promote(self, blocks: list[Block]) -> Transfer | None:
        """Copy the blocks without a device copy from host (loaded, protected by our
        waiters) to the device in one submission. Returns the transfer after which every
        one of `blocks` is readable on the device, None if all already are.

        Raises CapacityError, having changed nothing, when the device cannot make room.
        """
        device = self.tiers[Tier.DEVICE]
        missing = [b for b in blocks if Tier.DEVICE not in b.copies]
        present = [b for b in blocks if Tier.DEVICE in b.copies]
        in_flight = any(b.copies[Tier.DEVICE].loading for b in present)
        if not missing:
            return self.mover.marker() if in_flight else None
        # Copies that arrived while we waited (another acquire's) must not be chosen for room.
        for b in present:
            b.copies[Tier.DEVICE].waiters += 1
        try:
            self._make_room(Tier.DEVICE, len(missing))
        finally:
            self._stop_waiting(present, Tier.DEVICE)
        pairs = []
        for b in missing:
            slot = device.slots.alloc()
            b.copies[Tier.HOST].waiters += 1  # the source stays until the copy lands
            self._add_copy(b, Tier.DEVICE, Copy(slot, loading=True))
            pairs.append((b.copies[Tier.HOST].slot, slot))
        # The promotion stream runs in order: this transfer also covers earlier ones in flight.
        return self.mover.promote(pairs, lambda transfer, ok: self._finish_promote(missing, ok))

    def _finish_promote(self, blocks: list[Block], ok: bool) -> None:
        """A promotion landed (on the copy engine's thread, or at once in replay)."""
        with self._lock:
            device = self.tiers[Tier.DEVICE]
            for b in blocks:
                b.copies[Tier.HOST].waiters -= 1
                b.copies[Tier.DEVICE].loading = False
                if ok:
                    device.counters.promotions += 1
                    device.counters.bytes_in += self.layout.page_bytes
            if not ok:
                # A failed CUDA copy leaves the context unusable; drop what nobody holds.
                self._drop_copies([b for b in blocks if not b.copies[Tier.DEVICE].pins], Tier.DEVICE)
            self._loaded.notify_all()

    @_locked
    def prefetch(self, session: str, namespace: str, keys: list[bytes], tier: Tier = Tier.HOST, priority: int = 0) -> int:
        """Start loading the disk-only pages of `keys` into `tier`; returns at once.

        A hint, best effort: it stops at the first key that is not cached, when the
        prefetch queue is full (back-pressure) or when no room can be made. A loaded page is
        held for `prefetch_hold` seconds unless acquired. Returns how many leading keys are
        now in `tier` or on their way (a page already loading counts: loads merge).
        """
        check_namespace(namespace)
        check_keys(keys)
        if tier != Tier.HOST:
            raise InvalidArgument(
                f"prefetch into {tier.label} is not available: prefetch loads pages into host; "
                "acquire into device promotes them from there"
            )
        room = self.mover.prefetch_room()
        accepted = 0
        for key in keys:
            block = self.blocks.get((namespace, key))
            if block is None:
                break
            if tier not in block.copies:
                if room == 0:
                    break
                try:
                    self._start_loads(session, [block], tier, LoadKind.PREFETCH, priority)
                except CapacityError:
                    break
                block.copies[tier].waiters -= 1  # nobody waits: the hold protects it once loaded
                room -= 1
            accepted += 1
        return accepted

    def _start_loads(
        self, session: str, blocks: list[Block], tier: Tier, kind: LoadKind, priority: int = 0
    ) -> None:
        """Register one waiter on each block's copy in `tier`, starting a load for each block
        that has none (joining a load in flight instead: one transfer per page).

        Raises CapacityError, having changed nothing, when room for the loads cannot be made.
        """
        # Protect everything involved while room is made: the copies here (as waiters,
        # which they stay), device-only pages copied down first, and the disk copies about
        # to be read.
        present = [b for b in blocks if tier in b.copies]
        for b in present:
            b.copies[tier].waiters += 1
        down = [b for b in blocks if tier not in b.copies and Tier.DISK not in b.copies]
        try:
            self._copy_down(down)
        except CapacityError:
            self._stop_waiting(present, tier)
            raise
        for b in down:
            b.copies[tier].waiters += 1
        present += down
        missing = [b for b in blocks if tier not in b.copies]
        for b in missing:
            b.copies[Tier.DISK].waiters += 1
        try:
            self._make_room(tier, len(missing), hint=kind is LoadKind.PREFETCH)
        except CapacityError:
            for b in present:
                b.copies[tier].waiters -= 1
            raise
        finally:
            for b in missing:
                b.copies[Tier.DISK].waiters -= 1
        if kind is LoadKind.ACQUIRE:
            for b in present:
                if b.copies[tier].job is not None:
                    self.mover.boost(b.copies[tier].job)  # an Acquire now waits on a queued prefetch
        state = self.tiers[tier]
        for b in missing:
            slot = state.slots.alloc()
            # The slot holds this namespace's bytes from the read on, even if the page then
            # fails its checksum: a later writer of another namespace must get it zeroed.
            self._host_owner[slot] = b.ref[0]
            source = b.copies[Tier.DISK]
            source.waiters += 1  # the disk slot must not be reused while we read it
            job = LoadJob(source.record, slot, kind, session, self._finish_load, priority)
            self._add_copy(b, tier, Copy(slot, loading=True, waiters=1, job=job))
            self._loading += 1
            self.mover.load(job)

    def _copy_down(self, blocks: list[Block]) -> None:
        """Give device-only blocks a host copy (a synchronous device -> host copy), so host
        acquires and prefetches find them there. Raises CapacityError, having changed
        nothing, when host cannot make room."""
        if not blocks:
            return
        for b in blocks:
            b.copies[Tier.DEVICE].waiters += 1
        try:
            self._make_room(Tier.HOST, len(blocks))
        finally:
            self._stop_waiting(blocks, Tier.DEVICE)
        self._demote_to_host(blocks)

    def _demote_to_host(self, blocks: list[Block]) -> None:
        """Copy device pages to free host slots (the caller made room) and file the copies."""
        host = self.tiers[Tier.HOST]
        slots = [host.slots.alloc() for _ in blocks]
        try:
            self.mover.demote([(b.copies[Tier.DEVICE].slot, slot) for b, slot in zip(blocks, slots)])
        except BaseException:
            for slot in slots:
                host.slots.free(slot)
            raise
        for b, slot in zip(blocks, slots):  # filed only once the bytes are there
            self._host_owner[slot] = b.ref[0]
            self._add_copy(b, Tier.HOST, Copy(slot))
        host.counters.demotions += len(blocks)
        host.counters.bytes_in += len(blocks) * self.layout.page_bytes

    def _finish_load(self, job: LoadJob, ok: bool) -> None:
        """A load ended (on an I/O worker, or at once in replay): publish or drop the page."""
        with self._lock:
            block = self.blocks[(job.record.namespace, job.record.key)]
            copy = block.copies[Tier.HOST]
            source = block.copies[Tier.DISK]
            source.waiters -= 1
            copy.loading = False
            copy.job = None
            self._loading -= 1
            state = self.tiers[Tier.HOST]
            if ok:
                copy.held_until = time.monotonic() + self.prefetch_hold
                state.counters.promotions += 1
                state.counters.bytes_in += self.layout.page_bytes
            else:
                # Waiting acquires see the copy gone and stop their ready prefix before it.
                copy.waiters = 0
                self.tiers[Tier.DISK].counters.corrupt_pages += 1
                self._drop_copies([block], Tier.HOST)
                self._drop_copies([block], Tier.DISK)
            self._loaded.notify_all()

    def _cancel_loads(self, session: str) -> None:
        """Withdraw a session's queued prefetches that no Acquire waits for."""
        self._withdraw(self.mover.cancel(session, lambda job: self._copy_of(job).waiters == 0))

    @_locked
    def stop_loads(self) -> None:
        """Withdraw every queued load (shutdown): waiting acquires return what is ready."""
        self._withdraw(self.mover.cancel(None, lambda job: True))

    def _withdraw(self, jobs: list[LoadJob]) -> None:
        for job in jobs:
            block = self.blocks[(job.record.namespace, job.record.key)]
            block.copies[Tier.DISK].waiters -= 1
            copy = block.copies[Tier.HOST]
            copy.loading, copy.job, copy.waiters = False, None, 0
            self._loading -= 1
            self._drop_copies([block], Tier.HOST)
        if jobs:
            self._loaded.notify_all()

    @_locked
    def wait_loaded(self, timeout: float | None = None) -> bool:
        """Block until no load is in flight (False if `timeout` seconds pass first). For
        benchmarks and tests that need a quiet store, not for the request path."""
        return self._loaded.wait_for(lambda: self._loading == 0, timeout)

    def _is_loading(self, block: Block, tier: Tier) -> bool:
        return self.blocks.get(block.ref) is block and tier in block.copies and block.copies[tier].loading

    def _copy_of(self, job: LoadJob) -> Copy:
        return self.blocks[(job.record.namespace, job.record.key)].copies[Tier.HOST]

    def _pin(self, block: Block, tier: Tier) -> None:
        copy = block.copies[tier]
        if not copy.pins:
            self.tiers[tier].pinned += 1
        copy.pins += 1

    def _unpin(self, block: Block, tier: Tier) -> None:
        copy = block.copies[tier]
        copy.pins -= 1
        if not copy.pins:
            self.tiers[tier].pinned -= 1

    @_locked
    def persist(self) -> int:
        """Copy host-only (and device-only, through host) pages to disk (clean shutdown),
        evicting colder disk-only pages if needed.

        Host residency does not survive a restart; this keeps what the disk can hold. Pages
        go in commit order (the index's insertion order), so a prefix is saved before its
        suffixes, and no disk copy of a page that is also in host is given up for another.
        Returns how many pages were copied.
        """
        if Tier.DISK not in self.tiers:
            return 0
        device_only = [b for b in self.blocks.values() if set(b.copies) == {Tier.DEVICE}]
        if device_only:
            try:  # through host, as far as host can take them
                self._copy_down(device_only[: self.tiers[Tier.HOST].slots.capacity])
            except CapacityError:
                pass  # host is full of leased pages: the device-only pages are not saved
        host_only = [b for b in self.blocks.values() if Tier.DISK not in b.copies and Tier.HOST in b.copies]
        pinned = self._pinned(Tier.DISK)
        before = self.tiers[Tier.DISK].counters.demotions
        self._copy_to_disk(
            host_only[: self.tiers[Tier.DISK].slots.capacity],
            keep=lambda ref: pinned(ref) or Tier.HOST in self.blocks[ref].copies,
        )
        return self.tiers[Tier.DISK].counters.demotions - before

    # -- leases and sessions --------------------------------------------------
    @_locked
    def release(self, session: str, lease_id: int) -> None:
        """End a lease: unpin a read lease's pages, free a write lease's uncommitted pages."""
        lease = self._get_lease(session, lease_id, None)
        self._release(lease)

    @_locked
    def end_session(self, session: str) -> int:
        """Release every lease of a session (closed, crashed or timed out). Returns how many."""
        ids = list(self.sessions.get(session, ()))
        for lease_id in ids:
            self._release(self.leases[lease_id])
        self._cancel_loads(session)
        return len(ids)

    @_locked
    def session_leases(self, session: str) -> int:
        """How many leases a session holds in this store (Heartbeat reports it)."""
        return len(self.sessions.get(session, ()))

    @contextmanager
    def lease_slots(self, session: str, lease_id: int, kind: LeaseKind) -> Iterator[tuple[int, ...]]:
        """Hold the store while the caller touches a lease's pages (the gRPC slow path),
        so the lease cannot be released under it."""
        with self._lock:
            lease = self._get_lease(session, lease_id, None)
            if lease.kind is not kind:
                raise FailedPrecondition(f"lease {lease_id} is a {lease.kind.value} lease; this needs a {kind.value} lease")
            if lease.tier is not Tier.HOST:
                raise FailedPrecondition(
                    f"lease {lease_id} holds {lease.tier.label} pages; the slow path moves host pages: acquire into host"
                )
            yield tuple(lease.slots)

    def _release(self, lease: LeaseRecord) -> None:
        state = self.tiers[lease.tier]
        if lease.kind is LeaseKind.WRITE:
            for slot in lease.slots:
                state.writing.discard(slot)
                state.slots.free(slot)
        else:
            for ref in lease.refs:
                self._unpin(self.blocks[ref], lease.tier)
        self._close_lease(lease)

    def _open_lease(self, session, namespace, kind, tier, slots, refs=()) -> LeaseRecord:
        lease = LeaseRecord(self._next_lease, session, namespace, kind, tier, list(slots), list(refs))
        self._next_lease += 1
        self.leases[lease.lease_id] = lease
        self.sessions.setdefault(session, set()).add(lease.lease_id)
        return lease

    def _close_lease(self, lease: LeaseRecord) -> None:
        del self.leases[lease.lease_id]
        ids = self.sessions[lease.session]
        ids.discard(lease.lease_id)
        if not ids:
            del self.sessions[lease.session]

    def _get_lease(self, session: str, lease_id: int, kind: LeaseKind | None) -> LeaseRecord:
        lease = self.leases.get(lease_id)
        if lease is None:
            if isinstance(lease_id, int) and 0 < lease_id < self._next_lease:
                raise FailedPrecondition(f"lease {lease_id} has already been released or committed")
            raise NotFound(f"no lease {lease_id!r}; use the id that borrow or acquire returned")
        if lease.session != session:
            raise FailedPrecondition(f"lease {lease_id} belongs to another session; release it from its own session")
        if kind is LeaseKind.WRITE and lease.kind is not LeaseKind.WRITE:
            raise FailedPrecondition(
                f"lease {lease_id} is a read lease; only pages leased by borrow can be committed"
            )
        return lease

    # -- eviction and demotion ------------------------------------------------
    def _pinned(self, tier: Tier, *, holds: bool = True) -> Callable[[Ref], bool]:
        """Copies the policy must not choose: leased, loading, awaited, or (with `holds`)
        held after a prefetch."""
        now = time.monotonic()

        def protected(ref: Ref) -> bool:
            c = self.blocks[ref].copies[tier]
            return bool(c.pins or c.waiters or c.loading or (holds and c.held_until > now))

        return protected

    def _make_room(self, tier: Tier, n: int, *, hint: bool = False) -> None:
        """Make n slots of `tier` free, or raise CapacityError having changed nothing.

        Held prefetched pages go last: only when nothing else can, and never to make room
        for a hint (`hint`). So prefetches cannot evict each other's held pages, and a
        host full of them never refuses a borrow or an acquire.
        """
        state = self.tiers[tier]
        short = n - state.slots.free_count
        if short <= 0:
            return
        victims = state.policy.victims(short, self._pinned(tier))
        if len(victims) < short and not hint:
            chosen, unheld = set(victims), self._pinned(tier, holds=False)
            victims += state.policy.victims(short - len(victims), lambda ref: ref in chosen or unheld(ref))
        if len(victims) < short:
            raise CapacityError(
                f"{tier.label} tier is full: {n} pages needed, {state.slots.free_count} free, "
                f"{len(victims)} evictable, the rest leased or in use; release leases or give the tier more capacity"
            )
        self._evict(tier, [self.blocks[ref] for ref in victims])

    def _evict(self, tier: Tier, victims: list[Block]) -> None:
        """Remove victims' copies from `tier`. Device copies with no host copy and host
        copies with no disk copy are demoted first where the next tier can take them; what
        it cannot take is dropped."""
        if tier == Tier.HOST and Tier.DISK in self.tiers:
            self._copy_to_disk([b for b in victims if Tier.DISK not in b.copies])
        if tier == Tier.DEVICE:
            only_here = [b for b in victims if Tier.HOST not in b.copies]
            also_host = [b for b in victims if Tier.HOST in b.copies]
            for b in also_host:  # their host copies are what survives: not room for the others
                b.copies[Tier.HOST].waiters += 1
            try:
                self._make_room(Tier.HOST, len(only_here))
            except CapacityError:
                only_here = []  # host is full of leased pages: these device pages are dropped
            finally:
                self._stop_waiting(also_host, Tier.HOST)
            if only_here:
                self._demote_to_host(only_here)
        self._drop_copies(victims, tier)
        self.tiers[tier].counters.evictions += len(victims)

    def _copy_to_disk(self, blocks: list[Block], keep: Callable[[Ref], bool] | None = None) -> None:
        """Copy host pages to disk (demotion, or write-through), as many as the disk can take.
        Disk pages for which `keep` is true (default: pinned ones) are never evicted for room."""
        if not blocks:
            return
        disk = self.tiers[Tier.DISK]
        short = len(blocks) - disk.slots.free_count
        if short > 0:
            room = disk.policy.victims(short, keep or self._pinned(Tier.DISK))
            self._evict(Tier.DISK, [self.blocks[ref] for ref in room])
        fits = blocks[: disk.slots.free_count]
        moves = []
        for block in fits:
            ns, key = block.ref
            slot = disk.slots.alloc()
            parent = block.parent[1] if block.parent else None
            moves.append((block.copies[Tier.HOST].slot, DiskRecord(ns, key, slot, parent)))
        for block, record in zip(fits, self.mover.store(moves)):
            self._add_copy(block, Tier.DISK, Copy(record.slot, record=record))
            disk.counters.demotions += 1
            disk.counters.bytes_in += self.layout.page_bytes

    def _add_copy(self, block: Block, tier: Tier, copy: Copy) -> None:
        state = self.tiers[tier]
        block.copies[tier] = copy
        state.policy.add(block.ref, block.parent)
        state.cached += 1

    def _drop_copies(self, blocks: list[Block], tier: Tier) -> None:
        """Drop each block's copy in `tier`; disk copies leave the persistent index in one batch."""
        records = [r for b in blocks if (r := self._drop_copy(b, tier)) is not None]
        if records:
            self.mover.forget(records)

    def _drop_copy(self, block: Block, tier: Tier) -> DiskRecord | None:
        """Remove one copy from the index and its tier; returns its disk record to forget, if any."""
        state = self.tiers[tier]
        copy = block.copies.pop(tier)
        if copy.pins:
            raise RuntimeError(f"invariant broken: dropping a pinned {tier.label} copy of {block.ref}")
        state.policy.remove(block.ref)
        state.slots.free(copy.slot)
        state.cached -= 1
        if not block.copies:
            del self.blocks[block.ref]
        return copy.record


def check_namespace(namespace: str) -> None:
    if not isinstance(namespace, str) or not namespace or len(namespace.encode()) > MAX_NAMESPACE_BYTES:
        raise InvalidArgument(f"namespace must be a non-empty string of at most {MAX_NAMESPACE_BYTES} bytes")


def check_keys(keys: list[bytes]) -> None:
    for i, key in enumerate(keys):
        if not isinstance(key, bytes) or not 0 < len(key) <= MAX_KEY_BYTES:
            raise InvalidArgument(
                f"key {i} must be 1 to {MAX_KEY_BYTES} bytes (a block key from kvtier_client.block_keys)"
            )
