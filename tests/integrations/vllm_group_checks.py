"""A hybrid model's KV cache groups without an engine, for tests/integrations/vllm_checks.py
(`groups`): the real KVTierScheduler and KVTierWorker on a real daemon with two groups of
different layouts, as vLLM's hybrid allocator gives them (per group its own block ids; a
sliding-window group's blocks outside the window are vLLM's null block 0):

    group 0  full attention, 2 layers        needs every block of a restored prefix
    group 1  sliding window of 2 blocks, 1   needs only the 2 blocks before the prefix's end

    both        a prompt of 5 blocks stored in both groups; a new request for it loads all 5
                blocks of group 0 and only blocks 3 and 4 of group 1 (vLLM dropped 0-2)
    window_gone a prompt whose window-group pages were never committed (its worker failed
                them): no hit at all, though group 0 holds every block
    window_part a prompt whose window group holds blocks 0-2 only: the hit ends at 3 blocks
"""
from __future__ import annotations

import dataclasses
import itertools
import time

BLOCK, HEADS, HEAD_DIM, NUM_BLOCKS = 32, 2, 64, 40
FULL_LAYERS = ["model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn"]
WINDOW_LAYERS = ["model.layers.1.self_attn.attn"]


def groups(target: str) -> dict:
    import torch
    from vllm import SamplingParams
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.core.sched.output import NewRequestData
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvtier_client import PageLayout
    from kvtier_client.groups import GroupMode
    from kvtier_client.integrations.vllm import ConnectorConfig, KVTierConnectorMetadata, KVTierScheduler, KVTierWorker
    from kvtier_client.integrations.vllm.kv_groups import KVGroup
    from kvtier_client.integrations.vllm.kv_views import GroupViews
    from kvtier_client.integrations.vllm.link import DaemonLink
    from kvtier_client.integrations.vllm.shapes import WorkerSlice
    from vllm_steps import scheduler_output, worker_hooks

    torch.manual_seed(0)
    config = ConnectorConfig.from_extra({"target": target, "namespace": "checks/hybrid", "planner": False},
                                        default_namespace="x")
    full = PageLayout(len(FULL_LAYERS), HEADS, HEAD_DIM, block_tokens=BLOCK, dtype="float32")
    window = PageLayout(len(WINDOW_LAYERS), HEADS, HEAD_DIM, block_tokens=BLOCK, dtype="float32")
    kv_groups = [
        KVGroup(0, GroupMode.FULL, 0, full, tuple(FULL_LAYERS), (0, 1), HEADS, b"|kv group 0 FULL 0"),
        KVGroup(1, GroupMode.WINDOW, 2, window, tuple(WINDOW_LAYERS), (0,), HEADS, b"|kv group 1 WINDOW 2"),
    ]
    scheduler = KVTierScheduler([DaemonLink.open(config, g.layout, "scheduler") for g in kv_groups], kv_groups,
                                config, BLOCK, do_load=True, do_save=True)
    views = [GroupViews(g, WorkerSlice(0, 0, HEADS, True, g.page_layers), DaemonLink.open(config, g.layout, "worker"))
             for g in kv_groups]
    worker = KVTierWorker(views, None, "cpu")
    kv = {name: torch.randn(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM) for name in FULL_LAYERS + WINDOW_LAYERS}
    worker.register_kv_caches(kv)
    ids, words = itertools.count(), itertools.count(1)

    def step(scheduled: dict, new: list, fail_group: int | None = None) -> KVTierConnectorMetadata:
        """One engine step: metadata, the worker's hooks, its report back to the scheduler
        (the writes of `fail_group` reported failed)."""
        meta = scheduler.build_connector_meta(scheduler_output(scheduled, new))
        worker_hooks(worker, meta, FULL_LAYERS + WINDOW_LAYERS)
        report = worker.build_connector_worker_meta()
        if report is not None and fail_group is not None:
            report.saves = [dataclasses.replace(s, ok=False) if s.group == fail_group else s for s in report.saves]
        scheduler.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=report))
        return meta

    def run(prompt: list[int], block_ids: tuple[list[int], list[int]], fail_group: int | None = None) -> dict:
        """Admit a request into per-group blocks and run its prefill step; a hit is loaded
        in the background (a hybrid model's loads are asynchronous) while the request waits,
        as vLLM's WAITING_FOR_REMOTE_KVS, then the request computes the rest."""
        request = Request(f"r{next(ids)}", prompt, SamplingParams(max_tokens=1), None)
        scheduler.on_new_request(request)
        external, background = scheduler.get_num_new_matched_tokens(request, 0)
        blocks = KVCacheBlocks(tuple([KVCacheBlock(i) for i in group_ids] for group_ids in block_ids))
        scheduler.update_state_after_alloc(request, blocks, external or 0)
        request.num_computed_tokens = external or 0
        loads, finished = [], set()
        if background:
            loads = step({}, []).loads  # the request waits; the step's other work would go on
            deadline = time.monotonic() + 30
            while request.request_id not in finished and time.monotonic() < deadline:
                done, failed = worker.transfer_results()
                finished |= done
                time.sleep(0.01)
        left = len(prompt) - request.num_computed_tokens
        meta = step({request.request_id: left}, [NewRequestData.from_request(request, block_ids)], fail_group)
        done = scheduler.request_finished(request, [])[1]["kvtier"]
        return {"loaded_tokens": done["loaded_tokens"], "stored_blocks": done["stored_blocks"],
                "background": background, "finished": request.request_id in finished,
                "loads": {op.group: op.block_ids for op in loads + meta.loads},
                "saves": {op.group: op.block_ids for op in meta.saves}}

    def prompt(blocks: int) -> list[int]:
        return [next(words) % 500 for _ in range(blocks * BLOCK + 5)]

    def same(layers: list[str], pairs: list[tuple[int, int]]) -> bool:
        return all(torch.equal(kv[n][a], kv[n][b]) for n in layers for a, b in pairs)

    out = {}
    a = prompt(5)
    stored = run(a, ([1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]))
    loaded = run(a, ([13, 14, 15, 16, 17, 18], [0, 0, 0, 22, 23, 24]))
    out["both"] = {"stored": stored, "loaded": loaded,
                   "equal": same(FULL_LAYERS, list(zip(range(1, 6), range(13, 18))))
                   and same(WINDOW_LAYERS, [(10, 22), (11, 23)])}
    b = prompt(5)
    stored = run(b, ([25, 26, 27, 28, 29, 30], [31, 32, 33, 34, 35, 36]), fail_group=1)
    again = run(b, ([25, 26, 27, 28, 29, 30], [31, 32, 33, 34, 35, 36]))
    out["window_gone"] = {"stored": stored, "again": again}
    c = prompt(5)
    head = c[: 3 * BLOCK + 5]
    run(head, ([1, 2, 3, 4], [7, 8, 9, 10]))  # both groups hold c's first 3 blocks
    stored = run(c, ([1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]), fail_group=1)  # blocks 3-4: group 0 only
    again = run(c, ([13, 14, 15, 16, 17, 18], [0, 20, 21, 22, 23, 24]))
    out["window_part"] = {"stored": stored, "again": again}
    # A background load that failed (vLLM's failed_recving, then a recompute): asked again, the
    # request is not offered the same hit (which would fail the same way, step after step).
    request = Request(f"r{next(ids)}", a, SamplingParams(max_tokens=1), None)
    first_offer = scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.update_state_after_alloc(request, KVCacheBlocks(([], [])), 0)
    scheduler.update_connector_output(KVConnectorOutput(failed_recving={request.request_id}))
    out["after_failed_load"] = {"first": list(first_offer), "again": list(scheduler.get_num_new_matched_tokens(request, 0))}
    scheduler.request_finished(request, [])
    return out
