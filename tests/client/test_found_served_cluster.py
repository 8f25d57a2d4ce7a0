"""Found against served across the cluster tier (docs/metrics.md, "Found and served"): two
real daemons on one real Redis Cluster on loopback; node B finds node A's blocks in the
cluster, and what it acquires from there counts as served by the cluster tier, in Stats and
in the metrics, beside the blocks its engine said it held."""
from __future__ import annotations

import urllib.request

import pytest
import test_client_cluster as cluster
from client_helpers import LAYOUT
from kvtier_client import KVTierClient, Tier, Wait
from prometheus_client.parser import text_string_to_metric_families


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _samples(port: int, name: str, **labels) -> list[float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return [s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]


@pytest.fixture
def two_nodes(redis_cluster, daemons, tmp_path):
    opened, port = [], _free_port()
    for name, extra in (("a", ()), ("b", ("--metrics-port", str(port)))):
        (tmp_path / name).mkdir()
        d = daemons("--cluster", redis_cluster.url, "--cluster-timeout", "300ms", *extra, path=tmp_path / name)
        client = KVTierClient(d.target)
        client.register("tenant", LAYOUT)
        opened.append(client)
    yield (*opened, port)
    for client in opened:
        client.close()


def test_blocks_acquired_from_the_cluster_count_as_served_by_it(two_nodes):
    a, b, port = two_nodes
    keys, _ = cluster.committed_on(a, b, seed=11)  # 6 blocks B sees only in the cluster
    before = b.stats().pool(b.pool.pool_id)

    assert b.lookup(keys, known=2).tiers == (Tier.CLUSTER,) * 6  # B's engine holds blocks 0-1 itself
    with b.acquire(keys[2:], wait=Wait.ALL) as lease:
        assert lease.ready == 4
    after = b.stats().pool(b.pool.pool_id)
    assert after.engine_blocks - before.engine_blocks == 2
    assert (after.lookup_blocks - before.lookup_blocks, after.miss_blocks - before.miss_blocks) == (4, 0)
    assert after.tier(Tier.CLUSTER).served_blocks == 4 and after.tier(Tier.HOST).served_blocks == 0

    pool = {"pool": b.pool.pool_id}
    assert _samples(port, "kvtier_served_blocks_total", **pool, tier="cluster") == [4]
    assert _samples(port, "kvtier_lookup_blocks_total", **pool, result="engine_had") == [2]
    # Every lookup B made found its blocks in the cluster: the waits for A's writes and this one.
    found = after.lookup_blocks - after.miss_blocks
    assert _samples(port, "kvtier_lookup_blocks_total", **pool, result="found", tier="cluster") == [found]
