"""One engine step as vLLM drives the connector, for the checks without an engine
(vllm_checks.py and the vllm_*_checks.py it runs): the scheduler's output for the requests
scheduled, and the worker's hooks around a forward pass (which these checks leave out)."""
from __future__ import annotations

import torch
from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput


def scheduler_output(scheduled: dict[str, int], new: list) -> SchedulerOutput:
    """A step that schedules `scheduled` tokens per request, `new` its newly admitted ones
    (NewRequestData), and no request admitted before."""
    return SchedulerOutput(
        scheduled_new_reqs=new, scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()),
        scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={}, finished_req_ids=set(),
        free_encoder_mm_hashes=[],
    )


def worker_hooks(worker, meta, layer_names: list[str]) -> None:
    """What vLLM's model runner calls on the worker's connector around a forward pass, in
    inference mode as it does."""
    with torch.inference_mode():
        worker.start_step()
        worker.start_load_kv(meta)
        for name in layer_names:
            worker.save_kv_layer(name, meta)
        worker.wait_for_save(meta)
