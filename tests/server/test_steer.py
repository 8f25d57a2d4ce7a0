"""Steer (cache control) on a real daemon, as the wire and the operator see it: malformed
requests refused on either transport without a change, `kvtier cache` commands, and the
hints in `kvtier stats` (table and JSON), `kvtier stats why` and the metrics."""
from __future__ import annotations

import json
import math
import struct

import grpc
import pytest
from click.testing import CliRunner
from kvtier_client import frames
from kvtier_client.frames import Op
from kvtier_client.proto.v1 import kvtier_pb2 as pb
from rpc import Conn, expect_code, free_port, keys, pool_stats, run_kvtier, scrape, unchanged, value
from test_lane import INVALID_ARGUMENT, ask, connect, hello

from kvtier.cli import main

NS = "steer"


@pytest.fixture(scope="module")
def daemon(module_daemons):
    port = free_port()
    # The raw sessions send no heartbeats while the `kvtier` commands run.
    d = module_daemons.start("--metrics-port", str(port), "--session-timeout", "60s", host_size="1MiB",
                             disk_size="4MiB")
    d.metrics_port = port
    return d


@pytest.fixture
def session(daemon):
    conn = Conn(daemon.target)
    try:
        yield conn.session(NS)
    finally:
        conn.close()


def steer(session, ks: list[bytes], **fields) -> pb.SteerResponse:
    return session.call("Steer", pb.SteerRequest(session_id=session.id, keys=ks, **fields))


@pytest.mark.parametrize(("fields", "says"), [
    ({"action": pb.STEER_ACTION_UNSPECIFIED}, "unknown steer action 0"),
    ({"action": 9}, "unknown steer action 9"),
    ({"action": pb.STEER_ACTION_DROP, "ttl_seconds": 5}, "drop takes no ttl_seconds"),
    ({"action": pb.STEER_ACTION_UNPIN, "pin_mode": pb.PIN_MODE_HARD}, "unpin takes no pin_mode"),
    ({"action": pb.STEER_ACTION_PIN, "ttl_seconds": math.nan}, "ttl must be"),
    ({"action": pb.STEER_ACTION_PIN, "ttl_seconds": 8 * 24 * 3600}, "ttl must be"),
    ({"action": pb.STEER_ACTION_PIN, "pin_mode": 7}, "unknown pin mode 7"),
    ({"action": pb.STEER_ACTION_RETAIN}, "a retain names its priority"),
    ({"action": pb.STEER_ACTION_DEMOTE, "tier": pb.TIER_CLUSTER}, "not cluster"),
])
def test_a_malformed_steer_is_refused_over_grpc_changing_nothing(session, fields, says):
    cached = keys("refused", 2)
    session.put(cached)
    with unchanged(session.conn):
        details = expect_code(grpc.StatusCode.INVALID_ARGUMENT, steer, session, cached, **fields)
    assert says in details, details


def test_steer_names_the_session_and_its_key(session):
    request = pb.SteerRequest(session_id=session.id, action=pb.STEER_ACTION_DROP, keys=keys("x", 1))
    expect_code(grpc.StatusCode.PERMISSION_DENIED, session.conn.call, "Steer", request, key="not-its-key")
    request.session_id = "no-such-session"
    expect_code(grpc.StatusCode.NOT_FOUND, session.conn.call, "Steer", request, key=session.key)


_STEER_HEAD = struct.Struct("<BBBBxxxxd")


@pytest.mark.parametrize(("body", "says"), [
    (b"\x01\x02", "a steer starts with action"),
    (_STEER_HEAD.pack(pb.STEER_ACTION_PIN, 0, 0, 0, 0.0) + b"\x05\0\0\0\x10\0\0\0", "cut short"),
    (_STEER_HEAD.pack(pb.STEER_ACTION_DROP, 0, 0, 0, 0.0) + frames.pack_keys(keys("h", 1)) + b"!", "after the end"),
    (_STEER_HEAD.pack(200, 0, 0, 0, 0.0) + frames.pack_keys(keys("h", 1)), "unknown steer action 200"),
    (_STEER_HEAD.pack(pb.STEER_ACTION_PIN, 0, 0, 0, math.inf) + frames.pack_keys(keys("h", 1)), "ttl must be"),
    (_STEER_HEAD.pack(pb.STEER_ACTION_RETAIN, 0, 9, 0, 1.0) + frames.pack_keys(keys("h", 1)), "priority"),
])
def test_hostile_steer_frames_get_invalid_argument_and_the_lane_goes_on(session, body, says):
    with connect(session.reply.lane_socket) as sock:
        assert hello(sock, session)[0] == 0
        with unchanged(session.conn):
            op, status, seq, reply = ask(sock, frames.header(Op.STEER, 5) + body)
        assert (op, status, seq) == (Op.STEER, INVALID_ARGUMENT, 5), reply
        assert says in reply.decode(), reply
        cached = keys("lane-ok", 1)
        session.put(cached)
        op, status, _, reply = ask(sock, frames.steer(6, cached, pb.STEER_ACTION_DROP, 0, 0.0, 0, 0))
        assert status == 0 and frames.unpack_steer(memoryview(reply)) == (1, 0, 0, "")


def kvtier(daemon, *args: str) -> str:
    out = run_kvtier(*args[:2], "--socket", str(daemon.socket), *args[2:])
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_cache_commands_show_in_stats_why_and_metrics(daemon, session):
    cached = keys("cli", 4)
    session.put(cached)
    hexes = [k.hex() for k in cached]
    line = kvtier(daemon, "cache", "pin", "--namespace", NS, "--ttl", "10m", *hexes[:3], keys("absent", 1)[0].hex())
    assert f"pin (soft, 600 s): 4 blocks in namespace {NS}, pool {session.reply.pool_id}: 3 applied, 1 not cached" in line
    retained = json.loads(kvtier(daemon, "cache", "retain", "--namespace", NS, "--priority", "cold", "--ttl", "1m",
                                 hexes[3], "--json"))
    assert (retained["action"], retained["applied"], retained["missing"]) == ("retain", 1, 0)

    stats = json.loads(kvtier(daemon, "stats", "--json"))
    pool = next(p for p in stats["pools"] if p["pool_id"] == session.reply.pool_id)
    hints = next(ns for ns in pool["namespaces"] if ns["namespace"] == NS)["hints"]
    assert (hints["soft_pinned"], hints["cold"], hints["hard_pinned"]) == (3, 1, 0)
    assert 0 < hints["next_expiry_seconds"] <= 60
    table = kvtier(daemon, "stats")
    assert "next TTL end" in table
    row = next(line.split() for line in table.splitlines() if line.split()[:1] == [NS] and "in" in line.split())
    assert row[1:5] == ["0", "3", "0", "1"], row  # hard, soft, high, cold

    why = kvtier(daemon, "stats", "why", "--namespace", NS, *hexes)
    assert why.count("soft pin by session") == 3 and "retain cold by session" in why
    _, families = scrape(daemon.metrics_port)
    labels = {"pool": session.reply.pool_id, "kvtier_namespace": NS}
    assert value(families, "kvtier_hinted_blocks", **labels, **{"class": "soft"}) == 3
    assert value(families, "kvtier_hinted_blocks", **labels, **{"class": "cold"}) == 1
    assert 0 < value(families, "kvtier_hint_next_expiry_seconds", **labels) <= 60
    assert value(families, "kvtier_steer_blocks_total", action="pin", result="missing") >= 1

    before = value(families, "kvtier_steer_blocks_total", action="drop", result="applied")
    dropped = kvtier(daemon, "cache", "drop", "--namespace", NS, hexes[0])
    assert "1 applied, 0 not cached here, 0 skipped" in dropped
    why = kvtier(daemon, "stats", "why", "--namespace", NS, hexes[0])
    assert "dropped from host" in why and "s ago by a client's drop" in why, why
    assert value(scrape(daemon.metrics_port)[1], "kvtier_steer_blocks_total", action="drop", result="applied") == before + 1

    demoted = json.loads(kvtier(daemon, "cache", "demote", "--namespace", NS, "--json", *hexes[1:]))
    assert demoted["applied"] == 3
    assert list(session.lookup(cached[1:]).tiers) == [pb.TIER_DISK] * 3
    assert "3 applied" in kvtier(daemon, "cache", "unpin", "--namespace", NS, *hexes[1:3], hexes[3])
    left = pool_stats(session.conn.state(), session.reply.pool_id)
    assert next(ns for ns in left.namespaces if ns.namespace == NS).hints == pb.HintStats()


def test_cache_commands_refuse_what_they_cannot_do(daemon, session):
    session.put(keys("refuse", 1))
    key = keys("refuse", 1)[0].hex()
    base = ("cache", "pin", "--socket", str(daemon.socket), "--namespace", NS)
    no_ttl = run_kvtier(*base, key)
    assert no_ttl.returncode == 2 and "--ttl" in no_ttl.stderr
    hard = run_kvtier(*base, "--mode", "hard", "--ttl", "1m", key)
    assert hard.returncode == 1 and "FAILED_PRECONDITION" in hard.stderr and "guaranteed_host_pages" in hard.stderr
    both = run_kvtier(*base, "--ttl", "1m", "--tokens", "1,2", key)
    assert both.returncode == 2 and "one of them" in both.stderr
    for command in ("pin", "unpin", "retain", "demote", "drop"):  # in-process: each says what it does
        shown = CliRunner().invoke(main, ["cache", command, "--help"])
        assert shown.exit_code == 0 and "--namespace" in shown.output and "[KEY]..." in shown.output
