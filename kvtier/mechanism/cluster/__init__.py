"""The cluster tier: pages shared by every node on an existing distributed store.

    remote.py   the seam: ClusterBackend (reads its URLs, opens stores) and RemoteStore
                (batched exists, get, put, delete, memory of opaque two-part values),
                StoreSettings, and RemoteFault, how a store reports a failure
    redis.py    the built-in backend: Redis or Valkey Cluster through redis-py
    backends.py BACKENDS, the backends by URL scheme (built in, or the entry point group
                kvtier.cluster_backends): open_backend(url) makes the store a URL names,
                check_url reads a URL
    values.py   the key and value format, the tier's and not a backend's: keys carry
                prefix, layout and namespace; values a header (format version, layout,
                length, checksum, seal, codec) before the page
    tier.py     ClusterTier: pages in and out of one layout's share of the store; every
                fault a miss, counted by kind and logged once per episode
    writer.py   ClusterWriter: committed pages to the cluster in the background, bounded

A second backend (Mooncake Store, say) is one module providing ClusterBackend and
RemoteStore, and an entry point naming it: in kvtier or outside it (docs/tiers.md,
"Adding a cluster backend"); nothing else changes.
"""
from kvtier.mechanism.cluster.backends import BACKENDS, check_url, open_backend
from kvtier.mechanism.cluster.redis import RedisClusterStore
from kvtier.mechanism.cluster.remote import (
    ClusterBackend, FaultKind, RemoteFault, RemoteMemory, RemoteStore, StoreSettings,
)
from kvtier.mechanism.cluster.tier import ClusterStats, ClusterTier
from kvtier.mechanism.cluster.writer import ClusterWriter

__all__ = [
    "BACKENDS", "ClusterBackend", "ClusterStats", "ClusterTier", "ClusterWriter", "FaultKind", "RedisClusterStore",
    "RemoteFault", "RemoteMemory", "RemoteStore", "StoreSettings", "check_url", "open_backend",
]
