"""The connector's worker side (vLLM's model-runner process): copies between vLLM's paged KV
and kvtier pages.

    register_kv_caches   per KV cache group, views of vLLM's KV shaped like pages (kv_views.py)
    start_load_kv        per LoadOp: acquire -> copy this worker's part of the pages into their blocks -> release
    save_kv_layer        each layer: copy that layer of the blocks into this worker's part of the
                         pages the scheduler borrowed (SaveOp.slots)
    wait_for_save        copy the layers no hook handed over; report each save written (the
                         scheduler commits once every worker has)
    build_connector_worker_meta   forward time, copy rate, what each save became (to the scheduler)
    get_kv_connector_stats        counters (stats.py)

A worker holds part of every page (kvtier_client.integrations.vllm.shapes.WorkerSlice): its
heads of its layers. `GroupViews.parts` cuts a page into those, one view per local layer, so
the copies below see the page as if it held only what this worker holds.

On CPU the copies are torch copies (copies.py); on a GPU, kvtier_client.kernels_vllm
copies every layer and page of a LoadOp or SaveOp in one kernel launch (its per-layer hooks
are skipped).
"""
from __future__ import annotations

import queue
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvtier_client.client import Wait
from kvtier_client.errors import KVTierError
from kvtier_client.integrations.vllm.link import log
from kvtier_client.integrations.vllm.metadata import (
    SKIP,
    KVTierConnectorMetadata,
    KVTierWorkerMetadata,
    LoadOp,
    SaveOp,
    SaveOutcome,
)
from kvtier_client.integrations.vllm.copies import CopyThreads, load_pages, save_layer
from kvtier_client.integrations.vllm.kv_views import GroupViews, detect_format
from kvtier_client.integrations.vllm.stats import KVTierConnectorStats
from kvtier_client.kernels_vllm import load_blocks, save_blocks

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata



@dataclass(frozen=True)
class _LoadDone:
    """What one LoadOp did: blocks copied of how many, bytes, seconds spent copying."""

    op: LoadOp
    copied: int
    copy_bytes: int
    copy_seconds: float


@dataclass
class _PendingSave:
    """A SaveOp of this step: its pages, this worker's parts of them (per vLLM block, each as
    its local layers: `page_layers[i]` goes with op.block_ids[i]) and the layers copied."""

    op: SaveOp
    pages: list[torch.Tensor]
    page_layers: list[tuple[torch.Tensor, ...]]
    done: set[int] = field(default_factory=set)


class KVTierWorker:
    """The worker half of KVTierConnector: one per model runner. `groups[i]` is KV cache
    group i on this worker: its views, its pool's client and this worker's part of its pages."""

    def __init__(self, groups: list[GroupViews], vllm_config: VllmConfig, kv_cache_format: str) -> None:
        self.groups = groups
        self.part = groups[0].part  # rank and writer role: the same for every group
        self.link = groups[0].link
        self.kv_cache_format = kv_cache_format
        self._vllm_config = vllm_config
        self._registered = False
        self._kv_caches: dict[str, torch.Tensor] | None = None  # what register_kv_caches got (restore_kv_caches)
        #: layer name -> (group, the layer's index in the group)
        self._layer_index = {name: (g, i) for g, group in enumerate(groups) for i, name in enumerate(group.group.layer_names)}
        self._load_errors: set[int] = set()
        self._pending_saves: list[_PendingSave] | None = None  # None: this step has not mapped its saves yet
        self._step_started: float | None = None
        self._connector_seconds = 0.0
        self._report = KVTierWorkerMetadata()
        self._stats = KVTierConnectorStats()
        self._copy_threads = CopyThreads()
        #: Background loads (LoadOp.background): one thread runs them in order; their ends
        #: come back through `_loaded` and are reported by `transfer_results`.
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvtier-load")
        self._loaded: queue.SimpleQueue[_LoadDone] = queue.SimpleQueue()
        self._loading: Counter[str] = Counter()  # req_id -> its background LoadOps not done yet
        self._failed: set[str] = set()  # requests one of whose background LoadOps failed
        self._load_stream = None  # a CUDA stream of its own for background loads (GPU only)

    # -- engine KV as pages ------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        kv_format = self.kv_cache_format
        if kv_format == "auto" and any(g.layout.order != "latent" for g in self.groups):
            kv_format = detect_format(self._vllm_config, list(self._layer_index))
        for group in self.groups:
            group.register(kv_caches, kv_format)
        self._registered = True
        self._kv_caches = kv_caches
        log.info("kvtier connector: KV of %d layers in %d group(s) (%s format) mapped to kvtier pages %s",
                 len(self._layer_index), len(self.groups), kv_format, [g.layout.shape for g in self.groups])

    def unregister_kv_caches(self) -> None:
        """Before sleep (vLLM 0.33): background loads end first, then the views go; nothing
        touches vLLM's KV until restore_kv_caches. Idempotent."""
        self._loader.submit(lambda: None).result()  # the loads queued before it have ended
        for group in self.groups:
            group.views, group.raw = [], []
        self._registered = False

    def restore_kv_caches(self) -> None:
        """After wake-up: vLLM's KV tensors are mapped again at the same addresses (their
        contents are gone, which is vLLM's business: it recomputes or reloads). Idempotent."""
        if self._kv_caches is not None and not self._registered:
            self.register_kv_caches(self._kv_caches)

    # -- one step ----------------------------------------------------------------------
    def start_step(self) -> None:
        """vLLM bound this step's metadata: the forward pass timing starts here."""
        self._step_started = time.perf_counter()
        self._connector_seconds = 0.0
        self._pending_saves = None

    def start_load_kv(self, meta: KVConnectorMetadata | None) -> None:
        if not isinstance(meta, KVTierConnectorMetadata) or not meta.loads:
            return
        started = time.perf_counter()
        for op in meta.loads:
            if not self._registered:  # (asleep) reported failed: vLLM recomputes, nothing waits forever
                log.warning("kvtier connector: a load for request %s came while the KV caches are unregistered",
                            op.req_id)
                if op.background:
                    self._loading[op.req_id] += 1
                    self._loaded.put(_LoadDone(op, 0, 0, 0.0))
                else:
                    self._count(_LoadDone(op, 0, 0, 0.0))
            elif op.background:
                self._loading[op.req_id] += 1
                self._loader.submit(self._load_in_background, op)
            else:
                self._count(self._load(op))
        elapsed = time.perf_counter() - started
        self._connector_seconds += elapsed
        self._stats.add(load_seconds=elapsed)

    def _load_in_background(self, op: LoadOp) -> None:
        """A background load, in the loader thread: as vLLM's forward passes, in inference
        mode, on a CUDA stream of its own on a GPU."""
        done = _LoadDone(op, 0, 0, 0.0)
        try:
            with torch.inference_mode():
                group = self.groups[op.group]
                if group.cuda:
                    device = group.raw[0].device
                    torch.cuda.set_device(device)  # a new thread starts on device 0, not this rank's
                    if self._load_stream is None:
                        self._load_stream = torch.cuda.Stream(device=device)
                    with torch.cuda.stream(self._load_stream):
                        done = self._load(op)  # it synchronises the stream before the lease is released
                else:
                    done = self._load(op)
        except Exception as exc:  # noqa: BLE001 - reported as a failed load, never lost with the thread
            log.warning("kvtier connector: background load for request %s failed: %s", op.req_id, exc)
        finally:
            self._loaded.put(done)

    def _load(self, op: LoadOp) -> _LoadDone:
        """Acquire a LoadOp's pages and copy this worker's part of them into its blocks."""
        group = self.groups[op.group]
        copied, seconds = 0, 0.0
        if group.link.available():
            try:
                with group.kv.acquire(op.keys, wait=Wait.ALL) as lease:
                    pages = list(lease.tensors())[: len(op.keys)]
                    started = time.perf_counter()
                    if group.cuda:  # one kernel launch; done before the lease releases the pages
                        wanted = [i for i, b in enumerate(op.block_ids[: len(pages)]) if b != SKIP]
                        load_blocks(group.raw, [pages[i] for i in wanted], [op.block_ids[i] for i in wanted],
                                    head_offset=group.part.head_start, page_layers=group.part.page_layers,
                                    kv_format=group.kv_format)
                        torch.cuda.current_stream().synchronize()
                    else:
                        parts = [part for page in pages for part in group.parts(page)]
                        wanted = [i for i, b in enumerate(op.block_ids[: len(parts)]) if b != SKIP]
                        load_pages(group.views, [parts[i] for i in wanted], [op.block_ids[i] for i in wanted],
                                   self._copy_threads)
                    seconds = time.perf_counter() - started
                    copied = len(pages)
            except KVTierError as exc:
                group.link.failed(f"loading {len(op.keys)} pages of request {op.req_id}", exc)
        return _LoadDone(op, copied, copied * group.part_bytes, seconds)

    def _count(self, done: _LoadDone) -> bool:
        """Count a finished load (in pages); False if some of its pages did not arrive."""
        op = done.op
        missing = len(op.keys) - done.copied
        self._report.copy_bytes += done.copy_bytes
        self._report.copy_seconds += done.copy_seconds
        self._stats.add(load_blocks=done.copied, load_bytes=done.copy_bytes, load_failed_blocks=missing)
        if missing and not op.background:
            # vLLM recomputes from the first block that did not arrive (kv_load_failure_policy).
            k = len(op.block_ids) // len(op.keys)
            self._load_errors.update(b for b in op.block_ids[done.copied * k :] if b != SKIP)
        return not missing

    def transfer_results(self) -> tuple[set[str], set[str]]:
        """Requests whose background loads all ended since the last call, and those of them
        where some block did not arrive (vLLM recomputes them whole)."""
        finished: set[str] = set()
        while True:
            try:
                done = self._loaded.get_nowait()
            except queue.Empty:
                break
            req_id = done.op.req_id
            if not self._count(done):
                self._failed.add(req_id)
            self._loading[req_id] -= 1
            if self._loading[req_id] <= 0:
                del self._loading[req_id]
                finished.add(req_id)
        failed = finished & self._failed
        self._failed -= failed
        return finished, failed

    def save_kv_layer(self, layer_name: str, meta: KVConnectorMetadata | None) -> None:
        where = self._layer_index.get(layer_name)
        if not isinstance(meta, KVTierConnectorMetadata) or not meta.saves or where is None or not self._registered:
            return
        if not self.part.writes:
            return  # another rank writes the heads this one holds
        g, layer = where
        if self.groups[g].cuda:
            return  # on a GPU, wait_for_save copies every layer in one launch
        started = time.perf_counter()
        for save in self._this_step(meta.saves):
            if save.op.group == g:
                save_layer(self.groups[g].views[layer], save.page_layers, save.op.block_ids, layer,
                           self._copy_threads)
                save.done.add(layer)
        elapsed = time.perf_counter() - started
        self._connector_seconds += elapsed
        self._stats.add(store_seconds=elapsed)

    def _this_step(self, saves: list[SaveOp]) -> list[_PendingSave]:
        """This step's saves with this worker's parts of their pages (mapped on first use)."""
        if self._pending_saves is None:
            self._pending_saves = []
            for op in saves:
                group = self.groups[op.group]
                arena = group.kv.host_arena
                if arena is None:
                    raise RuntimeError("kvtier connector: the worker's client does not map the host arena")
                for slot in op.slots:
                    arena.map_slot(slot)
                pages = [arena.torch(slot) for slot in op.slots]
                self._pending_saves.append(_PendingSave(op, pages, [part for page in pages for part in group.parts(page)]))
        return self._pending_saves

    def wait_for_save(self, meta: KVConnectorMetadata | None) -> None:
        if isinstance(meta, KVTierConnectorMetadata) and self._registered:
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
            self._report.saves.extend(SaveOutcome(op.req_id, op.first, op.group, True, rank) for op in saves)
            return
        try:
            pending = self._this_step(saves)
        except (RuntimeError, ValueError, OSError) as exc:  # the pages could not be mapped: none written
            log.warning("kvtier connector: mapping %d saves failed: %s", len(saves), exc)
            self._report.saves.extend(SaveOutcome(op.req_id, op.first, op.group, False, rank) for op in saves)
            return
        for save in pending:
            op, ok, group = save.op, True, self.groups[save.op.group]
            try:
                if group.cuda:  # every layer in one launch, landed before the scheduler commits
                    save_blocks(group.raw, save.pages, op.block_ids, head_offset=group.part.head_start,
                                page_layers=group.part.page_layers, kv_format=group.kv_format)
                    torch.cuda.current_stream().synchronize()
                for layer, view in enumerate(group.views):
                    if layer not in save.done and not group.cuda:
                        save_layer(view, save.page_layers, op.block_ids, layer, self._copy_threads)
            except (RuntimeError, ValueError) as exc:  # a torch copy error: the scheduler releases the pages
                log.warning("kvtier connector: writing %d blocks of request %s failed: %s", len(op.slots), op.req_id, exc)
                ok = False
            self._report.saves.append(SaveOutcome(op.req_id, op.first, op.group, ok, rank))
            if ok:
                self._stats.add(store_bytes=len(op.slots) * group.part_bytes)

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
        """Let background loads end (their leases are released as they do). (The pages of
        saves in flight are the scheduler's: it releases them, or the daemon does when the
        scheduler's session ends.)"""
        self._pending_saves = None
        self._loader.shutdown(wait=True)
        self._copy_threads.close()
