"""Lossy, 8-bit integers: keys per channel (over the page's tokens), values per token (over
the head's channels), each group with one float16 scale, symmetric (-127..127). ~1.87x on
16-bit KV (16 tokens, head_dim 128).

Why beside fp8: FP8 e4m3 keeps 3 mantissa bits whatever the scale, so every key is off by
up to 1/16 of itself, and the outlier channels of real keys, which dominate the attention
scores, carry that error into them (docs/tiers.md, "Codecs": the quality table). An integer
per channel spends its 8 bits on that channel's own range: a key channel's error is at most
1/254 of its largest value over the page. Values have no outlier channels, so one scale per
token serves them. The size is fixed per layout, as for every lossy codec.
"""
from __future__ import annotations

import numpy as np
from kvtier_client.layout import PageLayout

from kvtier.codecs.quant import _Codec, _f32_into, _to_f32

_F16_MAX = float(np.finfo(np.float16).max)


class _Int8Groups:
    """One float16 scale per group of an array; the groups run along `axis`."""

    def __init__(self, shape: tuple[int, ...], axis: int) -> None:
        self.shape, self.axis = shape, axis
        self.elements = int(np.prod(shape))
        self.groups = self.elements // shape[axis]
        self.kept = tuple(1 if i == axis else n for i, n in enumerate(shape))
        self.nbytes = 2 * self.groups + self.elements

    def encode(self, a: np.ndarray, out: np.ndarray) -> None:
        x = _to_f32(a)
        amax = np.nan_to_num(np.abs(x).max(axis=self.axis, keepdims=True), nan=0.0, posinf=_F16_MAX)
        scale = np.clip(amax / 127, 0, _F16_MAX).astype(np.float16)
        bits = scale.view(np.uint16)
        # Rounded down, the largest value would pass 127: the next one up (never past float16's largest).
        bits[(scale.astype(np.float32) * 127 < amax) & ((bits & 0x7FFF) < 0x7BFF)] += 1
        bits[(bits & 0x7FFF) == 0] = 0x3C00  # an all-zero group: any scale
        x /= scale.astype(np.float32)
        np.rint(x, out=x)
        np.clip(np.nan_to_num(x), -127, 127, out=x)
        out[: 2 * self.groups] = bits.reshape(-1).view(np.uint8)
        out[2 * self.groups :] = x.astype(np.int8).reshape(-1).view(np.uint8)

    def decode(self, data: np.ndarray, dest: np.ndarray) -> None:
        scale = data[: 2 * self.groups].view(np.float16).astype(np.float32).reshape(self.kept)
        y = data[2 * self.groups :].view(np.int8).reshape(self.shape).astype(np.float32)
        if dest.dtype == np.float16:
            scale *= np.float32(2.0**-112)  # _f32_into narrows float16 from a 2**-112 scaled float32
        y *= scale
        if dest.dtype == np.float32:
            dest[...] = y
        else:
            out = np.empty(self.shape, dest.dtype)
            _f32_into(y, out)
            dest[...] = out


class Int8Codec(_Codec):
    id = 5
    name = "int8"

    def __init__(self, layout: PageLayout) -> None:
        super().__init__(layout)
        layers, parts, tokens, heads, dim = self.shape
        part = (layers, tokens, heads, dim)
        self._keys = _Int8Groups(part, 1)  # per channel: over tokens
        self._values = _Int8Groups(part, 3) if parts == 2 else None  # per token: over channels
        self.nbytes = self._keys.nbytes + (self._values.nbytes if self._values else 0)

    def _encode(self, a: np.ndarray, out: np.ndarray) -> None:
        self._keys.encode(np.ascontiguousarray(a[:, 0]), out[: self._keys.nbytes])
        if self._values:
            self._values.encode(np.ascontiguousarray(a[:, 1]), out[self._keys.nbytes :])

    def _decode(self, data: np.ndarray, dest: np.ndarray) -> None:
        self._keys.decode(data[: self._keys.nbytes], dest[:, 0])
        if self._values:
            self._values.decode(data[self._keys.nbytes :], dest[:, 1])
