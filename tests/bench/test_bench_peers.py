"""`kvtier bench peers` on tiny sizes: rows, reasons, ratios; never the speeds."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvtier_bench.peers import bench as peers
from kvtier_bench.peers.bench import (
    System,
    format_markdown,
    format_table,
    run_peers,
)
from kvtier_bench.peers.redis import redis_server_binary
from kvtier.cli import main

KIB64 = 64 * 1024


def _row(result, system):
    return next(r for r in result.rows if r.system == system)


def _positive(rate) -> bool:
    return rate is not None and rate.pages_per_s > 0 and math.isfinite(rate.gb_per_s)


def test_kvtier_and_grpc_run_and_a_missing_peer_keeps_its_row_with_the_reason(bench_dir, monkeypatch):
    monkeypatch.setattr(peers, "LMCACHE_VENV", Path("/nonexistent/venv"))
    messages = []
    result = run_peers([KIB64], pages=8, reps=1, systems=("kvtier", "grpc", "lmcache"), directory=str(bench_dir),
                       progress=messages.append)

    assert [r.system for r in result.rows] == ["kvtier", "lmcache", "grpc"]  # the table's order
    kvtier, lmcache, grpc = result.rows
    for row in (kvtier, grpc):
        assert row.ran and row.reason is None and row.pages == 8 and row.page_bytes == KIB64
        assert _positive(row.put) and _positive(row.get)
    assert result.ratio(kvtier, "put") == pytest.approx(1.0)
    assert result.ratio(grpc, "get") == pytest.approx(kvtier.get.pages_per_s / grpc.get.pages_per_s)
    assert not lmcache.ran and lmcache.put is None
    assert "not installed" in lmcache.reason and "setup_bench_peers.sh" in lmcache.reason
    assert result.best_peer(KIB64, "put").system == "grpc"  # kvtier's own rows never count as peers

    data = result.as_dict()
    assert data["machine"]["nproc"] >= 1 and data["reps"] == 1
    by_system = {r["system"]: r for r in data["rows"]}
    assert by_system["lmcache"]["ran"] is False and by_system["lmcache"]["put"] is None
    assert by_system["grpc"]["kvtier_over_put"] > 0
    assert data["best_peer"]["64 KiB put"]["system"] == "grpc"
    table = format_table(result)
    assert "not run: LMCache is not installed" in table and "kvtier/peer put" in table
    assert "| 64 KiB | LMCache server (cpu)" in format_markdown(result)
    assert any("does not run" in m for m in messages)


def test_a_system_that_fails_while_measuring_keeps_its_row_with_the_reason(bench_dir, monkeypatch):
    class Broken:
        def __init__(self, ctx):
            pass

        def prepare(self, rep):
            pass

        def put(self, rep):
            pass

        def get(self, rep):
            raise ConnectionResetError("peer went away")

        def close(self):
            pass

    broken = System("broken", "a broken store", "fails on get", Broken)
    monkeypatch.setattr(peers, "SYSTEMS", (*peers.SYSTEMS[:1], broken))
    monkeypatch.setattr(peers, "SYSTEM_NAMES", ("kvtier", "broken"))
    result = run_peers([KIB64], pages=4, reps=1, systems=("kvtier", "broken"), directory=str(bench_dir))

    kvtier, row = result.rows
    assert kvtier.ran
    assert not row.ran and "failed during warm-up" in row.reason and "peer went away" in row.reason


def test_a_store_that_returns_other_bytes_is_caught(bench_dir, monkeypatch):
    class Liar:
        def __init__(self, ctx):
            self.ctx = ctx

        def prepare(self, rep):
            pass

        def put(self, rep):
            pass

        def get(self, rep):
            self.ctx.sink[...] = 7

        def close(self):
            pass

    monkeypatch.setattr(peers, "SYSTEMS", (System("liar", "a liar", "wrong bytes", Liar),))
    monkeypatch.setattr(peers, "SYSTEM_NAMES", ("liar",))
    result = run_peers([KIB64], pages=4, reps=1, systems=("liar",), directory=str(bench_dir))
    assert not result.rows[0].ran and "other bytes" in result.rows[0].reason


def test_redis_row_runs_where_redis_server_is_installed(bench_dir):
    try:
        import redis
    except ImportError:
        redis = None
    result = run_peers([KIB64], pages=8, reps=1, systems=("kvtier", "redis"), directory=str(bench_dir))
    row = _row(result, "redis")
    if redis_server_binary() is None or redis is None:
        assert not row.ran and row.reason  # the reason says what to install
        pytest.skip(f"Redis is not installed here: {row.reason}")
    assert row.ran, row.reason
    assert _positive(row.put) and _positive(row.get)
    assert row.version.startswith(("redis-server", "valkey-server"))
    assert result.ratio(row, "put") > 0


def test_cli_json_and_unknown_system():
    out = CliRunner().invoke(main, ["bench", "peers", "--system", "grpc", "--page-size", "64KiB", "--pages", "4",
                                    "--reps", "1", "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert [r["system"] for r in data["rows"]] == ["grpc"]
    assert data["rows"][0]["ran"] and data["rows"][0]["kvtier_over_put"] is None  # no kvtier row to compare with

    bad = CliRunner().invoke(main, ["bench", "peers", "--system", "memcached"])
    assert bad.exit_code == 2 and "kvtier" in bad.output


def test_kvtier_over_the_lane_and_over_grpc_against_np_copyto(bench_dir):
    result = run_peers([KIB64], pages=8, reps=1, systems=("kvtier", "kvtier-grpc"), directory=str(bench_dir), batch=4)

    assert result.batch == 4
    lane, slow = _row(result, "kvtier"), _row(result, "kvtier-grpc")
    for row in (lane, slow):
        assert row.ran and _positive(row.copyto_put) and _positive(row.copyto_get)
        for op in ("put", "get"):
            assert math.isfinite(result.over_copyto(row, op)) and result.over_copyto(row, op) > 0
    assert result.best_peer(KIB64, "put") is None  # both are kvtier's own rows
    assert result.lane_over_grpc(KIB64, "get") == pytest.approx(lane.get.pages_per_s / slow.get.pages_per_s)
    data = result.as_dict()
    assert data["rows"][0]["over_copyto_put"] > 0 and data["lane_over_grpc"]["64 KiB put"] > 0
    assert data["copyto_targets"] == {"64 KiB": 0.6, "2 MiB": 0.9}
    table = format_table(result)
    assert "kvtier / np.copyto 64 KiB: put" in table and "(target >= 0.6)" in table and "lane/gRPC put" in table
    assert "kvtier / np.copyto" in format_markdown(result)


def test_the_kvtier_store_uses_the_transport_it_names(bench_dir):
    from kvtier_bench.harness import layout_for
    from kvtier_bench.peers.kvtier import KvtierPages

    _, layout = layout_for(KIB64)
    for lane, transport in ((True, "lane"), (False, "grpc")):
        with KvtierPages(bench_dir / transport, layout, 4, lane=lane) as store:
            assert store.client.transport == transport
        import shutil

        shutil.rmtree(bench_dir / transport)
