"""Core: the block index, leases and sessions, loads and capacity of one page layout,
behind one façade (`BlockStore`) and one lock. The only code that changes residency.

Import from here: these names are the core's boundary. MissReason is the client's
(kvtier_client.results), the one definition of the wire's miss reasons."""
from kvtier_client.results import MissReason

from kvtier.core.history import DEFAULT_HISTORY_SIZE
from kvtier.core.index import TierCounters, check_keys, check_namespace
from kvtier.core.leases import LeaseKind
from kvtier.core.quotas import Quota
from kvtier.core.results import (
    BlockState, BlockStatus, CommitOutcome, Explanation, NamespaceTierUsage, NamespaceUsage, PrefixMatch, ReadGrant,
    StoreUsage, TierUsage, WriteGrant,
)
from kvtier.core.store import BlockStore
from kvtier.core.cluster import ClusterWrite
from kvtier.core.disk_writes import clean_reserve

__all__ = [
    "ClusterWrite",
    "DEFAULT_HISTORY_SIZE",
    "BlockState",
    "BlockStatus",
    "BlockStore",
    "CommitOutcome",
    "Explanation",
    "LeaseKind",
    "MissReason",
    "NamespaceTierUsage",
    "NamespaceUsage",
    "PrefixMatch",
    "Quota",
    "ReadGrant",
    "StoreUsage",
    "TierCounters",
    "TierUsage",
    "WriteGrant",
    "check_keys",
    "check_namespace",
    "clean_reserve",
]
