"""Background loads without an engine, for tests/integrations/vllm_checks.py (`async`): does a
request whose pages are on disk hold up the step the other requests are in?

A prompt of 48 blocks is stored, then pushed out of the host tier to disk (other pages fill
the host tier). A fresh request for it is admitted twice: with async_loads="never" its load
runs in the step's start_load_kv, before the forward pass every request of the step waits
for; with "always" start_load_kv hands it to the loader thread and returns, and the request
waits alone until get_transfer_results says it has ended. Reported: the step's connector time
(start_load_kv to wait_for_save) both ways, and how long the background load took, all
measured in this run; and whether the loaded blocks equal the stored ones.
"""
from __future__ import annotations

import itertools
import time

BLOCK, LAYERS, HEADS, HEAD_DIM, NUM_BLOCKS = 32, 2, 2, 64, 128
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
PROMPT_BLOCKS = 48


def background_loads(target: str) -> dict:
    import torch
    from vllm import SamplingParams
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
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

    torch.manual_seed(0)
    layout = PageLayout(LAYERS, HEADS, HEAD_DIM, block_tokens=BLOCK, dtype="float32")
    group = single_group(layout, LAYER_NAMES)
    ids = itertools.count()
    kv = {name: torch.randn(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM) for name in LAYER_NAMES}

    def engine(async_loads: str) -> tuple[KVTierScheduler, KVTierWorker]:
        config = ConnectorConfig.from_extra({"target": target, "namespace": "checks/async", "planner": False,
                                             "prefetch": False, "async_loads": async_loads}, default_namespace="x")
        scheduler = KVTierScheduler([DaemonLink.open(config, layout, "scheduler")], [group], config, BLOCK,
                                    do_load=True, do_save=True)
        part = WorkerSlice(0, 0, HEADS, True, group.page_layers)
        worker = KVTierWorker([GroupViews(group, part, DaemonLink.open(config, layout, "worker"))], None, "cpu")
        worker.register_kv_caches(kv)
        return scheduler, worker

    def step(scheduler, worker, scheduled: dict, new: list) -> float:
        """One step's connector hooks around an (empty) forward pass; their seconds."""
        meta = scheduler.build_connector_meta(scheduler_output(scheduled, new))
        started = time.perf_counter()
        worker_hooks(worker, meta, LAYER_NAMES)
        seconds = time.perf_counter() - started
        scheduler.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=worker.build_connector_worker_meta()))
        return seconds

    def admit(scheduler, worker, prompt: list[int], blocks: list[int]) -> dict:
        request = Request(f"r{next(ids)}", prompt, SamplingParams(max_tokens=1), None)
        scheduler.on_new_request(request)
        external, background = scheduler.get_num_new_matched_tokens(request, 0)
        scheduler.update_state_after_alloc(request, KVCacheBlocks(([KVCacheBlock(b) for b in blocks],)), external or 0)
        request.num_computed_tokens = external or 0
        out = {"external": external, "background": background}
        if background:
            started = time.perf_counter()
            out["step_s"] = step(scheduler, worker, {}, [])  # the step the others are in; this request waits
            while request.request_id not in worker.transfer_results()[0]:
                time.sleep(0.001)
            out["load_s"] = time.perf_counter() - started
        left = len(prompt) - request.num_computed_tokens
        foreground = step(scheduler, worker, {request.request_id: left}, [NewRequestData.from_request(request, (blocks,))])
        out.setdefault("step_s", foreground)
        out["keys"] = list(scheduler._requests[request.request_id].keys)
        scheduler.request_finished(request, [])
        return out

    def to_disk(keys) -> list[Tier]:
        """Fill the host tier with other pages until `keys` have left it; their tiers."""
        with KVTierClient(target) as filler:
            filler.register("checks/async", layout)
            for round_ in range(8):
                tiers = filler.lookup(keys).tiers
                if tiers and min(tiers) >= Tier.DISK:
                    return list(tiers)
                with filler.borrow(64) as lease:
                    lease.commit(filler.block_keys(list(range(64 * BLOCK)), salt=f"filler {round_}".encode()))
            return list(filler.lookup(keys).tiers)

    prompt = [(i * 7) % 500 for i in range(PROMPT_BLOCKS * BLOCK + 5)]
    stored_in, loaded_in = list(range(PROMPT_BLOCKS + 1)), list(range(64, 64 + PROMPT_BLOCKS + 1))

    def same() -> bool:
        return all(torch.equal(kv[n][a], kv[n][b]) for n in LAYER_NAMES
                   for a, b in zip(stored_in[:PROMPT_BLOCKS], loaded_in[:PROMPT_BLOCKS]))

    foreground_engine = engine("never")
    keys = admit(*foreground_engine, prompt, stored_in)["keys"]
    tiers_before_foreground = to_disk(keys)
    foreground = admit(*foreground_engine, prompt, loaded_in)
    foreground_equal = same()
    for name in LAYER_NAMES:
        kv[name][loaded_in] = 0.0  # so the background load must write them again
    tiers_before_background = to_disk(keys)
    background = admit(*engine("always"), prompt, loaded_in)
    return {
        "tiers_before": [int(min(tiers_before_foreground)), int(min(tiers_before_background))],
        "foreground": {k: v for k, v in foreground.items() if k != "keys"},
        "background": {k: v for k, v in background.items() if k != "keys"},
        "equal": foreground_equal and same(),
    }
