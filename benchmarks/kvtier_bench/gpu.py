"""GPU bandwidth tables: the copy engine and the batched page-copy kernel, each next to the
plain CUDA copy of the same bytes in the same run.

1. Promotion and demotion through kvtier's CopyEngine (a real pinned shared-memory host
   arena and a device arena, pages in random order so no two coalesce, one submission per
   measurement, timed from submit to the completion thread's callback) against one plain
   cudaMemcpyAsync of the same bytes between pinned host memory and the device.
2. For each page size, N pages (about 1 GiB in all) copied arena -> arena in one launch of
   the batched kernel (``cuda/page_copy.cu``, pairs in a random order), against one
   contiguous CuPy device-to-device copy (cudaMemcpy underneath), CUDA-event timed.

Each figure is the median of several runs after a warm-up; nothing here asserts a speed.

Run with ``python -m kvtier_bench.gpu`` (scripts/gpu_check.sh does); it exits with a message
and status 2 where there is no GPU.
"""
from __future__ import annotations

import shutil
import statistics
import sys
import time
import uuid

import numpy as np

from kvtier_client import kernels

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


def copy_engine_bandwidth(page_sizes=PAGE_SIZES, total_bytes: int = 512 << 20, reps: int = 5) -> list[dict]:
    """One row per page size: promotion and demotion GB/s through the copy engine, and the
    plain pinned cudaMemcpyAsync GB/s of the same bytes each way."""
    import cupy
    from kvtier_client.layout import PageLayout

    from kvtier.mechanism.device import CopyEngine, DeviceArena, pin_host
    from kvtier.mechanism.host import HostArena

    # /dev/shm in a container can be small: take at most half of what is free.
    total_bytes = min(total_bytes, shutil.disk_usage("/dev/shm").free // 2)
    rows = []
    for page_bytes in page_sizes:
        # A uint8 layout whose page is exactly page_bytes (slot = page: page_bytes is 4 KiB aligned).
        layout = PageLayout(layers=1, kv_heads=1, head_dim=page_bytes // 32, block_tokens=16, dtype="uint8")
        pages = max(2, total_bytes // layout.slot_bytes)
        host = HostArena(f"kvtier-bench-gpu-{uuid.uuid4().hex[:8]}", layout, pages)
        for slot in range(pages):
            host.give(slot, "bench")
        device = DeviceArena(layout, pages)
        unpin = pin_host(host)
        engine = CopyEngine(host, device)
        pinned = cupy.cuda.alloc_pinned_memory(pages * layout.slot_bytes)
        pageable = np.ones(pages * layout.slot_bytes, np.uint8)  # touched: no first-fault cost
        stream = cupy.cuda.Stream(non_blocking=True)
        try:
            order = np.random.default_rng(0).permutation(pages)
            up = [(int(h), int(d)) for h, d in zip(order, np.roll(order, 1))]  # no two adjacent on both sides

            def promote():
                engine.promote(up, lambda t, ok: None).wait()

            def demote():
                engine.demote([(d, h) for h, d in up])

            def plain(kind, host_ptr):
                def run():
                    src, dst = (host_ptr, device.ptr) if kind == 1 else (device.ptr, host_ptr)
                    cupy.cuda.runtime.memcpyAsync(dst, src, pages * layout.slot_bytes, kind, stream.ptr)
                    stream.synchronize()
                return run

            nbytes = pages * layout.slot_bytes
            seconds = {name: _wall_seconds(fn, reps) for name, fn in
                       (("promote", promote), ("h2d", plain(1, pinned.ptr)), ("demote", demote),
                        ("d2h", plain(2, pinned.ptr)), ("h2d_pageable", plain(1, pageable.ctypes.data)),
                        ("d2h_pageable", plain(2, pageable.ctypes.data)))}
            rows.append({
                "page_bytes": page_bytes, "pages": pages,
                **{f"{name}_gbps": nbytes / s / 1e9 for name, s in seconds.items()},
            })
        finally:
            engine.close()
            unpin()
            device.close()
            host.close()
    return rows


def _wall_seconds(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def format_engine_table(rows: list[dict]) -> str:
    lines = [f"{'page':>9} {'pages':>6} {'promote':>8} {'h2d':>7} {'ratio':>6} {'demote':>8} {'d2h':>7} {'ratio':>6} {'h2d unpinned':>12} {'d2h unpinned':>12}   (GB/s)"]
    for r in rows:
        lines.append(
            f"{r['page_bytes'] // 1024:>6}KiB {r['pages']:>6} {r['promote_gbps']:>8.1f} {r['h2d_gbps']:>7.1f} "
            f"{r['promote_gbps'] / r['h2d_gbps']:>6.2f} {r['demote_gbps']:>8.1f} {r['d2h_gbps']:>7.1f} "
            f"{r['demote_gbps'] / r['d2h_gbps']:>6.2f} {r['h2d_pageable_gbps']:>12.1f} {r['d2h_pageable_gbps']:>12.1f}"
        )
    return "\n".join(lines)


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
        print("kvtier_bench.gpu: no GPU here (needs CuPy and a CUDA device); nothing measured", file=sys.stderr)
        return 2
    import cupy

    name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    print(f"copy engine (random page order, one submission) vs one pinned cudaMemcpyAsync of the same bytes, {name}")
    print(format_engine_table(copy_engine_bandwidth()))
    print()
    print(f"batched page copy vs device-to-device copy of the same bytes, {name}")
    print("(GB/s counts bytes copied once; kernel pairs are in random order)")
    print(format_table(page_copy_bandwidth()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
