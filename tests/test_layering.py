"""The layers import only downward (docs/architecture.md), no package's modules import each
other in a cycle at import time, and the daemon does not carry the benchmarks: `kvtier serve`
imports nothing from them.

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

import pytest

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
    "kvtier.registry": (),  # named parts from outside kvtier (codecs, policies, cluster backends): stdlib only
    "kvtier.policy": ("kvtier.policy", "kvtier.registry"),
    "kvtier.core": ("kvtier.core", "kvtier.policy"),
    "kvtier.mechanism": ("kvtier.mechanism", "kvtier.core.ports", "kvtier.core.chunks", "kvtier.codecs", "kvtier.units",
                         "kvtier.registry"),
    "kvtier.codecs": ("kvtier.codecs", "kvtier.registry"),  # page codecs of the lower tiers: bytes in, bytes out
    "kvtier.events": ("kvtier.events",),  # the daemon's KV event publisher: tiers and keys in, frames out
    "kvtier_client": ("kvtier_client",),
}


def _module_name(package: str, root: Path, path: Path) -> str:
    """The dotted name of the module in `path` (a package's __init__.py is the package)."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join((package, *parts)).removesuffix(".__init__")


def _imports(package: str, root: Path) -> Iterator[tuple[str, str]]:
    """(module, imported module) for every import statement under `root`."""
    for path in root.rglob("*.py"):
        module = _module_name(package, root, path)
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


# -- no import cycles inside a package -------------------------------------------
def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_time_nodes(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements that run when a module is imported: its top level, including
    inside try/except, with, if and class bodies; not inside functions, and not under
    ``if TYPE_CHECKING:`` (whose else branch does run)."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _import_time_nodes(node.orelse)
        else:
            for field in ("body", "orelse", "finalbody"):
                yield from _import_time_nodes(getattr(node, field, []))
            for clause in [*getattr(node, "handlers", []), *getattr(node, "cases", [])]:
                yield from _import_time_nodes(clause.body)


def _package_dirs() -> dict[str, Path]:
    """Every package of the daemon and the client, by dotted name, with its directory."""
    return {
        _module_name(package, root, init): init.parent
        for package, root in PACKAGES.items()
        for init in sorted(root.rglob("__init__.py"))
    }


def _package_graph(name: str, directory: Path) -> dict[str, set[str]]:
    """Module-level imports between the modules of package `name`: its __init__ (the node
    `name`) and its direct children (modules, and subpackages as their __init__).

    ``from pkg import x`` imports the submodule pkg.x when x is one, else pkg's __init__;
    ``from pkg.mod import Name`` imports pkg.mod; ``import pkg.sub.deep`` imports pkg.sub (a
    module of a subpackage is imported after, and by way of, the subpackage's __init__)."""
    paths = {name: directory / "__init__.py"}
    paths |= {f"{name}.{p.stem}": p for p in directory.glob("*.py") if p.name != "__init__.py"}
    paths |= {f"{name}.{p.parent.name}": p for p in directory.glob("*/__init__.py")}

    def node_of(imported: str) -> str | None:
        if imported == name:
            return name
        if imported.startswith(name + "."):
            child = f"{name}.{imported[len(name) + 1:].split('.')[0]}"
            return child if child in paths else None
        return None

    graph: dict[str, set[str]] = {module: set() for module in paths}
    for module, path in paths.items():
        # the package a relative import (level 1) in this module starts from
        here = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        for node in _import_time_nodes(ast.parse(path.read_text()).body):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [
                    f"{base}.{alias.name}" if base == name and f"{name}.{alias.name}" in paths else base
                    for alias in node.names
                ]
            graph[module] |= {node_of(t) for t in targets} - {None, module}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every elementary cycle of `graph`, each starting from its smallest module name."""
    found = []
    for start in sorted(graph):
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in sorted(graph[node], reverse=True):
                if nxt == start:
                    found.append(path + [start])
                elif nxt > start and nxt not in path:
                    stack.append((nxt, path + [nxt]))
    return sorted(found)


@pytest.mark.parametrize("package", list(_package_dirs()))
def test_no_import_cycles_inside_a_package(package):
    cycles = _cycles(_package_graph(package, _package_dirs()[package]))
    assert not cycles, f"import cycles inside {package} (module-level imports):\n" + "\n".join(
        " -> ".join(cycle) for cycle in cycles
    )


def test_an_import_cycle_is_found(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg.a import A\n")
    (pkg / "a.py").write_text("from . import b\nA = 1\n")
    (pkg / "b.py").write_text(
        "try:\n    from pkg.c import C\nexcept ImportError:\n    C = None\n"
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n"
        "def f():\n    import pkg.a\n"
    )
    (pkg / "c.py").write_text("import pkg.sub.deep\nC = 1\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "deep.py").write_text("")
    (pkg / "d.py").write_text("from pkg import A\n")
    graph = _package_graph("pkg", pkg)
    assert graph == {
        "pkg": {"pkg.a"}, "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.c"}, "pkg.c": {"pkg.sub"},
        "pkg.d": {"pkg"}, "pkg.sub": set(),
    }
    assert _cycles(graph) == []
    (pkg / "sub" / "__init__.py").write_text("from .. import b\n")
    (pkg / "a.py").write_text("from . import b\nfrom pkg import d\nA = 1\n")
    assert _cycles(_package_graph("pkg", pkg)) == [
        ["pkg", "pkg.a", "pkg.d", "pkg"],
        ["pkg.b", "pkg.c", "pkg.sub", "pkg.b"],
    ]
