"""The daemon does not carry the benchmarks: `kvtier serve` imports nothing from them.

The benchmarks are their own distribution (kvtier-bench, benchmarks/kvtier_bench); `kvtier
bench` loads them only when it runs. A child process checks what the serve path imports,
so that modules this test process has already loaded cannot hide or fake an import.
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import kvtier

_SERVE_PATH = """
import json, sys
from click.testing import CliRunner
import kvtier.cli
import kvtier.server.daemon
runner = CliRunner()
results = [runner.invoke(kvtier.cli.main, args) for args in (["serve", "--help"], ["--help"])]
print(json.dumps({
    "exit_codes": [r.exit_code for r in results],
    "lists_bench": "bench" in results[1].output,
    "benchmark_modules": sorted(m for m in sys.modules if m.startswith(("kvtier_bench", "kvtier.bench"))),
}))
"""


def test_the_serve_path_imports_no_benchmark_module():
    out = subprocess.run([sys.executable, "-c", _SERVE_PATH], capture_output=True, text=True, timeout=120, check=True)
    seen = json.loads(out.stdout.splitlines()[-1])
    assert seen["exit_codes"] == [0, 0]
    assert seen["lists_bench"]  # `kvtier --help` still lists `kvtier bench`, without importing it
    assert seen["benchmark_modules"] == []


def test_the_benchmarks_are_not_a_package_of_the_daemon():
    assert not (Path(kvtier.__file__).parent / "bench").exists()
    assert importlib.util.find_spec("kvtier.bench") is None
