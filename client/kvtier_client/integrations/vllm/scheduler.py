"""The connector's scheduler side (vLLM's engine-core process): lookups, load planning and
the per-step metadata that tells the worker what to load and store.

Per request, in the order vLLM calls it:

    on_new_request               block keys (salted), prefetch
    get_num_new_matched_tokens   lookup; the planner's load beyond vLLM's own prefix hit
    update_state_after_alloc     the offered load, as blocks of the request
    build_connector_meta         (every step) LoadOps for those blocks, SaveOps for the full
                                 prompt blocks this step completes and kvtier does not hold
    update_connector_output      the worker's prefill timing -> Planner.observe_prefill
    request_finished             kv_transfer_params={"kvtier": {...}}
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier_client.errors import KVTierError
from kvtier_client.integrations.planner import Planner
from kvtier_client.integrations.vllm.config import ConnectorConfig
from kvtier_client.integrations.vllm.link import DaemonLink, log
from kvtier_client.integrations.vllm.metadata import KVTierConnectorMetadata, KVTierWorkerMetadata, LoadOp, SaveOp
from kvtier_client.keys import BlockKey
from kvtier_client.results import LookupResult
from kvtier_client.tiers import Tier

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

_TIER_SOURCES = {Tier.DEVICE: CacheHitSource.DEVICE, Tier.HOST: CacheHitSource.HOST, Tier.DISK: CacheHitSource.DISK}


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


class KVTierScheduler:
    """The scheduler half of KVTierConnector: one per engine core."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, link: DaemonLink, config: ConnectorConfig, block_size: int, *, do_load: bool,
                 do_save: bool) -> None:
        self.link = link
        self.kv = link.kv
        self.config = config
        self.block_size = block_size
        self.do_load = do_load
        self.do_save = do_save
        self.planner = Planner(self.kv) if config.use_planner else None
        self._requests: dict[str, _RequestState] = {}

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
        if state is None or not state.keys or not self.config.prefetch or not self.do_load or not self.link.available():
            return
        try:
            self.kv.prefetch(state.keys)  # disk pages start climbing to host before the request is scheduled
        except KVTierError as exc:
            self.link.failed("prefetch", exc)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        state = self._state(request)
        if state is None or not self.do_load or not state.keys or not self.link.available():
            return 0, False
        state.candidate = None
        try:
            found = self.kv.lookup(state.keys)
        except KVTierError as exc:
            self.link.failed("lookup", exc)
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

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVTierConnectorMetadata:
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
        if not self.do_save or not self.link.available():
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
