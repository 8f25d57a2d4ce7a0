"""What the store's calls return: small frozen records at the core's boundary. Named apart
from the client's types (the client has its own `Lease`, `LookupResult`, `TierStats`...)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvtier_client.ids import LeaseId, Slot
from kvtier_client.results import BlockReason
from kvtier_client.tiers import Tier

from kvtier.core.index import TierCounters
from kvtier.core.ports import Transfer


@dataclass(frozen=True)
class PrefixMatch:
    """`hit_blocks` leading keys are cached; `tiers[i]` is the fastest tier holding key i."""

    hit_blocks: int
    tiers: tuple[Tier, ...]


@dataclass(frozen=True)
class GroupPages:
    """What one group of a group lookup needs to restore the prefix: the blocks
    [first_block, first_block + len(tiers)), `tiers[i]` the fastest tier holding each."""

    first_block: int
    tiers: tuple[Tier, ...]


@dataclass(frozen=True)
class GroupsMatch:
    """The first `hit_blocks` blocks can be restored by every group; `groups[i]`: what
    group i needs for it (kvtier.core.groups)."""

    hit_blocks: int
    groups: tuple[GroupPages, ...]


@dataclass(frozen=True)
class WriteGrant:
    """A borrow's answer: free pages leased for writing."""

    lease_id: LeaseId
    tier: Tier
    slots: tuple[Slot, ...]


@dataclass(frozen=True)
class CommitOutcome:
    """`duplicates` are indices of keys that were already cached: the cached page was kept
    and the lease's page for that key was freed. The lease has ended."""

    lease_id: LeaseId
    committed: int
    duplicates: tuple[int, ...]


@dataclass(frozen=True)
class ReadGrant:
    """An acquire's answer: cached pages leased for reading."""

    lease_id: LeaseId
    tier: Tier
    slots: tuple[Slot, ...]  # the ready prefix: pages pinned and readable
    promoted: int  # how many of the requested pages were not ready on arrival
    ready: int
    transfer: Transfer | None = None  # device: readable once this copy completes


@dataclass(frozen=True)
class TierUsage:
    """Every slot in exactly one state: free + writing + cached == capacity, and every
    cached page exactly one of pinned, loading, held (a prefetched page within its hold)
    or idle (evictable now)."""

    tier: Tier
    capacity: int
    free: int
    writing: int
    cached: int
    pinned: int
    loading: int
    held: int
    counters: TierCounters
    #: Disk and cluster: bytes the cached pages take as stored (their codecs' encodings),
    #: and the tier's room in bytes; a codec's gain is cached * page_bytes / stored_bytes.
    stored_bytes: int = 0
    capacity_bytes: int = 0
    free_bytes: int = 0

    @property
    def idle(self) -> int:
        return self.cached - self.pinned - self.loading - self.held


@dataclass(frozen=True)
class NamespaceTierUsage:
    """One namespace's share of one tier; quota fields are 0 where it has none."""

    tier: Tier
    pages: int  # cached copies; host: plus pages borrowed for writing
    max_pages: int
    guaranteed_pages: int
    hits: int  # looked-up blocks whose fastest copy was here
    evictions: int  # its copies evicted from this tier


@dataclass(frozen=True)
class NamespaceUsage:
    """One namespace's use of the store. `misses`: missed blocks by reason (the values of
    kvtier_client.results.MissReason: never_stored, evicted, corrupt, beyond_prefix, dropped)."""

    namespace: str
    tiers: tuple[NamespaceTierUsage, ...]
    lookup_blocks: int
    miss_blocks: int
    misses: Mapping[str, int]
    engine_blocks: int = 0  # looked-up blocks its engines held already (not in lookup_blocks)
    served: Mapping[Tier, int] = field(default_factory=dict)  # its blocks lent, by the tier each was in when asked

    def tier(self, tier: Tier) -> NamespaceTierUsage | None:
        return next((t for t in self.tiers if t.tier == tier), None)


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
    namespaces: tuple[NamespaceUsage, ...] = ()  # every namespace that has used the store
    history_entries: int = 0  # the miss history: departed blocks remembered, all namespaces together
    history_limit: int = 0  # the most it remembers
    history_bytes: int = 0  # its estimated size
    #: Looked-up blocks the engines held already (Lookup's `known`): not in lookup_blocks,
    #: which counts the blocks looked up beyond them (= hits + miss_blocks).
    engine_blocks: int = 0
    #: Blocks lent by acquires, by the tier each one's fastest copy was in when asked: what
    #: kvtier served (every tier; the cluster's too).
    served: Mapping[Tier, int] = field(default_factory=dict)

    def tier(self, tier: Tier) -> TierUsage | None:
        return next((t for t in self.tiers if t.tier == tier), None)

    def namespace(self, namespace: str) -> NamespaceUsage | None:
        return next((n for n in self.namespaces if n.namespace == namespace), None)


#: What `explain` finds for one key: the wire's BlockReason, CACHED or a MissReason (built
#: from kvtier_client.results.MissReason; the core never answers OTHER_LAYOUT, which
#: kvtier.server.explain finds across pools).
BlockState = BlockReason


@dataclass(frozen=True)
class BlockStatus:
    """One key of an `explain`. `tier`: the fastest tier holding it (CACHED, BEYOND_PREFIX)
    or the tier its last copy left (EVICTED, CORRUPT); the rest describe a departure."""

    index: int
    state: BlockState
    tier: Tier | None
    seconds_ago: float = 0.0
    policy: str = ""  # EVICTED: the eviction policy that chose it
    own_pressure: bool = False  # EVICTED: to make room for its own namespace
    hint: str = ""  # cached: the client's hint that ranks it, and for how long (kvtier.core.control)


@dataclass(frozen=True)
class Explanation:
    hit_blocks: int
    blocks: tuple[BlockStatus, ...]
