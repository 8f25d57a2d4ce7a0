"""Parallel shapes without an engine, for tests/integrations/vllm_checks.py (`shapes`): the
real KVTierScheduler and KVTierWorkers of engines of different tensor-parallel sizes on one
real daemon, driven step by step as vLLM drives them, each TP rank a worker with its own
slice of the KV heads (vLLM's CPU_ATTN per-layer tensors, random bytes).

    tp2_to_tp1       a TP=2 engine stores a prompt; a TP=1 engine of the same model loads it:
                     its blocks are the two ranks' heads side by side
    tp1_to_tp2       the other way round: each rank loads exactly its heads
    missing_report   a TP=2 save that only rank 0 reports: nothing committed, pages released
    replicated       one KV head over two ranks (both hold it, rank 0 writes it), then TP=1 loads
    mla              MLA's latent (pages of order `latent`), written by rank 0 of 2, loaded by TP=1
    pages            pages of 2 vLLM blocks (page_tokens=64): TP=2 stores, TP=1 loads a prompt
                     whose first block vLLM's own cache served (that block is not copied)
"""
from __future__ import annotations

import functools
import itertools

BLOCK, LAYERS, HEAD_DIM, NUM_BLOCKS = 32, 2, 64, 16
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def shapes(target: str) -> dict:
    import torch
    from vllm import SamplingParams
    from vllm.v1.core.sched.output import NewRequestData
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvtier_client import KVTierClient, PageLayout, Tier
    from kvtier_client.integrations.vllm import ConnectorConfig, KVTierScheduler, KVTierWorker
    from kvtier_client.integrations.vllm.link import DaemonLink
    from kvtier_client.integrations.vllm.kv_groups import single_group
    from kvtier_client.integrations.vllm.kv_views import GroupViews
    from kvtier_client.integrations.vllm.shapes import ParallelShape, WorkerSlice
    from vllm_steps import scheduler_output, worker_hooks

    torch.manual_seed(0)
    ids = itertools.count()
    words = itertools.count(1)

    class Engine:
        """One engine: a scheduler and `tp` workers, each with its own KV tensors."""

        def __init__(self, layout: PageLayout, tp: int, namespace: str) -> None:
            page = layout.block_tokens  # a multiple of BLOCK: pages of several vLLM blocks
            config = ConnectorConfig.from_extra({"target": target, "namespace": namespace, "planner": False,
                                                 "page_tokens": page}, default_namespace="x")
            self.layout, self.tp = layout, tp
            group = single_group(layout, LAYER_NAMES, block_size=BLOCK)
            self.scheduler = KVTierScheduler([DaemonLink.open(config, layout, "scheduler")], [group], config, BLOCK,
                                             do_load=True, do_save=True, workers=tp, page_tokens=page)
            self.workers = []
            mla = layout.order == "latent"
            local = 1 if mla else max(1, layout.kv_heads // tp)
            for rank in range(tp):
                part = WorkerSlice.of(ParallelShape(tp), rank, 0, layout.kv_heads, local, tuple(range(LAYERS)))
                link = DaemonLink.open(config, layout, "worker")
                views = GroupViews(single_group(layout, LAYER_NAMES, local, block_size=BLOCK), part, link)
                worker = KVTierWorker([views], None, "cpu")
                shape = (NUM_BLOCKS, BLOCK, HEAD_DIM) if mla else (NUM_BLOCKS, local, BLOCK, 2 * HEAD_DIM)
                kv = {name: torch.randn(*shape) for name in LAYER_NAMES}
                worker.register_kv_caches(kv)
                self.workers.append((worker, kv))

        def block(self, name: str, block: int) -> torch.Tensor:
            """Every head of one block of one layer, as a TP=1 engine would hold it: each
            distinct head range once (replicas hold the same heads; MLA's latent is whole on
            every rank)."""
            held = {worker.part.head_start: kv[name][block] for worker, kv in reversed(self.workers)}
            return torch.cat([held[start] for start in sorted(held)], dim=0)

        def run(self, prompt: list[int], blocks: list[int], reporting: set[int] | None = None,
                local: int = 0) -> dict:
            """Admit a request for `prompt` into vLLM blocks `blocks`, `local` tokens of it from
            vLLM's own cache, and run its prefill step; only the ranks in `reporting` (default
            all) get their reports to the scheduler."""
            request = Request(f"r{next(ids)}", prompt, SamplingParams(max_tokens=1), None)
            scheduler = self.scheduler
            scheduler.on_new_request(request)
            external, _ = scheduler.get_num_new_matched_tokens(request, local)
            request.num_computed_tokens = local + (external or 0)
            scheduler.update_state_after_alloc(request, None, external or 0)
            left = len(prompt) - request.num_computed_tokens
            meta = scheduler.build_connector_meta(
                scheduler_output({request.request_id: left}, [NewRequestData.from_request(request, (blocks,))]))
            reports = []
            for rank, (worker, _) in enumerate(self.workers):
                worker_hooks(worker, meta, LAYER_NAMES)
                report = worker.build_connector_worker_meta()
                if report is not None and (reporting is None or rank in reporting):
                    reports.append(report)
            merged = functools.reduce(lambda a, b: a.aggregate(b), reports) if reports else None
            scheduler.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=merged))
            return scheduler.request_finished(request, [])[1]["kvtier"]

    def prompt(blocks: int) -> list[int]:
        return [next(words) % 500 for _ in range(blocks * BLOCK + 5)]

    def same(src: Engine, src_blocks: list[int], dst: Engine, dst_blocks: list[int]) -> bool:
        return all(torch.equal(src.block(n, a), dst.block(n, b)) for n in LAYER_NAMES
                   for a, b in zip(src_blocks, dst_blocks))

    def host_pages(layout: PageLayout) -> dict:
        with KVTierClient(target) as probe:
            probe.register("checks/probe", layout)
            host = probe.stats().pool(probe.pool.pool_id).tier(Tier.HOST)
            return {"cached": host.cached_pages, "writing": host.writing_pages}

    out: dict = {}
    gqa = PageLayout(LAYERS, 2, HEAD_DIM, block_tokens=BLOCK, dtype="float32")
    tp1, tp2 = Engine(gqa, 1, "checks/shapes"), Engine(gqa, 2, "checks/shapes")
    a = prompt(3)
    stored = tp2.run(a, [0, 1, 2, 3])
    loaded = tp1.run(a, [4, 5, 6, 7])
    out["tp2_to_tp1"] = {"stored": stored["stored_blocks"], "loaded_tokens": loaded["loaded_tokens"],
                         "equal": same(tp2, [0, 1, 2], tp1, [4, 5, 6])}
    b = prompt(2)
    stored = tp1.run(b, [8, 9, 10])
    loaded = tp2.run(b, [8, 9, 10])
    out["tp1_to_tp2"] = {"stored": stored["stored_blocks"], "loaded_tokens": loaded["loaded_tokens"],
                         "equal": same(tp1, [8, 9], tp2, [8, 9])}
    before = host_pages(gqa)
    c = prompt(2)
    stored = tp2.run(c, [11, 12, 13], reporting={0})
    after = host_pages(gqa)
    again = tp1.run(c, [11, 12, 13])  # nothing was committed: a miss, and TP=1 stores the blocks itself
    out["missing_report"] = {"stored": stored["stored_blocks"], "before": before, "after": after,
                             "then_loaded_tokens": again["loaded_tokens"], "then_stored": again["stored_blocks"]}
    one_head = PageLayout(LAYERS, 1, HEAD_DIM, block_tokens=BLOCK, dtype="float32")
    rep2, rep1 = Engine(one_head, 2, "checks/replicated"), Engine(one_head, 1, "checks/replicated")
    d = prompt(2)
    stored = rep2.run(d, [0, 1, 2])
    loaded = rep1.run(d, [3, 4, 5])
    out["replicated"] = {"stored": stored["stored_blocks"], "loaded_tokens": loaded["loaded_tokens"],
                         "writers": [w.part.writes for w, _ in rep2.workers], "equal": same(rep2, [0, 1], rep1, [3, 4])}
    latent = PageLayout(LAYERS, 1, HEAD_DIM, block_tokens=BLOCK, dtype="float32", order="latent")
    mla2, mla1 = Engine(latent, 2, "checks/mla"), Engine(latent, 1, "checks/mla")
    e = prompt(2)
    stored = mla2.run(e, [0, 1, 2])
    loaded = mla1.run(e, [3, 4, 5])
    out["mla"] = {"stored": stored["stored_blocks"], "loaded_tokens": loaded["loaded_tokens"],
                  "equal": same(mla2, [0, 1], mla1, [3, 4])}
    two_blocks = PageLayout(LAYERS, 2, HEAD_DIM, block_tokens=2 * BLOCK, dtype="float32")
    big2, big1 = Engine(two_blocks, 2, "checks/pages"), Engine(two_blocks, 1, "checks/pages")
    f = prompt(4)  # 4 blocks + 5 tokens: 2 pages
    stored = big2.run(f, [0, 1, 2, 3, 4])
    untouched = {n: big1.workers[0][1][n][6].clone() for n in LAYER_NAMES}
    loaded = big1.run(f, [6, 7, 8, 9, 10], local=BLOCK)  # vLLM's cache served block 0 (in block 6)
    out["pages"] = {"stored": stored["stored_blocks"], "loaded_tokens": loaded["loaded_tokens"],
                    "equal": same(big2, [1, 2, 3], big1, [7, 8, 9]),
                    "served_block_untouched": all(torch.equal(big1.workers[0][1][n][6], untouched[n])
                                                  for n in LAYER_NAMES)}
    return out
