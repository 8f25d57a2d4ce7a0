"""`kvtier bench all` on tiny sizes: every section's figures, the files, the machine, errors; never the speeds."""
from __future__ import annotations

import json
import sys
import types

import pytest
from click.testing import CliRunner

import kvtier_bench
from kvtier_bench.all import SECTIONS, Settings, run_all
from kvtier.cli import main

PNG = b"\x89PNG\r\n\x1a\n"


def _fake_e2e(monkeypatch, *, fail: bool = False) -> None:
    """Stand in for kvtier_bench.e2e (another benchmark, minutes of CPU prefill)."""

    def path(ms: float) -> dict:
        return {"ttft_seconds": ms / 1e3, "load_seconds": 0.0, "prefill_seconds": ms / 1e3}

    class Result:
        def as_dict(self) -> dict:
            return {"model_description": "tiny fake", "rows": [
                {"tokens": n, "full": path(n / 10), "host": path(n / 100), "disk": path(n / 50)} for n in (256, 512)],
                "targets": [{"tokens": 512, "path": "host", "target": 10.0, "speedup": 10.0, "met": True}]}

    def run_e2e(*, quick=False, progress=lambda m: None, **kwargs):
        progress("fake e2e")
        if fail:
            raise RuntimeError("no model here")
        return Result()

    fake = types.SimpleNamespace(run_e2e=run_e2e, format_table=lambda result: "| fake e2e table |")
    monkeypatch.setitem(sys.modules, "kvtier_bench.e2e", fake)
    monkeypatch.setattr(kvtier_bench, "e2e", fake, raising=False)


def _trace(tmp_path) -> str:
    path = tmp_path / "trace.jsonl"
    requests = [[1, 2, 3], [1, 2, 4], [5, 6], [1, 2, 3, 7], [5, 6, 8], [9], [1, 2, 4, 10]] * 6
    path.write_text("".join(json.dumps({"hash_ids": ids}) + "\n" for ids in requests))
    return str(path)


def _tiny(tmp_path, bench_dir) -> Settings:
    return Settings(page_sizes=(64 * 1024,), tiers_pages=4, tiers_reps=1, rpc_iterations=20, rpc_keys=4,
                    rpc_processes=(1,), rpc_seconds=0.2, rpc_interference=False,
                    peers_pages=4, peers_reps=1, peers_systems=("kvtier", "grpc"), trace_path=_trace(tmp_path),
                    trace_capacities=(2, 4), cluster_page_sizes=(64 * 1024,), cluster_pages=4, cluster_reps=1,
                    cluster_requests=None, directory=str(bench_dir))


@pytest.mark.slow  # 46 s: every benchmark again; each has its own tiny test in the default suite
def test_all_on_tiny_sizes_writes_json_markdown_and_every_plot(tmp_path_factory, bench_dir, monkeypatch):
    tmp_path = tmp_path_factory.mktemp("all")  # bench_dir must stay empty
    _fake_e2e(monkeypatch)
    out = tmp_path / "results"
    messages = []
    doc = run_all(out, sections=SECTIONS, settings=_tiny(tmp_path, bench_dir), progress=messages.append)

    assert {p.name for p in out.iterdir()} == {"results.json", "results.md", "tiers.png", "peers.png", "trace.png",
                                               "e2e.png"}
    for name in ("tiers", "peers", "trace", "e2e"):
        assert (out / f"{name}.png").read_bytes()[:8] == PNG
    saved = json.loads((out / "results.json").read_text())
    assert saved["command"] == doc["command"] == "kvtier bench all"
    assert list(saved["sections"]) == list(SECTIONS)
    for name, entry in saved["sections"].items():
        assert entry["ok"], (name, entry.get("error"))
        assert entry["seconds"] >= 0
    m = saved["machine"]
    for key in ("cpu", "nproc", "ram_bytes", "kernel", "bench_dir_filesystem", "shm_filesystem"):
        assert m[key], key
    assert m["versions"]["python"] and "torch" in m["versions"]

    tiers = saved["sections"]["tiers"]["result"]
    ops = {r["op"] for r in tiers["results"]}
    assert {(r["op"], r["processes"]) for r in tiers["processes"]["rows"]} >= {("put", 4), ("get", 4), ("first fill", 1)}
    assert ops == {"host put", "host get", "disk write", "disk read", "host put (client)", "host get (client)"}
    peers = saved["sections"]["peers"]["result"]
    assert [r["system"] for r in peers["rows"]] == ["kvtier", "grpc"]
    assert saved["sections"]["trace"]["result"]["points"][0]["host_pages"] == 2
    rpc = saved["sections"]["rpc"]["result"]
    assert rpc["latency"]["transports"] == {"lane": "lane", "grpc": "grpc"}
    assert [r["processes"] for r in rpc["clients"]["rounds"]] == [1, 1] and "interference" not in rpc

    targets = saved["targets"]
    with_cluster = {"cluster"} if saved["sections"]["cluster"]["result"]["ran"] else set()  # no redis-server: a reason
    assert {t["section"] for t in targets} == {"tiers", "rpc", "peers", "e2e"} | with_cluster
    assert all(t["met"] in (True, False, None) for t in targets)
    assert any(t["section"] == "peers" and t["met"] is None and t["note"] for t in targets)  # no 2 MiB pages here
    rpc_targets = [t["what"] for t in targets if t["section"] == "rpc"]
    assert "Lookup (4 keys) lane p50" in rpc_targets and "page ops/s, 4 processes, lane" not in rpc_targets
    assert any(t["section"] == "peers" and "np.copyto" in t["target"] and t["measured"] > 0 for t in targets)

    md = (out / "results.md").read_text()
    for needle in ("## Targets", "![tiers](tiers.png)", "![peers](peers.png)", "![trace](trace.png)",
                   "![e2e](e2e.png)", "| fake e2e table |", "| 64 KiB | kvtier", "np.copyto"):
        assert needle in md, needle
    assert any(msg.startswith("section peers: done") for msg in messages)


def test_a_failing_section_records_its_error_and_the_rest_still_runs(tmp_path_factory, bench_dir, monkeypatch):
    tmp_path = tmp_path_factory.mktemp("all")
    _fake_e2e(monkeypatch, fail=True)
    out = tmp_path / "results"
    doc = run_all(out, sections=("e2e", "trace"), settings=_tiny(tmp_path, bench_dir))

    assert doc["sections"]["e2e"]["ok"] is False
    assert doc["sections"]["e2e"]["error"] == "RuntimeError: no model here"
    assert "Traceback" in doc["sections"]["e2e"]["traceback"]
    assert doc["sections"]["trace"]["ok"] is True
    assert (out / "trace.png").exists() and not (out / "e2e.png").exists()
    assert "Did not run: `RuntimeError: no model here`" in (out / "results.md").read_text()


def test_cli_exits_non_zero_when_a_section_failed_and_refuses_unknown_sections(tmp_path, monkeypatch):
    _fake_e2e(monkeypatch, fail=True)
    result = CliRunner().invoke(main, ["bench", "all", "--section", "e2e", "--out", str(tmp_path / "r")])
    assert result.exit_code == 1
    assert "e2e FAILED" in result.output and "section(s) failed: e2e" in result.output
    assert json.loads((tmp_path / "r" / "results.json").read_text())["command"] == "kvtier bench all --section e2e"

    bad = CliRunner().invoke(main, ["bench", "all", "--section", "everything"])
    assert bad.exit_code == 2


def test_unknown_section_in_the_api_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="unknown section"):
        run_all(tmp_path, sections=("tiers", "nope"))


def test_the_cli_works_when_the_e2e_module_does_not_load(monkeypatch):
    monkeypatch.setitem(sys.modules, "kvtier_bench.e2e", None)  # any import of it fails
    listing = CliRunner().invoke(main, ["bench", "--help"])
    assert listing.exit_code == 0 and "peers" in listing.output and "trace" in listing.output

    e2e = CliRunner().invoke(main, ["bench", "e2e", "--quick"])
    assert e2e.exit_code == 1 and "kvtier_bench.e2e does not load" in e2e.output
