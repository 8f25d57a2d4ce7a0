"""The layers import only downward (docs/architecture.md), and the daemon does not carry the
benchmarks: `kvtier serve` imports nothing from them.

The benchmarks are their own distribution (kvtier-bench, benchmarks/kvtier_bench); `kvtier
bench` loads them only when it runs. A child process checks what the serve path imports,
so that modules this test process has already loaded cannot hide or fake an import.
"""
from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
from collections.abc import Iterator
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


# -- import direction between the layers (docs/architecture.md) -----------------
ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"kvtier": ROOT / "kvtier", "kvtier_client": ROOT / "client" / "kvtier_client"}

#: What each layer may import from the daemon's packages (kvtier_client is open to all).
ALLOWED = {
    "kvtier.policy": ("kvtier.policy",),
    "kvtier.core": ("kvtier.core", "kvtier.policy"),
    "kvtier.mechanism": ("kvtier.mechanism", "kvtier.core.ports", "kvtier.units"),
    "kvtier.events": ("kvtier.events",),  # the daemon's KV event publisher: tiers and keys in, frames out
    "kvtier_client": ("kvtier_client",),
}


def _imports(package: str, root: Path) -> Iterator[tuple[str, str]]:
    """(module, imported module) for every import statement under `root`."""
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        module = ".".join((package, *parts)).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                yield from ((module, alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                yield module, node.module


def _ours(name: str) -> bool:
    return name.split(".")[0] in ("kvtier", "kvtier_client", "kvtier_bench")


def test_layers_import_only_downward():
    wrong = []
    for package, root in PACKAGES.items():
        for module, imported in _imports(package, root):
            if not _ours(imported) or imported.startswith("kvtier_client") and not module.startswith("kvtier_client."):
                continue
            layer = next((l for l in ALLOWED if module == l or module.startswith(l + ".")), None)
            if layer is None:
                continue
            if not any(imported == a or imported.startswith(a + ".") for a in ALLOWED[layer]):
                wrong.append(f"{module} imports {imported}")
    assert not wrong, "imports against the layering (docs/architecture.md):\n" + "\n".join(wrong)


def test_only_the_lazy_bench_command_names_the_benchmarks():
    wrong = [
        f"{m} imports {i}" for m, i in _imports("kvtier", PACKAGES["kvtier"])
        if i.split(".")[0] == "kvtier_bench" and m != "kvtier.cli"
    ]
    assert not wrong, "\n".join(wrong)
