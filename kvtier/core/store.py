"""The block store: the one owner of residency state for one page layout.

Every slot of every tier is exactly one of

    free     in the tier's SlotAllocator
    writing  held by a write lease (borrowed, not yet committed)
    cached   holding a copy of a block; may be pinned by read leases

and the three counts add up to the tier's capacity (kvtier.core.invariants checks it).

The engine's path to a page, in four hops:

    borrow(n)   -> _make_room(HOST, n) -> policy.victims -> _evict (demote to disk / drop)
                -> n host slots, leased for writing
    commit(keys)-> each slot becomes a cached copy of its key (or is freed as a duplicate)
    acquire(keys, HOST) -> pins host copies; disk-only blocks are loaded into host first
    release     -> unpins (read) or frees what was never committed (write)

Capacity failures are decided before anything changes: `victims` only proposes, so a
request that cannot be met raises CapacityError with every structure untouched.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from functools import wraps

from kvtier_client.errors import CapacityError, FailedPrecondition, InvalidArgument, NotFound
from kvtier_client.layout import PageLayout
from kvtier_client.tiers import Tier

from kvtier.core.slots import SlotAllocator
from kvtier.mechanism.disk import DiskRecord
from kvtier.mechanism.mover import PageMover
from kvtier.policy import EvictionPolicy, Ref, make_policy

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
    corrupt_pages: int = 0  # copies dropped here because they failed their checksum


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
class Lease:
    lease_id: int
    session: str
    namespace: str
    kind: LeaseKind
    tier: Tier
    slots: list[int]
    refs: list[Ref] = field(default_factory=list)  # read leases: the pinned blocks


@dataclass(frozen=True)
class LookupResult:
    """`hit_blocks` leading keys are cached; `tiers[i]` is the fastest tier holding key i."""

    hit_blocks: int
    tiers: tuple[Tier, ...]


@dataclass(frozen=True)
class WriteLease:
    lease_id: int
    tier: Tier
    slots: tuple[int, ...]


@dataclass(frozen=True)
class CommitResult:
    """`duplicates` are indices of keys that were already cached: the cached page was kept
    and the lease's page for that key was freed. The lease has ended."""

    lease_id: int
    committed: int
    duplicates: tuple[int, ...]


@dataclass(frozen=True)
class ReadLease:
    lease_id: int
    tier: Tier
    slots: tuple[int, ...]
    promoted: int  # how many of the pages had to be loaded from a slower tier


@dataclass(frozen=True)
class TierStats:
    tier: Tier
    capacity: int
    free: int
    writing: int
    cached: int
    pinned: int
    counters: TierCounters


@dataclass(frozen=True)
class StoreStats:
    tiers: tuple[TierStats, ...]
    lookup_blocks: int
    miss_blocks: int
    leases: int
    sessions: int

    def tier(self, tier: Tier) -> TierStats | None:
        return next((t for t in self.tiers if t.tier == tier), None)


def _locked(method):
    @wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper


class BlockStore:
    """Index, leases and sessions for one layout's host (and optional disk) tier."""

    def __init__(
        self,
        layout: PageLayout,
        *,
        host_pages: int,
        mover: PageMover,
        disk_pages: int = 0,
        policy: str = "lru",
        write_through: bool = False,
        recovered: Iterable[DiskRecord] = (),
    ) -> None:
        if host_pages <= 0:
            raise ValueError("the host tier needs at least one page: it is where engines read and write pages")
        self.layout = layout
        self.mover = mover
        self.write_through = write_through
        self.blocks: dict[Ref, Block] = {}
        self.leases: dict[int, Lease] = {}
        self.sessions: dict[str, set[int]] = {}
        self.tiers: dict[Tier, TierState] = {Tier.HOST: TierState(Tier.HOST, SlotAllocator(host_pages), make_policy(policy))}
        self._host_owner: list[str | None] = [None] * host_pages  # namespace whose data a host slot last held
        self._next_lease = 1
        self._lookup_blocks = 0
        self._miss_blocks = 0
        self._lock = threading.RLock()
        if disk_pages > 0:
            self._recover_disk(disk_pages, policy, recovered)

    def _recover_disk(self, pages: int, policy: str, records: Iterable[DiskRecord]) -> None:
        ordered = sorted(records, key=lambda r: r.seq)
        state = TierState(Tier.DISK, SlotAllocator(pages, used=[r.slot for r in ordered]), make_policy(policy))
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
    def lookup(self, namespace: str, keys: list[bytes]) -> LookupResult:
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
        return LookupResult(len(tiers), tuple(tiers))

    @_locked
    def stats(self) -> StoreStats:
        tiers = []
        for state in self.tiers.values():
            tiers.append(
                TierStats(
                    state.tier,
                    state.slots.capacity,
                    state.slots.free_count,
                    len(state.writing),
                    state.cached,
                    state.pinned,
                    TierCounters(**vars(state.counters)),
                )
            )
        return StoreStats(tuple(tiers), self._lookup_blocks, self._miss_blocks, len(self.leases), len(self.sessions))

    # -- write path -----------------------------------------------------------
    @_locked
    def borrow(self, session: str, namespace: str, n: int) -> WriteLease:
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
        return WriteLease(lease.lease_id, Tier.HOST, tuple(slots))

    @_locked
    def commit(self, session: str, lease_id: int, keys: list[bytes], parent: bytes | None = None) -> CommitResult:
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
        return CommitResult(lease_id, len(fresh), tuple(duplicates))

    # -- read path ------------------------------------------------------------
    @_locked
    def acquire(self, session: str, namespace: str, keys: list[bytes], tier: Tier = Tier.HOST) -> ReadLease:
        """A read lease pinning every key's page in `tier`, loading disk-only pages first.

        Every key must be cached (look up first and acquire the hit prefix). A page that
        fails its checksum while loading is dropped; the call then raises NotFound and
        holds nothing.
        """
        check_namespace(namespace)
        check_keys(keys)
        if not keys:
            raise InvalidArgument("acquire needs at least one key; look up first and acquire the hit prefix")
        if tier != Tier.HOST:
            raise InvalidArgument(f"acquire into {tier.label} is not available: this daemon lends host pages")
        if len(set(keys)) != len(keys):
            raise InvalidArgument("acquire got the same key twice; pass each block once")
        blocks = []
        for i, key in enumerate(keys):
            block = self.blocks.get((namespace, key))
            if block is None:
                raise NotFound(f"key {i} ({key.hex()}) is not cached; look up again and acquire only the hit prefix")
            blocks.append(block)
        state = self.tiers[tier]
        if len(keys) > state.slots.capacity:
            raise InvalidArgument(f"acquire of {len(keys)} pages exceeds the {tier.label} tier's {state.slots.capacity}")
        # Pin every copy involved, so that making room can evict none of them: the pages
        # already here, and the disk copies about to be loaded.
        missing = [b for b in blocks if tier not in b.copies]
        for b in blocks:
            self._pin(b, tier if b not in missing else Tier.DISK)
        try:
            self._make_room(tier, len(missing))
        except CapacityError:
            for b in blocks:
                self._unpin(b, tier if b not in missing else Tier.DISK)
            raise
        corrupt = []
        for b in missing:
            self._unpin(b, Tier.DISK)
            if not self._promote(b, tier):
                corrupt.append(b)
        if corrupt:
            for b in blocks:
                if tier in b.copies:
                    self._unpin(b, tier)
            first = keys.index(corrupt[0].ref[1])
            raise NotFound(
                f"{len(corrupt)} page(s) from key {first} on failed their checksum on disk and were dropped; "
                "recompute and commit them again"
            )
        for b in blocks:
            state.policy.touch(b.ref)
        slots = [b.copies[tier].slot for b in blocks]
        lease = self._open_lease(session, namespace, LeaseKind.READ, tier, slots, [b.ref for b in blocks])
        return ReadLease(lease.lease_id, tier, tuple(slots), len(missing))

    @_locked
    def prefetch(self, namespace: str, keys: list[bytes], tier: Tier = Tier.HOST) -> int:
        """Best effort: load the disk-only pages of `keys` into `tier`, unpinned, in order.

        Stops at the first key that is not cached, at the first corrupt page, or when no
        more room can be made. Returns how many pages were loaded.
        """
        check_namespace(namespace)
        check_keys(keys)
        if tier != Tier.HOST:
            # As in acquire: only host pages are lent, and the store has no other tier to load into.
            raise InvalidArgument(f"prefetch into {tier.label} is not available: this daemon loads pages into host")
        held: list[Block] = []  # pinned while the loop runs, so later keys cannot evict earlier ones
        try:
            for key in keys:
                block = self.blocks.get((namespace, key))
                if block is None:
                    break
                if tier not in block.copies:
                    self._pin(block, Tier.DISK)
                    try:
                        self._make_room(tier, 1)
                    except CapacityError:
                        break
                    finally:
                        self._unpin(block, Tier.DISK)
                    if not self._promote(block, tier):
                        break
                    held.append(block)
        finally:
            for block in held:
                self._unpin(block, tier)
        return len(held)

    def _promote(self, block: Block, tier: Tier) -> bool:
        """Load a disk copy into a free slot of `tier`, pinned. False if the page was corrupt."""
        source = block.copies[Tier.DISK]
        state = self.tiers[tier]
        slot = state.slots.alloc()
        # From the load on the slot holds this namespace's bytes, even if the page then fails
        # its checksum and the slot is freed: a later borrow by another namespace must zero it.
        self._host_owner[slot] = block.ref[0]
        if not self.mover.load(source.record, slot):
            state.slots.free(slot)
            self.tiers[Tier.DISK].counters.corrupt_pages += 1
            self._drop_copies([block], Tier.DISK)
            return False
        self._add_copy(block, tier, Copy(slot))
        self._pin(block, tier)
        state.counters.promotions += 1
        state.counters.bytes_in += self.layout.page_bytes
        return True

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
        """Copy host-only pages to disk (clean shutdown), evicting colder disk-only pages if needed.

        Host residency does not survive a restart; this keeps what the disk can hold. Pages
        go in commit order (the index's insertion order), so a prefix is saved before its
        suffixes, and no disk copy of a page that is also in host is given up for another.
        Returns how many pages were copied.
        """
        if Tier.DISK not in self.tiers:
            return 0
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
        return len(ids)

    @contextmanager
    def lease_slots(self, session: str, lease_id: int, kind: LeaseKind) -> Iterator[tuple[int, ...]]:
        """Hold the store while the caller touches a lease's pages (the gRPC slow path),
        so the lease cannot be released under it."""
        with self._lock:
            lease = self._get_lease(session, lease_id, None)
            if lease.kind is not kind:
                raise FailedPrecondition(f"lease {lease_id} is a {lease.kind.value} lease; this needs a {kind.value} lease")
            yield tuple(lease.slots)

    def _release(self, lease: Lease) -> None:
        state = self.tiers[lease.tier]
        if lease.kind is LeaseKind.WRITE:
            for slot in lease.slots:
                state.writing.discard(slot)
                state.slots.free(slot)
        else:
            for ref in lease.refs:
                self._unpin(self.blocks[ref], lease.tier)
        self._close_lease(lease)

    def _open_lease(self, session, namespace, kind, tier, slots, refs=()) -> Lease:
        lease = Lease(self._next_lease, session, namespace, kind, tier, list(slots), list(refs))
        self._next_lease += 1
        self.leases[lease.lease_id] = lease
        self.sessions.setdefault(session, set()).add(lease.lease_id)
        return lease

    def _close_lease(self, lease: Lease) -> None:
        del self.leases[lease.lease_id]
        ids = self.sessions[lease.session]
        ids.discard(lease.lease_id)
        if not ids:
            del self.sessions[lease.session]

    def _get_lease(self, session: str, lease_id: int, kind: LeaseKind | None) -> Lease:
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
    def _pinned(self, tier: Tier):
        return lambda ref: self.blocks[ref].copies[tier].pins > 0

    def _make_room(self, tier: Tier, n: int) -> None:
        """Make n slots of `tier` free, or raise CapacityError having changed nothing."""
        state = self.tiers[tier]
        short = n - state.slots.free_count
        if short <= 0:
            return
        victims = state.policy.victims(short, self._pinned(tier))
        if len(victims) < short:
            raise CapacityError(
                f"{tier.label} tier is full: {n} pages needed, {state.slots.free_count} free, "
                f"{len(victims)} evictable, the rest leased or in use; release leases or give the tier more capacity"
            )
        self._evict(tier, [self.blocks[ref] for ref in victims])

    def _evict(self, tier: Tier, victims: list[Block]) -> None:
        """Remove victims' copies from `tier`. Host copies with no disk copy are demoted
        first where the disk tier can take them; what it cannot take is dropped."""
        if tier == Tier.HOST and Tier.DISK in self.tiers:
            self._copy_to_disk([b for b in victims if Tier.DISK not in b.copies])
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
