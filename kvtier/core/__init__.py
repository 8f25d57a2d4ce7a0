"""Core: the block index, leases and sessions, loads and capacity of one page layout,
behind one façade (`BlockStore`) and one lock. The only code that changes residency.

Import from here: these names are the core's boundary."""
from kvtier.core.index import TierCounters, check_keys, check_namespace
from kvtier.core.leases import LeaseKind
from kvtier.core.results import CommitOutcome, PrefixMatch, ReadGrant, StoreUsage, TierUsage, WriteGrant
from kvtier.core.store import BlockStore

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
