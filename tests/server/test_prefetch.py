"""Prefetch: a hint that returns at once and moves disk pages up into host soon after."""
from __future__ import annotations

import time

from kvtier_client.proto.v1 import kvtier_pb2 as pb
from rpc import Arena, keys, page, tier_stats, wait_for


def test_prefetch_brings_disk_pages_back_to_host(daemons, connect):
    d = daemons.start(host_size="64KiB", disk_size="1MiB")  # 16 host pages
    conn = connect(d.target)
    s = conn.session("prefetch")
    capacity = s.reply.tiers[0].capacity_pages
    prefix = keys("prefetch", 4)
    arena = Arena.of(s)
    try:
        lease = s.borrow(len(prefix))
        for i, slot in enumerate(lease.slots):
            arena.write(slot, page(f"prefetch-{i}"))
        s.commit(lease.lease_id, prefix)

        # Fill the host tier: the cached pages are demoted to disk to make room.
        s.release(s.borrow(capacity).lease_id)
        assert s.lookup(prefix).tiers == [pb.TIER_DISK] * 4

        start = time.monotonic()
        assert s.prefetch(prefix).accepted == 4
        assert time.monotonic() - start < 1.0, "Prefetch is a hint: it must not wait for the loads"
        # Lookup names host as soon as a load starts; the pages are there once promoted.
        host = wait_for(lambda: (h := tier_stats(conn.state(), s.reply.pool_id)).promotions == 4 and h, 5,
                        "prefetched pages to reach host")
        assert s.lookup(prefix).tiers == [pb.TIER_HOST] * 4
        assert (host.promotions, host.cached_pages, host.pinned_pages) == (4, 4, 0)  # loaded, not held
        read = s.acquire(prefix)
        assert (read.ready, read.promoted) == (4, 0)  # already there: nothing to load
        for i, slot in enumerate(read.slots):
            assert arena.read(slot) == page(f"prefetch-{i}")
        s.release(read.lease_id)
    finally:
        arena.close()
