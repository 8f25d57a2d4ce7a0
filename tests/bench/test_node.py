"""`kvtier bench node` on small sizes, with real daemons and four real engine processes: the
node-wide daemon hits at least as often as four private ones with the same memory, and every
hit the benchmark counts is one the daemons' own counters saw; never the speeds."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from kvtier_bench.node import ENGINES, run_node
from kvtier_bench.node_routing import PrefixAffinity, RoundRobin

from kvtier.cli import main

#: Conversations of this many turns, interleaved: turn t of conversation c is request
#: t * CONVERSATIONS + c. CONVERSATIONS is 5, one more than the engines, so round-robin puts each
#: next turn on the next engine, and its previous turn has been answered by then (the router
#: waits for an engine's request i - 4 before it sends request i to that engine).
CONVERSATIONS, TURNS = 5, 4


def _chat_trace(tmp_path) -> str:
    """Every conversation opens with a shared 1-block system prompt; each turn adds 3 blocks."""
    lines = []
    for turn in range(TURNS):
        for c in range(CONVERSATIONS):
            ids = [0, *(100 * (c + 1) + i for i in range(3 * (turn + 1)))]
            lines.append(json.dumps({"timestamp": turn * 1000 + c, "hash_ids": ids}) + "\n")
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(lines))
    return str(path)


def _checked_against_the_daemons(run) -> None:
    """The hits are the daemons' answers: their pools counted every lookup's blocks and hits."""
    assert run.daemon_lookups == run.blocks
    assert run.daemon_hits == run.hits + run.lost
    assert run.hits > 0 and run.hit_rate <= run.ceiling


def test_a_shared_daemon_hits_at_least_as_often_as_private_ones_on_the_mooncake_trace(bench_dir, mooncake_trace):
    result = run_node(mooncake_trace, requests=600, fractions=(0.25,), setups=("shared", "private"),
                      directory=str(bench_dir))
    (point,) = result.points
    shared, private = point.run("shared"), point.run("private")
    assert (shared.daemons, private.daemons) == (1, ENGINES)
    assert shared.daemons * shared.host_pages == private.daemons * private.host_pages == point.shared_host_pages
    for run in (shared, private):
        assert [e.requests for e in run.engines] == [600 // ENGINES] * ENGINES
        assert run.blocks == result.blocks
        _checked_against_the_daemons(run)
    assert shared.hit_rate >= private.hit_rate
    assert shared.ceiling == result.infinite > private.ceiling


@pytest.mark.slow  # 17 s; the shared-vs-private hit-rate test keeps the node bench in the default suite
def test_the_cli_on_interleaved_conversations_saves_every_file(bench_dir, tmp_path_factory):
    trace = _chat_trace(tmp_path_factory.mktemp("trace"))  # bench_dir must end empty
    stem = tmp_path_factory.mktemp("results") / "node"
    out = CliRunner().invoke(main, ["bench", "node", "--trace", trace, "--fraction", "0.5", "--save", str(stem),
                                    "--json", "--dir", str(bench_dir)])
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    (point,) = data["points"]
    runs = {r["setup"]: r for r in point["runs"]}
    assert list(runs) == ["shared", "private", "private-sticky"]
    blocks = sum(1 + 3 * (t + 1) for t in range(TURNS)) * CONVERSATIONS
    # Private, round-robin: only the system prompt, after each engine's first request. Sticky: that
    # too, and each conversation's earlier turns, on its own engine. Shared: the same, and the system
    # prompt of every request after the first, unless it raced the first one's commit.
    earlier_turns = sum(3 * t for t in range(TURNS)) * CONVERSATIONS
    assert runs["private"]["hits"] == CONVERSATIONS * TURNS - ENGINES
    assert runs["private-sticky"]["hits"] == CONVERSATIONS * TURNS - ENGINES + earlier_turns
    assert runs["private-sticky"]["hits"] <= runs["shared"]["hits"] <= CONVERSATIONS * TURNS - 1 + earlier_turns
    assert point["shared_over_private"] == runs["shared"]["hit_rate"] / runs["private"]["hit_rate"] > 1
    for run in runs.values():
        assert run["blocks"] == blocks and run["daemon_hits"] == run["hits"] and run["lost"] == 0
        assert run["prefill_tokens_saved"] == run["hits"] * 512
    assert stem.with_suffix(".json").exists() and stem.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    assert "| 50% (" in stem.with_suffix(".md").read_text()


def test_routers():
    rr = RoundRobin(4)
    assert [rr.route([0]) for _ in range(6)] == [0, 1, 2, 3, 0, 1]

    sticky = PrefixAffinity(4)  # threshold 0.3
    new = [sticky.route([0, c, c + 100, c + 200]) for c in (1, 2, 3, 4)]  # 1 of 4 blocks matches: least loaded
    assert new == [0, 1, 2, 3]
    assert sticky.route([0, 3, 103, 203, 5]) == 2  # 4 of its 5 blocks were sent to engine 2
    assert sticky.route([0, 3, 103, *range(40, 47)]) == 0  # 3 of 10 is not more than 0.3: the least loaded
    assert sticky.route([0, 9, 90, 900]) == 1  # only the first block, sent to every engine: the least loaded
