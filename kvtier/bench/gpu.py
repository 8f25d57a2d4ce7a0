"""GPU page-copy bandwidth: the batched page copy kernel next to a plain device-to-device copy.

For each page size, N pages (about 1 GiB in all) are copied arena -> arena in one launch of
kvtier's batched kernel (``cuda/page_copy.cu``, pairs in a random order), and the same bytes
are copied by one contiguous CuPy device-to-device copy (cudaMemcpy underneath). Each figure
is the median of CUDA-event timings after a warm-up; nothing here asserts a speed.

Run with ``python -m kvtier.bench.gpu`` (scripts/gpu_check.sh does); it exits with a message
and status 2 where there is no GPU.
"""
from __future__ import annotations

import statistics
import sys

import numpy as np

from kvtier.mechanism import kernels

PAGE_SIZES = (64 * 1024, 256 * 1024, 2 * 1024 * 1024)
TOTAL_BYTES = 1 << 30


def _time_ms(fn, reps: int) -> float:
    import cupy

    fn()  # warm-up (and, for the kernel, compilation)
    times = []
    for _ in range(reps):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    return statistics.median(times)


def page_copy_bandwidth(page_sizes=PAGE_SIZES, total_bytes: int = TOTAL_BYTES, reps: int = 10) -> list[dict]:
    """One row per page size: pages, GB/s of the kernel and of the plain copy, and their ratio."""
    import cupy

    rows = []
    for page_bytes in page_sizes:
        pages = max(1, total_bytes // page_bytes)
        src = cupy.random.randint(1, 256, pages * page_bytes, dtype=cupy.uint8)
        dst = cupy.empty_like(src)
        pairs = np.stack([np.random.permutation(pages), np.random.permutation(pages)], axis=1)
        kernel_ms = _time_ms(lambda: kernels.copy_pages_gpu(src, dst, pairs, page_bytes), reps)
        plain_ms = _time_ms(lambda: cupy.copyto(dst, src), reps)
        nbytes = pages * page_bytes
        rows.append(
            {
                "page_bytes": page_bytes,
                "pages": pages,
                "kernel_gbps": nbytes / kernel_ms / 1e6,
                "memcpy_gbps": nbytes / plain_ms / 1e6,
            }
        )
    return rows


def format_table(rows: list[dict]) -> str:
    lines = [f"{'page':>9} {'pages':>7} {'kernel GB/s':>12} {'memcpy GB/s':>12} {'ratio':>6}"]
    for r in rows:
        lines.append(
            f"{r['page_bytes'] // 1024:>6}KiB {r['pages']:>7} {r['kernel_gbps']:>12.1f} "
            f"{r['memcpy_gbps']:>12.1f} {r['kernel_gbps'] / r['memcpy_gbps']:>6.2f}"
        )
    return "\n".join(lines)


def main() -> int:
    if not kernels.is_available():
        print("kvtier.bench.gpu: no GPU here (needs CuPy and a CUDA device); nothing measured", file=sys.stderr)
        return 2
    import cupy

    name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    print(f"batched page copy vs device-to-device copy of the same bytes, {name}")
    print("(GB/s counts bytes copied once; kernel pairs are in random order)")
    print(format_table(page_copy_bandwidth()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
