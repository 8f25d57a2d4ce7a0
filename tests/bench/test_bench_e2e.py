"""`kvtier_bench.e2e` on a tiny model and short prompts: the plumbing and the logits check,
never the speeds."""
from __future__ import annotations

import json
import math
import os

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from click.testing import CliRunner

from kvtier_bench.e2e import ARENA_PREFIX, COLUMNS, ModelSpec, command, format_table, run_e2e

TINY = ModelSpec(hidden_size=64, layers=2, attention_heads=4, kv_heads=2, intermediate_size=128, vocab_size=256)


def _e2e_arenas() -> set[str]:
    mine = f"{ARENA_PREFIX}{os.getpid()}-"
    return {name for name in os.listdir("/dev/shm") if name.startswith(mine)}


@pytest.fixture
def bench_dir(tmp_path):
    """Like tests/bench/conftest.py's, but watching only the arenas of daemons this process
    started, so benchmarks run at the same time by other processes cannot fail it."""
    arenas = _e2e_arenas()
    yield tmp_path
    assert os.listdir(tmp_path) == [], "the benchmark left files in its directory"
    assert _e2e_arenas() == arenas, "the benchmark left a host arena in /dev/shm"


def test_tiny_run_restores_from_host_and_disk_with_equal_logits(bench_dir):
    messages: list[str] = []
    result = run_e2e(lengths=[64, 128], model=TINY, directory=str(bench_dir), load_all=True, progress=messages.append)

    assert [r.tokens for r in result.rows] == [64, 128] and result.reps == 3
    assert any("restore from disk" in m for m in messages) and any("full prefill" in m for m in messages)
    for row in result.rows:
        blocks = row.tokens // TINY.block_tokens  # whole blocks: all restored, but the last token
        assert row.stored_blocks == blocks
        for path, tier_blocks in (("host", "host_blocks"), ("disk", "disk_blocks")):
            p = getattr(row, path)
            assert p.restored_tokens == row.tokens - 1  # the last token is always prefilled
            assert getattr(p, tier_blocks) == blocks
            assert p.max_abs_diff <= 1e-4, (row.tokens, path)
            assert p.ttft_seconds > 0 and math.isfinite(row.speedup(path))
            assert p.ttft_seconds == pytest.approx(sorted(p.samples)[1])
        assert row.host.promoted == 0 and row.disk.promoted == blocks
        assert row.full.restored_tokens == 0 and row.full.max_abs_diff == 0.0

    data = json.loads(json.dumps(result.as_dict()))
    assert data["machine"]["nproc"] >= 1 and data["machine"]["torch"] and data["machine"]["transformers"]
    assert data["model"]["layers"] == 2 and data["page_bytes"] == 2 * 2 * 16 * 2 * 16 * 4
    assert data["rows"][1]["speedup_disk"] == pytest.approx(result.rows[1].speedup("disk"))
    assert data["targets"] == []  # stated at 4,096 tokens only

    table = format_table(result)
    header = next(line for line in table.splitlines() if line.startswith("| prompt tokens"))
    assert all(column in header for column in COLUMNS)
    rows = [line for line in table.splitlines() if line.startswith("| 64 ") or line.startswith("| 128 ")]
    assert len(rows) == 2 and all(line.count("|") == len(COLUMNS) + 1 for line in rows)


def test_default_planner_decides_and_every_path_stays_exact(bench_dir):
    result = run_e2e(lengths=[96], model=TINY, directory=str(bench_dir), reps=1, keep_heap=False)
    assert not result.keep_heap and "glibc defaults" in format_table(result)
    row = result.rows[0]
    assert "Planner" in result.planner
    for p in (row.host, row.disk):
        assert p.max_abs_diff <= 1e-4
        assert p.restored_tokens in (0, 16, 32, 48, 64, 80, 95) and p.plan  # a prefix of blocks, never the last token


def test_bad_lengths_and_threads_are_refused(bench_dir):
    with pytest.raises(ValueError, match="exceed one block"):
        run_e2e(lengths=[16], model=TINY, directory=str(bench_dir))
    with pytest.raises(ValueError, match="threads"):
        run_e2e(lengths=[64], model=TINY, directory=str(bench_dir), threads=0)


def test_command_prints_json_for_the_requested_lengths(bench_dir):
    out = CliRunner().invoke(command, ["--length", "48", "--quick", "--reps", "2", "--threads", "1", "--json",
                                      "--dir", str(bench_dir)])
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert [r["tokens"] for r in data["rows"]] == [48] and data["reps"] == 2
    assert data["machine"]["torch_threads"] == 1 and data["keep_heap"] is True
    assert data["model"]["hidden_size"] == 512 and data["model"]["kv_heads"] == 4
    assert data["rows"][0]["host"]["max_abs_diff"] <= 1e-4
