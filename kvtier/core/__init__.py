"""Core: the block index, leases and sessions, loads and capacity of one page layout,
behind one façade (`BlockStore`) and one lock. The only code that changes residency.

Import from here: these names are the core's boundary."""
from kvtier.core.store import (
    BlockStore,
    CommitOutcome,
    LeaseKind,
    PrefixMatch,
    ReadGrant,
    StoreUsage,
    TierCounters,
    TierUsage,
    WriteGrant,
    check_keys,
    check_namespace,
)

__all__ = [
    "BlockStore",
    "CommitOutcome",
    "LeaseKind",
    "PrefixMatch",
    "ReadGrant",
    "StoreUsage",
    "TierCounters",
    "TierUsage",
    "WriteGrant",
    "check_keys",
    "check_namespace",
]
