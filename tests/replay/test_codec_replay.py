"""`kvtier replay --codec/--disk-ratio`: a codec's ratio turns the same disk bytes into more
pages, and on a trace whose working set only fits the larger disk, into more hits."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from kvtier_client.layout import PageLayout

from kvtier.replay.codec import DEFAULT_LAYOUT, codec_ratio, measure_ratio, parse_layout

KVTIER = str(Path(sys.executable).parent / "kvtier")
#: Ten conversations of three blocks visited round-robin five times: 30 distinct blocks.
#: Host 2 + disk 20 raw pages is too small for them (lru cycles: no hit); with fp8 the disk
#: holds 39 pages and every round after the first hits (4 of 5 rounds: 0.8).
CYCLIC = [[c * 10 + b for b in range(3)] for _ in range(5) for c in range(10)]


@pytest.fixture
def cyclic_trace(tmp_path) -> Path:
    path = tmp_path / "cyclic.jsonl"
    path.write_text("".join(json.dumps({"timestamp": i, "hash_ids": ids}) + "\n" for i, ids in enumerate(CYCLIC)))
    return path


def run_replay(trace: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([KVTIER, "replay", str(trace), *args], capture_output=True, text=True, timeout=120)


def replay_json(trace: Path, *args: str) -> dict:
    out = run_replay(trace, "--host-pages", "2", "--disk-pages", "20", "--json", *args)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_fp8_doubles_the_disk_and_its_hits(cyclic_trace):
    raw, fp8 = replay_json(cyclic_trace), replay_json(cyclic_trace, "--codec", "fp8")
    assert raw["disk_pages"] == 20 and raw["disk_codec"]["ratio"] == 1.0
    assert fp8["disk_pages"] >= 1.8 * raw["disk_pages"]
    assert fp8["disk_codec"]["raw_disk_pages"] == 20
    assert fp8["disk_codec"]["ratio"] == pytest.approx(2.0, abs=0.01)
    assert "synthetic" in fp8["disk_codec"]["source"]  # says what it was measured on
    assert fp8["block_hit_rate"] >= raw["block_hit_rate"]
    assert (raw["block_hit_rate"], fp8["block_hit_rate"]) == (0.0, pytest.approx(0.8))


def test_a_given_ratio_is_used_as_given(cyclic_trace):
    data = replay_json(cyclic_trace, "--codec", "zstd", "--disk-ratio", "2.5")
    assert data["disk_pages"] == 50
    assert data["disk_codec"] == {"codec": "zstd", "ratio": 2.5, "source": "given: --disk-ratio", "raw_disk_pages": 20}


def test_the_table_says_the_ratio_and_where_it_came_from(cyclic_trace):
    out = run_replay(cyclic_trace, "--host-pages", "2", "--disk-pages", "20", "--codec", "int4")
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stdout.splitlines() if x.startswith("disk codec"))
    assert "int4, ratio 3.12" in line and "20 raw pages' bytes hold 62" in line and "measured" in line
    assert "disk reads" in out.stdout


def test_help_names_the_codec_options():
    out = subprocess.run([KVTIER, "replay", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    for option in ("--codec", "--disk-ratio", "--layout", "fp8", "int4"):
        assert option in out.stdout


def test_a_bad_layout_is_one_line(cyclic_trace):
    out = run_replay(cyclic_trace, "--codec", "fp8", "--layout", "layers=two")
    assert out.returncode != 0
    assert out.stderr.strip().splitlines() == ["Error: layout 'layers=two': layers must be an integer, got 'two'"]


def test_measured_ratios():
    ratios = {name: measure_ratio(name).ratio for name in ("identity", "zstd", "k16v8", "fp8", "int4")}
    assert ratios["identity"] == 1.0
    assert 1.0 < ratios["zstd"] < 1.5  # lossless on noise-like low bytes: little
    assert ratios["k16v8"] == pytest.approx(4 / 3, abs=0.01)
    assert ratios["fp8"] == pytest.approx(2.0, abs=0.01)
    assert ratios["int4"] > 3.0


def test_lossy_codecs_leave_other_dtypes_alone():
    ratio = codec_ratio("fp8", layout=parse_layout("dtype=uint8"))
    assert ratio.ratio == 1.0 and "does not apply" in ratio.source


def test_parse_layout():
    assert parse_layout("") == DEFAULT_LAYOUT
    assert parse_layout("layers=2, head_dim=64") == PageLayout(2, 8, 64, 16, "float16")
    with pytest.raises(ValueError, match="'heads=2' is not one of"):
        parse_layout("heads=2")
