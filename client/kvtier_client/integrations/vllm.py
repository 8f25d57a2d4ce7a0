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

What it does, per request (docs/integrations.md has the full story):

* Scheduler side (`get_num_new_matched_tokens`): computes the prompt's block keys (one
  key per full vLLM block; kvtier `block_tokens` == vLLM `block_size`), looks them up,
  and asks the load planner (`kvtier_client.integrations.planner.Planner`) how many of
  the cached blocks beyond vLLM's own prefix-cache hit are worth loading: never more
  than loading beats recomputing. vLLM must compute at least one prompt token itself, so
  a prompt cached in full is loaded up to its last token (`len(prompt) - 1` tokens).
  `update_state_after_alloc` turns the answer into a load of vLLM block ids, and
  `build_connector_meta` adds, for every scheduled request, the full prompt blocks that
  this step completes and kvtier does not hold yet.
* Worker side: `register_kv_caches` maps vLLM's per-layer paged KV tensors onto views
  shaped like kvtier pages; `start_load_kv` acquires the pages and copies them into
  vLLM's blocks before the forward pass (synchronous: the scheduler marks such steps as
  having synchronous loads, so vLLM calls it before the forward; `wait_for_layer_load`
  then has nothing left to wait for); `save_kv_layer` copies each layer of the blocks to
  store into borrowed pages as soon as the layer's attention has written it, and
  `wait_for_save` copies any layer that was not handed over (a CUDA-graph replay skips
  the per-layer hooks) and commits the pages under their keys.
* Measured prefill speed: the worker times each forward pass and reports it with
  `build_connector_worker_meta`; the scheduler feeds it to `Planner.observe_prefill`.
* `request_finished` returns `kv_transfer_params={"kvtier": {...}}` (loaded tokens, blocks
  stored, the planner's reason), which vLLM attaches to the request's output.

What it supports: models whose layers are all full attention (one KV cache group), one
worker (tensor, pipeline and context parallel size 1), text prompts (requests with
multimodal inputs or prompt embeddings are neither loaded nor stored), the CPU attention
backend (verified end to end) and the backends that keep K and V side by side in the last
dimension (FlashAttention, Triton, FlexAttention; copies by torch indexing, see
docs/integrations.md for the GPU path). Only prompt blocks are stored, not generated ones.

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

Every vLLM import of the project happens in this module, so the rest of kvtier_client does
not need vLLM.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

try:
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
        KVConnectorWorkerMetadata,
    )
    from vllm.logger import init_logger
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError as exc:  # pragma: no cover - exercised only without vLLM
    raise ImportError(
        f"kvtier_client.integrations.vllm needs vLLM (and torch): {exc}. Install vLLM in the engine's "
        "environment; for this repository's CPU checks run scripts/setup_vllm.sh (creates .venv-vllm)."
    ) from exc

from kvtier_client.client import KVTierClient, Wait
from kvtier_client.connection import Backoff, TLSConfig
from kvtier_client.errors import CapacityError, KVTierError, Unavailable
from kvtier_client.integrations.planner import Planner
from kvtier_client.keys import BlockKey
from kvtier_client.layout import DTYPE_BYTES, PageLayout
from kvtier_client.results import LookupResult
from kvtier_client.tiers import Tier

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

#: Under vLLM's logger tree, so the connector's messages appear in the engine's log.
log = init_logger("vllm.kvtier_connector")

#: kv_connector_extra_config keys this connector reads.
CONFIG_KEYS = (
    "target", "namespace", "salt", "token", "token_file", "tls_ca", "tls_cert", "tls_key", "tls_server_name",
    "insecure", "planner", "prefetch", "connect_timeout", "kv_cache_format",
)
#: Attention backends whose per-layer KV [num_blocks, kv_heads, block_size, 2 * head_dim]
#: holds K in [..., :head_dim] and V in [..., head_dim:] (read in vLLM 0.32's sources).
KV_LAST_DIM_BACKENDS = frozenset({"FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION"})
#: Backends that view a block of one head as block_size rows of K then block_size rows of V.
CPU_BACKENDS = frozenset({"CPU_ATTN"})
KV_CACHE_FORMATS = ("auto", "cpu", "kv_last_dim")
#: After the daemon could not be reached, skip kvtier for this long instead of stalling
#: every request on connection retries.
RETRY_AFTER_SECONDS = 10.0
_TIER_SOURCES = {Tier.DEVICE: CacheHitSource.DEVICE, Tier.HOST: CacheHitSource.HOST, Tier.DISK: CacheHitSource.DISK}


# -- configuration ---------------------------------------------------------------------
def _default_target() -> str:
    env = os.environ.get("KVTIER_TARGET")
    if env:
        return env
    runtime = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/kvtier-{os.getuid()}"
    return f"unix://{os.path.join(runtime, 'kvtier', 'kvtier.sock')}"


def _as_bool(extra: dict[str, Any], key: str, default: bool) -> bool:
    value = extra.get(key, default)
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
        return value.lower() in ("true", "1", "yes")
    raise ValueError(f"kvtier connector: kv_connector_extra_config[{key!r}] must be true or false, got {value!r}")


def _as_str(extra: dict[str, Any], key: str, default: str | None = None) -> str | None:
    value = extra.get(key, default)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"kvtier connector: kv_connector_extra_config[{key!r}] must be a string, got {value!r}")
    return value


@dataclass(frozen=True)
class ConnectorConfig:
    """What `kv_connector_extra_config` asked for, checked (see the module docstring)."""

    target: str
    namespace: str
    salt: bytes = b""
    token: str | None = field(default=None, repr=False)
    tls: TLSConfig | None = field(default=None, repr=False)
    insecure: bool = False
    use_planner: bool = True
    prefetch: bool = True
    connect_timeout: float = 10.0
    kv_cache_format: str = "auto"

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None, *, default_namespace: str) -> ConnectorConfig:
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(CONFIG_KEYS))
        if unknown:
            raise ValueError(
                f"kvtier connector: unknown kv_connector_extra_config key(s) {unknown}; "
                f"the keys are {', '.join(CONFIG_KEYS)}"
            )
        target = _as_str(extra, "target") or _default_target()
        if not (target.startswith("unix://") or (":" in target and "/" not in target)):
            raise ValueError(
                f"kvtier connector: target {target!r} is neither 'unix:///abs/path.sock' nor 'host:port'"
            )
        namespace = _as_str(extra, "namespace") or default_namespace
        if not namespace:
            raise ValueError("kvtier connector: namespace must be a non-empty string")
        salt = _as_str(extra, "salt", "") or ""
        token = _as_str(extra, "token")
        token_file = _as_str(extra, "token_file")
        if token and token_file:
            raise ValueError("kvtier connector: give either token or token_file, not both")
        if token_file:
            try:
                token = Path(token_file).read_text().strip()
            except OSError as exc:
                raise ValueError(f"kvtier connector: cannot read token_file {token_file!r}: {exc}") from None
            if not token:
                raise ValueError(f"kvtier connector: token_file {token_file!r} is empty")
        tls_files = {k: _as_str(extra, k) for k in ("tls_ca", "tls_cert", "tls_key")}
        server_name = _as_str(extra, "tls_server_name")
        tls = None
        if any(tls_files.values()) or server_name:
            if target.startswith("unix://"):
                raise ValueError("kvtier connector: tls_* applies to a host:port target, not a unix socket")
            try:
                tls = TLSConfig.from_files(tls_files["tls_ca"], tls_files["tls_cert"], tls_files["tls_key"], server_name)
            except (OSError, ValueError) as exc:
                raise ValueError(f"kvtier connector: TLS configuration: {exc}") from None
        timeout = extra.get("connect_timeout", 10.0)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"kvtier connector: connect_timeout must be positive seconds, got {timeout!r}")
        kv_format = _as_str(extra, "kv_cache_format", "auto")
        if kv_format not in KV_CACHE_FORMATS:
            raise ValueError(f"kvtier connector: kv_cache_format must be one of {KV_CACHE_FORMATS}, got {kv_format!r}")
        return cls(
            target=target, namespace=namespace, salt=salt.encode(), token=token, tls=tls,
            insecure=_as_bool(extra, "insecure", False), use_planner=_as_bool(extra, "planner", True),
            prefetch=_as_bool(extra, "prefetch", True), connect_timeout=float(timeout), kv_cache_format=kv_format,
        )

    def client(self, name: str) -> KVTierClient:
        return KVTierClient(
            self.target, token=self.token, tls=self.tls, insecure=self.insecure, name=name,
            backoff=Backoff(total=self.connect_timeout), timeout=max(30.0, self.connect_timeout),
        )


def page_layout_for(kv_cache_config: KVCacheConfig, block_size: int) -> tuple[PageLayout, list[str]]:
    """The kvtier page layout of this engine's KV cache, and its attention layers in page order."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(
            f"kvtier connector: this model has {len(groups)} KV cache groups (sliding-window, linear or "
            "other non-full attention layers); the connector supports models whose layers all use full attention"
        )
    spec = groups[0].kv_cache_spec
    if isinstance(spec, MLAAttentionSpec) or not isinstance(spec, FullAttentionSpec):
        raise ValueError(f"kvtier connector: KV cache spec {type(spec).__name__} is not supported (full attention only)")
    if getattr(spec, "sliding_window", None) is not None:
        raise ValueError("kvtier connector: sliding-window attention is not supported")
    head_v = getattr(spec, "head_size_v", spec.head_size)
    if head_v != spec.head_size:
        raise ValueError(f"kvtier connector: K head size {spec.head_size} differs from V head size {head_v}")
    if spec.block_size != block_size:
        raise ValueError(f"kvtier connector: KV spec block size {spec.block_size} differs from cache block size {block_size}")
    dtype = str(spec.dtype).removeprefix("torch.")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"kvtier connector: KV cache dtype {dtype} has no kvtier page dtype ({', '.join(DTYPE_BYTES)})")
    layers = list(groups[0].layer_names)
    layout = PageLayout(
        layers=len(layers), kv_heads=spec.num_kv_heads, head_dim=spec.head_size, block_tokens=spec.block_size, dtype=dtype
    )
    return layout, layers


def _check_parallel(vllm_config: VllmConfig) -> None:
    pc = vllm_config.parallel_config
    sizes = {
        "tensor_parallel_size": pc.tensor_parallel_size,
        "pipeline_parallel_size": pc.pipeline_parallel_size,
        "prefill_context_parallel_size": getattr(pc, "prefill_context_parallel_size", 1),
        "decode_context_parallel_size": getattr(pc, "decode_context_parallel_size", 1),
    }
    wide = {k: v for k, v in sizes.items() if v != 1}
    if wide:
        raise ValueError(
            f"kvtier connector: {wide} is not supported yet; run one worker per engine "
            "(data parallel engines each with their own connector are fine)"
        )


# -- metadata passed between scheduler and worker ---------------------------------------
@dataclass
class LoadOp:
    """Copy the cached pages of `keys` into vLLM blocks `block_ids` (same length)."""

    req_id: str
    block_ids: list[int]
    keys: list[bytes]


@dataclass
class SaveOp:
    """Store vLLM blocks `block_ids` as the pages of `keys`; `parent` is the key before keys[0]."""

    req_id: str
    block_ids: list[int]
    keys: list[bytes]
    parent: bytes | None


@dataclass
class KVTierConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadOp] = field(default_factory=list)
    saves: list[SaveOp] = field(default_factory=list)
    step_tokens: int = 0  # tokens the forward pass of this step computes
    prefill_tokens: int = 0  # of which prompt tokens


@dataclass
class KVTierWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler after a step: how long the forward pass took, for the planner."""

    step_tokens: int = 0
    prefill_tokens: int = 0
    forward_seconds: float = 0.0

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KVTierWorkerMetadata):
            return self
        return KVTierWorkerMetadata(
            max(self.step_tokens, other.step_tokens), max(self.prefill_tokens, other.prefill_tokens),
            max(self.forward_seconds, other.forward_seconds),
        )


# -- scheduler-side bookkeeping ------------------------------------------------------
@dataclass
class _RequestState:
    request: Request
    keys: list[BlockKey]
    prompt_tokens: int
    kvtier_blocks: int = 0  # leading blocks kvtier held at the last lookup
    candidate: tuple[int, int, int] | None = None  # (first block, end block, external tokens) offered
    candidate_tiers: tuple[Tier, ...] = ()
    load: tuple[int, int] | None = None  # blocks to load in the next step
    load_tiers: tuple[Tier, ...] = ()
    block_ids: list[int] = field(default_factory=list)
    save_upto: int = 0  # blocks before this one are in kvtier or already sent to be stored
    loaded_tokens: int = 0
    stored_blocks: int = 0
    plan_reason: str = ""


def request_salt(base: bytes, request: Request) -> bytes:
    """The block-key salt of a request: the configured salt, vLLM's per-request cache_salt
    and the LoRA adapter, each length-prefixed so no two combinations collide."""
    parts = [base, (request.cache_salt or "").encode()]
    lora = getattr(request, "lora_request", None)
    parts.append(f"{lora.lora_name}:{lora.lora_int_id}".encode() if lora is not None else b"")
    return b"".join(len(p).to_bytes(4, "little") + p for p in parts)


class KVTierConnector(KVConnectorBase_V1):
    """A vLLM V1 KV connector backed by a kvtier daemon (see the module docstring)."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _check_parallel(vllm_config)
        model = vllm_config.model_config
        served = model.served_model_name
        if isinstance(served, (list, tuple)):
            served = served[0] if served else None
        default_namespace = "vllm/" + str(served or model.model).lstrip("/")
        self.config = ConnectorConfig.from_extra(
            self._kv_transfer_config.kv_connector_extra_config, default_namespace=default_namespace
        )
        self.block_size = vllm_config.cache_config.block_size
        self.layout, self.layer_names = page_layout_for(kv_cache_config, self.block_size)
        self.do_load = self._kv_transfer_config.is_kv_consumer
        self.do_save = self._kv_transfer_config.is_kv_producer
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            log.info(
                "kvtier connector: kv_load_failure_policy=%r; with 'recompute' a page evicted between lookup and "
                "load is recomputed instead of failing the request", self._kv_transfer_config.kv_load_failure_policy,
            )
        side = "scheduler" if role == KVConnectorRole.SCHEDULER else "worker"
        self.kv = self.config.client(f"vllm {side} pid {os.getpid()}")
        try:
            self.kv.register(self.config.namespace, self.layout)
        except KVTierError as exc:
            self.kv.close()
            raise RuntimeError(
                f"kvtier connector: cannot register namespace {self.config.namespace!r} with layout {self.layout} "
                f"at {self.config.target}: {exc}. Is `kvtier serve` running there (kv_connector_extra_config "
                "'target'), and does its token grant this namespace?"
            ) from exc
        self._down_until = 0.0
        # scheduler side
        self.planner = Planner(self.kv) if role == KVConnectorRole.SCHEDULER and self.config.use_planner else None
        self._requests: dict[str, _RequestState] = {}
        # worker side
        self._views: list[torch.Tensor] | None = None  # per layer, [num_blocks, 2, block, kv_heads, head_dim]
        self._layer_index = {name: i for i, name in enumerate(self.layer_names)}
        self._load_errors: set[int] = set()
        self._pending_saves: list[tuple[SaveOp, Any, list[torch.Tensor], set[int]]] = []
        self._step_started: float | None = None
        self._connector_seconds = 0.0
        self._worker_meta: KVTierWorkerMetadata | None = None
        log.info(
            "kvtier connector (%s) registered namespace %r at %s: %s",
            side, self.config.namespace, self.config.target, self.layout,
        )

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a save that did not happen is a future miss

    # -- daemon availability ----------------------------------------------------------
    def _available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, what: str, exc: KVTierError) -> None:
        if isinstance(exc, Unavailable):
            self._down_until = time.monotonic() + RETRY_AFTER_SECONDS
            log.warning("kvtier connector: %s: daemon unavailable (%s); not using kvtier for %.0fs",
                        what, exc, RETRY_AFTER_SECONDS)
        else:
            log.warning("kvtier connector: %s failed: %s", what, exc)

    # ==============================================================================
    # Scheduler side
    # ==============================================================================
    def _state(self, request: Request) -> _RequestState | None:
        state = self._requests.get(request.request_id)
        if state is not None:
            return state
        if request.prompt_token_ids is None or request.mm_features:
            return None  # prompt embeddings or multimodal inputs: their KV is not named by token ids
        keys = self.kv.block_keys(request.prompt_token_ids, salt=request_salt(self.config.salt, request))
        state = _RequestState(request, keys, len(request.prompt_token_ids))
        self._requests[request.request_id] = state
        return state

    def on_new_request(self, request: Request) -> None:
        state = self._state(request)
        if state is None or not state.keys or not self.config.prefetch or not self.do_load or not self._available():
            return
        try:
            self.kv.prefetch(state.keys)  # disk pages start climbing to host before the request is scheduled
        except KVTierError as exc:
            self._failed("prefetch", exc)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        state = self._state(request)
        if state is None or not self.do_load or not state.keys or not self._available():
            return 0, False
        state.candidate = None
        try:
            found = self.kv.lookup(state.keys)
        except KVTierError as exc:
            self._failed("lookup", exc)
            return 0, False
        state.kvtier_blocks = found.hit_blocks
        state.save_upto = max(state.save_upto, found.hit_blocks)
        block = self.block_size
        local = num_computed_tokens // block
        if found.hit_blocks <= local:
            return 0, False
        beyond = LookupResult(found.hit_blocks - local, tuple(found.tiers[local : found.hit_blocks]))
        if self.planner is not None:
            plan = self.planner.plan(beyond)
            n, state.plan_reason = plan.load_blocks, plan.reason
        else:
            n, state.plan_reason = beyond.hit_blocks, "planner off: loading every cached block"
        # vLLM computes at least the last prompt token itself.
        target = min((local + n) * block, state.prompt_tokens - 1)
        external = target - num_computed_tokens
        if external <= 0:
            return 0, False
        end = -(-target // block)
        state.candidate = (local, end, external)
        state.candidate_tiers = tuple(found.tiers[local:end])
        return external, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        state = self._requests.get(request.request_id)
        if state is None or num_external_tokens <= 0 or state.candidate is None:
            return
        start, end, offered = state.candidate
        if num_external_tokens != offered:
            end = -(-(start * self.block_size + num_external_tokens) // self.block_size)
        state.load = (start, end)
        state.load_tiers = state.candidate_tiers[: end - start]
        state.loaded_tokens += num_external_tokens
        state.candidate = None

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        state = self._requests.get(request.request_id)
        if num_external_tokens <= 0:
            return {}
        if state is None or not state.load_tiers:
            return {self._cache_hit_source: num_external_tokens}
        counts: dict[CacheHitSource, int] = {}
        left = num_external_tokens
        for tier in state.load_tiers:
            take = min(left, self.block_size)
            source = _TIER_SOURCES.get(tier, CacheHitSource.EXTERNAL_UNSPECIFIED)
            counts[source] = counts.get(source, 0) + take
            left -= take
        if left > 0:
            counts[self._cache_hit_source] = counts.get(self._cache_hit_source, 0) + left
        return {k: v for k, v in counts.items() if v}

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVTierConnectorMetadata(step_tokens=scheduler_output.total_num_scheduled_tokens)
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is not None:
                state.block_ids = list(new.block_ids[0]) if new.block_ids else []
                self._plan_step(state, new.req_id, new.num_computed_tokens, scheduled.get(new.req_id, 0), meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                state.block_ids.extend(new_ids[0])
            self._plan_step(state, req_id, cached.num_computed_tokens[i], scheduled.get(req_id, 0), meta)
        return meta

    def _plan_step(self, state: _RequestState, req_id: str, computed: int, scheduled: int,
                   meta: KVTierConnectorMetadata) -> None:
        if computed < state.prompt_tokens:
            meta.prefill_tokens += min(scheduled, state.prompt_tokens - computed)
        if state.load is not None:
            start, end = state.load
            state.load = None
            if end <= len(state.block_ids):
                meta.loads.append(LoadOp(req_id, state.block_ids[start:end], list(state.keys[start:end])))
            else:  # cannot happen with a consistent block table; recomputing is always safe
                log.warning("kvtier connector: request %s has %d blocks, load needs %d; not loading",
                            req_id, len(state.block_ids), end)
        if not self.do_save or not self._available():
            return  # while the daemon is away, blocks wait; a later step of the request stores them
        full = min(computed + scheduled, state.prompt_tokens) // self.block_size
        full = min(full, len(state.block_ids), len(state.keys))
        if full > state.save_upto:
            first = state.save_upto
            meta.saves.append(SaveOp(
                req_id, state.block_ids[first:full], list(state.keys[first:full]),
                state.keys[first - 1] if first else None,
            ))
            state.stored_blocks += full - first
            state.save_upto = full

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if self.planner is None or not isinstance(meta, KVTierWorkerMetadata):
            return
        # A step that was mostly prompt tokens measures the prefill rate.
        if meta.prefill_tokens >= self.block_size and 2 * meta.prefill_tokens >= meta.step_tokens:
            self.planner.observe_prefill(meta.step_tokens, meta.forward_seconds)
            log.debug("kvtier connector: prefill of %d tokens took %.4fs", meta.step_tokens, meta.forward_seconds)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        state = self._requests.pop(request.request_id, None)
        if state is None:
            return False, None
        # Saves run synchronously inside the step that scheduled them: nothing is in flight.
        return False, {"kvtier": {
            "loaded_tokens": state.loaded_tokens,
            "cached_blocks": state.kvtier_blocks,
            "stored_blocks": state.stored_blocks,
            "plan": state.plan_reason,
            "prefill_tokens_per_second": self.planner.prefill_tokens_per_second if self.planner else None,
        }}

    # ==============================================================================
    # Worker side
    # ==============================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        missing = [name for name in self.layer_names if name not in kv_caches]
        if missing:
            raise ValueError(f"kvtier connector: no KV cache tensor for layers {missing}")
        kv_format = self.config.kv_cache_format
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

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._step_started = time.perf_counter()
        self._connector_seconds = 0.0

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, KVTierConnectorMetadata) or not meta.loads or self._views is None:
            return
        started = time.perf_counter()
        for op in meta.loads:
            self._load(op)
        self._connector_seconds += time.perf_counter() - started

    def _load(self, op: LoadOp) -> None:
        assert self._views is not None
        copied = 0
        if not self._available():
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
            self._failed(f"loading {len(op.keys)} pages of request {op.req_id}", exc)
        if copied < len(op.block_ids):
            # vLLM recomputes from the first block that did not arrive (kv_load_failure_policy).
            self._load_errors.update(op.block_ids[copied:])

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv copied every layer before the forward pass began

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        meta = self._connector_metadata
        layer = self._layer_index.get(layer_name)
        if not isinstance(meta, KVTierConnectorMetadata) or not meta.saves or layer is None or self._views is None:
            return
        started = time.perf_counter()
        if not self._pending_saves:
            self._borrow(meta.saves)
        for op, _lease, pages, done in self._pending_saves:
            self._copy_layer(layer, op, pages)
            done.add(layer)
        self._connector_seconds += time.perf_counter() - started

    def _borrow(self, saves: list[SaveOp]) -> None:
        for op in saves:
            if not self._available():
                return
            try:
                lease = self.kv.borrow(len(op.keys))
            except CapacityError as exc:
                log.info("kvtier connector: no free pages to store %d blocks of request %s: %s",
                         len(op.keys), op.req_id, exc)
                continue
            except KVTierError as exc:
                self._failed(f"borrowing {len(op.keys)} pages", exc)
                continue
            self._pending_saves.append((op, lease, list(lease.tensors()), set()))

    def _copy_layer(self, layer: int, op: SaveOp, pages: list[torch.Tensor]) -> None:
        assert self._views is not None
        view = self._views[layer]
        for page, block_id in zip(pages, op.block_ids):
            page[layer].copy_(view[block_id])

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if isinstance(meta, KVTierConnectorMetadata) and self._views is not None:
            forward_end = time.perf_counter()
            if meta.saves and not self._pending_saves:
                self._borrow(meta.saves)  # no per-layer hook ran (e.g. a CUDA graph replay)
            for op, lease, pages, done in self._pending_saves:
                try:
                    for layer in range(len(self._views)):
                        if layer not in done:
                            self._copy_layer(layer, op, pages)
                    lease.commit(op.keys, parent=op.parent)
                except KVTierError as exc:
                    self._failed(f"storing {len(op.keys)} pages of request {op.req_id}", exc)
                    self._release(lease)
                except BaseException:
                    self._release(lease)
                    raise
            self._pending_saves = []
            if self._step_started is not None and meta.step_tokens:
                seconds = forward_end - self._step_started - self._connector_seconds
                if seconds > 0:
                    self._worker_meta = KVTierWorkerMetadata(meta.step_tokens, meta.prefill_tokens, seconds)
        self._step_started = None

    def _release(self, lease: Any) -> None:
        if lease.ended:
            return
        try:
            lease.release()
        except KVTierError as exc:
            log.warning("kvtier connector: could not release lease %s: %s", lease.lease_id, exc)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        meta, self._worker_meta = self._worker_meta, None
        return meta

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None  # loads and saves complete within their step

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        for _op, lease, _pages, _done in self._pending_saves:
            self._release(lease)
        self._pending_saves = []
        self.kv.close()


__all__ = [
    "ConnectorConfig",
    "KVTierConnector",
    "KVTierConnectorMetadata",
    "KVTierWorkerMetadata",
    "LoadOp",
    "SaveOp",
    "page_layout_for",
    "request_salt",
]
