"""The connector's worker side (vLLM's model-runner process): vLLM's paged KV as kvtier pages,
and the copies between them.

    register_kv_caches   per layer, a view of vLLM's KV shaped [num_blocks, 2, block, kv_heads, head_dim]
    start_load_kv        acquire -> copy the pages into their blocks (batched, below) -> release
    save_kv_layer        first layer: borrow; each layer: copy that layer of the blocks into the pages
    wait_for_save        copy the layers no hook handed over -> commit
    build_connector_worker_meta   forward time, copy rate, what each save became (to the scheduler)
    get_kv_connector_stats        counters (stats.py)

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
from kvtier_client.errors import CapacityError, KVTierError
from kvtier_client.integrations.vllm.link import DaemonLink, log
from kvtier_client.integrations.vllm.metadata import (
    KVTierConnectorMetadata,
    KVTierWorkerMetadata,
    LoadOp,
    SaveOp,
    SaveOutcome,
)
from kvtier_client.integrations.vllm.stats import KVTierConnectorStats
from kvtier_client.layout import PageLayout
from kvtier_client.leases import WriteLease

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
    """A SaveOp of this step: its borrowed pages (each as its layers) and the layers copied."""

    op: SaveOp
    lease: WriteLease
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


def load_pages(views: list[torch.Tensor], pages: list[torch.Tensor], block_ids: list[int],
               threads: CopyThreads) -> None:
    """Copy kvtier pages [layers, 2, block, kv_heads, head_dim] into the blocks `block_ids` of
    vLLM's per-layer views [num_blocks, 2, block, kv_heads, head_dim]: per thread and layer,
    one `_foreach_copy_` for that thread's pages."""
    def load(chunk: list[tuple[torch.Tensor, int]]) -> None:
        page_layers = [page.unbind(0) for page, _ in chunk]
        for layer, view in enumerate(views):
            torch._foreach_copy_([view[block] for _, block in chunk], [layers[layer] for layers in page_layers])

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
                 kv_cache_format: str) -> None:
        self.link = link
        self.kv = link.kv
        self.layout = layout
        self.layer_names = layer_names
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
        if kv_format == "auto":
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
        """A view of one layer's paged KV as [num_blocks, 2, block_size, kv_heads, head_dim]: the
        same order as a kvtier page's [2, block_tokens, kv_heads, head_dim] for that layer."""
        lay = self.layout
        if kv.dim() != 4 or tuple(kv.shape[1:]) != (lay.kv_heads, lay.block_tokens, 2 * lay.head_dim):
            raise ValueError(
                f"kvtier connector: layer {name} KV tensor has shape {tuple(kv.shape)}, expected "
                f"[num_blocks, {lay.kv_heads}, {lay.block_tokens}, {2 * lay.head_dim}]"
            )
        if str(kv.dtype).removeprefix("torch.") != lay.dtype:
            raise ValueError(f"kvtier connector: layer {name} KV dtype {kv.dtype} is not the page dtype {lay.dtype}")
        blocks = kv.shape[0]
        if kv_format == "cpu":
            # CPU_ATTN reads a block of one head as [2 * block_size, head_dim]: K rows, then V rows.
            inner = kv.stride()[1:]
            if inner != (lay.block_tokens * 2 * lay.head_dim, 2 * lay.head_dim, 1):
                raise ValueError(f"kvtier connector: layer {name} KV strides {kv.stride()} are not head-major dense")
            view = kv.view(blocks, lay.kv_heads, 2, lay.block_tokens, lay.head_dim)
            return view.permute(0, 2, 3, 1, 4)
        if kv.stride(-1) != 1:
            raise ValueError(f"kvtier connector: layer {name} KV last dimension is not contiguous")
        view = kv.unflatten(-1, (2, lay.head_dim))  # [B, H, N, 2, D]
        return view.permute(0, 3, 2, 1, 4)

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
                    pages = list(lease.tensors())[: len(op.block_ids)]
                    started = time.perf_counter()
                    load_pages(self._views, pages, op.block_ids[: len(pages)], self._copy_threads)
                    self._report.copy_seconds += time.perf_counter() - started
                    copied = len(pages)
                    self._report.copy_bytes += copied * self.layout.page_bytes
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
        started = time.perf_counter()
        for save in self._borrowed(meta.saves):
            save_layer(self._views[layer], save.page_layers, save.op.block_ids, layer, self._copy_threads)
            save.done.add(layer)
        elapsed = time.perf_counter() - started
        self._connector_seconds += elapsed
        self._stats.add(store_seconds=elapsed)

    def _borrowed(self, saves: list[SaveOp]) -> list[_PendingSave]:
        """This step's saves with their pages, borrowing them on the first call of the step; a
        save that gets no pages is reported as not stored."""
        if self._pending_saves is not None:
            return self._pending_saves
        self._pending_saves = []
        for op in saves:
            lease = None
            if self.link.available():
                try:
                    lease = self.kv.borrow(len(op.keys))
                except CapacityError as exc:
                    log.info("kvtier connector: no free pages to store %d blocks of request %s: %s",
                             len(op.keys), op.req_id, exc)
                except KVTierError as exc:
                    self.link.failed(f"borrowing {len(op.keys)} pages", exc)
            if lease is None:
                self._not_stored(op)
                continue
            self._pending_saves.append(_PendingSave(op, lease, [page.unbind(0) for page in lease.tensors()]))
        return self._pending_saves

    def _not_stored(self, op: SaveOp) -> None:
        self._report.saves.append(SaveOutcome(op.req_id, op.first, None))
        self._stats.add(store_failed_blocks=len(op.keys))

    def wait_for_save(self, meta: KVConnectorMetadata | None) -> None:
        if isinstance(meta, KVTierConnectorMetadata) and self._views is not None:
            forward_end = time.perf_counter()
            for save in self._borrowed(meta.saves) if meta.saves else []:
                self._finish_save(save)
            self._pending_saves = None
            self._stats.add(store_seconds=time.perf_counter() - forward_end)
            if self._step_started is not None and meta.step_tokens:
                seconds = forward_end - self._step_started - self._connector_seconds
                if seconds > 0:
                    report = self._report
                    report.step_tokens, report.prefill_tokens, report.forward_seconds = (
                        meta.step_tokens, meta.prefill_tokens, seconds)
        self._step_started = None

    def _finish_save(self, save: _PendingSave) -> None:
        """Copy the layers no hook handed over (a CUDA graph replay skips the per-layer hooks),
        then commit; report which pages the daemon took."""
        assert self._views is not None
        op = save.op
        try:
            for layer, view in enumerate(self._views):
                if layer not in save.done:
                    save_layer(view, save.page_layers, op.block_ids, layer, self._copy_threads)
            result = save.lease.commit(op.keys, parent=op.parent, token_ids=op.token_ids)
        except KVTierError as exc:
            self.link.failed(f"storing {len(op.keys)} pages of request {op.req_id}", exc)
            self._release(save.lease)
            self._not_stored(op)
            return
        except BaseException:
            self._release(save.lease)
            raise
        duplicates = set(result.duplicates)
        new = tuple(i for i in range(len(op.keys)) if i not in duplicates)
        self._report.saves.append(SaveOutcome(op.req_id, op.first, new))
        self._stats.add(store_blocks=len(new), store_duplicate_blocks=len(duplicates),
                        store_bytes=len(op.keys) * self.layout.page_bytes)

    def _release(self, lease: WriteLease) -> None:
        if lease.ended:
            return
        try:
            lease.release()
        except KVTierError as exc:
            log.warning("kvtier connector: could not release lease %s: %s", lease.lease_id, exc)

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
        """Release the pages of saves that never reached wait_for_save."""
        for save in self._pending_saves or []:
            self._release(save.lease)
        self._pending_saves = None
        self._copy_threads.close()
