"""Fast checks of the vLLM connector's halves without an engine, for tests/integrations/test_vllm_connector.py
(run with .venv-vllm's python; prints one JSON object):

    vllm_checks.py --target unix:///path/kvtier.sock dedupe shapes groups keys async copies

dedupe   The real KVTierScheduler and KVTierWorker on a real daemon, driven with vLLM's own
         Request, SchedulerOutput and KVConnectorOutput objects the way vLLM's scheduler and
         model runner drive them, through steps where a naive connector stores blocks twice:
         (1) two prompts sharing 4 blocks scheduled in one step, the second served those
         blocks by vLLM's prefix cache (its computed tokens); (2) two identical prompts in
         one step with separate blocks (no prefix caching), the second finding the first
         storing them; (3) a prompt whose blocks another engine commits between the lookup and
         the save. Reports what each request says it stored, what the daemon holds, the
         connector's stats and KV events, whether loaded pages equal the stored blocks, and
         what reset_cache does to a save in flight.
shapes   Engines of different tensor-parallel sizes sharing pages (vllm_shape_checks.py).
groups   A hybrid model's KV cache groups: per-group loads, partial groups (vllm_group_checks.py).
async    A load from disk in the step's foreground or in the background (vllm_async_checks.py).
served   What the daemon counts for a request vLLM's prefix cache partly serves (vllm_served_checks.py).
keys     Multimodal prompts' block keys against vLLM's own block hashes (vllm_key_checks.py).
copies   The worker's batched copies (`load_pages`, `save_layer`: one gather and one scatter
         per layer) against the per-page copies they replaced (one `copy_` per page and layer)
         and against one plain torch copy of the same bytes, on vLLM-shaped views of a KV cache.
         Reports rates and ratios measured in this run (no absolute expectations) and whether
         both ways give the same blocks. `--pages/--layers/--heads/--head-dim/--block/--dtype`
         set the shape; the defaults are a 4,096-token prompt (128 vLLM CPU blocks of 32) of the
         benchmarks' model (8 layers, 8 KV heads of 64, float32): 128 MiB.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")

BLOCK = 32
LAYERS, HEADS, HEAD_DIM = 2, 2, 64
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def dedupe(target: str) -> dict:
    import torch
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, maybe_convert_block_hash
    from vllm.v1.core.sched.output import NewRequestData
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvtier_client import KVTierClient, PageLayout, Tier
    from kvtier_client.integrations.vllm import ConnectorConfig, KVTierConnectorStats, KVTierScheduler, KVTierWorker
    from kvtier_client.integrations.vllm.link import DaemonLink
    from kvtier_client.integrations.vllm.kv_groups import single_group
    from kvtier_client.integrations.vllm.kv_views import GroupViews
    from kvtier_client.integrations.vllm.shapes import WorkerSlice
    from vllm_steps import scheduler_output, worker_hooks

    layout = PageLayout(LAYERS, HEADS, HEAD_DIM, block_tokens=BLOCK, dtype="float32")
    # No planner: with no model behind it, a "forward pass" takes microseconds and would make it recompute.
    config = ConnectorConfig.from_extra({"target": target, "namespace": "checks/dedupe", "planner": False},
                                        default_namespace="x")
    group = single_group(layout, LAYER_NAMES)
    scheduler = KVTierScheduler([DaemonLink.open(config, layout, "scheduler")], [group], config, BLOCK, do_load=True,
                                do_save=True, events=True)
    part = WorkerSlice(rank=0, head_start=0, heads=HEADS, writes=True, page_layers=(0, 1))
    worker = KVTierWorker([GroupViews(group, part, DaemonLink.open(config, layout, "worker"))], None, "cpu")
    torch.manual_seed(0)
    kv = {name: torch.randn(64, HEADS, BLOCK, 2 * HEAD_DIM) for name in LAYER_NAMES}  # CPU_ATTN's per-layer KV
    worker.register_kv_caches(kv)
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)
    words = iter(range(10**6))
    worker_stats = KVTierConnectorStats()  # what vLLM's model runner collects from the worker, step by step

    def tokens(n: int) -> list[int]:
        return [next(words) % 500 for _ in range(n)]

    def new_request(rid: str, prompt: list[int]) -> Request:
        request = Request(rid, prompt, SamplingParams(max_tokens=4), None, block_hasher=hasher)
        scheduler.on_new_request(request)
        return request

    def schedule(request: Request, local_tokens: int) -> None:
        """What vLLM's scheduler does when it admits a request with `local_tokens` from its prefix cache."""
        external, _ = scheduler.get_num_new_matched_tokens(request, local_tokens)
        request.num_computed_tokens = local_tokens + (external or 0)
        scheduler.update_state_after_alloc(request, None, external or 0)

    def step(admitted: list[tuple[Request, list[int]]]) -> dict:
        """One engine step: every admitted request computes the rest of its prompt."""
        new = [NewRequestData.from_request(r, (blocks,)) for r, blocks in admitted]
        tokens_now = {r.request_id: len(r.prompt_token_ids) - r.num_computed_tokens for r, _ in admitted}
        meta = scheduler.build_connector_meta(scheduler_output(tokens_now, new))
        worker_hooks(worker, meta, LAYER_NAMES)
        worker_stats.aggregate(worker.get_kv_connector_stats() or KVTierConnectorStats())
        report = worker.build_connector_worker_meta()
        scheduler.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=report))
        return {"saves": [[s.req_id, s.first, len(s.slots)] for s in meta.saves],
                "loads": [[op.req_id, op.block_ids] for op in meta.loads],
                "copy_bytes": report.copy_bytes if report else 0}

    def finish(request: Request) -> dict:
        return scheduler.request_finished(request, [])[1]["kvtier"]

    shared = tokens(4 * BLOCK)
    r1 = new_request("r1", shared + tokens(BLOCK + 10))  # 5 full blocks
    r2 = new_request("r2", shared + tokens(BLOCK + 5))  # 4 shared, 1 own
    r3 = new_request("r3", tokens(3 * BLOCK + 1))
    r4 = new_request("r4", list(r3.prompt_token_ids))  # identical to r3
    schedule(r1, 0)
    schedule(r2, 4 * BLOCK)  # vLLM's prefix cache: r1's blocks, allocated in this step
    schedule(r3, 0)
    schedule(r4, 0)  # prefix caching off: its own blocks
    first_step = step([(r1, [0, 1, 2, 3, 4, 5]), (r2, [0, 1, 2, 3, 6, 7]), (r3, [8, 9, 10, 11]),
                       (r4, [12, 13, 14, 15])])
    events = list(scheduler.take_events())

    # Another engine commits r5's blocks between its lookup and its save.
    r5 = new_request("r5", tokens(2 * BLOCK + 3))
    schedule(r5, 0)
    with KVTierClient(target) as other:
        other.register("checks/dedupe", layout)
        with other.borrow(2) as lease:
            lease.commit(scheduler._requests["r5"].keys)
    second_step = step([(r5, [16, 17, 18])])

    # A fresh request for r1's prompt loads r1's blocks from kvtier into other vLLM blocks.
    r6 = new_request("r6", list(r1.prompt_token_ids))
    schedule(r6, 0)
    loaded_blocks = [20, 21, 22, 23, 24, 25]
    third_step = step([(r6, loaded_blocks)])
    same = all(torch.equal(kv[n][src], kv[n][dst]) for n in LAYER_NAMES for src, dst in zip(range(5), loaded_blocks))

    # vLLM 0.33's sleep: the worker drops its views (twice: discard, then sleep) and takes them
    # back on wake-up (twice too); then a load works as before.
    worker.unregister_kv_caches()
    worker.unregister_kv_caches()
    slept = not worker._registered
    worker.restore_kv_caches()
    worker.restore_kv_caches()
    r6b = new_request("r6b", list(r1.prompt_token_ids))
    schedule(r6b, 0)
    woken_blocks = [40, 41, 42, 43, 44, 45]
    woken_step = step([(r6b, woken_blocks)])
    woken = slept and woken_step["loads"] == [["r6b", woken_blocks[:5]]] and all(
        torch.equal(kv[n][src], kv[n][dst]) for n in LAYER_NAMES for src, dst in zip(range(5), woken_blocks))

    # vLLM's reset_prefix_cache(reset_connector=True): which keys are being stored is forgotten, kvtier's
    # pages stay ("not reset"), and a save in flight still ends as its workers report it.
    r7 = new_request("r7", tokens(2 * BLOCK))
    schedule(r7, 0)
    r7_keys = list(scheduler._requests["r7"].keys)
    meta = scheduler.build_connector_meta(
        scheduler_output({"r7": 2 * BLOCK}, [NewRequestData.from_request(r7, ([30, 31],))]))
    storing_before = all(k in scheduler.saves.storing for k in r7_keys)
    reset = scheduler.reset_cache()
    r8 = new_request("r8", list(r1.prompt_token_ids))  # r1's prompt, after the reset: a new key epoch
    schedule(r8, 0)
    # r7 outlived the reset (vLLM preempts running requests when it resets): asked again, it
    # gets keys of the new epoch, and nothing of it counts as stored.
    schedule(r7, 0)
    renewed = scheduler._requests["r7"].keys != r7_keys and scheduler._requests["r7"].save_upto == 0
    reset_state = {"answer": reset, "storing_before": storing_before, "storing_after": len(scheduler.saves.storing),
                   "sent_after": len(scheduler.saves.sent), "saves_sent": len(meta.saves),
                   "hit_after": finish(r8)["loaded_tokens"], "renewed": renewed}

    requests = (r1, r2, r3, r4, r5, r6, r6b, r7)
    reports = {r.request_id: finish(r) for r in requests}
    stats = worker_stats.aggregate(scheduler.get_kv_connector_stats() or KVTierConnectorStats())
    with KVTierClient(target) as probe:
        probe.register("checks/probe", layout)
        held = probe.stats().pool(probe.pool.pool_id).tier(Tier.HOST).cached_pages
    public = [[maybe_convert_block_hash(h) for h in r.block_hashes] for r in requests]  # as events carry them
    where: dict = {}
    for request, hashes in zip(requests, public):
        for i, h in enumerate(hashes):
            where.setdefault(h, (request, i))  # the first request with that block

    def described(event) -> dict:
        """Which request's blocks an event names, and whether its tokens and parent are theirs."""
        request, first = where[event.block_hashes[0]]
        hashes = public[requests.index(request)]
        n = len(event.block_hashes)
        return {
            "req": request.request_id, "first": first, "blocks": n, "block_size": event.block_size,
            "medium": event.medium, "locality": event.locality, "ownership": event.ownership,
            "hashes_match": list(event.block_hashes) == hashes[first : first + n],
            "tokens_match": event.token_ids == request.prompt_token_ids[first * BLOCK : (first + n) * BLOCK],
            "parent_match": event.parent_block_hash == (hashes[first - 1] if first else None),
        }

    return {
        "steps": [first_step, second_step, third_step],
        "stored_blocks": {rid: rep["stored_blocks"] for rid, rep in reports.items()},
        "loaded_tokens": {rid: rep["loaded_tokens"] for rid, rep in reports.items()},
        "daemon_cached_pages": held,
        "stats": stats.data,
        "events": [described(e) for e in events],
        "loaded_pages_equal_stored_blocks": same,
        "sleep_and_wake": woken,
        "reset": reset_state,
    }


def copies(pages: int, layers: int, heads: int, head_dim: int, block: int, dtype: str, repeat: int) -> dict:
    import torch

    from kvtier_client.integrations.vllm.copies import CopyThreads, load_pages, save_layer

    dt = getattr(torch, dtype)
    num_blocks = 4 * pages
    torch.manual_seed(0)
    # vLLM 0.32's CPU_ATTN per-layer KV and the connector's view of it (worker.KVTierWorker._page_view).
    kv = [torch.randn(num_blocks, heads, block, 2 * head_dim).to(dt) for _ in range(layers)]
    views = [k.view(num_blocks, heads, 2, block, head_dim).permute(0, 2, 3, 1, 4) for k in kv]
    # Pages scattered over an arena, as a lease's are; blocks scattered over vLLM's cache.
    arena = torch.randn(2 * pages, layers, 2, block, heads, head_dim).to(dt)
    page_list = [arena[s] for s in torch.randperm(2 * pages)[:pages].tolist()]
    block_ids = torch.randperm(num_blocks)[:pages].tolist()
    nbytes = pages * page_list[0].numel() * page_list[0].element_size()
    threads = CopyThreads()

    def per_page_load() -> None:  # the connector's copies before they were batched
        for page, b in zip(page_list, block_ids):
            for layer, view in enumerate(views):
                view[b].copy_(page[layer])

    def per_page_save() -> None:
        for layer, view in enumerate(views):
            for page, b in zip(page_list, block_ids):
                page[layer].copy_(view[b])

    page_layers = [p.unbind(0) for p in page_list]  # each page as its layers, as the worker cuts them

    def batched_save() -> None:  # as the worker does it: layer by layer
        for layer, view in enumerate(views):
            save_layer(view, page_layers, block_ids, layer, threads)

    src = torch.randn(nbytes // dt.itemsize).to(dt)
    dst = torch.empty_like(src)

    variants = {
        "memcpy": lambda: dst.copy_(src),
        "before_load": per_page_load, "after_load": lambda: load_pages(views, page_layers, block_ids, threads),
        "before_save": per_page_save, "after_save": batched_save,
    }
    best = dict.fromkeys(variants, float("inf"))
    for run in range(repeat + 1):  # interleaved, so a busy moment hits every variant alike; run 0 warms up
        for name, fn in variants.items():
            started = time.perf_counter()
            fn()
            if run:
                best[name] = min(best[name], time.perf_counter() - started)
    memcpy = best.pop("memcpy")
    results = best
    # Same blocks either way: load with both and compare, save with both and compare.
    load_pages(views, page_layers, block_ids, threads)
    batched = [k.clone() for k in kv]
    per_page_load()
    same_load = all(torch.equal(a, b) for a, b in zip(batched, kv))
    batched_save()
    saved = arena.clone()
    per_page_save()
    same_save = torch.equal(saved, arena)
    threads.close()
    gb = nbytes / 1e9
    return {
        "shape": {"pages": pages, "layers": layers, "kv_heads": heads, "head_dim": head_dim, "block": block,
                  "dtype": dtype, "bytes": nbytes, "copy_threads": threads.threads},
        "memcpy_GBps": round(gb / memcpy, 3),
        **{f"{k}_GBps": round(gb / v, 3) for k, v in results.items()},
        **{f"{k}_vs_memcpy": round(memcpy / v, 3) for k, v in results.items()},
        "load_speedup": round(results["before_load"] / results["after_load"], 2),
        "save_speedup": round(results["before_save"] / results["after_save"], 2),
        "same_blocks": same_load and same_save,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checks", nargs="+", choices=["dedupe", "copies", "shapes", "keys", "groups", "async", "served"])
    parser.add_argument("--target", help="kvtier daemon (dedupe)")
    parser.add_argument("--pages", type=int, default=128)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    out = {}
    if "dedupe" in args.checks:
        out["dedupe"] = dedupe(args.target)
    if "shapes" in args.checks:
        from vllm_shape_checks import shapes

        out["shapes"] = shapes(args.target)
    if "groups" in args.checks:
        from vllm_group_checks import groups

        out["groups"] = groups(args.target)
    if "async" in args.checks:
        from vllm_async_checks import background_loads

        out["async"] = background_loads(args.target)
    if "served" in args.checks:
        from vllm_served_checks import served

        out["served"] = served(args.target)
    if "keys" in args.checks:
        from vllm_key_checks import keys, weights

        out["keys"] = {**keys(), "weights": weights()}
    if "copies" in args.checks:
        out["copies"] = copies(args.pages, args.layers, args.heads, args.head_dim, args.block, args.dtype, args.repeat)
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
