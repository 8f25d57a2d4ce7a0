"""kvtier client: everything an engine needs to use a kvtier daemon.

Import cost stays small: gRPC and numpy, never torch (torch views load it on first use).
"""
from kvtier_client.client import KVTierClient, Wait
from kvtier_client.connection import Backoff, TLSConfig
from kvtier_client.errors import (
    CapacityError,
    DaemonRestarted,
    FailedPrecondition,
    InvalidArgument,
    KVTierError,
    NotFound,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
)
from kvtier_client.groups import GroupHit, GroupLookup, GroupMode, GroupQuery
from kvtier_client.ids import LeaseId, SessionId, Slot
from kvtier_client.keys import ALGORITHMS, DEFAULT_ALGORITHM, BlockKey, block_keys, hash_fingerprint, root_key
from kvtier_client.layout import PageLayout
from kvtier_client.leases import ReadLease, WriteLease
from kvtier_client.remote import RemotePages
from kvtier_client.results import (
    BlockExplanation,
    BlockReason,
    CommitResult,
    Explanation,
    LookupResult,
    MissReason,
    PoolInfo,
    PoolStats,
    Stats,
    TierStats,
)
from kvtier_client.steering import MAX_TTL_SECONDS, Action, PinMode, PinUsage, Priority, SteerResult
from kvtier_client.tiers import Tier

__all__ = [
    "ALGORITHMS",
    "Action",
    "DEFAULT_ALGORITHM",
    "Backoff",
    "BlockExplanation",
    "BlockKey",
    "BlockReason",
    "CapacityError",
    "CommitResult",
    "DaemonRestarted",
    "Explanation",
    "FailedPrecondition",
    "GroupHit",
    "GroupLookup",
    "GroupMode",
    "GroupQuery",
    "InvalidArgument",
    "KVTierClient",
    "KVTierError",
    "LeaseId",
    "LookupResult",
    "MAX_TTL_SECONDS",
    "MissReason",
    "NotFound",
    "PageLayout",
    "PermissionDenied",
    "PinMode",
    "PinUsage",
    "PoolInfo",
    "PoolStats",
    "Priority",
    "ReadLease",
    "RemotePages",
    "SessionId",
    "Slot",
    "Stats",
    "SteerResult",
    "TLSConfig",
    "Tier",
    "TierStats",
    "Unauthenticated",
    "Unavailable",
    "Wait",
    "WriteLease",
    "block_keys",
    "hash_fingerprint",
    "root_key",
]
