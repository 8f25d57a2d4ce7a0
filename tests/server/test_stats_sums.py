"""Stats add up (docs/invariants.md, rule 8): every page in exactly one state, also right
after a client vanished in the middle of an Acquire whose pages were still loading.

Why this cannot be flaky: the sums are checked on every snapshot whatever the loads are
doing at that instant; the only timed step is waiting for the session to expire, done with
`wait_for` and a bound far above the 2 s session timeout, while the writer's session
heartbeats on every poll.
"""
from __future__ import annotations

from kvtier_client.proto.v1 import kvtier_pb2 as pb
from rpc import Conn, keys, tier_stats, wait_for


def _check_sums(stats: pb.StatsResponse) -> None:
    for pool in stats.pools:
        for t in pool.tiers:
            assert t.free_pages + t.writing_pages + t.cached_pages == t.capacity_pages, t
            idle = t.cached_pages - t.pinned_pages - t.loading_pages - t.held_pages
            assert idle >= 0, t


def test_a_client_gone_mid_acquire_leaves_stats_that_add_up(daemons, connect):
    d = daemons.start("--session-timeout", "2s", "--fsync", "never")  # 1 MiB host (256 pages), 4 MiB disk
    writer = connect(d.target).session("gone")
    blocks = keys("gone", 600)
    for i in range(0, len(blocks), 100):
        writer.put(blocks[i : i + 100])  # the first ~340 are pushed down to disk by the later ones
    on_disk = [k for k in blocks if writer.lookup([k]).tiers == [pb.TIER_DISK]]
    assert len(on_disk) >= 200

    vanishing = Conn(d.target)  # not the fixture's: it is closed without CloseSession below
    s = vanishing.session("gone")
    read = s.acquire(on_disk[:200], wait=pb.WAIT_NONE)  # returns at once; the rest keeps loading for it
    first = vanishing.call("Stats", pb.StatsRequest())
    _check_sums(first)
    host = tier_stats(first, s.reply.pool_id)
    assert host.pinned_pages == read.ready
    assert host.loading_pages + host.held_pages + host.pinned_pages >= 200 - read.ready  # nothing uncounted
    vanishing.channel.close()  # gone without CloseSession or a heartbeat: as if killed

    def expired():
        writer.heartbeat()
        stats = writer.conn.call("Stats", pb.StatsRequest())
        _check_sums(stats)
        return stats.sessions == 1 and stats.leases == 0
    wait_for(expired, 15.0, "the vanished session to expire")
    host = tier_stats(writer.conn.call("Stats", pb.StatsRequest()), s.reply.pool_id)
    assert host.pinned_pages == 0 and host.loading_pages == 0
    lease = writer.borrow(host.capacity_pages)  # held pages go as a last resort: the whole tier can be borrowed
    writer.release(lease.lease_id)
