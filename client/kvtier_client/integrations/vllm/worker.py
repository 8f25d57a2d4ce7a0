"""The connector's worker side (vLLM's model-runner process): vLLM's paged KV as kvtier pages,
and the copies between them.

    register_kv_caches   per layer, a view of vLLM's KV shaped [num_blocks, 2, block, kv_heads, head_dim]
    start_load_kv        acquire -> copy page into block, every layer -> release (before the forward)
    save_kv_layer        first layer: borrow; each layer: copy block into page
    wait_for_save        copy the layers no hook handed over -> commit

Why the copies are torch indexing and not `kvtier_client.kernels` (gather_*/scatter_*): the
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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvtier_client.client import Wait
from kvtier_client.errors import CapacityError, KVTierError
from kvtier_client.integrations.vllm.link import DaemonLink, log
from kvtier_client.integrations.vllm.metadata import KVTierConnectorMetadata, KVTierWorkerMetadata, LoadOp, SaveOp
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
    """A SaveOp of this step: its borrowed pages and the layers already copied into them."""

    op: SaveOp
    lease: WriteLease
    pages: list[torch.Tensor]
    done: set[int] = field(default_factory=set)


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
        self._pending_saves: list[_PendingSave] = []
        self._step_started: float | None = None
        self._connector_seconds = 0.0
        self._worker_meta: KVTierWorkerMetadata | None = None

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

    def start_load_kv(self, meta: KVConnectorMetadata | None) -> None:
        if not isinstance(meta, KVTierConnectorMetadata) or not meta.loads or self._views is None:
            return
        started = time.perf_counter()
        for op in meta.loads:
            self._load(op)
        self._connector_seconds += time.perf_counter() - started

    def _load(self, op: LoadOp) -> None:
        assert self._views is not None
        copied = 0
        if not self.link.available():
            self._load_errors.update(op.block_ids)
            return
        try:
            with self.kv.acquire(op.keys, wait=Wait.ALL) as lease:
                pages = lease.tensors()
                for page, block_id in zip(pages, op.block_ids):
                    for layer, view in enumerate(self._views):
                        view[block_id].copy_(page[layer])
                    copied += 1
        except KVTierError as exc:
            self.link.failed(f"loading {len(op.keys)} pages of request {op.req_id}", exc)
        if copied < len(op.block_ids):
            # vLLM recomputes from the first block that did not arrive (kv_load_failure_policy).
            self._load_errors.update(op.block_ids[copied:])

    def save_kv_layer(self, layer_name: str, meta: KVConnectorMetadata | None) -> None:
        layer = self._layer_index.get(layer_name)
        if not isinstance(meta, KVTierConnectorMetadata) or not meta.saves or layer is None or self._views is None:
            return
        started = time.perf_counter()
        if not self._pending_saves:
            self._borrow(meta.saves)
        for save in self._pending_saves:
            self._copy_layer(layer, save.op, save.pages)
            save.done.add(layer)
        self._connector_seconds += time.perf_counter() - started

    def _borrow(self, saves: list[SaveOp]) -> None:
        for op in saves:
            if not self.link.available():
                return
            try:
                lease = self.kv.borrow(len(op.keys))
            except CapacityError as exc:
                log.info("kvtier connector: no free pages to store %d blocks of request %s: %s",
                         len(op.keys), op.req_id, exc)
                continue
            except KVTierError as exc:
                self.link.failed(f"borrowing {len(op.keys)} pages", exc)
                continue
            self._pending_saves.append(_PendingSave(op, lease, list(lease.tensors())))

    def _copy_layer(self, layer: int, op: SaveOp, pages: list[torch.Tensor]) -> None:
        assert self._views is not None
        view = self._views[layer]
        for page, block_id in zip(pages, op.block_ids):
            page[layer].copy_(view[block_id])

    def wait_for_save(self, meta: KVConnectorMetadata | None) -> None:
        if isinstance(meta, KVTierConnectorMetadata) and self._views is not None:
            forward_end = time.perf_counter()
            if meta.saves and not self._pending_saves:
                self._borrow(meta.saves)  # no per-layer hook ran (e.g. a CUDA graph replay)
            for save in self._pending_saves:
                try:
                    for layer in range(len(self._views)):
                        if layer not in save.done:
                            self._copy_layer(layer, save.op, save.pages)
                    save.lease.commit(save.op.keys, parent=save.op.parent)
                except KVTierError as exc:
                    self.link.failed(f"storing {len(save.op.keys)} pages of request {save.op.req_id}", exc)
                    self._release(save.lease)
                except BaseException:
                    self._release(save.lease)
                    raise
            self._pending_saves = []
            if self._step_started is not None and meta.step_tokens:
                seconds = forward_end - self._step_started - self._connector_seconds
                if seconds > 0:
                    self._worker_meta = KVTierWorkerMetadata(meta.step_tokens, meta.prefill_tokens, seconds)
        self._step_started = None

    def _release(self, lease: WriteLease) -> None:
        if lease.ended:
            return
        try:
            lease.release()
        except KVTierError as exc:
            log.warning("kvtier connector: could not release lease %s: %s", lease.lease_id, exc)

    # -- reports to vLLM ---------------------------------------------------------------
    def build_connector_worker_meta(self) -> KVTierWorkerMetadata | None:
        meta, self._worker_meta = self._worker_meta, None
        return meta

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        """Release the pages of saves that never reached wait_for_save."""
        for save in self._pending_saves:
            self._release(save.lease)
        self._pending_saves = []
