"""The disk tier's space, in chunks: a page takes as many as its encoding needs.

A codec can keep a page in fewer bytes (kvtier.codecs), so the disk slab is cut into
chunks (a fraction of a page, 4 KiB aligned) and each page takes a run list of them: its
`extent`, flattened as (start, count, start, count, ...). The core owns the chunks as it
owns slots: a write takes the most its namespace's codec can need (`DiskSpace.reserve`),
and gives back what the encoding did not use when it is filed; a dropped copy gives back
its own. A slot still names each disk copy (its index entry); chunks are where its bytes are.
"""
from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from dataclasses import dataclass

Extent = tuple[int, ...]


@dataclass(frozen=True)
class DiskSpace:
    """The slab's geometry as the core needs it."""

    chunks: int  # chunks in the slab
    chunk_bytes: int
    #: Chunks one page of a namespace may need: its codec's largest encoding.
    reserve: Callable[[str], int]


def chunk_bytes_for(slot_bytes: int, align: int = 4096, most: int = 16) -> int:
    """The chunk size for pages of `slot_bytes`: the smallest `align` multiple that divides
    the slot in at most `most` chunks (a raw page is then whole chunks, and a page encoded
    to a fraction of its size takes about that fraction)."""
    units = slot_bytes // align
    parts = max(k for k in range(1, min(most, units) + 1) if units % k == 0)
    return slot_bytes // parts


def chunks_in(extent: Extent) -> list[int]:
    return [c for start, count in zip(extent[0::2], extent[1::2]) for c in range(start, start + count)]


def extent_of(chunks: Iterable[int]) -> Extent:
    """The run list of `chunks` (in the order given: consecutive ones join a run)."""
    runs: list[int] = []
    for c in chunks:
        if runs and runs[-2] + runs[-1] == c:
            runs[-1] += 1
        else:
            runs += [c, 1]
    return tuple(runs)


def size_of(extent: Extent) -> int:
    return sum(extent[1::2])


def split(extent: Extent, n: int) -> tuple[Extent, Extent]:
    """The first `n` chunks of `extent`, and the rest."""
    chunks = chunks_in(extent)
    return extent_of(chunks[:n]), extent_of(chunks[n:])


class ChunkAllocator:
    """Free chunks, lowest first (so a page's chunks are mostly one run), with a flag per
    chunk that turns a double free or a chunk owned twice into a crash with a message."""

    def __init__(self, total: int, used: Iterable[Extent] = ()) -> None:
        self.total = total
        self._is_free = bytearray(b"\x01") * total
        for extent in used:
            for c in chunks_in(extent):
                if not self._is_free[c]:
                    raise RuntimeError(f"disk chunk {c} is recovered twice")
                self._is_free[c] = 0
        self._free = [c for c in range(total) if self._is_free[c]]  # sorted: already a heap

    @property
    def free_count(self) -> int:
        return len(self._free)

    def take(self, n: int) -> Extent:
        """`n` free chunks. The caller checked `free_count`; too few is a bug."""
        if n > len(self._free):
            raise RuntimeError(f"chunk allocator has {len(self._free)} free chunks, {n} asked: make room first")
        chunks = [heapq.heappop(self._free) for _ in range(n)]
        for c in chunks:
            self._is_free[c] = 0
        return extent_of(chunks)

    def give(self, extent: Extent) -> None:
        for c in chunks_in(extent):
            if self._is_free[c]:
                raise RuntimeError(f"double free of disk chunk {c}")
            self._is_free[c] = 1
            heapq.heappush(self._free, c)

    def free_chunks(self) -> list[int]:
        return list(self._free)
