"""Every page codec, over random layouts, dtypes and values: lossless ones give the page back
byte for byte, lossy ones within their error bound; sizes are what `bound()` says; a damaged
encoding is refused (False), never an exception."""
from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvtier_client.layout import ORDERS, PageLayout

from kvtier.codecs import CODECS, codec_named, decoder

FLOATS = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
OTHERS = ("float8_e4m3fn", "float8_e5m2", "int8", "uint8")
LOSSY = [name for name in CODECS.builtin if CODECS[name].lossy]
EPS = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-24}  # half an ulp, relative
TINY = {"float16": 2.0**-24, "bfloat16": 2.0**-133, "float32": 2.0**-149}  # the smallest subnormal
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def layouts(dtypes) -> st.SearchStrategy[PageLayout]:
    dims = st.integers(1, 5) | st.sampled_from([8, 16, 64])
    return st.builds(PageLayout, layers=st.integers(1, 3), kv_heads=st.integers(1, 3), head_dim=dims,
                     block_tokens=dims, dtype=st.sampled_from(dtypes), order=st.sampled_from(ORDERS))


@st.composite
def float_pages(draw, dtypes=tuple(FLOATS), top: float = 1e4) -> tuple[PageLayout, np.ndarray]:
    """A page of KV-like values: normal with a scale drawn over many decades, some key
    channels 30x larger (the outliers real keys have), some exact zeros."""
    layout = draw(layouts(dtypes))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    scale = draw(st.sampled_from([1e-6, 1e-3, 0.05, 1.0, 30.0, 300.0]))
    x = rng.standard_normal(layout.shape) * scale
    if layout.order == "page_first":
        x[:, 0, ..., rng.integers(0, layout.head_dim, 2)] *= 30
    x[rng.random(layout.shape) < draw(st.sampled_from([0.0, 0.1, 0.9, 1.0]))] = 0
    return layout, np.clip(x, -top, top).astype(FLOATS[layout.dtype])


def raw(a: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(a).view(np.uint8).reshape(-1))


def roundtrip(name: str, layout: PageLayout, page: memoryview) -> tuple[bytes, np.ndarray]:
    codec = codec_named(name, layout)
    enc = codec.encode(page)
    data = bytes(enc.data)
    out = bytearray(layout.page_bytes)
    assert decoder(enc.codec, layout).decode_into(data, memoryview(out))
    return data, np.frombuffer(out, np.uint8)


def as_parts(layout: PageLayout, a: np.ndarray) -> np.ndarray:
    """[layers, parts, tokens, heads, dim] in float64."""
    parts = (layout.layers, layout.kv_parts, layout.block_tokens, layout.kv_heads, layout.head_dim)
    return np.asarray(a, np.float64).reshape(parts)


def fp8_bound(layout: PageLayout, x: np.ndarray) -> np.ndarray:
    """FP8 e4m3 keeps 3 mantissa bits (2^-4 relative); values under its normal range share
    the group's absolute step (2^-9 of the group's scale, itself under amax / 224)."""
    amax = np.abs(x).max(axis=(2, 4), keepdims=True)
    return 2.0**-4 * np.abs(x) + amax * 2.0**-16 + TINY[layout.dtype] + EPS[layout.dtype] * np.abs(x)


def int4_bound(layout: PageLayout, x: np.ndarray, axis: int) -> np.ndarray:
    """Half a step (the group's span / 15, rounded up to float16), the minimum's float16
    rounding, and the output dtype's rounding."""
    lo, hi = x.min(axis=axis, keepdims=True), x.max(axis=axis, keepdims=True)
    step = np.maximum((hi - lo) / 15 * (1 + 2.0**-9), 2.0**-24)
    return step / 2 * (1 + 2.0**-8) + np.abs(lo) * 2.0**-11 + EPS[layout.dtype] * 2 * np.abs(x) + 2.0**-24


def int8_bound(layout: PageLayout, x: np.ndarray, axis: int) -> np.ndarray:
    """Half a step (the group's largest magnitude / 127, rounded up to float16) and the output
    dtype's rounding."""
    step = np.maximum(np.abs(x).max(axis=axis, keepdims=True) / 127 * (1 + 2.0**-9), 2.0**-24)
    return step / 2 * (1 + 2.0**-8) + EPS[layout.dtype] * 2 * np.abs(x) + 2.0**-24


@FAST
@given(page=float_pages(), name=st.sampled_from(CODECS.builtin))
def test_float_pages_round_trip_within_bounds(page, name):
    layout, a = page
    codec = codec_named(name, layout)
    data, out = roundtrip(name, layout, raw(a))
    if codec.lossy:
        assert len(data) == codec.bound()
    else:
        assert len(data) <= codec.bound()
        assert out.tobytes() == raw(a).tobytes()
        return
    x, y = as_parts(layout, a), as_parts(layout, out.view(FLOATS[layout.dtype]))
    assert np.isfinite(y).all()
    if name == "fp8":
        assert (np.abs(y - x) <= fp8_bound(layout, x)).all()
    elif name == "k16v8":
        assert (y[:, :1] == x[:, :1]).all() if layout.kv_parts == 2 else (y == x).all()
        if layout.kv_parts == 2:
            assert (np.abs(y - x)[:, 1:] <= fp8_bound(layout, x[:, 1:])).all()
    else:
        keys, values = x[:, 0], x[:, -1]  # per channel over tokens; per token over channels
        bound = int8_bound if name == "int8" else int4_bound
        assert (np.abs(y[:, 0] - keys) <= bound(layout, keys, 1)).all()
        if layout.kv_parts == 2:
            assert (np.abs(y[:, 1] - values) <= bound(layout, values, 3)).all()


@FAST
@given(layout=layouts(OTHERS), seed=st.integers(0, 2**32 - 1), zeros=st.booleans())
def test_other_dtypes_stay_exact(layout, seed, zeros):
    """FP8 engine caches and the int8/uint8 state pages: lossy codecs are identity, zstd exact."""
    rng = np.random.default_rng(seed)
    page = np.zeros(layout.page_bytes, np.uint8) if zeros else rng.integers(0, 256, layout.page_bytes, np.uint8)
    for name in LOSSY:
        assert codec_named(name, layout).id == 0
        assert decoder(CODECS[name].id, layout) is None
    for name in CODECS.builtin:
        data, out = roundtrip(name, layout, memoryview(page))
        assert out.tobytes() == page.tobytes()
        assert len(data) <= codec_named(name, layout).bound()


@FAST
@given(page=float_pages(), name=st.sampled_from(CODECS.builtin), cut=st.integers(1, 64), extra=st.binary(min_size=1, max_size=8))
def test_damaged_encodings_are_refused(page, name, cut, extra):
    layout, a = page
    enc = codec_named(name, layout).encode(raw(a))
    data = bytes(enc.data)
    dec = decoder(enc.codec, layout)
    out = memoryview(bytearray(layout.page_bytes))
    assert dec.decode_into(data[: max(0, len(data) - cut)], out) is False
    assert dec.decode_into(data + extra, out) is False
    assert dec.decode_into(data, memoryview(bytearray(layout.page_bytes + 1))) is False


@FAST
@given(page=float_pages(), name=st.sampled_from(CODECS.builtin), seed=st.integers(0, 2**32 - 1))
def test_garbage_of_the_right_length_never_raises(page, name, seed):
    layout, a = page
    codec = codec_named(name, layout)
    size = len(bytes(codec.encode(raw(a)).data))
    garbage = np.random.default_rng(seed).integers(0, 256, size, np.uint8).tobytes()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert codec.decode_into(garbage, memoryview(bytearray(layout.page_bytes))) in (True, False)


@pytest.mark.parametrize("dtype", list(FLOATS))
@pytest.mark.parametrize("name", CODECS.builtin)
def test_non_finite_and_extreme_values_do_not_raise(dtype, name):
    layout = PageLayout(2, 2, 16, 4, dtype)
    f = np.finfo(FLOATS[dtype]) if dtype != "bfloat16" else ml_dtypes.finfo(ml_dtypes.bfloat16)
    x = np.random.default_rng(0).standard_normal(layout.shape)
    specials = [np.nan, np.inf, -np.inf, float(f.max), -float(f.max), float(f.tiny) / 4, 0.0, -0.0]
    x.reshape(-1)[: len(specials)] = specials
    x[1] *= float(f.max) / 8  # a layer of huge values: FP8's scale must not overflow on decode
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with np.errstate(over="ignore", invalid="ignore"):
            a = x.astype(FLOATS[dtype])
        _, out = roundtrip(name, layout, raw(a))
    y = out.view(FLOATS[dtype]).astype(np.float64).reshape(layout.shape)
    if name in ("fp8", "k16v8"):  # the layers without a NaN or infinity stay finite and close
        assert np.isfinite(y[1]).all()
        assert (np.abs(y[1] - a[1].astype(np.float64)) <= 2.0**-3 * np.abs(a[1].astype(np.float64)) + 1e-30).all()


def test_unknown_codec_is_a_miss():
    layout = PageLayout(2, 2, 16, 4)
    assert decoder(99, layout) is None
    assert decoder(99, PageLayout(2, 2, 16, 4, "uint8")) is None
    with pytest.raises(ValueError, match="unknown codec"):
        codec_named("lz77", layout)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_realistic_page_ratios(dtype):
    """The ratios the docs quote, on a 28-layer page (1.8 MB in 16 bits)."""
    layout = PageLayout(28, 8, 128, 16, dtype)
    rng = np.random.default_rng(1)
    x = rng.standard_normal(layout.shape)
    x[:, 0, ..., :4] *= 20
    page = raw(x.astype(FLOATS[dtype]))
    sizes = {name: len(bytes(codec_named(name, layout).encode(page).data)) for name in CODECS.builtin}
    ratio = {name: layout.page_bytes / size for name, size in sizes.items()}
    assert ratio["identity"] == 1 and ratio["zstd"] > 1.1
    assert ratio["k16v8"] == pytest.approx(4 / 3, rel=0.01) and ratio["fp8"] == pytest.approx(2, rel=0.01)
    assert ratio["int4"] == pytest.approx(3.12, rel=0.01) and ratio["int8"] == pytest.approx(1.87, rel=0.01)
