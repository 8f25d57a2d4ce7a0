"""What the daemon counts for a vLLM engine's lookups, for tests/integrations/vllm_checks.py
(`served`; docs/metrics.md, "Found and served"): the real KVTierScheduler and KVTierWorker
on a real daemon, driven with vLLM's own Request and SchedulerOutput objects.

r1 stores a prompt of 6 blocks. r2 is the same prompt, admitted with 4 blocks from vLLM's own
prefix cache (its computed tokens): the connector tells the daemon so (Lookup's `known`),
and loads blocks 4-5. The pool's counters before and after r2 are reported: the 4 blocks
vLLM held count as the engine's, only blocks 4-5 as found, and the 2 the worker acquired as
served. (Before `known`, r2's lookup counted all 6 blocks as host hits.) The layout is this
check's own, so the pool's counters are its alone.
"""
from __future__ import annotations

BLOCK, LAYERS, HEADS, HEAD_DIM = 32, 2, 2, 32
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
PROMPT_BLOCKS, LOCAL_BLOCKS = 6, 4


def served(target: str) -> dict:
    import torch
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.output import NewRequestData
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvtier_client import KVTierClient, PageLayout, Tier
    from kvtier_client.integrations.vllm import ConnectorConfig, KVTierScheduler, KVTierWorker
    from kvtier_client.integrations.vllm.kv_groups import single_group
    from kvtier_client.integrations.vllm.kv_views import GroupViews
    from kvtier_client.integrations.vllm.link import DaemonLink
    from kvtier_client.integrations.vllm.shapes import WorkerSlice
    from vllm_steps import scheduler_output, worker_hooks

    layout = PageLayout(LAYERS, HEADS, HEAD_DIM, block_tokens=BLOCK, dtype="float32")
    config = ConnectorConfig.from_extra({"target": target, "namespace": "checks/served", "planner": False,
                                         "prefetch": False}, default_namespace="x")
    group = single_group(layout, LAYER_NAMES)
    scheduler = KVTierScheduler([DaemonLink.open(config, layout, "scheduler")], [group], config, BLOCK, do_load=True,
                                do_save=True)
    part = WorkerSlice(rank=0, head_start=0, heads=HEADS, writes=True, page_layers=(0, 1))
    worker = KVTierWorker([GroupViews(group, part, DaemonLink.open(config, layout, "worker"))], None, "cpu")
    torch.manual_seed(0)
    worker.register_kv_caches({name: torch.randn(32, HEADS, BLOCK, 2 * HEAD_DIM) for name in LAYER_NAMES})
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)
    prompt = [i % 500 for i in range(PROMPT_BLOCKS * BLOCK + 10)]

    def admit(rid: str, local_blocks: int, block_ids: list[int]) -> dict:
        """vLLM admits a request with `local_blocks` from its prefix cache, then runs one step."""
        request = Request(rid, prompt, SamplingParams(max_tokens=4), None, block_hasher=hasher)
        scheduler.on_new_request(request)
        local = local_blocks * BLOCK
        external, _ = scheduler.get_num_new_matched_tokens(request, local)
        request.num_computed_tokens = local + (external or 0)
        scheduler.update_state_after_alloc(request, None, external or 0)
        new = [NewRequestData.from_request(request, (block_ids,))]
        meta = scheduler.build_connector_meta(scheduler_output({rid: len(prompt) - request.num_computed_tokens}, new))
        worker_hooks(worker, meta, LAYER_NAMES)
        scheduler.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=worker.build_connector_worker_meta()))
        scheduler.request_finished(request, [])
        return {"external_tokens": external or 0, "loads": [op.block_ids for op in meta.loads],
                "saved_blocks": sum(len(s.slots) for s in meta.saves)}

    def counters() -> dict:
        with KVTierClient(target, map_arena=False) as probe:
            probe.register("checks/served-probe", layout)
            pool = probe.stats().pool(probe.pool.pool_id)
        host = pool.tier(Tier.HOST)
        return {"engine_blocks": pool.engine_blocks, "lookup_blocks": pool.lookup_blocks,
                "miss_blocks": pool.miss_blocks, "host_hits": host.hits, "host_served": host.served_blocks,
                "served_rate": pool.served_rate}

    first = admit("r1", 0, list(range(PROMPT_BLOCKS + 1)))
    before = counters()
    second = admit("r2", LOCAL_BLOCKS, [0, 1, 2, 3, 10, 11, 12])
    return {"r1": first, "r2": second, "before": before, "after": counters()}
