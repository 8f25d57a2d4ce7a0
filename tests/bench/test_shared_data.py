"""kvtier_bench.shared_data: the shared data is found from the repository or from
$KVTIER_SHARED_DATA, and no file of the repository names it by a machine's absolute path
(a clone elsewhere would silently skip the tests that need it)."""
from __future__ import annotations

import re
from pathlib import Path

from kvtier_bench.shared_data import ENV, REPOSITORY, absent, mooncake_trace, shared_data, shown

#: An absolute path into a shared data folder: /any/where/shared/data (not ../shared/data).
ABSOLUTE = re.compile(r"(?<![\w.>])/(?:[\w-][\w.-]*/)+shared/data")
SCANNED = ("benchmarks", "client", "deploy", "docs", "examples", "kvtier", "scripts", "tests")
SUFFIXES = {".py", ".md", ".json", ".sh", ".toml", ".yaml", ".yml", ".txt"}


def test_the_data_folder_sits_beside_the_clone_unless_the_variable_names_one(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV, raising=False)
    assert shared_data() == REPOSITORY.parent.resolve() / "shared" / "data"
    assert mooncake_trace() == shared_data("mooncake", "conversation_trace.jsonl")
    monkeypatch.setenv(ENV, str(tmp_path))
    assert mooncake_trace() == tmp_path / "mooncake" / "conversation_trace.jsonl"


def test_results_name_the_shared_data_from_the_repository_root(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV, str(tmp_path))
    assert shown(tmp_path / "mooncake" / "conversation_trace.jsonl") == "../shared/data/mooncake/conversation_trace.jsonl"
    assert shown("/elsewhere/my_trace.jsonl") == "/elsewhere/my_trace.jsonl"  # a trace of one's own, as given
    assert ENV in absent(mooncake_trace()) and "../shared/data" in absent(mooncake_trace())


def test_no_file_names_the_shared_data_by_an_absolute_path():
    found = []
    for top in SCANNED:
        for path in (REPOSITORY / top).rglob("*"):
            if path.suffix in SUFFIXES and path.is_file() and path != Path(__file__).resolve():
                found += [f"{path.relative_to(REPOSITORY)}: {m.group(0)}" for m in ABSOLUTE.finditer(path.read_text(errors="replace"))]
    assert not found, "absolute paths to shared data (use kvtier_bench.shared_data, or ../shared/data):\n" + "\n".join(found)


def test_the_pattern_tells_absolute_paths_from_relative_ones():
    assert ABSOLUTE.search('"trace": "/opt/ci-clone/shared/data/mooncake/conversation_trace.jsonl"')
    assert ABSOLUTE.search("see /srv/ci/shared/data/mooncake/README.md")
    assert not ABSOLUTE.search('"trace": "../shared/data/mooncake/conversation_trace.jsonl"')
    assert not ABSOLUTE.search("<repository>/../shared/data")
