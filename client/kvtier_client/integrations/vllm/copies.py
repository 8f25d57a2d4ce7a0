"""The worker's copies on CPU between vLLM's per-layer KV (as kv_views.py's views) and this
worker's part of kvtier pages (GroupViews.parts).

The copies are torch copies. One layer of a page goes to one vLLM block, in vLLM's
head-major order, so each copy is strided (runs of head_dim elements) and small (under
torch's grain size, so torch runs it on one thread). What bounds a load is therefore not the
per-call dispatch but one core writing strided memory: batching the calls
(`torch._foreach_copy_`, one call for a layer of all pages) saves a little, and splitting the
pages over the threads torch may use (`CopyThreads`: vLLM's cores, idle while it waits for
the load) is what pays. `load_pages` and `save_layer` do both.
tests/integrations/vllm_checks.py (`copies`) measures them against the per-page copies and a
plain copy of the same bytes.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

#: At most this many threads copy: a few cores saturate a socket's memory bandwidth for
#: copies, more only add hand-offs.
MAX_COPY_THREADS = 8


class CopyThreads:
    """The threads copies are split over: as many as torch may use (vLLM sets that to the cores
    it was given, idle while vLLM waits for a load or a layer's save), at most MAX_COPY_THREADS.
    torch releases the GIL while it copies, so the parts run in parallel; each runs in the
    caller's inference mode (tensors made in it may only be written in it)."""

    def __init__(self, threads: int | None = None) -> None:
        self.threads = max(1, min(threads or torch.get_num_threads(), MAX_COPY_THREADS))
        self._pool = None
        if self.threads > 1:
            self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="kvtier-copy")
            started = threading.Barrier(self.threads - 1)  # each task waits for the others: one thread each
            for _ in range(self.threads - 1):  # started now, not in the first load's time
                self._pool.submit(started.wait, 5.0)

    def split(self, items: list, work: Callable[[list], None]) -> None:
        """`work` on `items` cut into one contiguous part per thread; this thread does the first."""
        size = -(-len(items) // self.threads)
        parts = [items[i : i + size] for i in range(0, len(items), size)]
        if self._pool is None or len(parts) < 2:
            for part in parts:
                work(part)
            return
        inference = torch.is_inference_mode_enabled()  # thread-local: vLLM's forward runs in it

        def run(part: list) -> None:
            with torch.inference_mode(inference):
                work(part)

        others = [self._pool.submit(run, part) for part in parts[1:]]
        try:
            work(parts[0])
        finally:
            for done in others:
                done.result()  # every part has finished before the pages' lease can end

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()


def load_pages(views: list[torch.Tensor], pages: list[tuple[torch.Tensor, ...]], block_ids: list[int],
               threads: CopyThreads) -> None:
    """Copy kvtier pages (each as this worker's part of its layers, `KVTierWorker._parts`)
    into the blocks `block_ids` of vLLM's per-layer views: per thread and layer, one
    `_foreach_copy_` for that thread's pages."""
    def load(chunk: list[tuple[tuple[torch.Tensor, ...], int]]) -> None:
        for layer, view in enumerate(views):
            torch._foreach_copy_([view[block] for _, block in chunk], [layers[layer] for layers, _ in chunk])

    threads.split(list(zip(pages, block_ids)), load)


def save_layer(view: torch.Tensor, page_layers: list[tuple[torch.Tensor, ...]], block_ids: list[int], layer: int,
               threads: CopyThreads) -> None:
    """Copy vLLM's blocks `block_ids` of one layer (its view [num_blocks, 2, block, kv_heads,
    head_dim]) into that layer of kvtier pages (each page as its layers): per thread, one
    `_foreach_copy_`."""
    def save(chunk: list[tuple[tuple[torch.Tensor, ...], int]]) -> None:
        torch._foreach_copy_([layers[layer] for layers, _ in chunk], [view[block] for _, block in chunk])

    threads.split(list(zip(page_layers, block_ids)), save)
