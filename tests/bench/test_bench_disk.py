"""`kvtier bench disk` on tiny sizes: the plumbing, never the speeds."""
from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from kvtier_bench.disk import (
    BANDWIDTH_OPS,
    COLUMNS,
    PREFIX_COLUMNS,
    PREFIX_OPS,
    prefix_pages_for,
)
from kvtier_bench.harness import layout_for
from kvtier.cli import main

KiB, MiB = 1024, 1024 * 1024


def _run(*args: str) -> str:
    result = CliRunner().invoke(main, ["bench", "disk", *args])
    assert result.exit_code == 0, result.output
    return result.stdout


def _check_row(row: dict) -> None:
    for side in (row["tier"], row["baseline"]):
        for field in ("seconds", "pages_per_s", "gb_per_s"):
            assert side[field] > 0 and math.isfinite(side[field]), (row["op"], field)
    assert row["ratio"] > 0 and math.isfinite(row["ratio"])
    assert row["ratio"] == pytest.approx(row["tier"]["pages_per_s"] / row["baseline"]["pages_per_s"])
    assert "O_DIRECT" in row["baseline"]["name"]


def test_json_has_every_row_with_positive_finite_ratios(bench_dir):
    data = json.loads(_run("--pages", "8", "--quick", "--json", "--dir", str(bench_dir), "--page-size", "256KiB", "--page-size", "2MiB"))

    assert data["reps"] == 1 and data["io_depth"] == 8 and data["fsync"] == "batch"
    assert data["dir"] == str(bench_dir)
    assert data["machine"]["nproc"] >= 1 and data["machine"]["ram_bytes"] > 0
    assert isinstance(data["direct_io"], bool)
    if not data["direct_io"]:  # the buffered fallback is never silent
        assert any("O_DIRECT" in note for note in data["notes"])
    sizes = (256 * KiB, 2 * MiB)
    assert [(s["page_bytes"], s["pages"], s["prefix_pages"]) for s in data["sizes"]] == [(size, 8, 8) for size in sizes]
    assert {(r["page_bytes"], r["op"]) for r in data["bandwidth"]} == {(s, op) for s in sizes for op in BANDWIDTH_OPS}
    assert {(r["page_bytes"], r["op"]) for r in data["prefix"]} == {(s, op) for s in sizes for op in PREFIX_OPS}
    for row in data["bandwidth"] + data["prefix"]:
        _check_row(row)
    for row in data["prefix"]:
        assert row["pages"] == 8
        assert row["tier_ms"] == pytest.approx(row["tier"]["seconds"] * 1e3)
        assert row["ratio"] == pytest.approx(row["baseline_ms"] / row["tier_ms"])


def test_table_shows_columns_and_one_row_per_op(bench_dir):
    out = _run("--pages", "4", "--quick", "--dir", str(bench_dir), "--page-size", "256KiB")

    lines = out.splitlines()
    headers = [line for line in lines if line.startswith("page ")]
    assert len(headers) == 2
    for header, columns in zip(headers, (COLUMNS, PREFIX_COLUMNS)):
        for column in columns:
            assert column in header
    rows = [line for line in lines if line.startswith("256 KiB")]
    assert [next(op for op in BANDWIDTH_OPS + PREFIX_OPS if op in row) for row in rows] == list(BANDWIDTH_OPS + PREFIX_OPS)
    for row in rows:
        ratio = float(row.split()[-1])
        assert ratio > 0 and math.isfinite(ratio)
    assert "O_DIRECT" in out and str(bench_dir) in out and "io_depth 8" in out


@pytest.mark.parametrize("io_depth, fsync", [("1", "never"), ("3", "interval")])
def test_io_depth_and_fsync_reach_both_sides(bench_dir, io_depth, fsync):
    data = json.loads(_run("--pages", "5", "--quick", "--json", "--dir", str(bench_dir), "--page-size", "12288",
                           "--io-depth", io_depth, "--fsync", fsync))

    assert data["io_depth"] == int(io_depth) and data["fsync"] == fsync
    assert [s["page_bytes"] for s in data["sizes"]] == [12288]
    for row in data["bandwidth"] + data["prefix"]:
        _check_row(row)
        assert f"x{io_depth}" in row["baseline"]["name"]


def test_bad_options_are_refused_with_a_message():
    result = CliRunner().invoke(main, ["bench", "disk", "--fsync", "sometimes", "--quick"])
    assert result.exit_code == 2 and "batch" in result.output
    result = CliRunner().invoke(main, ["bench", "disk", "--io-depth", "0", "--quick"])
    assert result.exit_code == 2 and "io-depth" in result.output


@pytest.mark.parametrize("size, pages, expected", [(256 * KiB, 10_000, 512), (2 * MiB, 10_000, 256), (2 * MiB, 100, 100)])
def test_prefix_is_4096_tokens_at_most_the_pages(size, pages, expected):
    _, layout = layout_for(size)
    assert prefix_pages_for(layout, pages) == expected
