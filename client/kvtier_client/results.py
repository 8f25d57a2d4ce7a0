"""What the client returns: small frozen dataclasses, so no protobuf message leaks to an engine."""
from __future__ import annotations

import enum
from dataclasses import dataclass

from kvtier_client.ids import SessionId
from kvtier_client.keys import BlockKey
from kvtier_client.layout import PageLayout
from kvtier_client.proto.v1 import kvtier_pb2 as pb
from kvtier_client.tiers import Tier
from kvtier_client.wire import layout_from_proto, tier_from_proto


@dataclass(frozen=True)
class PoolInfo:
    """A registered session and the pool it uses: what Register answered."""

    session_id: SessionId
    namespace: str
    layout: PageLayout
    algorithm: str
    pool_id: str
    page_bytes: int
    slot_bytes: int
    tiers: tuple[tuple[Tier, int], ...]  # (tier, capacity in pages), as the daemon listed them
    handoff_socket: str  # where a same-host client attaches its session (empty over TCP)
    host_arena_bytes: int  # size of this namespace's host arena (0 over TCP)
    heartbeat_interval: float  # seconds
    session_timeout: float  # seconds
    device_ipc_handle: bytes = b""  # the device arena's CUDA IPC handle; empty without a device tier
    device_arena_bytes: int = 0
    device_pci_bus_id: str = ""
    lane_socket: str = ""  # the same-host fast lane for the hot calls (empty over TCP, or when it is off)
    commit_checksums: bool = False  # the daemon takes the pages' checksums with a commit
    lookup_known: bool = False  # the daemon reads a lookup's `known` (the engine's own leading blocks)

    @classmethod
    def from_proto(cls, reply: pb.RegisterResponse, namespace: str, layout: PageLayout, algorithm: str) -> "PoolInfo":
        return cls(
            session_id=SessionId(reply.session_id),
            namespace=namespace,
            layout=layout,
            algorithm=algorithm,
            pool_id=reply.pool_id,
            page_bytes=reply.page_bytes,
            slot_bytes=reply.slot_bytes,
            tiers=tuple((tier_from_proto(t.tier), t.capacity_pages) for t in reply.tiers),
            handoff_socket=reply.handoff_socket,
            host_arena_bytes=reply.host_arena_bytes,
            heartbeat_interval=reply.heartbeat_interval_ms / 1000,
            session_timeout=reply.session_timeout_ms / 1000,
            device_ipc_handle=reply.device_ipc_handle,
            device_arena_bytes=reply.device_arena_bytes,
            device_pci_bus_id=reply.device_pci_bus_id,
            lane_socket=reply.lane_socket,
            commit_checksums=reply.commit_checksums,
            lookup_known=reply.lookup_known,
        )

    def capacity(self, tier: Tier) -> int:
        """Pages in `tier`; 0 if the daemon has no such tier."""
        return next((pages for t, pages in self.tiers if t == tier), 0)


@dataclass(frozen=True)
class LookupResult:
    """The first `hit_blocks` keys are cached; `tiers[i]` is the fastest tier holding key i."""

    hit_blocks: int
    tiers: tuple[Tier, ...]

    @classmethod
    def from_proto(cls, reply: pb.LookupResponse) -> "LookupResult":
        return cls(reply.hit_blocks, tuple(tier_from_proto(t) for t in reply.tiers))

    def hit_keys(self, keys: list[BlockKey]) -> list[BlockKey]:
        """The cached prefix of `keys` (the keys this lookup was for): what to acquire."""
        return keys[: self.hit_blocks]


@dataclass(frozen=True)
class CommitResult:
    """`duplicates` are indices of keys that were already cached: the daemon kept its page and
    freed ours. The lease has ended either way."""

    committed: int
    duplicates: tuple[int, ...]


@dataclass(frozen=True)
class TierStats:
    tier: Tier
    capacity_pages: int
    free_pages: int
    writing_pages: int  # borrowed, not yet committed
    cached_pages: int
    pinned_pages: int  # cached and held by read leases
    hits: int
    evictions: int
    promotions: int
    demotions: int
    bytes_in: int
    corrupt_pages: int
    read_bytes_per_second: float  # measured by the daemon; 0.0 if it has no figure yet
    loading_pages: int = 0  # cached, bytes still on their way
    held_pages: int = 0  # loaded ahead of use, kept for the daemon's prefetch_hold
    io_errors: int = 0  # failed reads or writes of this tier
    refused_pages: int = 0  # disk: host pages the daemon's disk admission kept off it
    stored_bytes: int = 0  # disk, cluster: what cached pages take as stored (encoded); 0 elsewhere
    capacity_bytes: int = 0  # disk, cluster: the tier's room in bytes
    free_bytes: int = 0
    served_blocks: int = 0  # blocks lent by acquires whose fastest copy was here on arrival (hits: what lookups found)

    @property
    def idle_pages(self) -> int:
        """Cached pages that are neither pinned, loading nor held: evictable now."""
        return self.cached_pages - self.pinned_pages - self.loading_pages - self.held_pages

    @classmethod
    def from_proto(cls, m: pb.TierStats) -> "TierStats":
        return cls(
            tier_from_proto(m.tier), m.capacity_pages, m.free_pages, m.writing_pages, m.cached_pages,
            m.pinned_pages, m.hits, m.evictions, m.promotions, m.demotions, m.bytes_in, m.corrupt_pages,
            m.read_bytes_per_second, m.loading_pages, m.held_pages, m.io_errors, m.refused_pages, m.stored_bytes,
            m.capacity_bytes, m.free_bytes, m.served_blocks,
        )


@dataclass(frozen=True)
class PoolStats:
    pool_id: str
    layout: PageLayout
    page_bytes: int
    tiers: tuple[TierStats, ...]
    lookup_blocks: int  # looked up beyond the engines' own blocks: hits + miss_blocks
    miss_blocks: int
    engine_blocks: int = 0  # looked-up blocks the engines held already (a lookup's `known`)

    @classmethod
    def from_proto(cls, m: pb.PoolStats) -> "PoolStats":
        return cls(
            m.pool_id, layout_from_proto(m.layout), m.page_bytes,
            tuple(TierStats.from_proto(t) for t in m.tiers), m.lookup_blocks, m.miss_blocks, m.engine_blocks,
        )

    @property
    def served_rate(self) -> float:
        """Blocks kvtier served (lent by acquires, every tier) over the blocks looked up
        beyond the engines' own: the hit rate to read (docs/metrics.md); 0.0 before any lookup."""
        return sum(t.served_blocks for t in self.tiers) / self.lookup_blocks if self.lookup_blocks else 0.0

    def tier(self, tier: Tier) -> TierStats | None:
        return next((t for t in self.tiers if t.tier == tier), None)


@dataclass(frozen=True)
class Stats:
    """The daemon at a glance: every pool, sessions and leases."""

    version: str
    pools: tuple[PoolStats, ...]
    sessions: int
    leases: int
    uptime_seconds: float

    @classmethod
    def from_proto(cls, m: pb.StatsResponse) -> "Stats":
        return cls(m.version, tuple(PoolStats.from_proto(p) for p in m.pools), m.sessions, m.leases, m.uptime_seconds)

    def pool(self, pool_id: str) -> PoolStats | None:
        return next((p for p in self.pools if p.pool_id == pool_id), None)


class MissReason(str, enum.Enum):
    """Why a looked-up block was not part of the hit prefix: the names Stats counts misses
    under (NamespaceStats.misses) and Explain's miss states. The one definition: the daemon's
    core records and counts these same members."""

    NEVER_STORED = "never_stored"  # no record in this namespace and layout (or too old to remember)
    EVICTED = "evicted"  # its last copy was evicted (from `tier` by `policy`, `seconds_ago`)
    CORRUPT = "corrupt"  # its last copy failed its checksum and was dropped (from `tier`)
    BEYOND_PREFIX = "beyond_prefix"  # cached in `tier`, but after a block that is not
    DROPPED = "dropped"  # a client's drop (`kvtier cache drop`, KVTierClient.drop) removed every copy (last from `tier`)


#: Why a block is or is not served: its state in the daemon (Explain). CACHED (in `tier`,
#: part of the longest cached prefix), each MissReason under its own name and value, and
#: OTHER_LAYOUT (cached in another pool, i.e. page layout, of the namespace: `pool_id`;
#: only Explain across pools finds it).
BlockReason = enum.Enum(
    "BlockReason",
    [("CACHED", "cached"), *((r.name, r.value) for r in MissReason), ("OTHER_LAYOUT", "other_layout")],
    module=__name__, qualname="BlockReason",
)

#: Each BlockReason's kvtier.v1.BlockState (the proto's numbering): the one table, both ways.
BLOCK_STATES = {
    BlockReason.CACHED: pb.BLOCK_CACHED,
    BlockReason.NEVER_STORED: pb.BLOCK_NEVER_STORED,
    BlockReason.EVICTED: pb.BLOCK_EVICTED,
    BlockReason.CORRUPT: pb.BLOCK_CORRUPT,
    BlockReason.OTHER_LAYOUT: pb.BLOCK_OTHER_LAYOUT,
    BlockReason.BEYOND_PREFIX: pb.BLOCK_BEYOND_PREFIX,
    BlockReason.DROPPED: pb.BLOCK_DROPPED,
}
_REASONS = {state: reason for reason, state in BLOCK_STATES.items()}


@dataclass(frozen=True)
class BlockExplanation:
    """One key's answer: its state, and where and when it got there."""

    index: int
    reason: BlockReason
    tier: Tier | None  # CACHED, BEYOND_PREFIX: where it is; EVICTED, CORRUPT, DROPPED: where it was
    pool_id: str  # the pool the answer is about (OTHER_LAYOUT: the pool that has it)
    seconds_ago: float = 0.0  # EVICTED, CORRUPT, DROPPED
    policy: str = ""  # EVICTED: the eviction policy that chose it
    own_pressure: bool = False  # EVICTED: to make room for this namespace (else another one)
    hint: str = ""  # CACHED, BEYOND_PREFIX: the client hint that ranks it (a pin, a retain), in words

    @classmethod
    def from_proto(cls, m: pb.BlockExplanation) -> "BlockExplanation":
        if m.state not in _REASONS:
            raise ValueError(f"block state {m.state} is not a known kvtier.v1.BlockState; is the daemon newer than this client?")
        tier = tier_from_proto(m.tier) if m.tier != pb.TIER_UNSPECIFIED else None
        return cls(m.index, _REASONS[m.state], tier, m.pool_id, m.seconds_ago, m.policy, m.own_pressure, m.hint)


@dataclass(frozen=True)
class Explanation:
    """Why each key is (not) served: `blocks[i]` answers for key i; the first `hit_blocks`
    keys are the longest cached prefix. `hashings` are the settings the namespace's clients
    registered with ("<algorithm> <block_tokens> tokens/block"): keys computed otherwise
    never match."""

    hit_blocks: int
    blocks: tuple[BlockExplanation, ...]
    hashings: tuple[str, ...]

    @classmethod
    def from_proto(cls, m: pb.ExplainResponse) -> "Explanation":
        return cls(m.hit_blocks, tuple(BlockExplanation.from_proto(b) for b in m.blocks), tuple(m.hashings))


def hashing(algorithm: str, block_tokens: int) -> str:
    """How a client computes block keys, in the form of Explanation.hashings."""
    return f"{algorithm} {block_tokens} tokens/block"
