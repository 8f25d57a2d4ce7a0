"""`kvtier bench trace`: the offline Belady reference, the infinite line, the plumbing on small traces."""
from __future__ import annotations

import json
import random

import pytest
from click.testing import CliRunner

from kvtier_bench.trace import (
    DEFAULT_TRACE,
    belady_hits,
    format_markdown,
    format_table,
    infinite_hits,
    next_uses,
    plot,
    run_trace,
)
from kvtier.cli import main
from kvtier.replay.mooncake import read_trace, replay


def _write(tmp_path, requests) -> str:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"hash_ids": ids}) + "\n" for ids in requests))
    return str(path)


def _synthetic(seed: int, n: int = 400) -> list[list[int]]:
    """Prefix-chained requests: conversations that grow turn by turn, plus shared system prompts."""
    rng = random.Random(seed)
    next_id = 1000
    chains: list[list[int]] = [[i, i + 1] for i in range(0, 20, 2)]  # ten system prompts
    requests = []
    for _ in range(n):
        base = rng.choice(chains)
        grown = base + list(range(next_id, next_id + rng.randint(1, 4)))
        next_id += 4
        if rng.random() < 0.6:
            chains.append(grown)
        requests.append(grown)
    return requests


def test_next_uses_points_at_the_next_access():
    assert next_uses([1, 2, 1, 3, 2, 1]) == [2, 4, 5, 6, 6, 6]


def test_belady_gives_the_known_optimum_on_the_textbook_string():
    # The classic reference string: with 3 frames the optimal policy faults 7 times in 12.
    # One block per request, so the prefix hit count is the plain hit count.
    requests = [[b] for b in (1, 2, 3, 4, 1, 2, 5, 1, 2, 3, 4, 5)]
    assert belady_hits(requests, 3) == (5, 12)
    assert belady_hits(requests, 4) == (6, 12)  # 6 faults with 4 frames
    assert belady_hits(requests, 5) == infinite_hits(requests) == (7, 12)


def test_belady_counts_only_the_cached_prefix():
    # Capacity 2. At block 2, 9 is next used later than 1, so 9 goes; [1] then hits. In the
    # last request 1 is still cached but its prefix 9 is not: that request hits nothing.
    requests = [[9, 1], [2], [1], [9, 1]]
    assert belady_hits(requests, 2) == (1, 6)


def test_infinite_is_an_upper_bound_and_belady_beats_lru_on_a_synthetic_trace(tmp_path):
    requests = _synthetic(7)
    path = _write(tmp_path, requests)
    inf_hits, blocks = infinite_hits(requests)
    for capacity in (8, 16, 32, 64):
        b_hits, b_blocks = belady_hits(requests, capacity)
        assert b_blocks == blocks
        lru = replay(read_trace(path), host_pages=capacity, policy="lru")
        assert lru.blocks == blocks
        assert lru.hit_blocks <= b_hits <= inf_hits, capacity


def test_belady_is_at_least_lru_on_a_slice_of_the_real_trace():
    if not DEFAULT_TRACE.exists():
        pytest.skip(f"{DEFAULT_TRACE} is absent: the shared Mooncake trace is needed for this check")
    requests = []
    for ids in read_trace(str(DEFAULT_TRACE)):
        requests.append(ids)
        if len(requests) == 1500:
            break
    hits, blocks = belady_hits(requests, 500)
    lru = replay(requests, host_pages=500, policy="lru")
    assert lru.blocks == blocks
    assert hits >= lru.hit_blocks
    assert hits <= infinite_hits(requests)[0]


def test_run_trace_on_a_small_trace_gives_every_line_and_a_plot(tmp_path):
    path = _write(tmp_path, _synthetic(3, 200))
    messages = []
    result = run_trace(path, capacities=(8, 32), disk_factor=2, workers=1, progress=messages.append)

    assert [p.host_pages for p in result.points] == [8, 32]
    assert [p.disk_pages for p in result.points] == [16, 64]
    assert result.series == ["lru", "prefix", "lru host+disk", "prefix host+disk", "belady"]
    for p in result.points:
        for name, rate in p.rates.items():
            assert 0 <= rate <= result.infinite + 1e-12, name
        assert set(p.tier_rates) == {"lru host+disk", "prefix host+disk"}
    small, large = result.points
    assert large.rates["lru"] >= small.rates["lru"]
    assert any("replays" in m for m in messages)
    data = result.as_dict()
    assert data["requests"] == 200 and data["points"][0]["hit_rate"]["belady"] == small.rates["belady"]
    assert "belady" in format_table(result) and "| 8 (" in format_markdown(result)
    png = tmp_path / "trace.png"
    plot(result, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_trace_json(tmp_path):
    path = _write(tmp_path, _synthetic(5, 120))
    out = CliRunner().invoke(main, ["bench", "trace", "--trace", path, "--capacity", "10", "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert data["points"][0]["host_pages"] == 10
    assert set(data["points"][0]["hit_rate"]) >= {"lru", "prefix", "belady"}


def test_a_missing_trace_is_one_line():
    out = CliRunner().invoke(main, ["bench", "trace", "--trace", "/nonexistent/trace.jsonl", "--capacity", "4"])
    assert out.exit_code == 1
    assert "absent" in out.output
