"""The Prometheus endpoint of a real daemon after real traffic: names, labels and values."""
from __future__ import annotations

import grpc
from kvtier_client.proto.v1 import kvtier_pb2 as pb
from rpc import expect_code, free_port, keys, samples, scrape, tier_stats, value, wait_for


def test_metrics_after_traffic(daemons, connect):
    port = free_port()
    d = daemons.start("--metrics-port", str(port), host_size="1MiB", disk_size="4MiB")
    # The endpoint is up as soon as the daemon reports SERVING.
    _, families = scrape(port)
    assert value(families, "kvtier_sessions") == 0

    conn = connect(d.target)
    s = conn.session("metrics")
    pool = s.reply.pool_id
    cached = keys("metrics", 4)
    s.put(cached)
    writing = s.borrow(3)
    read = s.acquire(cached[:2])
    assert s.lookup([*cached, *keys("metrics-miss", 2)]).hit_blocks == 4  # 4 hits, 2 misses
    expect_code(grpc.StatusCode.NOT_FOUND, conn.call, "Lookup", pb.LookupRequest(session_id="0" * 32, keys=cached))

    text, families = scrape(port)
    host, disk = {"pool": pool, "tier": "host"}, {"pool": pool, "tier": "disk"}
    assert value(families, "kvtier_tier_capacity_pages", **host) == 256
    assert value(families, "kvtier_tier_capacity_pages", **disk) == 1024
    assert value(families, "kvtier_tier_capacity_bytes", **host) == 256 * 3072
    assert value(families, "kvtier_tier_read_bytes_per_second", **host) > 0  # probed on first scrape
    assert value(families, "kvtier_tier_read_bytes_per_second", **disk) > 0
    pages = {state: value(families, "kvtier_tier_pages", **host, state=state) for state in ("free", "writing", "cached", "pinned")}
    assert pages == {"free": 256 - 3 - 4, "writing": 3, "cached": 4, "pinned": 2}
    assert sum(value(families, "kvtier_tier_pages", **disk, state=st) for st in ("free", "writing", "cached")) == 1024
    assert value(families, "kvtier_hits_total", **host) == 4
    assert value(families, "kvtier_hits_total", **disk) == 0
    assert value(families, "kvtier_misses_total", pool=pool) == 2
    assert value(families, "kvtier_leases", pool=pool) == 2
    assert value(families, "kvtier_sessions") == 1

    # RPC latency by method and status code.
    ok = samples(families, "kvtier_rpc_duration_seconds_bucket", method="Lookup", code="OK")
    assert ok and max(s.value for s in ok) == 1  # the +Inf bucket holds every call
    assert value(families, "kvtier_rpc_duration_seconds_count", method="Lookup", code="OK") == 1
    assert value(families, "kvtier_rpc_duration_seconds_count", method="Lookup", code="NOT_FOUND") == 1
    assert value(families, "kvtier_rpc_duration_seconds_count", method="Borrow", code="OK") == 2
    assert 0 < value(families, "kvtier_rpc_duration_seconds_sum", method="Lookup", code="OK") < 5
    assert "kvtier_hits_total{" in text and "kvtier_misses_total{" in text  # as exposed, not only as parsed

    # Conventions: kvtier_ prefix (process_ and python_: prometheus_client's standard
    # process and platform collectors), counters end in _total, base units in the name.
    for family in families.values():
        assert family.name.startswith(("kvtier_", "process_", "python_")), family.name
        if family.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in family.samples), family.name
        if family.type == "histogram":
            assert family.name.endswith("_seconds"), family.name
    s.release(read.lease_id)
    s.release(writing.lease_id)


def test_moved_bytes_after_demotion(daemons, connect):
    port = free_port()
    d = daemons.start("--metrics-port", str(port), host_size="64KiB", disk_size="1MiB")  # 16 host pages
    s = connect(d.target).session("moved")
    s.put(keys("moved", 16))
    s.release(s.borrow(4).lease_id)  # evicts 4: demoted to disk
    _, families = scrape(port)
    pool = s.reply.pool_id
    assert value(families, "kvtier_moved_bytes_total", pool=pool, src="host", dst="disk") == 4 * 3072
    assert value(families, "kvtier_demotions_total", pool=pool, tier="disk") == 4
    assert value(families, "kvtier_evictions_total", pool=pool, tier="host") == 4


def test_disk_load_metrics(daemons, connect):
    port = free_port()
    d = daemons.start("--metrics-port", str(port), host_size="64KiB", disk_size="1MiB")  # 16 host pages
    conn = connect(d.target)
    s = conn.session("loads")
    pool, slot_bytes = s.reply.pool_id, s.reply.slot_bytes
    k = keys("loads", 8)

    def disk_figures() -> dict:
        _, families = scrape(port)
        return {
            "read": value(families, "kvtier_disk_read_bytes_total", pool=pool),
            "written": value(families, "kvtier_disk_written_bytes_total", pool=pool),
            "queued": [value(families, "kvtier_disk_queue_depth", pool=pool, kind=kind) for kind in ("acquire", "prefetch")],
            "in_flight": value(families, "kvtier_disk_reads_in_flight", pool=pool),
        }

    # A new pool with a disk tier: every disk figure exported, all zero.
    assert disk_figures() == {"read": 0, "written": 0, "queued": [0, 0], "in_flight": 0}

    # Commit 8 pages and push them to disk: 8 whole slots written.
    s.put(k)
    s.release(s.borrow(16).lease_id)
    assert disk_figures()["written"] == 8 * slot_bytes

    # Acquire 4 of them (loads of kind acquire), prefetch the other 4 (kind prefetch), wait
    # for those to arrive, then acquire them (ready on arrival).
    s.release(s.acquire(k[:4]).lease_id)
    assert s.prefetch(k[4:]).accepted == 4
    wait_for(lambda: tier_stats(conn.state(), pool).promotions == 8, 10, "the prefetched pages to arrive")
    read = s.acquire(k[4:])
    assert (read.ready, read.promoted) == (4, 0)
    s.release(read.lease_id)

    _, families = scrape(port)
    assert disk_figures() == {"read": 8 * slot_bytes, "written": 8 * slot_bytes, "queued": [0, 0], "in_flight": 0}
    for kind in ("acquire", "prefetch"):
        assert value(families, "kvtier_disk_load_duration_seconds_count", kind=kind, result="ok") == 4
        assert value(families, "kvtier_disk_load_duration_seconds_bucket", kind=kind, result="ok", le="+Inf") == 4
        assert 0 < value(families, "kvtier_disk_load_duration_seconds_sum", kind=kind, result="ok") < 10
    assert not samples(families, "kvtier_disk_load_duration_seconds_count", result="corrupt")
    assert value(families, "kvtier_acquire_pages_total", pool=pool, on_arrival="loaded") == 4
    assert value(families, "kvtier_acquire_pages_total", pool=pool, on_arrival="ready") == 4
    assert value(families, "kvtier_promotions_total", pool=pool, tier="host") == 8
    assert value(families, "kvtier_moved_bytes_total", pool=pool, src="disk", dst="host") == 8 * s.reply.page_bytes


def test_disk_admission_counts_refused_pages(daemons, connect):
    """A daemon with `--disk-admission reuse` at threshold 1 (write a kind of page only if
    every one of its pages came back): pages used once that never return are refused once
    64 of them have settled; the stats and the metric count them, and they are not on disk."""
    port = free_port()
    d = daemons.start("--metrics-port", str(port), "--disk-admission", "reuse", "--disk-admission-threshold", "1",
                      host_size="48KiB", disk_size="96KiB")
    s = connect(d.target).session("admission")
    pool = s.reply.pool_id
    one_offs = keys("once", 160)
    for i in range(0, len(one_offs), 4):
        s.put(one_offs[i:i + 4])
    stats = s.conn.call("Stats", pb.StatsRequest())
    host, disk = tier_stats(stats, pool, pb.TIER_HOST), tier_stats(stats, pool, pb.TIER_DISK)
    # Every page that left host was written or refused.
    assert disk.refused_pages > 0 and disk.demotions + disk.refused_pages == len(one_offs) - host.capacity_pages
    _, families = scrape(port)
    assert value(families, "kvtier_admission_refused_total", pool=pool, tier="disk") == disk.refused_pages
    # The last pages to leave host were refused: nothing of them is cached anywhere.
    assert s.lookup(one_offs[-20:-16]).hit_blocks == 0
