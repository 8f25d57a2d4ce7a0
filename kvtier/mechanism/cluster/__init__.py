"""The cluster tier: pages shared by every node on an existing distributed store.

    remote.py   RemoteStore, the interface a store implements (batched exists, get, put,
                delete, memory), and RemoteFault, how a store reports a failure
    redis.py    RedisClusterStore: Redis or Valkey Cluster through redis-py's RedisCluster
    backends.py the stores by URL scheme (redis://, rediss://, valkey://, valkeys://):
                open_backend(url) makes the one a URL names, check_url reads a URL
    values.py   the key and value format: keys carry prefix, layout and namespace; values a
                header (format version, layout, length, checksum) before the page
    tier.py     ClusterTier: pages in and out of one layout's share of the store; every
                fault a miss, counted by kind and logged once per episode
    writer.py   ClusterWriter: committed pages to the cluster in the background, bounded

A second backend (Mooncake Store) is one more RemoteStore and its schemes in backends.py;
nothing else changes.
"""
from kvtier.mechanism.cluster.backends import check_url, open_backend
from kvtier.mechanism.cluster.redis import RedisClusterStore
from kvtier.mechanism.cluster.remote import FaultKind, RemoteFault, RemoteMemory, RemoteStore
from kvtier.mechanism.cluster.tier import ClusterStats, ClusterTier
from kvtier.mechanism.cluster.writer import ClusterWriter

__all__ = [
    "ClusterStats", "ClusterTier", "ClusterWriter", "FaultKind", "RedisClusterStore", "RemoteFault", "RemoteMemory",
    "RemoteStore", "check_url", "open_backend",
]
