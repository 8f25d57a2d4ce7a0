"""`kvtier bench tiers --daemon`'s multi-process table on tiny sizes: the plumbing, never the
speeds; and nothing left running when it is interrupted."""
from __future__ import annotations

import json
import math
import os
import re

import pytest
from click.testing import CliRunner

from kvtier.cli import main
from kvtier_bench.procs import OPS, render_procs, run_procs

KIB = 1024


def _children() -> set[int]:
    """Live (not zombie) child processes of this one."""
    me, found = os.getpid(), set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    state, parent = f.read().rsplit(")", 1)[1].split()[:2]
            except OSError:
                continue
            if int(parent) == me and state != "Z":
                found.add(int(entry))
    return found


def test_json_and_table_have_every_op_size_and_process_count(bench_dir):
    before = _children()
    result = CliRunner().invoke(main, ["bench", "tiers", "--processes", "1", "--processes", "2", "--pages", "8",
                                       "--page-size", "64KiB", "--quick", "--json", "--dir", str(bench_dir)])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)["processes"]

    assert data["processes"] == [1, 2] and data["reps"] == 1 and data["policy"] == "lru"
    assert [(s["page_bytes"], s["pages"], s["pages_per_call"]) for s in data["sizes"]] == [(64 * KIB, 8, 64)]
    assert {(r["op"], r["processes"]) for r in data["rows"]} == {
        ("get", 1), ("get", 2), ("put", 1), ("put", 2), ("first fill", 1)}
    for row in data["rows"]:
        for side in (row["tier"], row["baseline"]):
            assert all(side[f] > 0 and math.isfinite(side[f]) for f in ("seconds", "pages_per_s", "gb_per_s"))
        assert row["ratio"] > 0 and math.isfinite(row["ratio"])
        assert row["ratio"] == pytest.approx(row["tier"]["pages_per_s"] / row["baseline"]["pages_per_s"])
    assert data["verified_pages"] == 16  # every page of the 1- and 2-process gets, checked
    measured = {(t["op"], t["processes"]): t["met"] for t in data["targets"] if t["page_bytes"] == 64 * KIB}
    assert measured[("put", 1)] in (True, False) and measured[("get", 4)] is None  # no 4-process round here

    table = render_procs(data)
    assert "ratio to P processes copying the same bytes into a cold private buffer" in table
    row = next(line for line in table.splitlines() if line.startswith("64 KiB, 64"))
    assert row.count("x") == 5 and row.count("|") == len(OPS)
    assert "put >= 0.5x at 64 KiB with 1 process" in table and not re.search(r"(?<![\d.])2 MiB", table)
    assert _children() == before


def test_an_interrupted_run_stops_every_worker_and_daemon(bench_dir):
    before = _children()

    def interrupt(message: str) -> None:
        if "2 processes" in message:  # workers and daemon up, one round done
            assert len(_children() - before) == 3
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_procs((64 * KIB,), processes=(1, 2), pages=8, reps=1, directory=str(bench_dir), progress=interrupt)
    assert _children() == before


def test_too_few_pages_for_the_processes_is_refused():
    result = CliRunner().invoke(main, ["bench", "tiers", "--processes", "4", "--pages", "2", "--quick"])
    assert result.exit_code == 2 and "--pages" in result.output
