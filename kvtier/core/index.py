"""The block index: which blocks are cached, their copies in each tier, and each tier's
slots and counts. Plain bookkeeping: no locking (the store holds its lock around every
call), no I/O, no decisions.

A copy's protection, one word each:

    pinned     held by read leases (`pins`): never evicted, never moved
    protected  pinned, or `waiters` > 0, or `readers` > 0, or still `loading`, or being
               `saved`, or held after a prefetch (`held_until`): the policy must not
               choose it as a victim now. Held pages are given up only as a last resort
               for a real request, never for a hint (kvtier.core.capacity.Capacity.make_room)
    saved      a host copy whose bytes are being written to disk, outside the store's lock
               (kvtier.core.writes): readable and acquirable, never dropped meanwhile

    waiters    requests working with this copy right now: an Acquire waiting for it to
               load, or a call keeping it while it makes room elsewhere
    readers    copies in flight that read from this one: a disk load reading a disk copy,
               a promotion reading a host copy; the slot must not be reused meanwhile
"""
from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvtier_client.errors import InvalidArgument
from kvtier_client.ids import Slot
from kvtier_client.results import MissReason
from kvtier_client.tiers import Tier

from kvtier.core.chunks import ChunkAllocator, DiskSpace
from kvtier.core.hints import HintTable
from kvtier.core.history import DEFAULT_HISTORY_SIZE, MissHistory
from kvtier.core.ports import BlockEvents, LoadJob, PageRecord
from kvtier.core.slots import SlotAllocator
from kvtier.policy import EvictionPolicy, Ref

MAX_KEY_BYTES = 64
MAX_NAMESPACE_BYTES = 255
#: The owner of a host slot whose last contents are unknown (an adopted arena's free slots):
#: equal to no namespace, so the slot is zeroed before any writer gets it.
UNKNOWN_OWNER = "\0unknown"
# Enum members as plain names for the hot paths: reading one off its class is slow.
_HOST = Tier.HOST
_EVICTED, _CORRUPT = MissReason.EVICTED, MissReason.CORRUPT
_NEVER_STORED, _BEYOND_PREFIX = MissReason.NEVER_STORED, MissReason.BEYOND_PREFIX


@dataclass
class Copy:
    """One copy of a block in one tier."""

    slot: Slot
    pins: int = 0  # read leases holding this copy
    record: PageRecord | None = None  # disk copies: the persisted index entry
    loading: bool = False  # bytes still on their way (host: from disk; device: from host)
    waiters: int = 0  # requests waiting on or working with this copy now
    readers: int = 0  # copies in flight reading from this one (disk loads, promotions)
    held_until: float = 0.0  # a loaded page is kept (monotonic time) until acquired or this passes
    job: LoadJob | None = None  # the queued or running load, while loading
    saved: bool = False  # host copies: being written to disk (its disk slot is `writing` there)

    def is_protected(self, now: float, *, holds: bool = True, saves: bool = True) -> bool:
        """`saves` False: a copy being saved counts as evictable (it will be, once its
        write lands: kvtier.core.capacity waits for it)."""
        return bool(self.pins or self.waiters or self.readers or self.loading or (saves and self.saved)
                    or (holds and self.held_until > now))


@dataclass(eq=False)
class Block:
    ref: Ref
    parent: Ref | None
    copies: dict[Tier, Copy] = field(default_factory=dict)
    tokens: tuple[int, ...] | None = None  # its token ids, when the client passed them (KV events)
    in_cluster: bool = False  # known to be in the cluster tier: written there, or loaded from there

    @property
    def best_tier(self) -> Tier:
        return min(self.copies)

    def entry(self, tier: Tier) -> PageRecord:
        """The persistent index entry of this block's copy in `tier` (length, checksum and
        sequence are filled in by the tier that stores it)."""
        namespace, key = self.ref
        return PageRecord(namespace, key, self.copies[tier].slot, self.parent[1] if self.parent else None)


@dataclass
class TierCounters:
    hits: int = 0  # looked-up blocks whose fastest copy was here
    evictions: int = 0  # copies removed from this tier to make room
    promotions: int = 0  # copies made here from a slower tier
    demotions: int = 0  # copies made here from a faster tier
    bytes_in: int = 0  # bytes copied into this tier by promotions and demotions
    corrupt_pages: int = 0  # copies dropped here because they failed its checksum
    io_errors: int = 0  # reads or writes of this tier that failed (EIO, ENOSPC...): those pages were dropped or not copied
    refused: int = 0  # disk: host pages not written here as they left host, refused by the admission policy


@dataclass
class TierState:
    tier: Tier
    slots: SlotAllocator
    policy: EvictionPolicy
    writing: set[Slot] = field(default_factory=set)  # host: write-leased; disk: a write to it is in flight
    cached: int = 0
    pinned: int = 0  # cached copies held by at least one read lease
    loading: set[Ref] = field(default_factory=set)  # cached copies whose bytes are on their way
    held: set[Ref] = field(default_factory=set)  # loaded copies with a hold set (it may have passed)
    counters: TierCounters = field(default_factory=TierCounters)
    chunks: ChunkAllocator | None = None  # disk: where pages' bytes are (kvtier.core.chunks)
    space: DiskSpace | None = None  # disk: the chunks' geometry, and what a page reserves
    stored_bytes: int = 0  # disk: bytes its cached copies take as stored (encoded)

    def byte_usage(self) -> tuple[int, int, int]:
        """(stored, capacity, free) bytes where pages take their encodings' chunks (disk); 0s elsewhere."""
        if self.chunks is None:
            return 0, 0, 0
        chunk = self.space.chunk_bytes
        return self.stored_bytes, self.chunks.total * chunk, self.chunks.free_count * chunk

    def breakdown(self, blocks: dict[Ref, "Block"], now: float) -> tuple[int, int, int]:
        """(pinned, loading, held): cached copies in exactly one of these states (pinned
        first, then loading, then held within its hold); the rest of `cached` is idle."""
        loading = sum(1 for ref in self.loading if not blocks[ref].copies[self.tier].pins)
        expired = {ref for ref in self.held if blocks[ref].copies[self.tier].held_until <= now}
        self.held -= expired
        held = sum(1 for ref in self.held if not blocks[ref].copies[self.tier].pins and ref not in self.loading)
        return self.pinned, loading, held


@dataclass
class RequestCounters:
    lookup_blocks: int = 0  # keys looked up beyond those the engine held (engine_blocks)
    miss_blocks: int = 0  # of those, not cached
    engine_blocks: int = 0  # looked-up keys the engine held already: neither hits nor misses
    served: dict[Tier, int] = field(default_factory=lambda: _per_tier())  # blocks lent, by the tier each was in when asked
    acquired_pages: int = 0  # pages asked for by acquires
    ready_on_arrival: int = 0  # of those, already in the target tier and loaded
    loads_in_flight: int = 0  # host copies whose bytes are on their way


def _per_tier() -> dict[Tier, int]:
    return dict.fromkeys(Tier, 0)


@dataclass
class NamespaceCounters:
    """One namespace's share of the store, kept as it changes (quotas read it on every
    allocation)."""

    pages: dict[Tier, int] = field(default_factory=_per_tier)  # cached copies; host: plus slots borrowed for writing
    hits: dict[Tier, int] = field(default_factory=_per_tier)  # looked-up blocks whose fastest copy was there
    served: dict[Tier, int] = field(default_factory=_per_tier)  # blocks lent whose fastest copy was there when asked
    evictions: dict[Tier, int] = field(default_factory=_per_tier)  # its copies evicted from there
    lookup_blocks: int = 0
    miss_blocks: int = 0
    engine_blocks: int = 0
    misses: dict[MissReason, int] = field(default_factory=lambda: dict.fromkeys(MissReason, 0))


class BlockIndex:
    """Blocks by reference and the tiers' slot states, for one layout."""

    def __init__(self, tiers: Iterable[TierState], *, host_reused: bool = False,
                 history_size: int = DEFAULT_HISTORY_SIZE) -> None:
        """`host_reused`: the host arena held pages before (adopted after a crash), so no
        free slot may be assumed clean. `history_size`: departed blocks remembered, all
        namespaces together."""
        self.tiers: dict[Tier, TierState] = {state.tier: state for state in sorted(tiers, key=lambda s: s.tier)}
        self.blocks: dict[Ref, Block] = {}
        self.requests = RequestCounters()
        #: Every namespace that has used the store (an entry is made on first use).
        self.namespaces: defaultdict[str, NamespaceCounters] = defaultdict(NamespaceCounters)
        self.history = MissHistory(history_size)
        #: Clients' hints on blocks (pins, priorities); a block's hint leaves with it.
        self.hints = HintTable()
        host_pages = self.tiers[Tier.HOST].slots.capacity
        #: The namespace whose data each host slot last held: a slot must be zeroed before
        #: a writer of another namespace gets it.
        self.host_owner: list[str | None] = [UNKNOWN_OWNER if host_reused else None] * host_pages
        #: Told of copies that arrive in or leave a tier (KV events); None: nobody listens.
        self.events: BlockEvents | None = None

    def recover_disk(self, records: Iterable[PageRecord]) -> None:
        """File the disk tier's persisted pages, oldest first (the policy's recency)."""
        for record in sorted(records, key=lambda r: r.seq):
            parent = (record.namespace, record.parent) if record.parent else None
            self.add_block((record.namespace, record.key), parent, Tier.DISK, Copy(record.slot, record=record),
                           record.tokens)

    def recover_host(self, records: Iterable[PageRecord]) -> None:
        """File the host pages adopted from a crashed daemon's arena, oldest first, next to
        any disk copy of the same block."""
        for record in sorted(records, key=lambda r: r.seq):
            ref = (record.namespace, record.key)
            block = self.blocks.get(ref)
            if block is None:
                parent = (record.namespace, record.parent) if record.parent else None
                self.add_block(ref, parent, Tier.HOST, Copy(record.slot))
            else:
                self.add_copy(block, Tier.HOST, Copy(record.slot))
            self.host_owner[record.slot] = record.namespace

    def add_block(self, ref: Ref, parent: Ref | None, tier: Tier, copy: Copy,
                  tokens: tuple[int, ...] | None = None) -> Block:
        """File a new block with its first copy; a miss of its key is no longer explained by
        an earlier departure."""
        block = self.blocks[ref] = Block(ref, parent, tokens=tokens)
        self.add_copy(block, tier, copy)
        self.history.forget(ref)
        return block

    def add_copy(self, block: Block, tier: Tier, copy: Copy) -> None:
        state = self.tiers[tier]
        block.copies[tier] = copy
        state.policy.add(block.ref, block.parent)
        state.cached += 1
        if state.chunks is not None and copy.record is not None:
            state.stored_bytes += copy.record.stored
        self.namespaces[block.ref[0]].pages[tier] += 1
        if copy.loading:
            state.loading.add(block.ref)
        elif self.events is not None:
            self._stored(block, tier)

    def _stored(self, block: Block, tier: Tier) -> None:
        namespace, key = block.ref
        self.events.stored(tier, namespace, key, block.parent[1] if block.parent else None, block.tokens)

    def loaded(self, block: Block, tier: Tier, arrived: bool) -> None:
        """The copy's bytes have arrived (`arrived`), or its load was given up and the
        caller drops it."""
        block.copies[tier].loading = False
        self.tiers[tier].loading.discard(block.ref)
        if arrived and self.events is not None:
            self._stored(block, tier)

    def hold(self, block: Block, tier: Tier, until: float) -> None:
        """Keep a loaded copy until `until` (monotonic time) unless it is acquired first."""
        block.copies[tier].held_until = until
        if until:
            self.tiers[tier].held.add(block.ref)
        else:
            self.tiers[tier].held.discard(block.ref)

    def drop_copy(self, block: Block, tier: Tier) -> PageRecord | None:
        """Remove one copy from the index and its tier; returns its disk record to forget, if any."""
        state = self.tiers[tier]
        copy = block.copies.pop(tier)
        if copy.pins:
            raise RuntimeError(f"invariant broken: dropping a pinned {tier.label} copy of {block.ref}")
        state.policy.remove(block.ref)
        state.slots.free(copy.slot)
        if state.chunks is not None and copy.record is not None:
            state.chunks.give(copy.record.extent)
            state.stored_bytes -= copy.record.stored
        state.cached -= 1
        self.namespaces[block.ref[0]].pages[tier] -= 1
        state.held.discard(block.ref)
        if copy.loading:
            state.loading.discard(block.ref)
        elif self.events is not None:
            self.events.removed(tier, *block.ref)
        if not block.copies:
            del self.blocks[block.ref]
            if self.hints.hints:
                self.hints.clear(block.ref)
        return copy.record

    def evicted(self, blocks: list[Block], tier: Tier, policy: str, requester: str) -> None:
        """Count copies evicted from `tier` (already dropped) for a request of `requester`,
        and remember the blocks that left the index with them."""
        self.tiers[tier].counters.evictions += len(blocks)
        now = None
        for b in blocks:
            namespace = b.ref[0]
            self.namespaces[namespace].evictions[tier] += 1
            if not b.copies:
                if now is None:
                    now = time.monotonic()
                self.history.record(b.ref, _EVICTED, tier, now, policy, namespace == requester)

    def corrupted(self, block: Block) -> None:
        """The block's disk copy failed its checksum and was dropped (with its host copy)."""
        self.tiers[Tier.DISK].counters.corrupt_pages += 1
        if not block.copies:
            self.history.record(block.ref, _CORRUPT, Tier.DISK, time.monotonic())

    def count_misses(self, namespace: str, keys: list[bytes]) -> None:
        """Count why each of `keys` (a lookup's keys after its hit prefix) missed: one look-up
        in the index, and for a key not there one in the history."""
        misses = self.namespaces[namespace].misses
        blocks, why = self.blocks, self.history.reason
        for key in keys:
            ref = (namespace, key)
            if ref in blocks:
                misses[_BEYOND_PREFIX] += 1
            else:
                misses[why(ref) or _NEVER_STORED] += 1

    def start_writing(self, namespace: str, slots: list[Slot], tier: Tier = _HOST) -> None:
        """Slots being written for `namespace` (host: leased to a writer; disk: a store in
        flight): they count as its pages."""
        self.tiers[tier].writing.update(slots)
        self.namespaces[namespace].pages[tier] += len(slots)

    def stop_writing(self, namespace: str, slots: list[Slot], tier: Tier = _HOST) -> None:
        """The writing ended; the caller frees the slots or files them as copies."""
        self.tiers[tier].writing.difference_update(slots)
        self.namespaces[namespace].pages[tier] -= len(slots)

    def pin(self, block: Block, tier: Tier) -> None:
        copy = block.copies[tier]
        if not copy.pins:
            self.tiers[tier].pinned += 1
        copy.pins += 1

    def unpin(self, block: Block, tier: Tier) -> None:
        copy = block.copies[tier]
        copy.pins -= 1
        if not copy.pins:
            self.tiers[tier].pinned -= 1

    def protected(self, tier: Tier, *, holds: bool = True, saves: bool = True) -> Callable[[Ref], bool]:
        """The copies of `tier` the policy must not choose now (with `holds`, held
        prefetched pages too; without `saves`, copies being saved are not protected)."""
        now = time.monotonic() if holds else 0.0
        return lambda ref: self.blocks[ref].copies[tier].is_protected(now, holds=holds, saves=saves)

    def is_current(self, block: Block) -> bool:
        """Still filed: not dropped, nor replaced by a new block under the same key."""
        return self.blocks.get(block.ref) is block

    def is_loading(self, block: Block, tier: Tier) -> bool:
        return self.is_current(block) and tier in block.copies and block.copies[tier].loading

    def wait_on(self, blocks: Iterable[Block], tier: Tier) -> None:
        for b in blocks:
            b.copies[tier].waiters += 1

    def stop_waiting(self, blocks: Iterable[Block], tier: Tier) -> None:
        for b in blocks:
            if tier in b.copies:
                b.copies[tier].waiters -= 1

    def block_of(self, job: LoadJob) -> Block:
        return self.blocks[(job.record.namespace, job.record.key)]


def check_namespace(namespace: str) -> None:
    if not isinstance(namespace, str) or not namespace or len(namespace.encode()) > MAX_NAMESPACE_BYTES:
        raise InvalidArgument(f"namespace must be a non-empty string of at most {MAX_NAMESPACE_BYTES} bytes")


def check_keys(keys: list[bytes]) -> None:
    # The common case checked in C (type and length of every key); the loop finds the culprit.
    if not keys or (set(map(type, keys)) == {bytes} and min(map(len, keys)) > 0 and max(map(len, keys)) <= MAX_KEY_BYTES):
        return
    for i, key in enumerate(keys):
        if not isinstance(key, bytes) or not 0 < len(key) <= MAX_KEY_BYTES:
            raise InvalidArgument(
                f"key {i} must be 1 to {MAX_KEY_BYTES} bytes (a block key from kvtier_client.block_keys)"
            )
