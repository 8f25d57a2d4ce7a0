"""Lossy codecs: K and V at fewer bits, with scales stored beside them.

    k16v8   keys as they are, values in FP8 (e4m3)                     ~1.33x on 16-bit KV
    fp8     keys and values in FP8 (e4m3)                              ~2.0x
    int4    KIVI-style 4-bit: keys per channel (over the page's tokens),
            values per token (over the head's channels), each group with
            its own minimum and step in float16                        ~3.1x (16 tokens, head_dim 128)
    (int8, integers per channel and per token, is kvtier.codecs.int8: ~1.87x)

FP8 keeps its own exponent per value, so one power-of-two scale per (layer, K or V, head)
only keeps the group's largest value under FP8's 448: an outlier channel costs the other
channels nothing, and a power of two makes the scaling exact. 4-bit has no exponent, so it
follows KIVI: keys have outlier channels (quantized per channel), values do not (per token).

Lossy codecs apply to float16, bfloat16 and float32 pages only: other dtypes (an FP8 engine
cache, the uint8 state pages of hybrid models) are left alone (`lossy_applies`). Every
encoding has a fixed size per layout, so a tier can count on it. Non-finite values are not
kept: an infinity decodes as NaN (FP8) or as a finite value (int4).

Speed (decoding is on every compressed page's read path: it must outrun the disk): numpy's
float16 casts are scalar (1 ns a value) and so is a gather, so FP8 is converted on integers
(a power-of-two scale adds to the exponent bits; zeros, FP8 subnormals and NaN are fixed one
by one after), and int4 computes in float32 and narrows by shifts (rounding half away from
zero); a block of layers at a time, its temporaries in the core's cache; GIL released.

The encoded formats are those of the first version of these codecs (FP8 encodes to the same
bytes; int4 rounds (x - low) / step as x * (1 / step) + (0.5 - low / step), so a value at a
tie may land on the other side).
"""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np
from kvtier_client.layout import PageLayout

from kvtier.codecs.base import Encoded

_FLOATS = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
FP8 = ml_dtypes.float8_e4m3fn
FP8_MAX = 448.0
_FP8_VALUES = np.arange(256, dtype=np.uint8).view(FP8).astype(np.float32)
_F16_MAX = float(np.finfo(np.float16).max)
#: Values per block of layers worked at once (float32 temporaries: 512 KiB, in L2).
_BLOCK = 1 << 17


@dataclass(frozen=True)
class _Bits:
    """Where a float dtype keeps its fields: what the integer-domain conversions need."""

    uint: type
    sint: type
    width: int  # bits
    mant: int  # mantissa bits
    bias: int
    maxfield: int  # the largest exponent field of a finite value
    dtype_max: float


_BITS = {
    np.dtype(np.float16): _Bits(np.uint16, np.int16, 16, 10, 15, 30, _F16_MAX),
    np.dtype(ml_dtypes.bfloat16): _Bits(np.uint16, np.int16, 16, 7, 127, 254, float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)),
    np.dtype(np.float32): _Bits(np.uint32, np.int32, 32, 23, 127, 254, float(np.finfo(np.float32).max)),
}


def lossy_applies(layout: PageLayout) -> bool:
    """Whether lossy codecs encode pages of this layout (float pages only)."""
    return layout.dtype in _FLOATS


class _Blocked:
    """Works a block of layers at a time, so that a block's temporaries stay in the core's
    cache (numpy's passes over a whole page run from memory: 1.4x slower). The encoding is a
    few sections (`_sizes`), each in layer order, so a block's part of each is one slice."""

    def _block_layers(self, blockable: bool) -> None:
        layers, per_layer = self.shape[0], int(np.prod(self.shape[1:]))
        n = max(1, _BLOCK // per_layer) if blockable else layers
        self._blocks = [(s, min(s + n, layers)) for s in range(0, layers, n)]
        self._starts = np.concatenate([[0], np.cumsum(self._sizes(layers))[:-1]]).tolist()
        self.nbytes = sum(self._sizes(layers))

    def _split(self, data: np.ndarray, s: int, e: int) -> list[np.ndarray]:
        return [data[start + a : start + b] for start, a, b in zip(self._starts, self._sizes(s), self._sizes(e))]

    def encode(self, a: np.ndarray, out: np.ndarray) -> None:
        for s, e in self._blocks:
            self._encode(a[s:e], *self._split(out, s, e))

    def decode(self, data: np.ndarray, dest: np.ndarray) -> None:
        for s, e in self._blocks:
            self._decode(*self._split(data, s, e), dest[s:e])


def _where(mask: np.ndarray) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
    """The indices of a contiguous [L, p, T, H, D] mask's true values, and each one's
    (layer, part, head) group: a flat nonzero is 20 times faster than a 5-dimensional one."""
    idx = np.unravel_index(np.flatnonzero(mask), mask.shape)
    return idx, (idx[0] * mask.shape[1] + idx[1]) * mask.shape[3] + idx[3]


class _Fp8Groups(_Blocked):
    """FP8 with one power-of-two scale per (layer, part, head) of a [L, p, T, H, D] array:
    the int8 exponents, then one byte per value."""

    def __init__(self, shape: tuple[int, ...], dtype) -> None:
        self.shape, self.dtype = shape, dtype
        self.bits = b = _BITS[np.dtype(dtype)]
        self._mask = b.uint((1 << (b.width - 1)) | (0x7F << (b.mant - 3)))  # sign and FP8's 7 bits
        self._block_layers(True)

    def _sizes(self, layers: int) -> list[int]:
        _, parts, tokens, heads, dim = self.shape
        return [layers * parts * heads, layers * parts * tokens * heads * dim]

    @staticmethod
    def _exponents(amax: np.ndarray) -> np.ndarray:
        """Per group, the power of two that brings its largest magnitude under 448 (or 0)."""
        exps = np.ceil(np.log2(amax / FP8_MAX))
        exps = np.clip(np.nan_to_num(exps, nan=0.0, posinf=0.0, neginf=0.0), -126, 127)
        exps[np.isfinite(amax) & (amax * np.exp2(-exps) > FP8_MAX)] += 1  # log2 rounded down
        return np.clip(exps, -126, 127).astype(np.int8)

    def _limit(self, exps: np.ndarray) -> np.ndarray:
        """Per group, the largest FP8 value whose decoding stays finite in the page's dtype."""
        lim = self.bits.dtype_max * np.exp2(-exps.astype(np.float64))
        finite = np.sort(_FP8_VALUES[np.isfinite(_FP8_VALUES) & (_FP8_VALUES >= 0)])
        return finite[np.clip(np.searchsorted(finite, lim, side="right") - 1, 0, None)]

    def _encode_values(self, x: np.ndarray, exps: np.ndarray, g: np.ndarray | None = None) -> np.ndarray:
        """FP8 bytes of float32 `x` of groups `g` (all if None) by ml_dtypes: the reference."""
        scale = np.exp2(-exps.astype(np.float32)).reshape(-1)
        lim = self._limit(exps).astype(np.float32).reshape(-1)
        if g is None:
            gshape = exps.shape[:2] + (1, exps.shape[2], 1)
            scale, lim = scale.reshape(gshape), lim.reshape(gshape)
        else:
            scale, lim = scale[g], lim[g]
        x = x * scale
        if (lim < FP8_MAX).any():
            x = np.clip(x, -lim, lim)
        return x.astype(FP8).view(np.uint8)

    def _encode(self, a: np.ndarray, exps_out: np.ndarray, codes_out: np.ndarray) -> None:
        b = self.bits
        bits = a.view(b.uint)
        mag = np.bitwise_and(bits, b.uint((1 << (b.width - 1)) - 1))
        top = mag.max(axis=2).max(axis=-1)
        exps = self._exponents(top.view(self.dtype).astype(np.float64))
        exps_out[...] = exps.reshape(-1).view(np.uint8)
        codes = codes_out.reshape(a.shape)
        k = exps.astype(np.int64)[:, :, None, :, None] + (b.bias - 7)
        if (top >= (b.maxfield + 1) << b.mant).any() or ((k + 15) > b.maxfield).any():
            codes[...] = self._encode_values(a.astype(np.float32), exps)  # rare: slow and exact
            return
        # RNE of the magnitude to 3 mantissa bits, the exponent moved by the group's scale.
        sh = b.mant - 3
        r = np.right_shift(mag, sh)
        np.bitwise_and(r, 1, out=r)
        r += mag
        r += b.uint((1 << (sh - 1)) - 1)
        r >>= sh
        np.subtract(r, (k << 3).astype(b.uint), out=r)
        np.right_shift(bits, b.width - 8, out=codes, casting="unsafe")
        np.bitwise_and(codes, 0x80, out=codes)
        np.bitwise_or(codes, r, out=codes, casting="unsafe")
        # Values under FP8's normal range (or the input's): FP8 subnormals, zeros.
        idx, g = _where(mag < (np.maximum(k + 1, 1) << b.mant).astype(b.uint))
        if g.size:
            codes[idx] = self._encode_values(a[idx].astype(np.float32), exps, g)

    def _decode(self, exps: np.ndarray, codes: np.ndarray, dest: np.ndarray) -> None:
        b = self.bits
        exps = exps.view(np.int8)
        codes = codes.reshape(dest.shape)
        gshape = dest.shape[:2] + (1, dest.shape[3], 1)
        k = exps.astype(np.int64).reshape(gshape) + (b.bias - 7)
        out = dest.view(b.uint)
        # Sign and FP8's 7 bits in place, then the exponent moved by the group's scale.
        np.left_shift(codes.view(np.int8), b.mant - 3, dtype=b.sint, out=out.view(b.sint))
        np.bitwise_and(out, self._mask, out=out)
        np.add(out, (k << b.mant).astype(b.uint), out=out)
        # What that got wrong: zeros, FP8 subnormals and NaN, and values the scale moves out of
        # the dtype's normal range (codes c with c + 1 mod 128 under 8 * lo + 1 or over 8 * hi + 8).
        lo, hi = np.clip(1 - k, 1, 16), np.clip(b.maxfield - k, -1, 15)
        t = np.add(codes, np.uint8(1))
        np.bitwise_and(t, 0x7F, out=t)
        if (lo == 1).all() and (hi == 15).all():
            special = t < 9
        else:
            special = t < (lo * 8 + 1).astype(np.uint8)
            special |= t > (hi * 8 + 8).astype(np.uint8)
        n = np.count_nonzero(special)
        if not n:
            return
        if n > special.size // 8:  # mostly zeros: a table per group is cheaper
            lut = (np.exp2(exps.astype(np.float32))[:, None] * _FP8_VALUES[None, :]).astype(self.dtype)
            base = (np.arange(exps.size, dtype=np.intp) * 256).reshape(gshape)
            out[...] = np.take(lut.view(b.uint).reshape(-1), codes + base)
            return
        idx, g = _where(special)
        out[idx] = (_FP8_VALUES[codes[idx]] * np.exp2(exps.astype(np.float32))[g]).astype(self.dtype).view(b.uint)


class _Codec:
    lossy = True

    def __init__(self, layout: PageLayout) -> None:
        if not lossy_applies(layout):
            raise ValueError(f"{self.name} encodes float16, bfloat16 or float32 pages, not {layout.dtype}")
        self.layout = layout
        self.dtype = _FLOATS[layout.dtype]
        # [layers, parts, tokens, heads, dim]: parts 2 (K, V), or 1 (MLA's latent)
        self.shape = (layout.layers, layout.kv_parts, layout.block_tokens, layout.kv_heads, layout.head_dim)

    def bound(self) -> int:
        return self.nbytes

    def encode(self, page: memoryview) -> Encoded:
        out = np.empty(self.nbytes, np.uint8)
        with np.errstate(all="ignore"):  # NaN and infinities are not kept (module docstring)
            self._encode(np.frombuffer(page, self.dtype).reshape(self.shape), out)
        return Encoded(self.id, memoryview(out))

    def decode_into(self, data: memoryview | bytes, out: memoryview) -> bool:
        if len(data) != self.nbytes or len(out) != self.layout.page_bytes:
            return False
        with np.errstate(all="ignore"):  # any bytes decode: damage is for checksums to find
            self._decode(np.frombuffer(data, np.uint8), np.frombuffer(out, self.dtype).reshape(self.shape))
        return True


class Fp8Codec(_Codec):
    id = 3
    name = "fp8"

    def __init__(self, layout: PageLayout) -> None:
        super().__init__(layout)
        fp8 = _Fp8Groups(self.shape, self.dtype)
        self.nbytes, self._encode, self._decode = fp8.nbytes, fp8.encode, fp8.decode


class K16V8Codec(_Codec):
    """Keys as they are (their outlier channels are what attention is most sensitive to),
    values in FP8. For MLA's latent, which has no values, it changes nothing."""

    id = 2
    name = "k16v8"

    def __init__(self, layout: PageLayout) -> None:
        super().__init__(layout)
        layers, parts, tokens, heads, dim = self.shape
        self._keys = layers * tokens * heads * dim * layout.itemsize if parts == 2 else layout.page_bytes
        self._fp8 = _Fp8Groups((layers, 1, tokens, heads, dim), self.dtype) if parts == 2 else None
        self.nbytes = self._keys + (self._fp8.nbytes if self._fp8 else 0)

    def _encode(self, a: np.ndarray, out: np.ndarray) -> None:
        out[: self._keys].view(self.dtype).reshape(a[:, :1].shape)[...] = a[:, :1]
        if self._fp8:
            self._fp8.encode(a[:, 1:], out[self._keys :])

    def _decode(self, data: np.ndarray, dest: np.ndarray) -> None:
        dest[:, :1] = data[: self._keys].view(self.dtype).reshape(dest[:, :1].shape)
        if self._fp8:
            self._fp8.decode(data[self._keys :], dest[:, 1:])


def _to_f32(a: np.ndarray) -> np.ndarray:
    """`a` as float32, by shifts where numpy's cast is slow (float16: a scalar loop)."""
    if a.dtype == np.float32:
        return np.array(a)
    if a.dtype == ml_dtypes.bfloat16:
        return np.left_shift(a.view(np.uint16), 16, dtype=np.uint32).view(np.float32)
    # float16: sign-extended, shifted under float32's exponent, scaled by 2**112 (exact,
    # subnormals included; an infinity or NaN turns into a value of 65536 or more).
    x = np.left_shift(a.view(np.int16), 13, dtype=np.int32)
    np.bitwise_and(x, np.int32(-0x70000001), out=x)
    x = x.view(np.float32)
    x *= np.float32(2.0**112)
    return x


def _f32_into(y: np.ndarray, dest: np.ndarray) -> None:
    """float32 `y` into `dest`, rounding half away from zero. For float16, `y` comes scaled
    by 2**-112 (its exponent is float16's; float16 subnormals are float32 subnormals)."""
    u = y.view(np.uint32)
    out = dest.view(np.uint16)
    if dest.dtype == ml_dtypes.bfloat16:
        u += np.uint32(0x8000)
        np.right_shift(u, 16, out=out, casting="unsafe")
        return
    sign = np.right_shift(u, 16)
    np.bitwise_and(sign, np.uint32(0x8000), out=sign)
    u += np.uint32(0x1000)
    u >>= 13
    np.bitwise_or(u, sign, out=out, casting="unsafe")  # the sign, at bit 18 of u, falls off


def _min_max(x: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """float32 `x`'s minimum and maximum along `axis` (kept). Along the last axis numpy's float
    reductions are slow (NaN checks): there, on integers ordered as the floats (NaN outside)."""
    if axis != x.ndim - 1:
        return x.min(axis=axis, keepdims=True), x.max(axis=axis, keepdims=True)
    i = x.view(np.int32)
    key = np.right_shift(i, 31)
    np.bitwise_and(key, 0x7FFFFFFF, out=key)
    key ^= i  # negative floats: their magnitude bits flipped
    lo, hi = key.min(axis=axis, keepdims=True), key.max(axis=axis, keepdims=True)
    lo ^= np.right_shift(lo, 31) & 0x7FFFFFFF
    hi ^= np.right_shift(hi, 31) & 0x7FFFFFFF
    return lo.view(np.float32), hi.view(np.float32)


class _Int4Groups(_Blocked):
    """Asymmetric 4-bit of an [L, ...] array, one (minimum, step) pair in float16 per group;
    the groups are what `axis` (the reduced axis) runs along: the minimums, the steps, then
    the values two to a byte, the first in the low nibble."""

    def __init__(self, shape: tuple[int, ...], axis: int, dtype) -> None:
        self.shape, self.axis, self.dtype = shape, axis, dtype
        self._per_layer = int(np.prod(shape[1:]))
        self._block_layers(self._per_layer % 2 == 0)

    def _sizes(self, layers: int) -> list[int]:
        groups = layers * self._per_layer // self.shape[self.axis]
        return [2 * groups, 2 * groups, (layers * self._per_layer + 1) // 2]

    def _encode(self, a: np.ndarray, low_out: np.ndarray, step_out: np.ndarray, packed_out: np.ndarray) -> None:
        x = _to_f32(a)
        lo, hi = _min_max(x, self.axis)
        finite = bool(np.isfinite(lo).all() and np.isfinite(hi).all() and max(-lo.min(), hi.max()) < 65536)
        if not finite and a.dtype == np.float16:  # _to_f32 made a NaN or infinity finite
            x = a.astype(np.float32)
            lo, hi = _min_max(x, self.axis)
        low = np.clip(lo, -_F16_MAX, _F16_MAX).astype(np.float16)
        low32 = low.astype(np.float32)
        span = hi - low32
        step = np.clip(span / 15, 0, _F16_MAX).astype(np.float16)
        bits = step.view(np.uint16)  # float16 arithmetic is scalar in numpy: its bits instead
        # Rounded down, the top value would clip: the next one up (never past float16's largest).
        bits[(step.astype(np.float32) * 15 < span) & ((bits & 0x7FFF) < 0x7BFF)] += 1
        bits[(bits & 0x7FFF) == 0] = 0x3C00  # a step of 0: 1
        low_out[...] = low.reshape(-1).view(np.uint8)
        step_out[...] = bits.reshape(-1).view(np.uint8)
        q = np.zeros(2 * packed_out.size, np.uint8)
        qv = q[: x.size].reshape(x.shape)
        if finite:  # round((x - low) / step) as x * (1 / step) + (0.5 - low / step), clipped, truncated
            inv = np.float32(1) / step.astype(np.float32)
            x *= inv
            x += np.float32(0.5) - low32 * inv
            np.clip(x, 0, 15, out=x)
            np.copyto(qv, x, casting="unsafe")
        else:  # NaN or infinity in the page
            t = np.rint((x - low32) / step.astype(np.float32))
            np.copyto(qv, np.clip(np.nan_to_num(t), 0, 15), casting="unsafe")
        w = q.view(np.uint16)
        np.bitwise_or(w, np.right_shift(w, 4), out=packed_out, casting="unsafe")

    def _decode(self, low: np.ndarray, step: np.ndarray, packed: np.ndarray, dest: np.ndarray) -> None:
        kept = tuple(1 if i == self.axis else n for i, n in enumerate(dest.shape))
        low = low.view(np.float16).astype(np.float32).reshape(kept)
        step = step.view(np.float16).astype(np.float32).reshape(kept)
        w = packed.astype(np.uint16)  # a byte's two nibbles into two bytes, low one first
        w |= np.left_shift(w, 4)
        w &= np.uint16(0x0F0F)
        q = w.view(np.uint8)[: dest.size].reshape(dest.shape)
        if dest.dtype == np.float16:
            if (np.abs(low) + 15 * step).max(initial=0) >= _F16_MAX:  # rare: may round to infinity
                dest[...] = (q * step + low).astype(np.float16)
                return
            low *= np.float32(2.0**-112)
            step *= np.float32(2.0**-112)
        y = np.multiply(q, step, out=dest if dest.dtype == np.float32 else None, dtype=np.float32)
        y += low
        if y is not dest:
            _f32_into(y, dest)


class Int4Codec(_Codec):
    id = 4
    name = "int4"

    def __init__(self, layout: PageLayout) -> None:
        super().__init__(layout)
        layers, parts, tokens, heads, dim = self.shape
        self._keys = _Int4Groups((layers, tokens, heads, dim), 1, self.dtype)  # per channel: over tokens
        self._values = _Int4Groups(self._keys.shape, 3, self.dtype) if parts == 2 else None  # per token: over channels
        self.nbytes = self._keys.nbytes + (self._values.nbytes if self._values else 0)

    def _encode(self, a: np.ndarray, out: np.ndarray) -> None:
        self._keys.encode(a[:, 0], out[: self._keys.nbytes])
        if self._values:
            self._values.encode(a[:, 1], out[self._keys.nbytes :])

    def _decode(self, data: np.ndarray, dest: np.ndarray) -> None:
        self._keys.decode(data[: self._keys.nbytes], dest[:, 0])
        if self._values:
            self._values.decode(data[self._keys.nbytes :], dest[:, 1])
