"""The cluster tier end to end: two real daemons, each with its own socket, cache dir and
arena, act as two nodes on one real Redis Cluster on loopback (tests/redis_cluster_plugin.py).
A prefix committed on node A is found, acquired and byte-equal on node B; every fault is a
miss and a counter on B, never an error and never a wrong page."""
from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
from client_helpers import LAYOUT, as_bytes, kv_pages, tokens
from kvtier_client import KVTierClient, NotFound, PageLayout, Tier

from kvtier.codecs import Encoded
from kvtier.mechanism.cluster.values import cluster_key, header, layout_hash
from kvtier.mechanism.seal import PageIdentity, Sealer


def write_blocks(client, keys, data):
    with client.borrow(len(keys)) as lease:
        for page, payload in zip(lease.pages, data):
            as_bytes(page)[:] = payload
        return lease.commit(keys)


def write_prompts(client, n, seed, blocks=6):
    """n prompts of `blocks` pages each, committed through `client`: [(keys, data)]."""
    prompts = []
    for i in range(n):
        keys = client.block_keys(tokens(16 * blocks, seed=seed + i))
        data = kv_pages(blocks, LAYOUT, seed=seed + i)
        write_blocks(client, keys, data)
        prompts.append((keys, data))
    return prompts


def read_checked(client, keys, data) -> int:
    """Look up and acquire the prefix through `client`; every page it lends must be the one
    written. A page lost between lookup and load is a NotFound for this call: a miss."""
    try:
        match, lease = client.acquire_prefix(keys)
    except NotFound:
        return 0
    if lease is None:
        return 0
    with lease:
        for page, payload in zip(lease.pages, data):
            np.testing.assert_array_equal(as_bytes(page), payload)
        return lease.ready


def committed_on(a, b, seed, blocks=6):
    """One prompt committed through node `a`, once node `b` sees all of it in the cluster
    (the writes are asynchronous): (keys, data)."""
    (keys, data), = write_prompts(a, 1, seed, blocks)
    wait_until(lambda: b.lookup(keys).hit_blocks == blocks, what="node B to see A's pages in the cluster")
    return keys, data


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
        node.daemons.append(d)
        client = KVTierClient(d.target)
        client.register("tenant", LAYOUT)
        opened.append(client)
        return client

    node.cluster = redis_cluster
    node.daemons = []
    yield node
    for client in opened:
        client.close()


def test_a_prefix_committed_on_one_node_is_read_on_another(nodes):
    a, b = nodes("a"), nodes("b")
    keys, data = committed_on(a, b, seed=5)
    assert b.lookup(keys).tiers == (Tier.CLUSTER,) * 6
    with b.acquire(keys) as lease:
        assert lease.ready == 6
        for page, payload in zip(lease.pages, data):
            np.testing.assert_array_equal(as_bytes(page), payload)
    assert b.lookup(keys).tiers == (Tier.HOST,) * 6  # now B's own
    row = cluster_row(b, b.pool.pool_id)
    assert row.hits >= 6 and row.corrupt_pages == 0 and row.io_errors == 0
    assert row.read_bytes_per_second > 0  # measured by the loads, for engines' load planners


def test_namespaces_and_layouts_never_share_cluster_pages(nodes, daemons, redis_cluster, tmp_path):
    a, b = nodes("a"), nodes("b")
    keys, _ = committed_on(a, b, seed=6, blocks=3)
    target = f"unix://{tmp_path / 'b' / 'run' / 'kvtier.sock'}"
    for namespace, layout in (("another-tenant", LAYOUT),
                              ("tenant", PageLayout(layers=2, kv_heads=2, head_dim=32, block_tokens=16, dtype="bfloat16"))):
        with KVTierClient(target) as other:
            other.register(namespace, layout)
            assert other.lookup(keys).hit_blocks == 0


def test_a_corrupted_value_is_a_miss_and_a_counter(nodes):
    a, b = nodes("a"), nodes("b")
    keys, data = committed_on(a, b, seed=7, blocks=4)
    cluster = nodes.cluster.client()
    key = cluster_key("kvtier", LAYOUT.layout_id, "tenant", keys[2])
    page = bytearray(cluster.hget(key, b"p"))  # a value is a hash: h (header) and p (the page)
    page[100:108] = bytes(255 - b for b in page[100:108])  # eight bytes flipped in the store, as SETRANGE would
    cluster.hset(key, b"p", bytes(page))
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



def test_a_cluster_down_at_start_is_a_miss_not_an_error(daemons, tmp_path):
    from kvtier_bench.services import free_port

    (tmp_path / "a").mkdir()
    d = daemons("--cluster", f"redis://127.0.0.1:{free_port()}", "--cluster-timeout", "200ms", path=tmp_path / "a")
    with KVTierClient(d.target) as a:
        a.register("tenant", LAYOUT)
        (keys, data), = write_prompts(a, 1, seed=300)
        assert read_checked(a, keys, data) == 6  # the node's own tiers work
        other = a.block_keys(tokens(16 * 4, seed=301))
        assert a.lookup(other).hit_blocks == 0
        assert cluster_row(a, a.pool.pool_id).io_errors > 0  # counted as faults, served as misses
    assert "cluster tier:" in d.log() and d.log().count("cluster tier:") < 5  # once per episode, not per call


def test_killing_a_master_mid_read_gives_misses_never_errors(nodes):
    a, b = nodes("a"), nodes("b")
    prompts = write_prompts(a, 12, seed=400)
    wait_until(lambda: b.lookup(prompts[-1][0]).hit_blocks == 6, what="the pages to reach the cluster")
    read = [read_checked(b, keys, data) for keys, data in prompts[:4]]
    nodes.cluster.kill(nodes.cluster.masters()[1])
    read += [read_checked(b, keys, data) for keys, data in prompts[4:]]
    assert sum(read[:4]) == 24 and sum(read[4:]) < 48  # a third of the slots went with the master
    assert cluster_row(b, b.pool.pool_id).io_errors > 0
    # The node still serves what it holds, and commits still work.
    assert read_checked(b, *prompts[0]) == 6
    write_prompts(b, 1, seed=450)


def test_a_failover_keeps_the_pages(redis_cluster_replicas, daemons, tmp_path):
    cluster = redis_cluster_replicas
    clients = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        d = daemons("--cluster", cluster.url, "--cluster-timeout", "300ms", path=tmp_path / name)
        clients.append(KVTierClient(d.target))
        clients[-1].register("tenant", LAYOUT)
    a, b = clients
    try:
        prompts = write_prompts(a, 8, seed=500)
        wait_until(lambda: b.lookup(prompts[-1][0]).hit_blocks == 6, what="the pages to reach the cluster")
        time.sleep(0.5)  # replication is asynchronous
        master = cluster.masters()[0]
        cluster.failover(cluster.replicas_of(master)[0], "default")
        for keys, data in prompts:
            assert read_checked(b, keys, data) == 6
    finally:
        for client in clients:
            client.close()


def test_a_reshard_under_load_gives_no_errors_and_no_wrong_pages(nodes):
    a, b = nodes("a"), nodes("b")
    prompts = write_prompts(a, 10, seed=600)
    wait_until(lambda: b.lookup(prompts[-1][0]).hit_blocks == 6, what="the pages to reach the cluster")
    stop = threading.Event()
    failures: list[BaseException] = []

    def load() -> None:
        i = 0
        while not stop.is_set():
            try:
                read_checked(b, *prompts[i % len(prompts)])
                write_prompts(a, 1, seed=700 + i)
            except BaseException as exc:  # noqa: BLE001 - reported below
                failures.append(exc)
                return
            i += 1

    worker = threading.Thread(target=load)
    worker.start()
    try:
        cluster = nodes.cluster
        cluster.reshard(300, cluster.masters()[0], cluster.masters()[1], batch=5)
    finally:
        stop.set()
        worker.join()
    assert not failures, failures
    c = nodes("c")  # a node that holds nothing itself: every page comes from the resharded cluster
    for keys, data in prompts:
        assert read_checked(c, keys, data) == 6


def test_a_namespace_with_its_own_acl_user_reaches_only_its_keys(nodes, tmp_path):
    """The default user may not touch "tenant"'s keys; the ACL file gives "tenant" a user
    that may touch only them. Pages of both namespaces still reach the cluster."""
    cluster = nodes.cluster
    for node in cluster.masters():
        node.admin.execute_command("ACL", "SETUSER", "tenant-user", "on", ">s3cret", "~kvtier:*:tenant:*", "+@all")
        node.admin.execute_command("ACL", "SETUSER", "kvtier-node", "on", ">node", "~kvtier:*:other:*", "+@all")
    acl = tmp_path / "acl.toml"
    acl.write_text('[namespaces."tenant"]\nusername = "tenant-user"\npassword = "s3cret"\n')
    url = cluster.url.replace("redis://", "redis://kvtier-node:node@")
    try:
        a = nodes("a", "--cluster-acl-file", str(acl), "--cluster", url)
        keys = a.block_keys(tokens(16 * 3, seed=800))
        write_blocks(a, keys, kv_pages(3, LAYOUT, seed=800))
        wait_until(lambda: cluster.client().exists(cluster_key("kvtier", LAYOUT.layout_id, "tenant", keys[0])),
                   what="tenant's page written by its own ACL user")
        # A namespace with no user of its own goes through the node's user, which may not
        # write its keys: refused by the cluster, counted, never an error to the engine.
        with KVTierClient(f"unix://{tmp_path / 'a' / 'run' / 'kvtier.sock'}") as third:
            third.register("third", LAYOUT)
            write_blocks(third, keys, kv_pages(3, LAYOUT, seed=801))
            wait_until(lambda: cluster_row(third, third.pool.pool_id).io_errors >= 3, what="the refusals counted")
        assert not cluster.client().exists(cluster_key("kvtier", LAYOUT.layout_id, "third", keys[0]))
    finally:
        for node in cluster.masters():
            node.admin.execute_command("ACL", "DELUSER", "tenant-user", "kvtier-node")


def test_demote_writes_pages_as_they_leave_host_and_never_back(nodes):
    """cluster_write = demote: a page reaches the cluster when it is demoted from host to
    disk, not at commit; a page loaded from the cluster is not written back when it leaves."""
    small = ("--cluster-write", "demote", "--host-size", "1MiB")  # 128 pages: no clean reserve, eviction writes
    a, b = nodes("a", *small), nodes("b", *small)
    cluster = nodes.cluster.client()

    def in_cluster(keys) -> int:
        return sum(cluster.exists(cluster_key("kvtier", LAYOUT.layout_id, "tenant", k)) for k in keys)

    first, *rest = write_prompts(a, 30, seed=900)  # 180 pages through a 128-page host
    assert in_cluster(rest[-1][0]) == 0  # the newest pages are still only in host
    wait_until(lambda: in_cluster(first[0]) == 6, what="the oldest pages demoted to the cluster")
    assert read_checked(b, *first) == 6  # now in B's host, loaded from the cluster
    cluster.delete(*[cluster_key("kvtier", LAYOUT.layout_id, "tenant", k) for k in first[0]])
    mine = write_prompts(b, 30, seed=950)  # push B's copy of `first` out of its host, to its disk
    wait_until(lambda: in_cluster(mine[0][0]) == 6, what="B's own pages demoted to the cluster")
    assert in_cluster(first[0]) == 0  # B knew they came from the cluster: not written back
    assert b.stats().pool(b.pool.pool_id).tier(Tier.DISK).cached_pages > 0


def test_prefetch_brings_cluster_pages_into_host(nodes):
    a, b = nodes("a"), nodes("b")
    keys, data = committed_on(a, b, seed=1000, blocks=8)
    other = b.block_keys(tokens(16 * 2, seed=1001))  # never stored anywhere
    assert b.prefetch(keys + other) == 8  # what the cluster holds, not what it does not
    wait_until(lambda: b.lookup(keys).tiers == (Tier.HOST,) * 8, what="the prefetched pages in B's host")
    assert read_checked(b, keys, data) == 8


def test_a_tls_cluster(daemons, tmp_path):
    """rediss:// with the CA that signed the nodes' certificates: pages cross nodes over TLS."""
    from kvtier_bench.peers.redis import redis_server_binary
    from kvtier_bench.redis_cluster import SETUP_HINT, LocalRedisCluster, TlsFiles
    from pki import make_pki

    if redis_server_binary() is None:
        pytest.skip(f"no redis-server or valkey-server on this machine: {SETUP_HINT}")
    pki = make_pki(tmp_path)
    cluster = LocalRedisCluster.start(tmp_path / "tls-cluster", masters=3,
                                      tls=TlsFiles(pki.server_cert, pki.server_key, pki.ca))
    clients = []
    try:
        assert cluster.url.startswith("rediss://")
        for name in ("a", "b"):
            (tmp_path / name).mkdir()
            d = daemons("--cluster", cluster.url, "--cluster-tls-ca", str(pki.ca), path=tmp_path / name)
            clients.append(KVTierClient(d.target))
            clients[-1].register("tenant", LAYOUT)
        a, b = clients
        keys, data = committed_on(a, b, seed=1100)
        assert read_checked(b, keys, data) == 6
        assert cluster_row(b, b.pool.pool_id).io_errors == 0
    finally:
        for client in clients:
            client.close()
        cluster.stop()


def move_value(cluster, src: bytes, dst: bytes) -> None:
    """Copy the whole value (header and page) of cluster key `src` over `dst`, as anyone
    with write access to the store could."""
    cluster.hset(dst, mapping={b"h": cluster.hget(src, b"h"), b"p": cluster.hget(src, b"p")})


def test_a_value_moved_from_another_namespace_is_a_miss_and_a_counter(nodes):
    a, b = nodes("a"), nodes("b")
    keys, data = committed_on(a, b, seed=8, blocks=4)
    with KVTierClient(a.target) as other:  # another tenant commits a prompt on node A
        other.register("other-tenant", LAYOUT)
        (other_keys, other_data), = write_prompts(other, 1, seed=80, blocks=4)
    cluster = nodes.cluster.client()
    wait_until(lambda: cluster.exists(cluster_key("kvtier", LAYOUT.layout_id, "other-tenant", other_keys[3])),
               what="the other tenant's pages in the cluster")
    move_value(cluster, cluster_key("kvtier", LAYOUT.layout_id, "other-tenant", other_keys[2]),
               cluster_key("kvtier", LAYOUT.layout_id, "tenant", keys[2]))
    with pytest.raises(NotFound, match="key 2"):
        b.acquire(keys)
    assert read_checked(b, keys, data) == 2  # the good pages before it, never the moved one
    assert b.lookup(keys).hit_blocks == 2  # the moved value was deleted from the cluster
    row = cluster_row(b, b.pool.pool_id)
    assert row.corrupt_pages == 1 and row.io_errors == 0
    assert "sealed as another key's, namespace's or layout's" in nodes.daemons[1].log()


def test_values_swapped_between_keys_of_one_namespace_are_misses(nodes):
    a, b = nodes("a"), nodes("b")
    keys, data = committed_on(a, b, seed=9, blocks=4)
    cluster = nodes.cluster.client()
    first, second = (cluster_key("kvtier", LAYOUT.layout_id, "tenant", keys[i]) for i in (1, 3))
    saved = {k: (cluster.hget(k, b"h"), cluster.hget(k, b"p")) for k in (first, second)}
    for dst, src in ((first, second), (second, first)):
        cluster.hset(dst, mapping={b"h": saved[src][0], b"p": saved[src][1]})
    assert read_checked(b, keys, data) == 1
    assert cluster_row(b, b.pool.pool_id).corrupt_pages == 2  # both were loaded, both misbound


def test_with_a_seal_key_a_forged_or_foreign_value_is_a_miss(nodes, tmp_path):
    secret = tmp_path / "seal.key"
    secret.write_bytes(b"a secret every node of this cluster shares")
    secret.chmod(0o600)
    a, b = nodes("a", "--seal-key-file", str(secret)), nodes("b", "--seal-key-file", str(secret))
    keys, data = committed_on(a, b, seed=10, blocks=3)  # nodes with the same secret share pages
    assert read_checked(b, keys, data) == 3
    # A writer without the secret forges a value for a fresh key: header, checksum and an
    # unkeyed seal all as kvtier writes them. A node without a secret would take it.
    forged_keys, forged_data = b.block_keys(tokens(32, seed=11)), kv_pages(2, LAYOUT, seed=11)
    cluster = nodes.cluster.client()
    for key, payload in zip(forged_keys, forged_data):
        page = memoryview(bytes(payload))
        head = header(layout_hash(LAYOUT.layout_id), PageIdentity(LAYOUT.layout_id, "tenant", key), Sealer(),
                      len(page), Encoded(0, page))
        cluster.hset(cluster_key("kvtier", LAYOUT.layout_id, "tenant", key), mapping={b"h": head, b"p": bytes(page)})
    assert b.lookup(forged_keys).hit_blocks == 2  # present in the cluster...
    with pytest.raises(NotFound, match="key 0"):
        b.acquire(forged_keys)  # ...but never served
    c = nodes("c")  # a node without the secret: the keyed values are not its either
    keys2, _ = write_prompts(a, 1, seed=12, blocks=2)[0]
    wait_until(lambda: cluster.exists(cluster_key("kvtier", LAYOUT.layout_id, "tenant", keys2[1])),
               what="node A's pages in the cluster")
    with pytest.raises(NotFound, match="key 0"):
        c.acquire(keys2)


def test_an_acquire_that_joins_a_queued_cluster_prefetch_returns(nodes):
    """The vLLM worker's sequence: the scheduler prefetches a prompt at its arrival, and the
    worker acquires it (Wait.ALL) while those loads still wait in the cluster reader's queue.
    The acquire joins them and returns. (It once boosted them on the disk reader, whose
    worker died on them, and never returned; a phantom corrupt disk page was counted.)"""
    a, b = nodes("a"), nodes("b")
    prompts = [committed_on(a, b, seed=1200 + i, blocks=64) for i in range(12)]
    keys = [k for ks, _ in prompts for k in ks]
    last_keys, last_data = prompts[-1]
    assert b.prefetch(keys) == len(keys)
    # Freeze the cluster: the readers' batches in flight wait on it, the rest stay queued.
    for node in nodes.cluster.nodes:
        os.kill(node.pid, signal.SIGSTOP)
    outcome: list = []
    try:
        acquirer = threading.Thread(target=lambda: outcome.append(read_checked(b, last_keys, last_data)), daemon=True)
        acquirer.start()
        acquirer.join(0.2)
    finally:
        for node in nodes.cluster.nodes:
            os.kill(node.pid, signal.SIGCONT)
    acquirer.join(30)
    assert not acquirer.is_alive(), "the acquire that joined queued cluster loads never returned"
    assert outcome == [64]  # the joined loads landed, every page the one written
    host = b.stats().pool(b.pool.pool_id)
    assert host.tier(Tier.DISK).corrupt_pages == 0
