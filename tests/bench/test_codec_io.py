"""`kvtier bench codec-io` on a tiny layout, one sample: every codec has its row, the lossy
ones store fewer bytes, the pages read back are what each codec restores (checked by the
bench itself); never the speeds."""
from __future__ import annotations

import json
import math

from click.testing import CliRunner

from kvtier_bench.codec_io import CODEC_NAMES, format_table, run_codec_io
from kvtier.cli import main
from kvtier_client.layout import PageLayout

#: 512 KiB pages of 512 tokens: a 4,096-token prefix is 8 pages.
TINY = "layers=2,kv_heads=2,head_dim=64,block_tokens=512,dtype=float16"
LOSSY = ("k16v8", "fp8", "int4", "int8")


def test_disk_part_has_every_codec_and_lossy_ratios_above_one(bench_dir):
    result = CliRunner().invoke(main, ["bench", "codec-io", "--part", "disk", "--layout", TINY, "--samples", "1",
                                       "--json", "--dir", str(bench_dir)])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)

    rows = {r["codec"]: r for r in data["disk"]}
    assert list(rows) == list(CODEC_NAMES) and data["prefix_pages"] == 8 and data["cluster"] == []
    for name, row in rows.items():
        assert all(math.isfinite(row[k]) and row[k] > 0 for k in ("acquire_ms", "identity_ms", "raw_ms", "ratio"))
        assert row["ratio"] > 1 if name in LOSSY else row["ratio"] >= 1
        assert row["rel_error"] > 0 if name in LOSSY else row["rel_error"] == 0


def test_cluster_part_on_the_shared_cluster(redis_cluster, tmp_path):
    layout = PageLayout(layers=2, kv_heads=2, head_dim=64, block_tokens=16, dtype="float16")
    result = run_codec_io(layout, parts=("cluster",), samples=1, cluster_pages=4, cluster=redis_cluster,
                          directory=str(tmp_path))

    assert [r.codec for r in result.cluster] == list(CODEC_NAMES) and not result.disk
    for r in result.cluster:
        assert r.get_ms_per_page > 0 and (r.ratio > 1 if r.codec in LOSSY else r.ratio >= 1)
    table = format_table(result)
    assert all(name in table for name in CODEC_NAMES) and "memcpy" in table
