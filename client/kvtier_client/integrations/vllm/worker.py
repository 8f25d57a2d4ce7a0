"""The connector's worker side (vLLM's model-runner process): vLLM's paged KV as kvtier pages,
and the copies between them.

    register_kv_caches   per layer, a view of vLLM's KV shaped [num_blocks, 2, block, kv_heads, head_dim]
                         (MLA: [num_blocks, block, 1, latent_dim])
    start_load_kv        acquire -> copy this worker's part of the pages into their blocks -> release
    save_kv_layer        each layer: copy that layer of the blocks into this worker's part of the
                         pages the scheduler borrowed (SaveOp.slots)
    wait_for_save        copy the layers no hook handed over; report each save written (the
                         scheduler commits once every worker has)
    build_connector_worker_meta   forward time, copy rate, what each save became (to the scheduler)
    get_kv_connector_stats        counters (stats.py)

A worker holds part of every page (kvtier_client.integrations.vllm.shapes.WorkerSlice): its
heads of its layers. `_parts` cuts a page into those, one view per local layer, so the
copies below see the page as if it held only what this worker holds.

Copies: a page is [layers, 2, block, kv_heads, head_dim]; one layer of it goes to one vLLM
block, in vLLM's head-major order, so each copy is strided (runs of head_dim elements) and
small (under torch's grain size, so torch runs it on one thread). What bounds a load on CPU is
therefore not the per-call dispatch but one core writing strided memory: batching the calls
(`torch._foreach_copy_`, one call for a layer of all pages) saves a little, the
`index_copy_` / advanced-indexing gather-scatter is slower still (it goes through a staging
tensor and torch's generic indexing kernels), and splitting the pages over the threads torch
may use (`CopyThreads`: vLLM's cores, idle while it waits for the load) is what pays.
`load_pages` and `save_layer` do both: per thread, one `_foreach_copy_` per layer.
tests/integrations/vllm_checks.py (`copies`) measures them against the per-page copies and a
plain copy of the same bytes.

Why the copies are torch copies and not `kvtier_client.kernels` (gather_*/scatter_*): the
kernels take per-layer engine tensors that are C-contiguous [num_blocks, 2, block_tokens,
kv_heads, head_dim], so one (layer, K/V) of a block is one contiguous run of bytes. vLLM 0.32's
per-layer tensor is [num_blocks, kv_heads, block_size, 2 * head_dim], head-major: K of one
block is kv_heads strided runs (CPU_ATTN: K rows then V rows per head; FlashAttention, Triton,
FlexAttention: K and V side by side in the last dimension). The views below are permutations
of that memory, not the kernels' layout; the kernels need a head-major variant first
(docs/integrations.md, "GPU deployments").
"""
from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvtier_client.client import Wait
from kvtier_client.errors import KVTierError
from kvtier_client.integrations.vllm.link import DaemonLink, log
from kvtier_client.integrations.vllm.metadata import (
    KVTierConnectorMetadata,
    KVTierWorkerMetadata,
    LoadOp,
    SaveOp,
    SaveOutcome,
)
from kvtier_client.integrations.vllm.shapes import WorkerSlice
from kvtier_client.integrations.vllm.stats import KVTierConnectorStats
from kvtier_client.layout import PageLayout

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

#: Attention backends whose per-layer KV [num_blocks, kv_heads, block_size, 2 * head_dim]
#: holds K in [..., :head_dim] and V in [..., head_dim:] (read in vLLM 0.32's sources).
KV_LAST_DIM_BACKENDS = frozenset({"FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION"})
#: Backends that view a block of one head as block_size rows of K then block_size rows of V.
CPU_BACKENDS = frozenset({"CPU_ATTN"})


@dataclass
class _PendingSave:
    """A SaveOp of this step: this worker's parts of its pages (each as its local layers)
    and the layers copied."""

    op: SaveOp
    page_layers: list[tuple[torch.Tensor, ...]]
    done: set[int] = field(default_factory=set)


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


class KVTierWorker:
    """The worker half of KVTierConnector: one per model runner."""

    def __init__(self, link: DaemonLink, vllm_config: VllmConfig, layout: PageLayout, layer_names: list[str],
                 kv_cache_format: str, part: WorkerSlice) -> None:
        self.link = link
        self.kv = link.kv
        self.layout = layout
        self.layer_names = layer_names
        self.part = part
        #: Bytes of this worker's part of a page.
        self._part_bytes = layout.page_bytes * len(part.page_layers) * part.heads // (layout.layers * layout.kv_heads)
        self.kv_cache_format = kv_cache_format
        self._vllm_config = vllm_config
        self._views: list[torch.Tensor] | None = None  # per layer, [num_blocks, 2, block, kv_heads, head_dim]
        self._layer_index = {name: i for i, name in enumerate(layer_names)}
        self._load_errors: set[int] = set()
        self._pending_saves: list[_PendingSave] | None = None  # None: this step has not borrowed yet
        self._step_started: float | None = None
        self._connector_seconds = 0.0
        self._report = KVTierWorkerMetadata()
        self._stats = KVTierConnectorStats()
        self._copy_threads = CopyThreads()

    # -- engine KV as pages ------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        missing = [name for name in self.layer_names if name not in kv_caches]
        if missing:
            raise ValueError(f"kvtier connector: no KV cache tensor for layers {missing}")
        kv_format = self.kv_cache_format
        if self.layout.order == "latent":
            kv_format = "mla"
        elif kv_format == "auto":
            kv_format = self._detect_format()
        self._views = [self._page_view(name, kv_caches[name], kv_format) for name in self.layer_names]
        log.info("kvtier connector: %d layers of KV (%s format, %s) mapped to kvtier pages %s",
                 len(self._views), kv_format, tuple(kv_caches[self.layer_names[0]].shape), self.layout.shape)

    def _detect_format(self) -> str:
        names = set()
        context = self._vllm_config.compilation_config.static_forward_context
        for name in self.layer_names:
            backend = getattr(context.get(name), "attn_backend", None)
            names.add(backend.get_name() if backend is not None else "unknown")
        if names <= CPU_BACKENDS:
            return "cpu"
        if names <= KV_LAST_DIM_BACKENDS:
            return "kv_last_dim"
        raise ValueError(
            f"kvtier connector: attention backend(s) {sorted(names)} are not known to the connector. If the backend "
            "keeps K and V side by side in the last dimension of [num_blocks, kv_heads, block_size, 2 * head_dim], set "
            "kv_connector_extra_config kv_cache_format='kv_last_dim'; if it stores block_size rows of K then of V per "
            "head (as CPU_ATTN), set 'cpu'"
        )

    def _page_view(self, name: str, kv: torch.Tensor, kv_format: str) -> torch.Tensor:
        """A view of one layer's paged KV as [num_blocks, 2, block_size, heads, head_dim]
        (MLA: [num_blocks, block_size, 1, latent_dim]): the same order as this worker's part
        of a kvtier page's layer."""
        lay, heads = self.layout, self.part.heads
        if str(kv.dtype).removeprefix("torch.") != lay.dtype:
            raise ValueError(f"kvtier connector: layer {name} KV dtype {kv.dtype} is not the page dtype {lay.dtype}")
        if kv_format == "mla":
            if kv.dim() != 3 or tuple(kv.shape[1:]) != (lay.block_tokens, lay.head_dim):
                raise ValueError(f"kvtier connector: MLA layer {name} KV tensor has shape {tuple(kv.shape)}, expected "
                                 f"[num_blocks, {lay.block_tokens}, {lay.head_dim}]")
            return kv.unsqueeze(2)
        if kv.dim() != 4 or tuple(kv.shape[1:]) != (heads, lay.block_tokens, 2 * lay.head_dim):
            raise ValueError(
                f"kvtier connector: layer {name} KV tensor has shape {tuple(kv.shape)}, expected "
                f"[num_blocks, {heads}, {lay.block_tokens}, {2 * lay.head_dim}]"
            )
        blocks = kv.shape[0]
        if kv_format == "cpu":
            # CPU_ATTN reads a block of one head as [2 * block_size, head_dim]: K rows, then V rows.
            inner = kv.stride()[1:]
            if inner != (lay.block_tokens * 2 * lay.head_dim, 2 * lay.head_dim, 1):
                raise ValueError(f"kvtier connector: layer {name} KV strides {kv.stride()} are not head-major dense")
            view = kv.view(blocks, heads, 2, lay.block_tokens, lay.head_dim)
            return view.permute(0, 2, 3, 1, 4)
        if kv.stride(-1) != 1:
            raise ValueError(f"kvtier connector: layer {name} KV last dimension is not contiguous")
        view = kv.unflatten(-1, (2, lay.head_dim))  # [B, H, N, 2, D]
        return view.permute(0, 3, 2, 1, 4)

    def _parts(self, page: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This worker's part of a page, per local layer: its heads of that page layer."""
        start = self.part.head_start
        heads = slice(start, start + self.part.heads)
        return tuple(page[layer][..., heads, :] for layer in self.part.page_layers)

    # -- one step ----------------------------------------------------------------------
    def start_step(self) -> None:
        """vLLM bound this step's metadata: the forward pass timing starts here."""
        self._step_started = time.perf_counter()
        self._connector_seconds = 0.0
        self._pending_saves = None

    def start_load_kv(self, meta: KVConnectorMetadata | None) -> None:
        if not isinstance(meta, KVTierConnectorMetadata) or not meta.loads or self._views is None:
            return
        started = time.perf_counter()
        for op in meta.loads:
            self._load(op)
        elapsed = time.perf_counter() - started
        self._connector_seconds += elapsed
        self._stats.add(load_seconds=elapsed)

    def _load(self, op: LoadOp) -> None:
        assert self._views is not None
        copied = 0
        if self.link.available():
            try:
                with self.kv.acquire(op.keys, wait=Wait.ALL) as lease:
                    pages = [self._parts(page) for page in list(lease.tensors())[: len(op.block_ids)]]
                    started = time.perf_counter()
                    load_pages(self._views, pages, op.block_ids[: len(pages)], self._copy_threads)
                    self._report.copy_seconds += time.perf_counter() - started
                    copied = len(pages)
                    self._report.copy_bytes += copied * self._part_bytes
            except KVTierError as exc:
                self.link.failed(f"loading {len(op.keys)} pages of request {op.req_id}", exc)
        self._stats.add(load_blocks=copied, load_bytes=copied * self.layout.page_bytes,
                        load_failed_blocks=len(op.block_ids) - copied)
        if copied < len(op.block_ids):
            # vLLM recomputes from the first block that did not arrive (kv_load_failure_policy).
            self._load_errors.update(op.block_ids[copied:])

    def save_kv_layer(self, layer_name: str, meta: KVConnectorMetadata | None) -> None:
        layer = self._layer_index.get(layer_name)
        if not isinstance(meta, KVTierConnectorMetadata) or not meta.saves or layer is None or self._views is None:
            return
        if not self.part.writes:
            return  # another rank writes the heads this one holds
        started = time.perf_counter()
        for save in self._this_step(meta.saves):
            save_layer(self._views[layer], save.page_layers, save.op.block_ids, layer, self._copy_threads)
            save.done.add(layer)
        elapsed = time.perf_counter() - started
        self._connector_seconds += elapsed
        self._stats.add(store_seconds=elapsed)

    def _this_step(self, saves: list[SaveOp]) -> list[_PendingSave]:
        """This step's saves with this worker's parts of their pages (mapped on first use)."""
        if self._pending_saves is None:
            arena = self.kv.host_arena
            if arena is None:
                raise RuntimeError("kvtier connector: the worker's client does not map the host arena")
            self._pending_saves = []
            for op in saves:
                for slot in op.slots:
                    arena.prepare_write(slot)
                self._pending_saves.append(_PendingSave(op, [self._parts(arena.torch(slot)) for slot in op.slots]))
        return self._pending_saves

    def wait_for_save(self, meta: KVConnectorMetadata | None) -> None:
        if isinstance(meta, KVTierConnectorMetadata) and self._views is not None:
            forward_end = time.perf_counter()
            if meta.saves:
                self._finish_saves(meta.saves)
            self._pending_saves = None
            self._stats.add(store_seconds=time.perf_counter() - forward_end)
            if self._step_started is not None and meta.step_tokens:
                seconds = forward_end - self._step_started - self._connector_seconds
                if seconds > 0:
                    report = self._report
                    report.step_tokens, report.prefill_tokens, report.forward_seconds = (
                        meta.step_tokens, meta.prefill_tokens, seconds)
        self._step_started = None

    def _finish_saves(self, saves: list[SaveOp]) -> None:
        """Copy the layers no hook handed over (a CUDA graph replay skips the per-layer hooks)
        and report each save: written (or nothing to write: a replica), or not."""
        rank = frozenset({self.part.rank})
        if not self.part.writes:
            self._report.saves.extend(SaveOutcome(op.req_id, op.first, True, rank) for op in saves)
            return
        for save in self._this_step(saves):
            op, ok = save.op, True
            try:
                for layer, view in enumerate(self._views or ()):
                    if layer not in save.done:
                        save_layer(view, save.page_layers, op.block_ids, layer, self._copy_threads)
            except (RuntimeError, ValueError) as exc:  # a torch copy error: the scheduler releases the pages
                log.warning("kvtier connector: writing %d blocks of request %s failed: %s", len(op.slots), op.req_id, exc)
                ok = False
            self._report.saves.append(SaveOutcome(op.req_id, op.first, ok, rank))
            if ok:
                self._stats.add(store_bytes=len(op.slots) * self._part_bytes)

    # -- reports to vLLM ---------------------------------------------------------------
    def build_connector_worker_meta(self) -> KVTierWorkerMetadata | None:
        report, self._report = self._report, KVTierWorkerMetadata()
        if not (report.forward_seconds or report.copy_bytes or report.saves):
            return None
        return report

    def get_kv_connector_stats(self) -> KVTierConnectorStats | None:
        return self._stats.take()

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        """(The pages of saves in flight are the scheduler's: it releases them, or the daemon
        does when the scheduler's session ends.)"""
        self._pending_saves = None
        self._copy_threads.close()
