"""The Prometheus endpoint of a real daemon after real traffic: names, labels and values."""
from __future__ import annotations

import socket
import urllib.request

import grpc
from kvtier_client.proto.v1 import kvtier_pb2 as pb
from prometheus_client.parser import text_string_to_metric_families
from rpc import expect_code, keys


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> tuple[str, dict]:
    """The raw text and {family name: family}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return text, {f.name: f for f in text_string_to_metric_families(text)}


def samples(families: dict, sample_name: str, **labels) -> list:
    return [s for f in families.values() for s in f.samples
            if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items())]


def value(families: dict, sample_name: str, **labels) -> float:
    found = samples(families, sample_name, **labels)
    assert len(found) == 1, f"{sample_name}{labels}: {found}"
    return found[0].value


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

    # Conventions: kvtier_ prefix, counters end in _total, base units in the name.
    for family in families.values():
        assert family.name.startswith("kvtier_"), family.name
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
