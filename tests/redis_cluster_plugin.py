"""Pytest fixtures with a real Redis Cluster on loopback (kvtier_bench.redis_cluster), for the
cluster tier's tests. Registered in tests/conftest.py (`pytest_plugins`).

- `redis_cluster`: 3 masters, no replicas; one cluster for the whole session (starting one
  takes ~2 s: a fresh master waits 2 s before it calls the cluster ok), emptied (FLUSHALL)
  and uncapped (maxmemory 0, noeviction) before each test. A test may kill, restart or
  reshard it: if it is not whole and ok afterwards, the next test gets a new one.
- `redis_cluster_replicas`: 3 masters with one replica each, a new one per test: for
  failover tests, which change who is master.

Both skip, saying how to install it, when there is no redis-server (or valkey-server) binary;
any other failure to start is an error with the node's log tail.
"""
from __future__ import annotations

import pytest
from kvtier_bench.peers.redis import redis_server_binary
from kvtier_bench.redis_cluster import SETUP_HINT, LocalRedisCluster


def _skip_without_server() -> None:
    if redis_server_binary() is None:
        pytest.skip(f"no redis-server or valkey-server on this machine: {SETUP_HINT}")


class _SharedCluster:
    """The session's `redis_cluster`, started on first use and replaced when a test broke it."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self.tmp_path_factory = tmp_path_factory
        self.cluster: LocalRedisCluster | None = None

    def get(self) -> LocalRedisCluster:
        if self.cluster is None:
            self.cluster = LocalRedisCluster.start(self.tmp_path_factory.mktemp("redis-cluster"), masters=3)
        return self.cluster

    def discard(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()
            self.cluster = None


@pytest.fixture(scope="session")
def _redis_cluster_shared(tmp_path_factory):
    shared = _SharedCluster(tmp_path_factory)
    yield shared
    shared.discard()


@pytest.fixture
def redis_cluster(_redis_cluster_shared) -> LocalRedisCluster:
    """3 masters, no replicas, empty and uncapped; shared by the session (see the module doc)."""
    _skip_without_server()
    cluster = _redis_cluster_shared.get()
    cluster.flushall()
    cluster.set_maxmemory(0, "noeviction")  # Redis's defaults, whatever the last test set
    slots = _slot_counts(cluster)
    yield cluster
    if not (all(n.alive for n in cluster.nodes) and cluster.is_ok() and _slot_counts(cluster) == slots):
        _redis_cluster_shared.discard()  # broken or resharded: the next test (in any order) gets a fresh one


def _slot_counts(cluster: LocalRedisCluster) -> list[int]:
    return [len(cluster.slots_of(m)) for m in cluster.masters()]


@pytest.fixture
def redis_cluster_replicas(tmp_path_factory) -> LocalRedisCluster:
    """3 masters with one replica each (6 nodes), new for each test."""
    _skip_without_server()
    cluster = LocalRedisCluster.start(tmp_path_factory.mktemp("redis-cluster-replicas"), masters=3, replicas=1)
    yield cluster
    cluster.stop()
