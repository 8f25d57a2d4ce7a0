"""Measured read bandwidth of each tier: what an engine's load planner weighs against
recomputing a prefix (docs/integrations.md).

A tier's figure starts from a short probe the first time someone asks for it (a memcpy for
host memory, direct reads of a scratch file for the disk; run lazily so that a pool nobody
plans against pays nothing) and is refined by real traffic:
the disk reader reports each busy period (first read started to queue drained), so the
figure includes queueing, checksums, decoding (kvtier.codecs) and the device's parallelism
as the daemon uses it. A disk tier with a codec probes its decoding too (`with_decode`), so
its first figure is already what a load of its pages costs.
Nothing here is configured; a figure is always something this machine just did.
"""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvtier.codecs import PageCodec
from kvtier.mechanism.directio import aligned_buffer, open_direct

#: Weight of a new observation in the moving average.
ALPHA = 0.2
HOST_PROBE_BYTES = 16 << 20
DISK_PROBE_BYTES = 8 << 20


class Throughput:
    """An exponentially weighted moving average of bytes per second; thread-safe. `probe`
    gives the first figure when it is asked for before any traffic was observed."""

    def __init__(self, probe: Callable[[], float] | None = None) -> None:
        self._value = 0.0
        self._probe = probe
        self._lock = threading.Lock()
        self._probe_lock = threading.Lock()  # one probe at a time, never under _lock

    @property
    def bytes_per_second(self) -> float:
        with self._probe_lock:
            with self._lock:
                if self._value or self._probe is None:
                    return self._value
            measured = self._probe()
            with self._lock:
                self._probe = None
                if not self._value:
                    self._value = measured
                return self._value

    def observe(self, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        rate = nbytes / seconds
        with self._lock:
            self._value = rate if self._value == 0.0 else (1 - ALPHA) * self._value + ALPHA * rate


def probe_memcpy(nbytes: int = HOST_PROBE_BYTES, reps: int = 3) -> float:
    """Bytes per second of a large memcpy: what copying pages out of the shared-memory arena
    costs an engine. Best of `reps` (the first touches the pages)."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def probe_disk_reads(directory: str, chunk_bytes: int, depth: int, nbytes: int = DISK_PROBE_BYTES) -> float:
    """Bytes per second of `depth` parallel direct reads of `chunk_bytes` each from a scratch
    file in `directory` (written, synced, dropped from the page cache, read, removed): the
    disk tier's read path without its index."""
    chunks = max(depth, nbytes // chunk_bytes)
    path = os.path.join(directory, f".bandwidth-probe-{os.getpid()}-{threading.get_ident()}")
    fd, direct = open_direct(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    try:
        buffers = [aligned_buffer(chunk_bytes) for _ in range(depth)]
        for buf in buffers:
            buf.write(os.urandom(min(chunk_bytes, 4096)) * (chunk_bytes // min(chunk_bytes, 4096)))
        for i in range(chunks):
            os.pwrite(fd, buffers[i % depth], i * chunk_bytes)
        os.fdatasync(fd)
        if not direct:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

        def read(worker: int) -> None:
            for i in range(worker, chunks, depth):
                os.preadv(fd, [buffers[worker]], i * chunk_bytes)

        with ThreadPoolExecutor(depth) as pool:
            start = time.perf_counter()
            list(pool.map(read, range(depth)))
            seconds = time.perf_counter() - start
        for buf in buffers:
            buf.close()
        return chunks * chunk_bytes / seconds
    finally:
        os.close(fd)
        os.unlink(path)


def with_decode(read_rate: float, codec: PageCodec, workers: int, reps: int = 3) -> float:
    """A tier's read rate in page bytes per second once its pages are decoded: each page's
    encoding (smaller by the codec's ratio) read at `read_rate`, then decoded on one of
    `workers` threads, the two one after the other (conservative: a planner that trusts
    this never loads slower than it thought). Identity changes nothing."""
    if not codec.id or read_rate <= 0:
        return read_rate
    page_bytes = codec.layout.page_bytes
    rng = np.random.default_rng(0)
    page = memoryview(rng.standard_normal(page_bytes // codec.layout.itemsize).astype(np.float32)
                      .astype(np.float16 if codec.layout.itemsize == 2 else np.float32).view(np.uint8))
    if codec.layout.itemsize not in (2, 4):
        page = memoryview(rng.integers(0, 256, page_bytes, dtype=np.uint8))
    encoded = codec.encode(page)
    out = memoryview(bytearray(page_bytes))
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        codec.decode_into(encoded.data, out)
        best = min(best, time.perf_counter() - start)
    ratio = page_bytes / len(encoded.data)
    return 1 / (1 / (read_rate * ratio) + best / (page_bytes * max(1, workers)))
