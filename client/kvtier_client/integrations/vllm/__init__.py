"""vLLM: a KV connector (`KVConnectorBase_V1`) that keeps prompt KV in a kvtier daemon.

Load it with vLLM's own configuration; nothing in vLLM needs patching:

    from vllm import LLM
    from vllm.config import KVTransferConfig

    llm = LLM(
        model=...,
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVTierConnector",
            kv_connector_module_path="kvtier_client.integrations.vllm",
            kv_role="kv_both",                      # kv_producer: only store; kv_consumer: only load
            kv_load_failure_policy="recompute",     # a page evicted between lookup and load is recomputed
            kv_connector_extra_config={"target": "unix:///run/kvtier/kvtier.sock",
                                       "namespace": "llama-3-8b/tenant-a"},
        ),
    )

What it does (docs/integrations.md has the full story and the support matrix):

* Pages: one page layout per KV cache group (kv_groups.py), holding every KV head of the
  model and every layer of the group, so all parallel shapes of a model share pages; each
  worker writes and reads its part (shapes.py: its heads of its layers). MLA pages hold the
  latent. Keys carry the configured salt, vLLM's cache salt and LoRA, multimodal extra keys
  (extra_keys.py), the group, the checkpoint (weights.py) and the reset epoch.
* Scheduler side (`get_num_new_matched_tokens`): a lookup (one group lookup for a hybrid
  model or a window: the longest prefix every group can restore) and the load planner say
  how many cached blocks beyond vLLM's own prefix-cache hit to load (never more than loading
  beats recomputing; vLLM computes a fully cached prompt's last token itself). A load runs
  before the step's forward pass, or in the background while the request waits (async_loads).
  `build_connector_meta` adds, per scheduled request, the full prompt blocks this step
  completes that are new; the scheduler borrows their pages and commits them once every
  worker reported its part written (saves.py).
* Worker side: `start_load_kv` acquires pages and copies this worker's part into vLLM's
  blocks (batched torch copies on CPU, one kernel launch on a GPU); `save_kv_layer` copies
  each layer of the blocks to store into the borrowed pages; `wait_for_save` copies what no
  hook handed over and reports. Background loads end through `get_transfer_results`.
* Each block is stored once: not if kvtier, vLLM's own prefix cache or another live request
  of the engine already has it (scheduler.py says how).
* `request_finished` returns `kv_transfer_params={"kvtier": {...}}` (loaded tokens, blocks
  stored, the planner's reason). KV events (events.py) and, with vLLM's KV events on,
  kvtier's later tier changes of the engine's pages (tier_events.py: written to disk,
  evicted from host); stats and Prometheus metrics (stats.py). `reset_cache` starts a new
  key epoch and says True; vLLM 0.33's sleep hooks drop and restore the worker's views.

What it refuses, with the reason at engine start: Mamba / linear-attention layers, context
parallelism, a hybrid model with pipeline parallelism, K and V head sizes that differ.

Configuration (`kv_connector_extra_config`), every key optional:

    target        daemon address: "unix:///abs/path.sock" or "host:port"
                  (default $KVTIER_TARGET, else unix://$XDG_RUNTIME_DIR/kvtier/kvtier.sock)
    namespace     isolation unit, model + tenant (default "vllm/<served model name>")
    salt          per-tenant string mixed into every block key (default "")
    token_file    file holding the bearer token (for a daemon run with --tokens-file)
    token         the bearer token itself (prefer token_file)
    tls_ca, tls_cert, tls_key, tls_server_name   PEM files / name for a TLS TCP target
    insecure      plaintext TCP (trusted loopback only; default false)
    planner       true: load only what the planner says pays; false: load every cached block
    prefetch      ask the daemon to start bringing a new request's pages up from disk (true)
    connect_timeout   seconds to keep retrying an unreachable daemon per call (10)
    kv_cache_format   "auto" (default), "cpu" or "kv_last_dim": how a layer's KV tensor
                      [num_blocks, kv_heads, block_size, 2 * head_dim] holds K and V
    async_loads   "auto" (background when a page is on disk or in the cluster, and for hybrid
                  models), "always" or "never"
    max_load_tokens   at most this many tokens loaded per request
    on_reset      "new_epoch" (default) or "keep": what vLLM's cache reset does to the keys
    page_tokens   tokens per kvtier page, a multiple of vLLM's block size (default one block)
    kv_events_pages   with vLLM's KV events on: pages whose later tier changes are relayed
                  as KV events, at most (1,000,000; tier_events.py)

The package, one module per concern (vLLM loads one connector class and tells it its role;
`KVTierConnector` below is a thin facade that builds the half for that role and forwards to it):

    config.py     ConnectorConfig (kv_connector_extra_config), the default namespace
    kv_groups.py  KV cache groups as page layouts and what a restore needs of each
    shapes.py     the parallel shape, and a worker's part of every page
    weights.py    the checkpoint fingerprint in every key
    extra_keys.py multimodal inputs as block-key extras
    link.py       DaemonLink: a registered client, and the gate that skips an unreachable daemon
    metadata.py   LoadOp, SaveOp and the per-step messages between the roles
    request_state.py   what the scheduler knows of a request, and the salt of its keys
    scheduler.py  KVTierScheduler: lookups, load planning, metadata building
    saves.py      saves in flight: borrowed pages, committed once every worker wrote its part
    hints.py      request.kv_hints (and kv_transfer_params["kvtier_hints"]) as kvtier actions:
                  pin, retain, prefetch, demote, drop (docs/cache-control.md)
    events.py     the BlockStored events of the blocks kvtier took
    tier_events.py    kvtier's later tier changes of those pages, relayed as KV events
    kv_views.py   per group, vLLM's KV tensors as views shaped like a worker's part of a page
    worker.py     KVTierWorker: foreground and background loads, saves, reports
    copies.py     the CPU copies (batched, split over torch's threads)
    stats.py      KVTierConnectorStats and its Prometheus counters

Every vLLM import of the project happens in this package, so the rest of kvtier_client does
not need vLLM.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

try:
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
        KVConnectorTransferResults,
        KVConnectorWorkerMetadata,
        SupportsHMA,
    )
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError as exc:  # pragma: no cover - exercised only without vLLM
    raise ImportError(
        f"kvtier_client.integrations.vllm needs vLLM (and torch): {exc}. Install vLLM in the engine's "
        "environment; for this repository's CPU checks run scripts/setup_vllm.sh (creates .venv-vllm)."
    ) from exc

from kvtier_client.integrations.vllm.config import ConnectorConfig, default_namespace, served_model
from kvtier_client.integrations.vllm.link import DaemonLink, log
from kvtier_client.integrations.vllm.metadata import KVTierConnectorMetadata, KVTierWorkerMetadata, LoadOp, SaveOp
from kvtier_client.integrations.vllm.request_state import request_salt
from kvtier_client.integrations.vllm.scheduler import KVTierScheduler
from kvtier_client.integrations.vllm.kv_groups import KVGroup, kv_groups
from kvtier_client.integrations.vllm.kv_views import GroupViews
from kvtier_client.integrations.vllm.shapes import ParallelShape, WorkerSlice
from kvtier_client.integrations.vllm.stats import KVTierConnectorStats, KVTierPromMetrics
from kvtier_client.integrations.vllm.weights import checkpoint_fingerprint
from kvtier_client.integrations.vllm.worker import KVTierWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


def _worker_slice(shape: ParallelShape, group: KVGroup) -> WorkerSlice:
    """This worker's part of a group's pages, from vLLM's parallel groups (initialised
    before vLLM builds a worker's connector)."""
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    return WorkerSlice.of(shape, get_tp_group().rank_in_group, get_pp_group().rank_in_group, group.layout.kv_heads,
                          group.local_heads, group.page_layers)


class KVTierConnector(KVConnectorBase_V1, SupportsHMA):
    """A vLLM V1 KV connector backed by a kvtier daemon (see the package docstring).

    vLLM makes one per role: in the engine core with role SCHEDULER, in each model runner with
    role WORKER. Each builds only its half, and a call meant for the other role is a bug
    (AssertionError), as in vLLM's own connectors.
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        shape = ParallelShape.of(vllm_config)
        transfer = self._kv_transfer_config
        self.config = ConnectorConfig.from_extra(
            transfer.kv_connector_extra_config, default_namespace=default_namespace(vllm_config),
            served_model=served_model(vllm_config),
        )
        block_size = vllm_config.cache_config.block_size
        self.groups = kv_groups(kv_cache_config, vllm_config, self.config.page_tokens)
        if len(self.groups) > 1 and self.config.async_loads == "never":
            raise ValueError("kvtier connector: async_loads='never' is not possible for a model with several KV cache "
                             "groups: vLLM takes such a model's load failures only per request, from background loads; "
                             "use 'auto' or 'always'")
        if transfer.kv_load_failure_policy != "recompute":
            log.info(
                "kvtier connector: kv_load_failure_policy=%r; with 'recompute' a page evicted between lookup and "
                "load is recomputed instead of failing the request", transfer.kv_load_failure_policy,
            )
        side = "scheduler" if role == KVConnectorRole.SCHEDULER else "worker"
        # One registration per distinct layout: groups with equal layouts share a pool (their
        # keys differ by the group's salt).
        by_layout: dict = {}
        for group in self.groups:
            if group.layout not in by_layout:
                by_layout[group.layout] = DaemonLink.open(self.config, group.layout, side)
        self._links = list(by_layout.values())
        links = [by_layout[group.layout] for group in self.groups]
        self._scheduler: KVTierScheduler | None = None
        self._worker: KVTierWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            events = vllm_config.kv_events_config
            self._scheduler = KVTierScheduler(
                links, self.groups, self.config, block_size, do_load=transfer.is_kv_consumer,
                do_save=transfer.is_kv_producer, weights=checkpoint_fingerprint(vllm_config),
                page_tokens=self.config.page_tokens,
                workers=shape.workers, events=bool(events and events.enable_kv_cache_events),
                hash_block_size=getattr(kv_cache_config, "hash_block_size", None),
            )
        else:
            views = [GroupViews(group, _worker_slice(shape, group), link) for group, link in zip(self.groups, links)]
            self._worker = KVTierWorker(views, vllm_config, self.config.kv_cache_format)
        log.info(
            "kvtier connector (%s) registered namespace %r at %s: %s",
            side, self.config.namespace, self.config.target,
            [(g.mode.name, g.window, g.layout) for g in self.groups],
        )

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a save that did not happen is a future miss

    @property
    def scheduler(self) -> KVTierScheduler:
        assert self._scheduler is not None, "a scheduler-side call on the worker's connector"
        return self._scheduler

    @property
    def worker(self) -> KVTierWorker:
        assert self._worker is not None, "a worker-side call on the scheduler's connector"
        return self._worker

    # -- scheduler side (kvtier_client.integrations.vllm.scheduler) ---------------------
    def on_new_request(self, request: Request) -> None:
        self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        return self.scheduler.get_external_cache_hit_sources(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hybrid allocator (SupportsHMA): the same as request_finished; saves end
        within their step, so no group's blocks are held."""
        return self.scheduler.request_finished(request, [])

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self.scheduler.take_events()

    def reset_cache(self) -> bool | None:
        return self.scheduler.reset_cache() if self._scheduler is not None else None

    # -- worker side (kvtier_client.integrations.vllm.worker) ---------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    # vLLM 0.33's sleep mode: the KV tensors go away during sleep and come back, empty, at
    # the same addresses on wake-up; kvtier's pages are not touched (0.32 never calls these).
    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        return True

    def unregister_kv_caches(self) -> None:
        self.worker.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        self.worker.restore_kv_caches()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self.worker.start_step()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker.start_load_kv(self._connector_metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv copied every layer before the forward pass began

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        self.worker.save_kv_layer(layer_name, self._connector_metadata)

    def wait_for_save(self) -> None:
        self.worker.wait_for_save(self._connector_metadata)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.worker.build_connector_worker_meta()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        finished, _ = self.worker.transfer_results()
        return None, finished or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Background loads that ended (saves end within their step): a load some block of
        which did not arrive is also `failed_recving`, and vLLM recomputes the request."""
        finished, failed = self.worker.transfer_results()
        return KVConnectorTransferResults(finished_recving=finished, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    # -- both ---------------------------------------------------------------------------
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        half = self._scheduler if self._scheduler is not None else self.worker
        return half.get_kv_connector_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVTierConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVTierPromMetrics:
        return KVTierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()
        for link in self._links:
            link.close()


__all__ = [
    "ConnectorConfig",
    "KVTierConnector",
    "KVTierConnectorMetadata",
    "KVTierConnectorStats",
    "KVTierScheduler",
    "KVTierWorker",
    "KVTierWorkerMetadata",
    "LoadOp",
    "SaveOp",
    "KVGroup",
    "kv_groups",
    "request_salt",
]
