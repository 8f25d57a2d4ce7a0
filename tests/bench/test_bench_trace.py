"""`kvtier bench trace`: the offline Belady reference, the infinite line, the plumbing on small traces."""
from __future__ import annotations

import json
import random

import pytest
from click.testing import CliRunner

from kvtier_bench import shapes
from kvtier_bench.trace import (
    MOONCAKE_2ND_HALF,
    POLICIES,
    Line,
    Point,
    TraceResult,
    belady_hits,
    format_markdown,
    format_table,
    infinite_hits,
    next_uses,
    plot,
    plot_path,
    run_shapes,
    run_trace,
)
from kvtier import policy as kvtier_policy
from kvtier.cli import main
from kvtier.replay.mooncake import halfway, read_timed_trace, read_trace, replay


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


def test_belady_is_at_least_lru_on_a_slice_of_the_real_trace(mooncake_trace):
    requests = []
    for ids in read_trace(str(mooncake_trace)):
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
    assert result.series == [*POLICIES, *(f"{p} host+disk" for p in POLICIES), "belady", "belady host+disk"]
    for p in result.points:
        for name, rate in p.rates.items():
            assert 0 <= rate <= result.infinite + 1e-12, name
        assert set(p.tier_rates) == {f"{p} host+disk" for p in POLICIES}
        assert p.rates["belady host+disk"] >= p.rates["belady"]
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


def test_belady_and_infinite_count_only_from_measure_from():
    requests = [[1, 2], [1, 2, 3], [4], [1, 2, 3]]
    assert infinite_hits(requests, measure_from=2) == (3, 4)
    assert belady_hits(requests, 10, measure_from=2) == (3, 4)
    assert belady_hits(requests, 10) == infinite_hits(requests) == (5, 9)


def test_ratio_vs_lru_and_disk_writes_per_hit_come_from_the_same_replays(tmp_path):
    path = _write(tmp_path, _synthetic(4, 200))
    result = run_trace(path, capacities=(8,), disk_factor=3, workers=1)
    (p,) = result.points
    for name, line in p.lines.items():
        reference = "lru host+disk" if line.disk else "lru"
        assert p.ratio_vs_lru(name) == pytest.approx(p.rates[name] / p.rates[reference]), name
    lru = replay(read_trace(path), host_pages=8, disk_pages=24, policy="lru")
    line = p.lines["lru host+disk"]
    assert (line.disk_writes, line.writes_per_hit) == (lru.disk_writes, lru.disk_writes_per_hit)
    assert line.disk_writes > 0 and line.policy_blocks_per_second > 0
    assert p.lines["belady"].policy_blocks_per_second is None
    data = result.as_dict()["points"][0]
    assert data["ratio_vs_lru"]["lru"] == 1.0
    assert data["disk_writes"] == {f"{x} host+disk": p.lines[f"{x} host+disk"].disk_writes for x in POLICIES}
    assert set(data["disk_writes_per_hit"]) == set(data["disk_writes"])
    assert set(data["policy_blocks_per_second"]) == {n for n, x in p.lines.items() if x.policy != "belady"}
    lowest = result.as_dict()["lowest_ratio_vs_lru"]
    assert "lru" not in lowest and lowest["belady"] == pytest.approx(p.ratio_vs_lru("belady"))


def test_lru_is_replayed_even_when_not_asked_for(tmp_path):
    path = _write(tmp_path, _synthetic(2, 60))
    result = run_trace(path, capacities=(6,), policies=("prefix",), disk_factor=0, workers=1)
    assert result.series == ["lru", "prefix", "belady"]


def test_the_second_half_is_counted_after_the_first_warms_the_cache(tmp_path):
    requests = shapes.shift(seed=1, scale=0.02)
    path = tmp_path / "shift.jsonl"
    shapes.write_jsonl(requests, path)
    middle = halfway([t for t, _ in requests])
    result = run_trace(path, shape=MOONCAKE_2ND_HALF, capacities=(40,), policies=("lru",), disk_factor=0, workers=1)
    ids = [i for _, i in requests]
    assert (result.warmup_requests, result.requests) == (middle, len(requests) - middle)
    assert (result.blocks, round(result.infinite * result.blocks)) == infinite_hits(ids, middle)[::-1]
    assert result.points[0].rates["lru"] == replay(ids, host_pages=40, measure_from=middle).block_hit_rate


def test_the_second_half_of_the_real_trace_is_measured_from_its_midpoint(mooncake_trace):
    timed = []
    for request in read_timed_trace(str(mooncake_trace)):
        timed.append(request)
        if len(timed) == 1500:
            break
    middle = halfway([t for t, _ in timed])
    assert 0 < middle < 1500
    result = run_trace(mooncake_trace, shape=MOONCAKE_2ND_HALF, limit=1500, capacities=(500,), policies=("lru",),
                       disk_factor=0, workers=1)
    assert (result.warmup_requests, result.requests) == (middle, 1500 - middle)
    assert result.trace == "../shared/data/mooncake/conversation_trace.jsonl"  # results name it from the repository
    lru = replay([ids for _, ids in timed], host_pages=500, measure_from=middle)
    assert result.points[0].rates["lru"] == lru.block_hit_rate and result.blocks == lru.blocks


def test_shapes_run_through_one_pool_and_each_gets_its_plot(tmp_path):
    results = run_shapes(("zipf", "scan"), capacities=(50,), policies=("lru",), scale=0.02, workers=2)
    assert [r.shape for r in results] == ["zipf", "scan"]
    for r in results:
        assert r.requests == len(shapes.generate(r.shape, scale=0.02)) and r.warmup_requests == 0
        assert r.points[0].rates["lru"] == replay([i for _, i in shapes.generate(r.shape, scale=0.02)],
                                                  host_pages=50).block_hit_rate
    assert plot_path(tmp_path / "trace.png", "zipf", several=True) == tmp_path / "trace-zipf.png"
    assert plot_path(tmp_path / "trace.png", "zipf", several=False) == tmp_path / "trace.png"


def test_the_plot_takes_policies_it_does_not_know():
    lines = {"lru": Line("lru", False, None, 0.1), "someday": Line("someday", False, None, 0.2),
             "someday host+disk (picky)": Line("someday", True, "picky", 0.3, 0.2, 0.1, 5, 2.5, 1e6),
             "belady host+disk": Line("belady", True, None, 0.4)}
    result = TraceResult(date="now", shape="zipf", trace="-", requests=1, warmup_requests=0, blocks=1, infinite=0.5,
                         disk_factor=10, admissions=("picky",), points=(Point(1, 10, lines), Point(2, 20, lines)),
                         seconds=0.0)
    import io

    png = io.BytesIO()
    plot(result, png)
    assert png.getvalue()[:4] == b"\x89PNG"
    assert "someday host+disk (picky)" in format_table(result) and "2.50" in format_markdown(result)


def test_admissions_give_one_host_disk_line_each(tmp_path):
    names = getattr(kvtier_policy, "AdmissionName", None)
    if names is None:
        pytest.skip("kvtier.policy has no AdmissionName yet: replay() takes no disk admission")
    admissions = [a.value for a in names]
    result = run_trace(_write(tmp_path, _synthetic(8, 80)), capacities=(6,), policies=("lru",), admissions=admissions,
                       disk_factor=2, workers=1)
    (p,) = result.points
    assert [n for n in p.lines if "host+disk" in n and not n.startswith("belady")] == [
        f"lru host+disk ({a})" for a in admissions]
    first, *others = admissions
    assert p.ratio_vs_lru(f"lru host+disk ({first})") == 1.0
    for a in others:
        assert p.ratio_vs_lru(f"lru host+disk ({a})") == p.rates[f"lru host+disk ({a})"] / p.rates[f"lru host+disk ({first})"]
    writes = {a: p.lines[f"lru host+disk ({a})"].disk_writes for a in admissions}
    assert writes[first] == replay(read_trace(result.trace), host_pages=6, disk_pages=12, admission=first).disk_writes


def test_cli_trace_with_shapes_and_a_policy_prints_ratio_and_writes_per_hit_columns(tmp_path):
    out = CliRunner().invoke(main, ["bench", "trace", "--shape", "zipf", "--shape", "sessions", "--scale", "0.02",
                                    "--policy", "prefix", "--capacity", "30", "--plot", str(tmp_path / "t.png")])
    assert out.exit_code == 0, out.output
    for needle in ("x lru", "writes/disk hit", "policy blocks/s", "prefix host+disk", "belady host+disk", ": zipf:",
                   ": sessions:", "Lowest x lru"):
        assert needle in out.stdout, needle
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t-sessions.png", "t-zipf.png"]


def test_cli_trace_json_is_one_object_per_shape(tmp_path):
    out = CliRunner().invoke(main, ["bench", "trace", "--shape", "scan", "--shape", "shift", "--scale", "0.02",
                                    "--policy", "lru", "--capacity", "30", "--json"])
    assert out.exit_code == 0, out.output
    docs = [json.loads(line) for line in out.stdout.splitlines()]
    assert [d["shape"] for d in docs] == ["scan", "shift"]
    point = docs[0]["points"][0]
    assert {"hit_rate", "tier_hit_rate", "ratio_vs_lru", "disk_writes", "disk_writes_per_hit",
            "policy_blocks_per_second"} <= set(point)


def test_cli_a_mooncake_shape_needs_the_trace_but_a_synthetic_one_does_not():
    out = CliRunner().invoke(main, ["bench", "trace", "--trace", "/nonexistent/t.jsonl", "--shape", "mooncake-2nd-half"])
    assert out.exit_code == 1 and "absent" in out.output
    out = CliRunner().invoke(main, ["bench", "trace", "--trace", "/nonexistent/t.jsonl", "--shape", "scan",
                                    "--scale", "0.01", "--capacity", "20", "--policy", "lru", "--workers", "1"])
    assert out.exit_code == 0, out.output
