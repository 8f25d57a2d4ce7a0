"""`kvtier stats`, `kvtier health-check` and gRPC reflection against a real daemon."""
from __future__ import annotations

import json
import re

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from kvtier_client.proto.v1 import kvtier_pb2 as pb
from kvtier_client.results import BlockReason
from kvtier_client.tiers import Tier
from rpc import Conn, keys, run_kvtier

from kvtier.admin import enum_json, message_json


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
    """Numbers as JSON numbers (64-bit ones too), tiers by their lower-case names, every field
    present: the shape docs/cli.md describes."""
    out = run_kvtier("stats", "--socket", str(daemon.socket), "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    (pool,) = data["pools"]
    tiers = {t["tier"]: t for t in pool["tiers"]}
    assert set(tiers) == {"host", "disk"}
    assert tiers["host"]["cached_pages"] == 5 and tiers["host"]["capacity_pages"] == 256
    assert tiers["disk"]["capacity_pages"] == 1024
    assert isinstance(data["sessions"], int) and isinstance(data["uptime_seconds"], float)
    assert pool["lookup_blocks"] == 5 and pool["page_bytes"] > 0 and pool["layout"]["block_tokens"] == 16
    (ns,) = pool["namespaces"]
    assert ns["namespace"] == "cli" and [t["tier"] for t in ns["tiers"]] == ["host", "disk"]
    assert ns["tiers"][0]["pages"] == 5 and isinstance(ns["misses"], dict)
    numbers = [v for t in pool["tiers"] for k, v in t.items() if k != "tier"]
    assert all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in numbers)
    for message, fields in ((pb.StatsResponse, data), (pb.PoolStats, pool), (pb.TierStats, tiers["host"]),
                            (pb.NamespaceStats, ns)):
        assert set(fields) == set(message.DESCRIPTOR.fields_by_name)


@pytest.mark.parametrize("enum", sorted(pb.DESCRIPTOR.enum_types_by_name))
def test_every_enum_reads_as_a_lower_case_name(enum):
    """One rule for every enum of the protocol: the name after the prefix they share, lower
    case, as `kvtier events --json` and `stats why --json` already write tiers and states."""
    descriptor = pb.DESCRIPTOR.enum_types_by_name[enum]
    names = [enum_json(descriptor, v.number) for v in descriptor.values]
    assert names[0] is None  # UNSPECIFIED
    assert all(re.fullmatch(r"[a-z][a-z_]*", n) for n in names[1:]), names
    assert len(set(names[1:])) == len(names) - 1


def test_enum_names_match_the_client_and_the_other_json_outputs():
    tier = pb.DESCRIPTOR.enum_types_by_name["Tier"]
    assert [enum_json(tier, v.number) for v in tier.values[1:]] == ["device", "host", "disk", "cluster"]
    assert {"device", "host", "disk", "cluster"} == {t.label for t in Tier}
    state = pb.DESCRIPTOR.enum_types_by_name["BlockState"]
    assert {enum_json(state, v.number) for v in state.values[1:]} == {r.value for r in BlockReason}
    kind = pb.DESCRIPTOR.enum_types_by_name["KVEventKind"]
    assert [enum_json(kind, v.number) for v in kind.values[1:]] == ["stored", "removed", "cleared"]


def test_message_json_writes_plain_values():
    reply = pb.StatsResponse(version="v", uptime_seconds=float("nan"), pools=[pb.PoolStats(
        pool_id="p", page_bytes=2**40, tiers=[pb.TierStats(tier=pb.TIER_CLUSTER, bytes_in=2**63 + 1)],
        namespaces=[pb.NamespaceStats(namespace="n", misses={"evicted": 3, "corrupt": 2**62})])])
    data = json.loads(json.dumps(message_json(reply)))
    assert data["uptime_seconds"] is None  # not NaN, which is no JSON
    (pool,) = data["pools"]
    assert pool["page_bytes"] == 2**40 and pool["tiers"][0] == {**pool["tiers"][0], "tier": "cluster", "bytes_in": 2**63 + 1}
    assert pool["layout"] is None  # an unset message
    assert pool["namespaces"][0]["misses"] == {"corrupt": 2**62, "evicted": 3}
    assert message_json(pb.KVEvent(kind=pb.KV_EVENT_STORED, keys=[b"\x01\xff"], tier=pb.TIER_HOST)) == {
        "kind": "stored", "namespace": "", "tier": "host", "keys": ["01ff"], "parent": "", "token_ids": [],
        "block_size": 0}


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
