"""`kvtier_bench.codec_quality` on one tiny random Llama and short prompts, and on synthetic
KV with outlier key channels: lossless codecs change nothing, lossy ones change what they
say they change, by finite amounts in the order their bit widths give. Never any speed."""
from __future__ import annotations

import math

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from click.testing import CliRunner

from kvtier_bench.cli import bench
from kvtier_bench.codec_pages import CODECS, synthetic
from kvtier_bench.codec_quality import Settings, render, run_model

TINY = Settings(prompts=3, min_tokens=40, max_tokens=150, new_tokens=4, text_tokens=128, dtype="float32")


@pytest.fixture(scope="module")
def llama():
    return {r.codec: r for r in run_model("llama", TINY)}


def test_lossless_rows_restore_exactly_and_decode_the_same_tokens(llama):
    assert set(llama) == {"identity", *CODECS}
    for name in ("identity", "zstd"):
        r = llama[name]
        assert (r.k_max, r.k_mean, r.v_max, r.v_mean) == (0, 0, 0, 0), name
        assert r.agree == r.agree_identity == r.prompts == TINY.prompts, name
        assert r.ppl == r.ppl_ref and r.logit_max == llama["identity"].logit_max, name
    assert llama["identity"].ratio == 1.0 and llama["zstd"].ratio < 1.0


def test_lossy_rows_change_only_what_their_codec_quantizes(llama):
    k16v8, fp8, int4 = llama["k16v8"], llama["fp8"], llama["int4"]
    assert k16v8.k_max == 0 and 0 < k16v8.v_max == fp8.v_max  # keys kept, values FP8 in both
    assert 0 < fp8.k_mean < int4.k_mean and fp8.v_mean < int4.v_mean
    for r in (k16v8, fp8, int4):
        assert all(math.isfinite(x) for x in (r.k_max, r.v_max, r.logit_max, r.ppl)), r.codec
        assert r.logit_max > 0 and r.ppl != r.ppl_ref and 0 <= r.agree <= r.prompts, r.codec
    assert int4.ratio < fp8.ratio < k16v8.ratio < 1  # float32 pages: 4-bit < 8-bit < keys kept


def test_synthetic_outlier_channels_fp8_beats_int4_on_k_and_v():
    rows = {r.codec: r for r in synthetic(tokens=256, layers=1, heads=2, dim=64)}
    assert rows["zstd"].k_max == rows["zstd"].attn_max == 0
    fp8, int4 = rows["fp8"], rows["int4"]
    assert fp8.k_mean < int4.k_mean and fp8.v_mean < int4.v_mean
    assert all(math.isfinite(x) and x > 0 for x in (fp8.attn_max, fp8.attn_rel, int4.attn_max, int4.attn_rel))
    assert rows["k16v8"].k_max == 0 and rows["k16v8"].attn_rel < fp8.attn_rel  # keys untouched


def test_markdown_names_every_row_and_the_command(llama):
    text = render(list(llama.values()), synthetic(tokens=64, layers=1, heads=1, dim=32), TINY, "the command")
    assert "`the command`" in text and text.count("| llama |") == 6 and "| int8 |" in text


def test_cli_registers_the_command():
    result = CliRunner().invoke(bench, ["codec-quality", "--help"])
    assert result.exit_code == 0 and "--prompts" in result.output


def test_the_vllm_half_gets_its_pages_through_the_parents_codecs_over_the_pipe():
    import os
    import threading

    import numpy as np

    from kvtier_bench.codec_pages import roundtrip
    from kvtier_bench.codec_quality_vllm import CodecPipe, serve
    from kvtier_client.layout import PageLayout

    layout = PageLayout(2, 2, 64, 32, "float32")
    pages = np.random.default_rng(0).standard_normal((3, layout.page_bytes // 4), np.float32).view(np.uint8)
    up_r, up_w = os.pipe()
    down_r, down_w = os.pipe()
    with os.fdopen(up_r, "rb") as read, os.fdopen(down_w, "wb") as write:
        parent = threading.Thread(target=serve, args=(read, write, roundtrip))
        parent.start()
        pipe = CodecPipe(up_w, down_r)
        back, ratio = pipe.roundtrip(pages, layout, "fp8")
        same, one = pipe.roundtrip(pages, layout, "zstd")
        pipe.w.close()
        parent.join(timeout=10)
        pipe.r.close()
    assert not parent.is_alive() and 0.25 <= ratio < 0.26 and 0 < one <= 1 and np.array_equal(same, pages)
    assert np.array_equal(back, roundtrip(pages, layout, "fp8")[0]) and not np.array_equal(back, pages)
