"""Lossless: the page's bytes split into byte planes, then zstd.

The planes put each element's high bytes (sign, exponent, top of the mantissa: few
distinct values in KV) apart from its low bytes (close to noise), so zstd finds the
redundancy that is there. A page that does not shrink is stored as it is, under identity.

Encoded: one zstd frame of the planes, byte 0 of every element first, then byte 1, ...
Speed: the planes are split and joined with whole-array shifts on 16- or 32-bit words
(numpy's strided transpose of [n, 2] bytes runs at a tenth of that speed).
"""
from __future__ import annotations

import threading

import numpy as np
import zstandard
from kvtier_client.layout import PageLayout

from kvtier.codecs.base import Encoded

#: zstd's fastest level: the ratio barely moves with higher levels on KV (measured: 1.17x at 1 and 3).
LEVEL = 1
_WORDS = {2: np.uint16, 4: np.uint32}


def split_planes(raw: np.ndarray, width: int) -> np.ndarray:
    """Bytes [b0 b1 ... b0 b1 ...] of `width`-byte elements as planes [b0 b0 ... b1 b1 ...]."""
    if width == 1:
        return raw
    words = raw.view(_WORDS[width])
    planes = np.empty((width, words.size), np.uint8)
    np.copyto(planes[0], words, casting="unsafe")  # the low byte
    for j in range(1, width):
        np.right_shift(words, 8 * j, out=planes[j], casting="unsafe")
    return planes


def join_planes(planes: np.ndarray, out: np.ndarray, width: int) -> None:
    """The inverse of `split_planes`, into `out` (bytes)."""
    if width == 1:
        out[:] = planes
        return
    words = out.view(_WORDS[width])
    planes = planes.reshape(width, -1)
    np.left_shift(planes[width - 1], 8 * (width - 1), dtype=words.dtype, out=words)
    for j in range(width - 2, -1, -1):
        if j:
            words |= np.left_shift(planes[j], 8 * j, dtype=words.dtype)
        else:
            np.bitwise_or(words, planes[0], out=words)


class PlanesZstdCodec:
    id = 1
    name = "zstd"
    lossy = False

    def __init__(self, layout: PageLayout) -> None:
        self.layout = layout
        self._width = layout.itemsize
        self._local = threading.local()  # zstd contexts are not thread-safe: one per thread

    def _contexts(self) -> tuple[zstandard.ZstdCompressor, zstandard.ZstdDecompressor]:
        ctx = getattr(self._local, "ctx", None)
        if ctx is None:
            ctx = self._local.ctx = (zstandard.ZstdCompressor(level=LEVEL), zstandard.ZstdDecompressor())
        return ctx

    def bound(self) -> int:
        return self.layout.page_bytes

    def encode(self, page: memoryview) -> Encoded:
        planes = split_planes(np.frombuffer(page, np.uint8), self._width)
        data = self._contexts()[0].compress(planes)
        if len(data) >= len(page):
            return Encoded(0, page)  # identity: no gain
        return Encoded(self.id, data)

    def decode_into(self, data: memoryview | bytes, out: memoryview) -> bool:
        n = len(out)
        if n != self.layout.page_bytes:
            return False
        try:
            planes = self._contexts()[1].decompress(data, max_output_size=n, allow_extra_data=False)
        except zstandard.ZstdError:
            return False
        if len(planes) != n:
            return False
        join_planes(np.frombuffer(planes, np.uint8), np.frombuffer(out, np.uint8), self._width)
        return True
