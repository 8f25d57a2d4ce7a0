"""`kvtier bench rpc` on tiny sizes: the plumbing, never the speed."""
import json
import math
import subprocess
import sys


def test_bench_rpc_reports_latency_against_the_echo_baseline():
    out = subprocess.run(
        [sys.executable, "-m", "kvtier", "bench", "rpc", "--iterations", "20", "--keys", "8", "--json"],
        capture_output=True, text=True, timeout=120, check=True,
    )
    result = json.loads(out.stdout)
    names = [row["name"] for row in result["latency"]]
    assert names == ["Lookup (8 keys)", "Acquire+Release (8 pages)"]
    for row in result["latency"]:
        for field in ("median_us", "p99_us", "baseline_median_us", "baseline_p99_us", "median_ratio"):
            assert math.isfinite(row[field]) and row[field] > 0, (field, row)
        assert row["p99_us"] >= row["median_us"]
    assert result["page_ops_per_s"] > 0 and result["echo_calls_per_s"] > 0


def test_bench_rpc_table_names_the_baseline():
    out = subprocess.run(
        [sys.executable, "-m", "kvtier", "bench", "rpc", "--iterations", "10", "--keys", "4"],
        capture_output=True, text=True, timeout=120, check=True,
    )
    assert "echo median" in out.stdout and "baseline: 2 echo calls" in out.stdout
    assert "pages/s" in out.stdout
