"""`kvtier bench cluster` on tiny sizes, on a real loopback Redis Cluster and real daemons:
both parts run, the pages come back byte-equal, the shared tier raises two nodes' hit rate;
never the speeds."""
from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from kvtier_bench.all import targets
from kvtier_bench.cluster import format_markdown, format_table, run_cluster, server_missing
from kvtier.cli import main

KIB64 = 64 * 1024
#: Conversations of this many turns, interleaved: turn t of conversation c is request
#: t * CONVERSATIONS + c. CONVERSATIONS is odd, so round-robin puts each next turn on the other
#: node, CONVERSATIONS requests later (time enough for the cluster writer).
CONVERSATIONS, TURNS = 9, 4

pytestmark = pytest.mark.skipif(server_missing() is not None, reason=server_missing() or "")


def _chat_trace(tmp_path) -> str:
    """Every conversation opens with a shared 2-block system prompt; each turn adds 3 blocks."""
    requests = []
    for turn in range(TURNS):
        for c in range(CONVERSATIONS):
            own = [1000 * (c + 1) + i for i in range(3 * (turn + 1))]
            requests.append([0, 1, *own])
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"hash_ids": ids}) + "\n" for ids in requests))
    return str(path)


def test_both_parts_on_tiny_sizes(bench_dir, tmp_path_factory):
    trace = _chat_trace(tmp_path_factory.mktemp("trace"))  # bench_dir must end empty
    messages = []
    result = run_cluster((KIB64,), pages=8, reps=1, trace=trace, requests=None, host_pages=128, disk_pages=128,
                         directory=str(bench_dir), progress=messages.append)

    (row,) = result.pages
    assert row.page_bytes == KIB64 and row.pages == 8
    for op in ("put", "get"):
        assert math.isfinite(row.ratio(op)) and row.ratio(op) > 0

    without, with_cluster = result.runs
    assert (without.cluster, with_cluster.cluster) == (False, True)
    assert without.blocks == with_cluster.blocks == sum(2 + 3 * (t + 1) for t in range(TURNS)) * CONVERSATIONS
    for run in result.runs:
        assert [n.requests for n in run.nodes] == [18, 18]
        assert run.hit_rate <= result.infinite and run.lost == 0
    assert "cluster" not in without.by_tier()
    assert with_cluster.by_tier()["cluster"] > 0  # a turn found its previous turn, written by the other node
    assert with_cluster.hit_rate > without.hit_rate
    assert all(n.cluster_written > 0 for n in with_cluster.nodes)

    data = result.as_dict()
    assert data["pages"][0]["page_size"] == "64 KiB" and data["trace"]["requests"] == TURNS * CONVERSATIONS
    assert [r["cluster"] for r in data["trace"]["runs"]] == [False, True]
    assert "tier put GB/s" in format_table(result) and "| with |" in format_markdown(result)
    assert [t["what"] for t in targets({"cluster": {"result": {"ran": True, **data}}})] == \
        ["64 KiB tier put", "64 KiB tier get"]
    assert any("with the cluster" in m for m in messages)


def test_cli_pages_only_as_json(bench_dir):
    out = CliRunner().invoke(main, ["bench", "cluster", "--part", "pages", "--page-size", "64KiB", "--pages", "4",
                                    "--reps", "1", "--json", "--dir", str(bench_dir)])
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert [r["pages"] for r in data["pages"]] == [4] and data["trace"]["runs"] == []
    assert data["pages"][0]["ratio_get"] > 0


def test_a_missing_trace_is_one_line():
    out = CliRunner().invoke(main, ["bench", "cluster", "--part", "trace", "--trace", "/nonexistent/trace.jsonl"])
    assert out.exit_code == 1 and "absent" in out.output
