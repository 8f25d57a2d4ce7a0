"""vLLM's own tiering layer as an engine's scheduler builds and drives it, for
vllm_tier_checks.py (run with .venv-vllm's python): `TieringOffloadingSpec(config).get_manager()`
builds the CPU tier and loads kvtier's secondary tier by module path through vLLM's
SecondaryTierFactory; stores and loads go through the manager's scheduler-side calls in
the order the OffloadingConnector makes them. The GPU worker's part (copying blocks into
and out of the CPU tier's rows) is a numpy copy here: no model, no worker process.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

ROW = 64 * 1024  # bytes of one block (one chunk: blocks_per_chunk 1) in the CPU tier
TIER = {"type": "KVTierSecondaryTier", "module_path": "kvtier_client.integrations.vllm_tier"}
STEP_SECONDS = 0.002  # between scheduler steps while a job or a lookup is in flight


def offloading_config(model: str, extra: dict) -> OffloadingConfig:
    """What vLLM's OffloadingConnector hands the spec for a one-group, one-worker model."""
    parallel = OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                        data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
                                        is_parallelism_agnostic=True)
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("layers.0.attn", "layers.1.attn"), group_id=0),),
        worker_kv_bytes_per_block=ROW, enable_kv_cache_events=False, extra_config=extra,
        engine_id=f"kvtier-tier-{uuid.uuid4().hex[:8]}", model=OffloadingModelConfig(name=model, dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1), parallel=parallel)


@dataclass
class Engine:
    """One engine's scheduler-side offloading manager, and what its calls into the tier cost."""

    manager: TieringOffloadingManager
    engine_id: str
    call_seconds: list[float] = field(default_factory=list)  # every scheduler-thread call into the tier

    @classmethod
    def start(cls, target: str, *, model: str = "test/model", rows: int = 32, **tier: object) -> Engine:
        extra = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": rows * ROW,
                 "secondary_tiers": [{**TIER, "target": target, **tier}]}
        config = offloading_config(model, extra)
        engine = cls(TieringOffloadingSpec(config).get_manager(), config.engine_id)
        engine._time_tier_calls()
        return engine

    @property
    def tier(self):
        return self.manager.secondary_tiers[0]

    def _time_tier_calls(self) -> None:
        """Wrap the tier's scheduler-facing methods to time each call (the methods run unchanged)."""
        for name in ("lookup", "submit_store", "submit_load", "get_finished_jobs", "on_schedule_end",
                     "on_new_request", "on_request_finished"):
            method = getattr(self.tier, name)

            def timed(*args, _method=method, **kwargs):
                started = time.perf_counter()
                try:
                    return _method(*args, **kwargs)
                finally:
                    self.call_seconds.append(time.perf_counter() - started)

            setattr(self.tier, name, timed)

    def step(self) -> None:
        self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))

    def settle(self, timeout: float = 20.0) -> None:
        """Step until no transfer is in flight."""
        deadline = time.monotonic() + timeout
        while self.manager.has_pending_work():
            assert time.monotonic() < deadline, "the tier's jobs did not finish"
            self.step()
            time.sleep(STEP_SECONDS)

    def store(self, req_id: str, blocks: dict[OffloadKey, bytes]) -> list[OffloadKey]:
        """A request's new blocks: GPU -> CPU tier (the worker's copy), then vLLM cascades
        them to the secondary tier. Returns the keys the CPU tier took."""
        ctx = ReqContext(req_id=req_id)
        self.manager.on_new_request(ctx)
        out = self.manager.prepare_store(list(blocks), ctx)
        assert out is not None, "the CPU tier has no room"
        rows = np.asarray(self.manager.primary_tier.get_kv_memoryview())
        for key, chunk in zip(out.keys_to_store, out.store_spec.chunk_ids):
            rows[chunk] = np.frombuffer(blocks[key], dtype=np.uint8)
        del rows  # vLLM releases its view at shutdown: nothing may still export it
        self.manager.complete_store(out.keys_to_store, ctx)
        self.manager.on_request_finished(ctx)
        return out.keys_to_store

    def lookup(self, ctx: ReqContext, keys: Sequence[OffloadKey], answers: list[str],
               timeout: float = 20.0) -> int:
        """The connector's prefix scan, repeated each step until nothing is deferred: how
        many leading keys are ready in the CPU tier. `answers` gets each scan's results."""
        deadline = time.monotonic() + timeout
        while True:
            hits, deferred, scan = 0, False, []
            for key in keys:
                result = self.manager.lookup(key, ctx)
                scan.append(result.name)
                if result is LookupResult.MISS:
                    break
                if result is not LookupResult.RETRY:
                    hits += 1
                deferred |= result is not LookupResult.HIT
            answers.append(" ".join(scan))
            if not deferred:
                return hits
            assert time.monotonic() < deadline, f"lookups still deferred: {answers[-3:]}"
            self.step()
            time.sleep(STEP_SECONDS)

    def load(self, req_id: str, keys: Sequence[OffloadKey]) -> tuple[int, list[bytes], list[str]]:
        """A new request's prompt: lookup (promoting from the secondary tier), then the CPU
        tier's rows the GPU would load. Returns hits, their bytes, and the lookup answers."""
        ctx = ReqContext(req_id=req_id)
        self.manager.on_new_request(ctx)
        answers: list[str] = []
        hits = self.lookup(ctx, keys, answers)
        loaded = []
        if hits:
            spec = self.manager.prepare_load(keys[:hits], ctx)
            rows = np.asarray(self.manager.primary_tier.get_kv_memoryview())
            loaded = [rows[chunk].tobytes() for chunk in spec.chunk_ids]
            del rows
            self.manager.complete_load(keys[:hits], ctx)
        self.manager.on_request_finished(ctx)
        self.step()
        return hits, loaded, answers

    def shutdown(self) -> None:
        self.manager.shutdown()
