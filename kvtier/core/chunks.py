"""The disk tier's space, in chunks: a page takes as many as its encoding needs.

A codec can keep a page in fewer bytes (kvtier.codecs), so the disk slab is cut into
chunks (a fraction of a page, 4 KiB aligned) and each page takes a run list of them: its
`extent`, flattened as (start, count, start, count, ...). The core owns the chunks as it
owns slots: a write takes a raw page's chunks (`DiskSpace.reserve`: any codec's encoding
fits, so a reload that gives a namespace another codec never finds a write too small), and
gives back what the encoding did not use when it is filed; a dropped copy gives back its own. A slot still names each disk copy (its index entry); chunks are where its bytes are.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

Extent = tuple[int, ...]


@dataclass(frozen=True)
class DiskSpace:
    """The slab's geometry as the core needs it."""

    chunks: int  # chunks in the slab
    chunk_bytes: int
    reserve: int  # chunks a write takes per page: a raw page's


def chunk_bytes_for(slot_bytes: int, align: int = 4096, most: int = 64) -> int:
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
    """Free chunks as one byte each: `take` scans for free ones from where the last take
    ended (next fit, in C: bytearray.find), so a page's chunks are mostly one run and the
    allocator costs a byte per chunk. The flags also turn a double free or a chunk owned
    twice into a crash with a message."""

    def __init__(self, total: int, used: Iterable[Extent] = ()) -> None:
        self.total = total
        self._is_free = bytearray(b"\x01") * total
        for extent in used:
            for c in chunks_in(extent):
                if not self._is_free[c]:
                    raise RuntimeError(f"disk chunk {c} is recovered twice")
                self._is_free[c] = 0
        self.free_count = self._is_free.count(1)
        self._cursor = 0

    def take(self, n: int) -> Extent:
        """`n` free chunks. The caller checked `free_count`; too few is a bug."""
        if n > self.free_count:
            raise RuntimeError(f"chunk allocator has {self.free_count} free chunks, {n} asked: make room first")
        flags, chunks, at = self._is_free, [], self._cursor
        while len(chunks) < n:
            c = flags.find(1, at)
            if c < 0:
                c = flags.find(1)
            end = flags.find(0, c)
            end = min(self.total if end < 0 else end, c + n - len(chunks))
            flags[c:end] = bytes(end - c)
            chunks.extend(range(c, end))
            at = end
        self._cursor = at
        self.free_count -= n
        return extent_of(chunks)

    def give(self, extent: Extent) -> None:
        flags = self._is_free
        for start, count in zip(extent[0::2], extent[1::2]):
            if flags.find(1, start, start + count) >= 0:
                raise RuntimeError(f"double free of a disk chunk in {start}..{start + count - 1}")
            flags[start : start + count] = b"\x01" * count
            self.free_count += count

    def free_chunks(self) -> list[int]:
        return [c for c, free in enumerate(self._is_free) if free]
