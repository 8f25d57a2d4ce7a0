"""Found against served (docs/metrics.md, "Found and served") on a real daemon, over both
transports: a lookup's `known` leading keys (the blocks the engine holds itself) count as
the engine's, neither hits nor misses; acquires count what kvtier served, by the tier each
block was in when asked; Stats, the metrics and `kvtier stats` show both.

Before `known`, a connector that looked up whole prompts had every block its engine already
held counted as a kvtier hit (issue 35: ~1,970 host hits counted while 529 blocks were
loaded). The old count is here too, as a lookup without `known`: it still counts so.
"""
from __future__ import annotations

import socket

import grpc
import pytest
from kvtier_client import KVTierClient, PageLayout, Tier, Wait, frames
from kvtier_client.frames import Op
from kvtier_client.groups import GroupMode, GroupQuery
from kvtier_client.proto.v1 import kvtier_pb2 as pb
from rpc import Conn, expect_code, free_port, run_kvtier, scrape, unchanged, value, wait_for

LAYOUT = PageLayout(layers=1, kv_heads=1, head_dim=48, block_tokens=16, dtype="float16")
INVALID_ARGUMENT = 3


@pytest.fixture(params=["lane", "grpc"])
def transport(request) -> str:
    return request.param


def _pool(client: KVTierClient):
    return client.stats().pool(client.pool.pool_id)


def test_known_blocks_are_the_engines_and_acquires_count_as_served(daemons, transport):
    port = free_port()
    d = daemons.start("--metrics-port", str(port), host_size="1MiB", disk_size="4MiB")
    client = KVTierClient(d.target, lane=transport == "lane")
    try:
        client.register("found", LAYOUT)
        assert client.transport == transport
        prompt = client.block_keys(list(range(10 * LAYOUT.block_tokens)))  # 10 blocks
        client.commit(client.borrow(8), prompt[:8])
        assert client.demote(prompt[4:8], tier=Tier.DISK).applied == 4
        wait_for(lambda: _pool(client).tier(Tier.HOST).cached_pages == 4, 10.0, "blocks 4-7 to leave host for disk")

        # The engine holds blocks 0-2 itself: kvtier found block 3 in host, 4-7 on disk; 8-9 missed.
        found = client.lookup(prompt, known=3)
        assert (found.hit_blocks, found.tiers) == (8, (Tier.HOST,) * 4 + (Tier.DISK,) * 4)  # the same answer
        p = _pool(client)
        assert (p.engine_blocks, p.lookup_blocks, p.miss_blocks) == (3, 7, 2)
        assert (p.tier(Tier.HOST).hits, p.tier(Tier.DISK).hits) == (1, 4)
        assert (p.tier(Tier.HOST).served_blocks, p.tier(Tier.DISK).served_blocks) == (0, 0)  # found, not served yet

        with client.acquire(prompt[3:8], wait=Wait.ALL) as lease:  # what the engine lacks
            assert lease.ready == 5
        p = _pool(client)
        assert (p.tier(Tier.HOST).served_blocks, p.tier(Tier.DISK).served_blocks) == (1, 4)  # where each was when asked
        assert p.served_rate == pytest.approx(5 / 7)

        # A lookup that does not say what the engine holds (a client from before `known`):
        # every cached block is a hit, as it always was (the acquire loaded 4-7 into host).
        client.lookup(prompt)
        p = _pool(client)
        assert (p.engine_blocks, p.lookup_blocks, p.miss_blocks) == (3, 7 + 10, 2 + 2)
        assert (p.tier(Tier.HOST).hits, p.tier(Tier.DISK).hits) == (1 + 8, 4)

        # A group lookup (one full-attention group counts as a Lookup) takes `known` too.
        assert client.lookup_groups([GroupQuery(prompt, GroupMode.FULL)], known=6).hit_blocks == 8
        p = _pool(client)
        assert (p.engine_blocks, p.lookup_blocks, p.miss_blocks, p.tier(Tier.HOST).hits) == (9, 17 + 4, 4 + 2, 9 + 2)

        with pytest.raises(ValueError, match="known"):  # refused before anything is sent
            client.lookup(prompt, known=11)

        _, families = scrape(port)
        pool, ns = {"pool": p.pool_id}, {"pool": p.pool_id, "kvtier_namespace": "found"}
        for name, labels in (("kvtier_lookup_blocks_total", pool), ("kvtier_namespace_lookup_blocks_total", ns)):
            assert value(families, name, **labels, result="engine_had", tier="") == 9
            assert value(families, name, **labels, result="found", tier="host") == 11
            assert value(families, name, **labels, result="found", tier="disk") == 4
            assert value(families, name, **labels, result="missed", tier="") == 6
        for name, labels in (("kvtier_served_blocks_total", pool), ("kvtier_namespace_served_blocks_total", ns)):
            assert value(families, name, **labels, tier="host") == 1
            assert value(families, name, **labels, tier="disk") == 4
        assert value(families, "kvtier_hits_total", **pool, tier="host") == 11  # the found ones, as before

        shown = run_kvtier("stats", "--socket", str(d.socket)).stdout
        assert "served rate 0.238: kvtier served 5 blocks (host 1, disk 4) of the 21 looked up beyond the 9 " \
               "the engines held themselves" in " ".join(shown.split()), shown
    finally:
        client.close()


def test_a_known_count_beyond_the_keys_is_refused_and_counts_nothing(daemons):
    d = daemons.start(host_size="1MiB", disk_size="0")
    conn = Conn(d.target)
    try:
        s = conn.session("refused")
        keys = [bytes([i]) * 16 for i in range(4)]
        s.put(keys[:2])
        with unchanged(conn):
            message = expect_code(grpc.StatusCode.INVALID_ARGUMENT, s.call, "Lookup",
                                  pb.LookupRequest(session_id=s.id, keys=keys, known=5))
            assert "known" in message
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as lane:  # the same refusal on the lane
                lane.settimeout(10)
                lane.connect(f"{d.socket}.lane")
                lane.send(frames.hello(1, s.id, s.key, None))
                assert frames.split(lane.recv(frames.MAX_FRAME))[1] == 0
                lane.send(frames.lookup(2, keys, known=5))
                op, status, _, body = frames.split(lane.recv(frames.MAX_FRAME))
                assert (op, status) == (Op.LOOKUP, INVALID_ARGUMENT) and b"known" in bytes(body)
        assert s.call("Lookup", pb.LookupRequest(session_id=s.id, keys=keys, known=4)).hit_blocks == 2
        pool = conn.state().pools[0]
        assert (pool.engine_blocks, pool.lookup_blocks, pool.miss_blocks) == (4, 0, 0)  # all the engine's: no hit, no miss
    finally:
        conn.close()
