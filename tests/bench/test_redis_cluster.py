"""The loopback Redis Cluster launcher (kvtier_bench.redis_cluster) on real redis-server processes:
it forms, its fault operations do what the cluster tier's tests rely on, and it leaves nothing running."""
from __future__ import annotations

import os
import stat

import pytest
import redis
from redis.crc import key_slot
from redis.exceptions import AskError, MovedError

from kvtier_bench.redis_cluster import SLOTS, LocalRedisCluster
from kvtier_bench.services import ServiceError


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _keys(n: int) -> list[bytes]:
    return [b"key-%d" % i for i in range(n)]


def test_start_gives_three_masters_that_agree_on_a_complete_slot_map(redis_cluster):
    assert [n.role for n in redis_cluster.nodes] == ["master"] * 3
    assert redis_cluster.url == "redis://" + ",".join(f"127.0.0.1:{n.port}" for n in redis_cluster.nodes)
    maps = [redis_cluster.slot_map(n) for n in redis_cluster.nodes]
    assert all(m == maps[0] for m in maps)
    assert sum(last - first + 1 for first, last in maps[0]) == SLOTS
    assert sorted(len(redis_cluster.slots_of(n)) for n in redis_cluster.nodes) == [5461, 5461, 5462]
    with redis_cluster.client() as client:
        for key in _keys(200):
            client.set(key, key * 3)
        assert all(client.get(key) == key * 3 for key in _keys(200))
    assert sum(n.admin.dbsize() for n in redis_cluster.nodes) == 200
    assert all(n.admin.dbsize() > 0 for n in redis_cluster.nodes)  # spread over every master


def test_kill_of_a_master_and_a_forced_failover_give_a_new_master_with_the_data(redis_cluster_replicas):
    cluster = redis_cluster_replicas
    assert len(cluster.masters()) == 3 and len(cluster.replicas()) == 3
    with cluster.client() as client:
        for key in _keys(300):
            client.set(key, key)
        master = cluster.masters()[0]
        replica = cluster.replicas_of(master)[0]
        assert master.admin.execute_command("WAIT", 1, 5000) == 1  # the replica has every write
        old_pid = master.pid
        cluster.kill(master)
        assert _gone(old_pid) and master.role == "down"
        cluster.failover(replica, "force")
        assert replica.role == "master" and cluster.is_ok()
        assert len(cluster.slots_of(replica)) >= 5461
        assert all(client.get(key) == key for key in _keys(300))  # the client follows the new owner

        cluster.restart(master)  # comes back as the new master's replica
        assert master.pid != old_pid and master.role == "replica" and master.master_port() == replica.port


def test_manual_failover_swaps_the_roles_without_losing_a_write(redis_cluster_replicas):
    cluster = redis_cluster_replicas
    master = cluster.masters()[1]
    replica = cluster.replicas_of(master)[0]
    with cluster.client() as client:
        for key in _keys(300):
            client.set(key, b"v")
        cluster.failover(replica)
        assert (replica.role, master.role) == ("master", "replica")
        assert all(client.get(key) == b"v" for key in _keys(300))
    with pytest.raises(ValueError, match="not a replica"):
        cluster.failover(replica, "takeover")


def test_reshard_moves_keys_live_and_a_client_follows_ask_then_moved(redis_cluster):
    cluster = redis_cluster
    src, dst = cluster.nodes[0], cluster.nodes[1]
    keys = [*_keys(3000), b"\xff\x00binary"]  # keys need not be text
    plain_src = redis.Redis(host="127.0.0.1", port=src.port)  # sees the redirections a cluster client hides
    by_slot: dict[int, list[bytes]] = {}
    for key in keys:
        by_slot.setdefault(key_slot(key), []).append(key)
    seen_ask = []
    with cluster.client() as client:
        for key in keys:
            client.set(key, key + b"!")

        def half_moved(slot: int) -> None:
            in_slot = by_slot[slot]
            for key in in_slot:
                assert client.get(key) == key + b"!"  # moved or not, the client finds it
            still = set(src.admin.execute_command("CLUSTER GETKEYSINSLOT", slot, len(in_slot)))
            gone = [k for k in in_slot if k not in still]
            assert len(gone) == 1  # batch=1: one key on dst, the rest still on src
            with pytest.raises(AskError):
                plain_src.get(gone[0])
            if still:
                assert plain_src.get(next(iter(still))) is not None
            seen_ask.append(slot)

        moved = cluster.reshard(400, src, dst, batch=1, during=half_moved)
        assert len(moved) == 400 and seen_ask
        moved_keys = [k for slot in moved for k in by_slot.get(slot, [])]
        assert moved_keys and all(dst.admin.exists(k) for k in moved_keys)
        assert not set(moved) & set(cluster.slots_of(src)) and set(moved) <= set(cluster.slots_of(dst))
        with pytest.raises(MovedError):
            plain_src.get(moved_keys[0])
        assert all(client.get(key) == key + b"!" for key in keys)  # its slot map was stale: MOVED, followed
    plain_src.close()


def test_maxmemory_makes_every_master_evict_instead_of_refusing_writes(redis_cluster):
    cluster = redis_cluster
    cap = 8 << 20
    cluster.set_maxmemory(cap)
    value = os.urandom(64 << 10)
    with cluster.client() as client:
        for i in range(3 * 200):  # 37.5 MiB into 24 MiB
            client.set(b"page-%d" % i, value)
    memory = cluster.info_memory()
    assert set(memory) == {n.port for n in cluster.nodes}
    for node in memory.values():
        assert node["maxmemory"] == cap and node["maxmemory_policy"] == "allkeys-lru"
        assert node["evicted_keys"] > 0 and node["used_memory"] <= cap * 1.1


def test_a_killed_master_without_replica_restarts_empty_and_stop_leaves_nothing(tmp_path):
    cluster = LocalRedisCluster.start(tmp_path, masters=3)
    pids = [n.pid for n in cluster.nodes]
    victim = cluster.nodes[2]
    with cluster.client() as client:
        for key in _keys(100):
            client.set(key, key)
    assert victim.admin.dbsize() > 0
    cluster.kill(victim)
    assert victim.role == "down"
    cluster.restart(victim)
    assert victim.role == "master" and victim.admin.dbsize() == 0 and cluster.is_ok()  # no persistence
    pids.append(victim.pid)
    cluster.stop()
    cluster.stop()  # idempotent
    assert all(_gone(pid) for pid in pids)
    assert not any(n.alive for n in cluster.nodes)


def test_a_node_that_cannot_start_is_a_service_error_with_its_log(tmp_path):
    fake = tmp_path / "broken-redis-server"
    fake.write_text("#!/bin/sh\necho 'FATAL CONFIG FILE ERROR: this server cannot start'\nexit 1\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    with pytest.raises(ServiceError, match="exited with status 1.*FATAL CONFIG FILE ERROR"):
        LocalRedisCluster.start(tmp_path / "nodes", masters=1, binary=str(fake))
