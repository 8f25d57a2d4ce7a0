"""`kvtier stats`, `kvtier health-check` and gRPC reflection against a real daemon."""
from __future__ import annotations

import json

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from rpc import Conn, keys, run_kvtier


@pytest.fixture(scope="module")
def daemon(module_daemons):
    return module_daemons.start(host_size="1MiB", disk_size="4MiB")


@pytest.fixture(scope="module")
def traffic(daemon):
    """A pool with a few cached pages, so the table has rows."""
    conn = Conn(daemon.target)
    s = conn.session("cli")
    s.put(keys("cli", 5))
    s.lookup(keys("cli", 5))
    yield s
    conn.close()


def test_stats_table(daemon, traffic):
    out = run_kvtier("stats", "--socket", str(daemon.socket))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("kvtier 0.1.0") and "1 sessions" in lines[0]
    rows = {line.split()[0]: line.split() for line in lines if line.startswith("  ")}
    assert {"tier", "host", "disk"} <= set(rows)
    # tier capacity used leased cached ...
    assert rows["host"][1:5] == ["256", "5", "0", "5"]
    assert rows["disk"][1] == "1024"


def test_stats_json(daemon, traffic):
    out = run_kvtier("stats", "--socket", str(daemon.socket), "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    (pool,) = data["pools"]
    tiers = {t["tier"]: t for t in pool["tiers"]}
    assert set(tiers) == {"TIER_HOST", "TIER_DISK"}
    assert int(tiers["TIER_HOST"]["cached_pages"]) == 5
    assert int(tiers["TIER_HOST"]["capacity_pages"]) == 256
    assert data["sessions"] == 1


def test_stats_without_a_daemon(tmp_path):
    out = run_kvtier("stats", "--socket", str(tmp_path / "nobody.sock"))
    assert out.returncode != 0
    assert out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert "no kvtier daemon answers" in lines[0] and "nobody.sock" in lines[0]


def test_health_check(daemon, tmp_path):
    serving = run_kvtier("health-check", "--socket", str(daemon.socket))
    assert (serving.returncode, serving.stdout.strip()) == (0, "SERVING")
    absent = run_kvtier("health-check", "--socket", str(tmp_path / "nobody.sock"), "--timeout", "2")
    assert absent.returncode == 1
    assert "NOT SERVING" in absent.stderr


def test_reflection_lists_the_service(daemon):
    channel = grpc.insecure_channel(daemon.target)
    try:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = database.get_services()
        assert "kvtier.v1.KVTier" in services
        assert "grpc.health.v1.Health" in services
        service = DescriptorPool(database).FindServiceByName("kvtier.v1.KVTier")
        assert {"Register", "Borrow", "Commit", "Acquire", "Release", "Lookup", "Stats"} <= {m.name for m in service.methods}
    finally:
        channel.close()
