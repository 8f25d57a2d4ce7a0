"""Requests' kvtier hints (vLLM's `Request.kv_hints`, and kv_transfer_params["kvtier_hints"])
through the real KVTierScheduler and KVTierWorker on a real daemon, for
tests/integrations/test_vllm_hints.py (run with .venv-vllm's python; prints one JSON object):

    vllm_hint_checks.py --target unix:///path/kvtier.sock --token TOKEN --namespace NS [--engine MODEL_DIR]

Each request is driven as vLLM drives the connector (arrival, lookup, one step that computes
and stores its prompt, the worker's report, finish); then a client of the namespace asks the
daemon (`explain`) what became of its pages: their hint, tier, or that they were dropped.
Also the parser alone, on envelopes good and bad. With --engine, instead: a real vLLM engine
(a tiny random Llama built into MODEL_DIR, its engine core in its own process) serves
requests added with `LLMEngine.add_request(..., kv_hints=...)` and reports their
kv_transfer_params; the test then asks the daemon's stats for the namespace's hints.
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


def envelope(*actions: tuple[str, dict], version: str = "1"):
    from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope

    return KvHintsEnvelope("1", "m1", [KvHintAction(f"a{i}", kind, version, payload)
                                       for i, (kind, payload) in enumerate(actions)])


def parser_checks() -> dict:
    """The parser alone: what it takes, skips, ignores and rejects (never raising)."""
    from kvtier_client.integrations.vllm.hints import HintParser

    parse = HintParser().parse
    good = parse(envelope(("kvtier.pin", {"mode": "hard", "ttl_s": 30}), ("kvtier.retain", {"priority": "cold"}),
                          ("kvtier.prefetch", {"hold_s": 5}), ("kvtier.demote", {}), ("kvtier.drop", {"prefix_tokens": 64})),
                 None)
    bad_payloads = [{"ttl": 5}, {"mode": "glued"}, {"ttl_s": -1}, {"ttl_s": True}, {"prefix_tokens": 0}, {"ttl_s": 1e9}]
    bad = parse(envelope(*(("kvtier.pin", p) for p in bad_payloads), ("kvtier.retain", {}),
                         ("kvtier.demote", {"tier": "device"})), None)
    return {
        "good": [repr(a) for a in good.actions], "good_counts": [good.ignored, good.invalid],
        "bad": [len(bad.actions), bad.ignored, bad.invalid],
        "others": parse(envelope(("kvcr.pin", {"x": 1}), ("kvtier.teleport", {})), None).describe(),
        "old_version": parse(envelope(("kvtier.pin", {}), version="2"), None).describe(),
        "transfer_list": parse(None, {"kvtier_hints": [{"action_type": "kvtier.pin", "payload": {"ttl_s": 9}}]}).describe(),
        "transfer_envelope": parse(None, {"kvtier_hints": {"actions": [{"action_type": "kvtier.drop"}]}}).describe(),
        "not_envelopes": [parse(None, {"kvtier_hints": "pin please"}).describe(), parse(42, None).describe(),
                          parse(envelope(("kvtier.pin", {})), {"other": 1}).describe()],
        "payload_not_object": parse(None, {"kvtier_hints": [{"action_type": "kvtier.pin", "payload": [1]}]}).describe(),
    }


def connector_checks(target: str, token: str, namespace: str) -> dict:
    import torch
    from kvtier_client import KVTierClient, PageLayout, Tier
    from kvtier_client.integrations.vllm import (
        ConnectorConfig,
        KVTierScheduler,
        KVTierWorker,
    )
    from kvtier_client.integrations.vllm.kv_groups import single_group
    from kvtier_client.integrations.vllm.kv_views import GroupViews
    from kvtier_client.integrations.vllm.link import DaemonLink
    from kvtier_client.integrations.vllm.shapes import WorkerSlice
    from vllm import SamplingParams
    from vllm.v1.core.sched.output import NewRequestData
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request
    from vllm_steps import scheduler_output, worker_hooks

    layout = PageLayout(LAYERS, HEADS, HEAD_DIM, block_tokens=BLOCK, dtype="float32")
    config = ConnectorConfig.from_extra({"target": target, "namespace": namespace, "token": token, "planner": False,
                                         "prefetch": False}, default_namespace="x")
    group = single_group(layout, LAYER_NAMES)
    scheduler = KVTierScheduler([DaemonLink.open(config, layout, "scheduler")], [group], config, BLOCK, do_load=True,
                                do_save=True)
    part = WorkerSlice(rank=0, head_start=0, heads=HEADS, writes=True, page_layers=(0, 1))
    worker = KVTierWorker([GroupViews(group, part, DaemonLink.open(config, layout, "worker"))], None, "cpu")
    worker.register_kv_caches({name: torch.randn(128, HEADS, BLOCK, 2 * HEAD_DIM) for name in LAYER_NAMES})
    words = iter(range(10**6))
    free_blocks = iter(range(1, 128))
    probe = KVTierClient(target, token=token)
    probe.register(namespace, layout)

    def request(rid: str, blocks: int, kv_hints=None, transfer_params=None, prompt=None) -> Request:
        prompt = prompt or [next(words) % 500 for _ in range(blocks * BLOCK + 1)]
        params = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": transfer_params}
                                if transfer_params is not None else None)
        r = Request(rid, prompt, params, None, kv_hints=kv_hints)
        scheduler.on_new_request(r)
        return r

    def run(r: Request, *, finish_first: bool = False) -> dict:
        """Schedule, compute and store the prompt in one step, finish; returns what the
        request reported and its keys."""
        external, _ = scheduler.get_num_new_matched_tokens(r, 0)
        r.num_computed_tokens = external or 0
        scheduler.update_state_after_alloc(r, None, external or 0)
        keys = list(scheduler._requests[r.request_id].keys)
        ids = [next(free_blocks) for _ in range(len(r.prompt_token_ids) // BLOCK + 1)]
        new = [NewRequestData.from_request(r, (ids,))]
        meta = scheduler.build_connector_meta(
            scheduler_output({r.request_id: len(r.prompt_token_ids) - r.num_computed_tokens}, new))
        worker_hooks(worker, meta, LAYER_NAMES)
        report = KVConnectorOutput(kv_connector_worker_meta=worker.build_connector_worker_meta())
        out: dict = {}
        if finish_first:  # vLLM may finish a request before its last step's output comes back
            out["finished"] = scheduler.request_finished(r, [])[1]["kvtier"]
            out["hints_before_commit"] = hints(keys)
            scheduler.update_connector_output(report)
        else:
            scheduler.update_connector_output(report)
            out["finished"] = scheduler.request_finished(r, [])[1]["kvtier"]
        out["keys"], out["prompt"] = keys, list(r.prompt_token_ids)
        return out

    def hints(keys) -> list[str]:
        return [b.hint for b in probe.explain(keys).blocks]

    def where(keys) -> list[str]:
        return [f"{b.reason.value}:{b.tier.label if b.tier is not None else ''}:{b.policy}"
                for b in probe.explain(keys).blocks]

    out: dict = {}
    soft = run(request("soft", 3, envelope(("kvtier.pin", {"mode": "soft", "ttl_s": 60}))))
    out["soft"] = {"hints": hints(soft["keys"]), "report": soft["finished"]}
    late = run(request("late", 2, envelope(("kvtier.pin", {"ttl_s": 60}))), finish_first=True)
    out["late"] = {"before": late["hints_before_commit"], "after": hints(late["keys"])}
    retain = run(request("retain", 4, None, {"kvtier_hints": [
        {"action_type": "kvtier.retain", "action_version": "1", "payload": {"priority": "high", "prefix_tokens": 2 * BLOCK + 7}}]}))
    out["retain"] = {"hints": hints(retain["keys"]), "report": retain["finished"]}
    hard = run(request("hard", 3, envelope(("kvtier.pin", {"mode": "hard", "ttl_s": 60}))))
    too_many = run(request("too_many", 3, envelope(("kvtier.pin", {"mode": "hard", "ttl_s": 60}),
                                                   ("kvtier.retain", {"priority": "cold", "ttl_s": 60}))))
    out["hard"] = {"hints": hints(hard["keys"]), "past_guarantee": hints(too_many["keys"])}
    noisy = run(request("noisy", 2, envelope(("kvtier.teleport", {}), ("kvcr.pin", {"tier": "g3"}),
                                             ("kvtier.pin", {"ttl": 60}), ("kvtier.retain", {"priority": "urgent"})),
                        {"kvtier_hints": "pin please"}))
    out["noisy"] = {"hints": hints(noisy["keys"]), "report": noisy["finished"]}
    demoted = run(request("demote", 2, envelope(("kvtier.demote", {"tier": "disk"}))))
    out["demote"] = where(demoted["keys"])
    dropped = run(request("drop", 2, envelope(("kvtier.drop", {}))))
    out["drop"] = where(dropped["keys"])

    # A prefetch hint at arrival brings a prompt's disk pages up to host (the connector's own
    # prefetch is off here): the demoted prompt again.
    back = request("back", 0, envelope(("kvtier.prefetch", {"hold_s": 30})), prompt=demoted["prompt"])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(w.startswith("cached:host") for w in where(demoted["keys"])):
        time.sleep(0.05)
    out["prefetch"] = where(demoted["keys"])
    scheduler.request_finished(back, [])
    out["stats"] = scheduler.get_kv_connector_stats().data
    out["host_tier"] = probe.stats().pool(probe.pool.pool_id).tier(Tier.HOST).cached_pages
    probe.close()
    scheduler.shutdown()
    worker.shutdown()
    return out


def engine_checks(target: str, token: str, namespace: str, model_dir: str) -> dict:
    from vllm_engine_run import build

    build(model_dir)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    llm = LLM(model=model_dir, dtype="float32", block_size=BLOCK, max_model_len=1024, enforce_eager=True, seed=0,
              max_num_seqs=4, kv_transfer_config=KVTransferConfig(
                  kv_connector="KVTierConnector", kv_connector_module_path="kvtier_client.integrations.vllm",
                  kv_role="kv_both", kv_connector_extra_config={"target": target, "namespace": namespace,
                                                                "token": token}))
    engine = llm.llm_engine

    def params(transfer_params=None) -> SamplingParams:
        extra = {"kv_transfer_params": transfer_params} if transfer_params is not None else None
        return SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, extra_args=extra)

    words = iter(range(3, 500))
    prompts = {rid: {"prompt_token_ids": [next(words) for _ in range(n * BLOCK + 5)]}
               for rid, n in (("pinned", 3), ("retained", 2), ("noisy", 2))}
    engine.add_request("pinned", prompts["pinned"], params(),
                       kv_hints=envelope(("kvtier.pin", {"mode": "soft", "ttl_s": 600})))
    engine.add_request("retained", prompts["retained"], params({"kvtier_hints": [
        {"action_type": "kvtier.retain", "action_version": "1", "payload": {"priority": "high", "ttl_s": 600}}]}))
    engine.add_request("noisy", prompts["noisy"], params({"kvtier_hints": "pin please"}),
                       kv_hints=envelope(("kvtier.teleport", {}), ("kvtier.pin", {"mode": "sticky", "ttl_s": 600})))
    reports: dict = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                reports[out.request_id] = {"kvtier": (out.kv_transfer_params or {}).get("kvtier"),
                                           "tokens": len(out.outputs[0].token_ids)}
    return reports


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--token", required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--engine", metavar="MODEL_DIR", help="run the engine checks, building the model there")
    args = parser.parse_args()
    if args.engine:
        print(json.dumps({"engine": engine_checks(args.target, args.token, args.namespace, args.engine)}))
        return
    print(json.dumps({"parser": parser_checks(), "connector": connector_checks(args.target, args.token, args.namespace)}))


if __name__ == "__main__":
    sys.exit(main())
