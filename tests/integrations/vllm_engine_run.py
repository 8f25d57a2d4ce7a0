"""One vLLM engine process for tests/integrations/test_vllm_e2e.py (run with .venv-vllm's python).

    vllm_engine_run.py build MODEL_DIR
        save a tiny random Llama (float32, 2 layers, 2 KV heads of 64) and an offline
        word-level tokenizer ("w0" .. "w508", one token per word) into MODEL_DIR
    vllm_engine_run.py run --model DIR --prompts PROMPTS.json --out OUT.json [--build-model [--arch A]]
                           [--block-size N] [--dtype D]
                           [--kvtier TARGET --namespace NS] [--no-prefix-caching] [--in-process]
                           [--max-tokens N] [--max-num-batched-tokens N] [--long-prefill-token-threshold N]
                           [--batch-prompts PROMPTS.json] [--kv-events ENDPOINT] [--stats] [--tp N] [--kv-extra JSON]
        (--build-model: build MODEL_DIR first, in this process) run the prompts one
        generate() call after another (greedy) and write, per prompt,
        the prompt and generated token ids, the generated tokens' logprobs, vLLM's
        num_cached_tokens, the connector's kv_transfer_params and the call's seconds; then the --batch-prompts,
        all in one generate() call (so vLLM schedules them side by side), the same per prompt.
        --in-process runs the engine core and the worker inside this process
        (VLLM_ENABLE_V1_MULTIPROCESSING=0: starts in half the time); by default they are
        separate processes, as in `vllm serve`, so the connector's metadata crosses process
        boundaries. --kv-events publishes vLLM's KV events on a ZeroMQ ENDPOINT (ipc://...)
        and records the BlockStored events the connector made (ownership "kvtier") and the
        block hashes of vLLM's own; --stats turns vLLM's stats on and records the connector's
        Prometheus counters (vllm:kvtier_*) from LLM.get_metrics(). --tp runs N tensor-parallel
        worker processes, one CPU core each.

Everything runs offline: no hub, no usage stats. vLLM is imported only under `__main__`
(its engine starts worker processes that re-import this file).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

BLOCK_SIZE = 32  # vLLM's CPU attention needs a multiple of 32
VOCAB_WORDS = 509


def build(model_dir: str) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(VOCAB_WORDS)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(model_dir)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(words), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=8192,
        bos_token_id=1, eos_token_id=2, initializer_range=0.2, tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(model_dir)


class EventListener:
    """Collects the KV event batches vLLM publishes on a ZeroMQ endpoint, in a thread."""

    def __init__(self, endpoint: str) -> None:
        import threading

        import zmq

        self._socket = zmq.Context.instance().socket(zmq.SUB)
        self._socket.connect(endpoint)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.events: list = []
        self._running = True
        self._thread = threading.Thread(target=self._listen, daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        while self._running:
            if self._socket.poll(100):
                _topic, _seq, payload = self._socket.recv_multipart()
                self.events.extend(decoder.decode(payload).events)

    def stop(self) -> None:
        time.sleep(1.0)  # the publisher thread sends what the last steps queued
        self._running = False
        self._thread.join()
        self._socket.close(linger=0)


def _event_report(events: list) -> dict:
    from vllm.distributed.kv_events import BlockStored

    stored = [e for e in events if isinstance(e, BlockStored)]
    return {
        "kvtier": [{"block_hashes": [str(h) for h in e.block_hashes], "token_ids": list(e.token_ids),
                    "block_size": e.block_size, "medium": e.medium, "locality": e.locality, "ownership": e.ownership,
                    "parent": None if e.parent_block_hash is None else str(e.parent_block_hash)}
                   for e in stored if e.ownership == "kvtier"],
        "vllm_block_hashes": sorted({str(h) for e in stored if e.ownership != "kvtier" for h in e.block_hashes}),
    }


def _result(out) -> dict:
    completion = out.outputs[0]
    return {
        "prompt_token_ids": list(out.prompt_token_ids),
        "token_ids": list(completion.token_ids),
        "logprobs": [lp[t].logprob for lp, t in zip(completion.logprobs or [], completion.token_ids)],
        "num_cached_tokens": out.num_cached_tokens,
        "kv_transfer_params": out.kv_transfer_params,
        # Engine-core time from scheduling to the first token (with --stats): loads and prefill.
        "first_token_s": (out.metrics.first_token_ts - out.metrics.scheduled_ts
                          if getattr(out, "metrics", None) and out.metrics.first_token_ts else None),
    }


def run(args: argparse.Namespace) -> None:
    if args.build_model:
        from vllm_models import build as build_arch

        build_arch(args.arch, args.model)
    if args.in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig, KVTransferConfig

    kv_config = None
    if args.kvtier:
        kv_config = KVTransferConfig(
            kv_connector="KVTierConnector",
            kv_connector_module_path="kvtier_client.integrations.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"target": args.kvtier, "namespace": args.namespace, "salt": "e2e",
                                       **json.loads(args.kv_extra)},
        )
    options = {}
    if args.tp > 1:
        # One core per rank: this machine has one NUMA node, so vLLM's CPU backend needs the binding said.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % (os.cpu_count() or 1)) for i in range(args.tp)))
        options.update(tensor_parallel_size=args.tp, distributed_executor_backend="mp")
    if args.max_num_batched_tokens:
        options["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.long_prefill_token_threshold:
        options["long_prefill_token_threshold"] = args.long_prefill_token_threshold
    if args.kv_events:
        options["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                     endpoint=args.kv_events)
    started = time.monotonic()
    llm = LLM(
        model=args.model, dtype=args.dtype, block_size=args.block_size, max_model_len=args.max_model_len, enforce_eager=True,
        enable_prefix_caching=not args.no_prefix_caching, kv_transfer_config=kv_config, seed=0,
        max_num_seqs=4, disable_log_stats=not args.stats, **options,
    )
    ready = time.monotonic()
    listener = EventListener(args.kv_events) if args.kv_events else None
    with open(args.prompts) as f:
        prompts = json.load(f)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=0, ignore_eos=True)
    # One call per prompt: each finishes (and is stored) before the next.
    results = []
    for prompt in prompts:
        started_prompt = time.monotonic()
        results.append(_result(llm.generate([prompt], params, use_tqdm=False)[0]))
        results[-1]["seconds"] = time.monotonic() - started_prompt
    batch_results = []
    if args.batch_prompts:
        with open(args.batch_prompts) as f:
            batch = json.load(f)
        batch_results = [_result(out) for out in llm.generate(batch, params, use_tqdm=False)]
    done = time.monotonic()
    report = {"results": results, "batch_results": batch_results, "startup_s": ready - started,
              "generate_s": done - ready}
    if listener is not None:
        listener.stop()
        report["events"] = _event_report(listener.events)
    if args.stats:
        report["metrics"] = {m.name: m.value for m in llm.get_metrics() if m.name.startswith("vllm:kvtier_")}
    with open(args.out, "w") as f:
        json.dump(report, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build")
    b.add_argument("model_dir")
    r = sub.add_parser("run")
    r.add_argument("--model", required=True)
    r.add_argument("--prompts", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--kvtier", help="kvtier daemon target; without it the engine runs without a connector")
    r.add_argument("--namespace", default="e2e/tiny-llama")
    r.add_argument("--build-model", action="store_true")
    r.add_argument("--arch", default="llama", help="the tiny model --build-model writes (vllm_models.py ARCHS)")
    r.add_argument("--block-size", type=int, default=BLOCK_SIZE, help="vLLM block size (CPU MLA needs 16)")
    r.add_argument("--dtype", default="float32", help="model dtype (CPU MLA needs bfloat16)")
    r.add_argument("--max-model-len", type=int, default=1024)
    r.add_argument("--in-process", action="store_true")
    r.add_argument("--no-prefix-caching", action="store_true")
    r.add_argument("--max-tokens", type=int, default=12)
    r.add_argument("--tp", type=int, default=1, help="tensor parallel size (one CPU core per rank)")
    r.add_argument("--kv-extra", default="{}", help="more kv_connector_extra_config keys, as JSON")
    r.add_argument("--max-num-batched-tokens", type=int, help="small values split prompts into prefill chunks")
    r.add_argument("--long-prefill-token-threshold", type=int,
                   help="at most this many prompt tokens per request and step (requests prefill side by side)")
    r.add_argument("--batch-prompts", help="prompts (JSON list) to run in one generate() call after the others")
    r.add_argument("--kv-events", help="publish vLLM's KV events on this ZeroMQ endpoint and record them")
    r.add_argument("--stats", action="store_true", help="turn vLLM's stats on and record the connector's counters")
    args = parser.parse_args()
    if args.command == "build":
        build(args.model_dir)
    else:
        run(args)


if __name__ == "__main__":
    sys.exit(main())
