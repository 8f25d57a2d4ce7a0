"""`kvtier bench rpc` on tiny sizes: the plumbing, never the speed.

One run of the real command (latency over every transport, the multi-client table with 1
and 2 processes, the interference figure) is shared by the checks below."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from kvtier_bench.clients import DEFINITION, render_clients, render_interference
from kvtier_bench.echo import SeqpacketEcho
from kvtier_bench.rpc import TRANSPORTS, render_all

CALLS = ["lookup", "acquire_release", "acquire_prefix", "commit_borrow"]


def _finite_positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def rpc_result(tmp_path_factory):
    where = tmp_path_factory.mktemp("rpc")
    out = subprocess.run(
        [sys.executable, "-m", "kvtier", "bench", "rpc", "--iterations", "10", "--keys", "8", "--processes", "1",
         "--processes", "2", "--seconds", "0.2", "--dir", str(where), "--json"],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert os.listdir(where) == [], "the interference daemon left files behind"
    return json.loads(out.stdout)


def test_latency_of_every_call_over_every_transport(rpc_result):
    latency = rpc_result["latency"]
    assert latency["transports"] == {"lane": "lane", "grpc": "grpc"}  # what the clients report, not what we asked
    assert [c["name"] for c in latency["calls"]] == CALLS
    assert latency["calls"][0]["label"] == "Lookup (8 keys)"
    for call in latency["calls"]:
        expected = set(TRANSPORTS) if call["name"] in ("lookup", "acquire_release") else set(TRANSPORTS) - {"stubs"}
        assert {t for t in TRANSPORTS if t in call} == expected, call["name"]
        for t in expected:
            row = call[t]
            assert _finite_positive(row["p50_us"]) and row["p99_us"] >= row["p50_us"] and row["samples"] == 10
        for ratio in ("lane_over_grpc", "lane_over_echo", "grpc_over_grpc_echo"):
            assert _finite_positive(call[ratio]), (call["name"], ratio)
        assert "B->" in call["echo_frames"]
    assert "one-way" in latency["calls"][1]["echo_frames"]  # the lane's Release asks for no reply


def test_multi_client_rounds_report_page_operations_per_transport(rpc_result):
    clients = rpc_result["clients"]
    assert clients["definition"] == DEFINITION
    assert [(r["transport"], r["processes"]) for r in clients["rounds"]] == [
        ("lane", 1), ("lane", 2), ("grpc", 1), ("grpc", 2)]
    for r in clients["rounds"]:
        assert r["pairs"] > 0 and _finite_positive(r["page_ops_per_s"])
        assert r["page_ops_per_s"] == pytest.approx(r["pairs"] * clients["keys_per_call"] / r["seconds"])
    table = render_clients(clients)
    assert "lane/gRPC" in table and "page operation = one page acquired and then released" in table


def test_interference_reports_both_halves_and_their_ratio(rpc_result):
    interference = rpc_result["interference"]
    for half in ("alone", "with_loader"):
        assert _finite_positive(interference[half]["p50_us"]) and interference[half]["samples"] == 10
    assert _finite_positive(interference["p50_ratio"]) and _finite_positive(interference["p99_ratio"])
    assert interference["loader_pages"] > interference["host_pages"]  # the loader's working set does not fit
    assert interference["loader"]["acquire_release_calls"] > 0
    assert "with loader" in render_interference(interference)


def test_the_table_names_transports_ratios_and_targets(rpc_result):
    text = render_all(rpc_result)
    for needle in ("lane p50/p99 us", "raw echo p50/p99 us", "gRPC echo p50/p99 us", "lane/gRPC", "lane/raw echo",
                   "<= 0.1", "<= 15", "Commit+Borrow (8 pages)", "acquire_prefix (8 pages)", "interference"):
        assert needle in text, needle


def test_seqpacket_echo_answers_with_the_sizes_asked_for(tmp_path):
    path = tmp_path / "echo.sock"
    server = subprocess.Popen([sys.executable, "-m", "kvtier_bench.echo", "--seqpacket", str(path)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "serving"
        echo = SeqpacketEcho(str(path), timeout=10)
        try:
            echo.sock.send(SeqpacketEcho.message(1040, 76))
            assert len(echo.sock.recv(1 << 16)) == 76
            echo.exchange([SeqpacketEcho.message(16, 0), SeqpacketEcho.message(12, 280), SeqpacketEcho.message(8, 9)])
            echo.sock.send(SeqpacketEcho.message(4, 33))
            assert len(echo.sock.recv(1 << 16)) == 33  # the exchange read exactly its two replies
        finally:
            echo.close()
    finally:
        server.terminate()
        server.wait(10)
