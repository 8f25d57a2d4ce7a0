"""`kvtier bench trace --codec`: each codec's disk holds its measured ratio more pages in the
same bytes; the table gives the hit rate and disk reads per hit against identity's."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvtier_bench.trace import format_codec_markdown, format_codec_table, run_codecs
from kvtier.cli import main

#: Ten conversations of three blocks, round-robin five times (tests/replay/test_codec_replay.py):
#: host 2 + 20 raw disk pages cycle without a hit; fp8's 39 disk pages hit 4 rounds of 5.
CYCLIC = [[c * 10 + b for b in range(3)] for _ in range(5) for c in range(10)]
DISK_TOKENS = 20 * 512


@pytest.fixture
def cyclic_trace(tmp_path) -> str:
    path = tmp_path / "cyclic.jsonl"
    path.write_text("".join(json.dumps({"timestamp": i, "hash_ids": ids}) + "\n" for i, ids in enumerate(CYCLIC)))
    return str(path)


def test_each_codec_replays_with_its_ratio(cyclic_trace):
    result = run_codecs(cyclic_trace, codecs=("fp8", "int4"), disk_tokens=(DISK_TOKENS,), host_pages=2, workers=1)
    lines = {x.ratio.codec: x for x in result.lines}
    assert list(lines) == ["identity", "fp8", "int4"]  # identity first: the reference
    assert [lines[c].disk_pages for c in lines] == [20, 39, 62]
    assert lines["fp8"].disk_pages >= 1.8 * lines["identity"].disk_pages
    assert (lines["identity"].line.rate, lines["fp8"].line.rate, lines["int4"].line.rate) == (0.0, pytest.approx(0.8),
                                                                                            pytest.approx(0.8))
    # Every hit past the host's two pages comes from disk: 120 of 120 hit blocks.
    assert lines["fp8"].reads_per_hit == pytest.approx(1.0)
    assert result.versus(lines["fp8"]) == (None, None)  # identity hits nothing: no ratio to it
    data = result.as_dict()
    assert [x["disk_pages"] for x in data["lines"]] == [20, 39, 62]
    assert data["lines"][1]["raw_disk_tokens"] == DISK_TOKENS and "synthetic" in data["lines"][1]["source"]
    table, markdown = format_codec_table(result), format_codec_markdown(result)
    assert "disk reads/hit" in table and "fp8       1.999" in table
    assert markdown.startswith("| disk, raw-eq. tokens | codec | ratio |") and "| fp8 | 1.999 | 39 |" in markdown


def test_hit_rate_and_reads_against_identity(cyclic_trace):
    # A disk already big enough for identity: the codec cannot add hits, the ratios are 1.
    result = run_codecs(cyclic_trace, codecs=("fp8",), disk_tokens=(40 * 512,), host_pages=2, workers=1)
    fp8 = next(x for x in result.lines if x.ratio.codec == "fp8")
    assert result.versus(fp8) == (pytest.approx(1.0), pytest.approx(1.0))


def test_the_command(cyclic_trace):
    runner = CliRunner()
    help_text = runner.invoke(main, ["bench", "trace", "--help"]).output
    assert "--codec" in help_text and "--disk-tokens" in help_text
    out = runner.invoke(main, ["bench", "trace", "--trace", cyclic_trace, "--codec", "fp8", "--disk-tokens", "10240",
                               "--capacity", "2", "--workers", "1", "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output.strip().splitlines()[-1])
    assert [(x["codec"], x["disk_pages"]) for x in data["lines"]] == [("identity", 20), ("fp8", 39)]
    bad = runner.invoke(main, ["bench", "trace", "--trace", cyclic_trace, "--codec", "fp8", "--layout", "heads=2"])
    assert bad.exit_code != 0 and "is not one of" in bad.output
