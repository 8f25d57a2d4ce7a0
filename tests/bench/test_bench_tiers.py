"""`kvtier bench tiers` on tiny sizes: the plumbing, never the speeds."""
from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from kvtier_bench.harness import layout_for
from kvtier_bench.tiers import COLUMNS, OPS
from kvtier.units import parse_size
from kvtier.cli import main



def _run(*args: str) -> str:
    result = CliRunner().invoke(main, ["bench", "tiers", *args])
    assert result.exit_code == 0, result.output
    return result.stdout


def test_json_has_every_op_with_positive_finite_ratios(bench_dir):
    data = json.loads(_run("--pages", "8", "--quick", "--json", "--dir", str(bench_dir), "--page-size", "256KiB", "--page-size", "2MiB"))

    assert data["reps"] == 1
    assert [s["pages"] for s in data["sizes"]] == [8, 8]
    assert data["dir"] == str(bench_dir)
    assert data["machine"]["nproc"] >= 1 and data["machine"]["ram_bytes"] > 0
    assert isinstance(data["direct_io"], bool)
    if not data["direct_io"]:  # the buffered fallback is never silent
        assert any("O_DIRECT" in note for note in data["notes"])
    assert [s["page_bytes"] for s in data["sizes"]] == [256 * 1024, 2 * 1024 * 1024]
    rows = {(r["page_bytes"], r["op"]) for r in data["results"]}
    assert rows == {(size, op) for size in (256 * 1024, 2 * 1024 * 1024) for op in OPS}
    for row in data["results"]:
        for side in (row["tier"], row["baseline"]):
            for field in ("seconds", "pages_per_s", "gb_per_s"):
                assert side[field] > 0 and math.isfinite(side[field]), (row["op"], field)
        assert row["ratio"] > 0 and math.isfinite(row["ratio"])
        assert row["ratio"] == pytest.approx(row["tier"]["pages_per_s"] / row["baseline"]["pages_per_s"])
        assert row["baseline"]["name"]


def test_table_shows_columns_and_one_row_per_op(bench_dir):
    out = _run("--pages", "3", "--quick", "--dir", str(bench_dir), "--page-size", "256KiB")

    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("page"))
    for column in COLUMNS:
        assert column in header
    rows = [line for line in lines if line.startswith("256 KiB")]
    assert [next(op for op in OPS if op in row) for row in rows] == list(OPS)
    for row in rows:
        ratio = float(row.split()[-1])
        assert ratio > 0 and math.isfinite(ratio)
    assert "O_DIRECT" in out and str(bench_dir) in out


def test_a_size_without_a_named_layout_gets_an_exact_generic_one(bench_dir):
    data = json.loads(_run("--pages", "2", "--quick", "--json", "--dir", str(bench_dir), "--page-size", "12288"))

    assert [s["page_bytes"] for s in data["sizes"]] == [12288]
    assert len(data["results"]) == len(OPS)


def test_bad_page_size_is_refused_with_a_message():
    result = CliRunner().invoke(main, ["bench", "tiers", "--page-size", "lots", "--quick"])
    assert result.exit_code == 2
    assert "256KiB" in result.output


@pytest.mark.parametrize("text, size", [("256KiB", 262144), ("2MiB", 2097152), ("2MB", 2_000_000), ("4096", 4096), ("1 GiB", 2**30)])
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("size", [256 * 1024, 2 * 1024 * 1024, 12288, 6])
def test_layouts_have_exactly_the_page_size(size):
    _, layout = layout_for(size)
    assert layout.page_bytes == size
