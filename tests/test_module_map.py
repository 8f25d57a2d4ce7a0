"""docs/architecture.md's module map names every module and package of the three
distributions, so a module added without a line there fails here (the map is how a
newcomer finds where things live; a map that drifts sends them to the wrong place)."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = (ROOT / "kvtier", ROOT / "client" / "kvtier_client", ROOT / "benchmarks" / "kvtier_bench")
GENERATED = "proto"  # protobuf code from proto/ (scripts/gen_proto.sh), named by the proto


def mapped_names() -> set[str]:
    """Every word of the module map's section: a module is named when its stem is one."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    section = doc.split("## Module map", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", section))


def unnamed(names: set[str]) -> list[str]:
    missing = []
    for source in SOURCES:
        for path in sorted(source.rglob("*")):
            if GENERATED in path.relative_to(source).parts or path.name == "__pycache__":
                continue
            if path.is_dir() and any(path.glob("*.py")):
                name = path.name
            elif path.suffix == ".py" and path.name != "__init__.py":
                name = path.stem
            else:
                continue
            if name not in names:
                missing.append(str(path.relative_to(ROOT)))
    return missing


def test_the_module_map_names_every_module():
    missing = unnamed(mapped_names())
    assert not missing, f"docs/architecture.md's module map does not name {missing}: add a line for each"


def test_a_module_the_map_does_not_name_is_found():
    assert unnamed(mapped_names() - {"frecency"}) == ["kvtier/policy/frecency.py"]
