"""The cluster tier end to end: two real daemons, each with its own socket, cache dir and
arena, act as two nodes on one real Redis Cluster on loopback (tests/redis_cluster_plugin.py).
A prefix committed on node A is found, acquired and byte-equal on node B; every fault is a
miss and a counter on B, never an error and never a wrong page."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from client_helpers import LAYOUT, as_bytes, kv_pages, tokens
from kvtier_client import KVTierClient, NotFound, PageLayout, Tier

from kvtier.mechanism.cluster.values import cluster_key


def write_blocks(client, keys, data):
    with client.borrow(len(keys)) as lease:
        for page, payload in zip(lease.pages, data):
            as_bytes(page)[:] = payload
        return lease.commit(keys)


def wait_until(condition, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def cluster_row(client, pool_id):
    return client.stats().pool(pool_id).tier(Tier.CLUSTER)


@pytest.fixture
def nodes(redis_cluster, daemons, tmp_path):
    """Two daemons on the cluster and a client of each (namespace "tenant"): (a, b)."""
    opened = []

    def node(name: str, *extra: str) -> KVTierClient:
        (tmp_path / name).mkdir()
        d = daemons("--cluster", redis_cluster.url, "--cluster-timeout", "300ms", *extra, path=tmp_path / name)
        client = KVTierClient(d.target)
        client.register("tenant", LAYOUT)
        opened.append(client)
        return client

    node.cluster = redis_cluster
    yield node
    for client in opened:
        client.close()


def test_a_prefix_committed_on_one_node_is_read_on_another(nodes):
    a, b = nodes("a"), nodes("b")
    keys = a.block_keys(tokens(16 * 6, seed=5))
    data = kv_pages(6, LAYOUT, seed=5)
    write_blocks(a, keys, data)
    wait_until(lambda: b.lookup(keys).hit_blocks == 6, what="node B to see A's pages in the cluster")
    assert b.lookup(keys).tiers == (Tier.CLUSTER,) * 6
    with b.acquire(keys) as lease:
        assert lease.ready == 6
        for page, payload in zip(lease.pages, data):
            np.testing.assert_array_equal(as_bytes(page), payload)
    assert b.lookup(keys).tiers == (Tier.HOST,) * 6  # now B's own
    row = cluster_row(b, b.pool.pool_id)
    assert row.hits >= 6 and row.corrupt_pages == 0 and row.io_errors == 0


def test_namespaces_and_layouts_never_share_cluster_pages(nodes, daemons, redis_cluster, tmp_path):
    a, b = nodes("a"), nodes("b")
    keys = a.block_keys(tokens(16 * 3, seed=6))
    write_blocks(a, keys, kv_pages(3, LAYOUT, seed=6))
    wait_until(lambda: b.lookup(keys).hit_blocks == 3, what="the pages to reach the cluster")
    target = f"unix://{tmp_path / 'b' / 'run' / 'kvtier.sock'}"
    for namespace, layout in (("another-tenant", LAYOUT),
                              ("tenant", PageLayout(layers=2, kv_heads=2, head_dim=32, block_tokens=16, dtype="bfloat16"))):
        with KVTierClient(target) as other:
            other.register(namespace, layout)
            assert other.lookup(keys).hit_blocks == 0


def test_a_corrupted_value_is_a_miss_and_a_counter(nodes):
    a, b = nodes("a"), nodes("b")
    keys = a.block_keys(tokens(16 * 4, seed=7))
    data = kv_pages(4, LAYOUT, seed=7)
    write_blocks(a, keys, data)
    wait_until(lambda: b.lookup(keys).hit_blocks == 4, what="the pages to reach the cluster")
    cluster = nodes.cluster.client()
    cluster.setrange(cluster_key("kvtier", LAYOUT.layout_id, "tenant", keys[2]), 100, b"\xff" * 8)
    with pytest.raises(NotFound, match="key 2"):
        b.acquire(keys)
    with b.acquire(keys[:2]) as lease:  # the pages before it are good and now B's own
        for page, payload in zip(lease.pages, data):
            np.testing.assert_array_equal(as_bytes(page), payload)
    assert b.lookup(keys).hit_blocks == 2  # the corrupt value was deleted from the cluster
    assert cluster_row(b, b.pool.pool_id).corrupt_pages == 1


def test_maxmemory_eviction_gives_misses_never_wrong_pages(nodes):
    a, b = nodes("a"), nodes("b")
    memory = nodes.cluster.info_memory()
    used = max(int(info["used_memory"]) for info in memory.values())
    nodes.cluster.set_maxmemory(used + 40 * LAYOUT.page_bytes, "allkeys-lru")
    prompts = [a.block_keys(tokens(16 * 8, seed=100 + i)) for i in range(40)]
    payloads = [kv_pages(8, LAYOUT, seed=100 + i) for i in range(40)]
    for keys, data in zip(prompts, payloads):
        write_blocks(a, keys, data)
    time.sleep(0.5)  # let A's writer drain
    found = 0
    for keys, data in zip(prompts, payloads):
        match, lease = b.acquire_prefix(keys)
        found += match.hit_blocks
        if lease is not None:
            with lease:
                assert lease.ready == match.hit_blocks
                for page, payload in zip(lease.pages, data):
                    np.testing.assert_array_equal(as_bytes(page), payload)
    assert 0 < found < 40 * 8  # the cluster kept some and evicted others
    row = cluster_row(b, b.pool.pool_id)
    assert row.corrupt_pages == 0 and row.io_errors == 0
