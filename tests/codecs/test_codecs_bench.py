"""`kvtier bench codecs` runs end to end on a tiny working set and lists every codec (no
timing asserts: the figures are the machine's)."""
from __future__ import annotations

from click.testing import CliRunner
from kvtier_bench.cli import bench
from kvtier_bench.codecs import CodecBenchResult, format_table, run_codecs, synthetic_kv
from kvtier_client.layout import PageLayout

from kvtier.codecs import CODECS


def test_table_has_every_codec_and_dtype(tmp_path):
    layout = PageLayout(layers=2, kv_heads=2, head_dim=16, block_tokens=4)
    # The built-in codecs: a plugin another test registered in this process (tests/test_registry.py,
    # on the same xdist worker) would join CODECS.
    result = run_codecs(layout, dtypes=("float16", "bfloat16"), working_set=4 * layout.page_bytes, reps=1,
                        directory=str(tmp_path), codecs=CODECS.builtin)
    assert isinstance(result, CodecBenchResult) and result.pages == 4
    assert {(r.codec, r.dtype) for r in result.rows} == {(c, d) for c in CODECS.builtin for d in ("float16", "bfloat16")}
    assert all(r.ratio >= 1 and r.decode_gbs > 0 and r.decode2_gbs > 0 for r in result.rows)
    table = format_table(result)
    for name in CODECS.builtin:
        assert f"\n{name} " in table
    assert "decode/disk" in table and result.as_dict()["rows"][0]["decode_vs_disk"] > 0
    assert list(tmp_path.iterdir()) == []  # the disk probe's scratch file is gone


def test_synthetic_kv_has_outlier_key_channels():
    layout = PageLayout(layers=2, kv_heads=2, head_dim=64, block_tokens=16)
    page = synthetic_kv(layout, 1)[0].view("float16").astype(float).reshape(layout.shape)
    keys = abs(page[:, 0]).max(axis=1)  # per (layer, head, channel)
    assert (keys.max(axis=-1) > 5 * abs(page[:, 1]).max(axis=(1, 3))).all()


def test_command_is_registered():
    result = CliRunner().invoke(bench, ["codecs", "--help"])
    assert result.exit_code == 0, result.output
    assert "--working-set" in result.output
