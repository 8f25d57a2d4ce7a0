"""Offline inference with vLLM and the kvtier connector: prompts that share a long prefix.

Start a daemon (README quick start), then run this twice; the second run is a fresh engine
with an empty vLLM cache, and loads the prompts' KV from kvtier instead of recomputing it:

    .venv/bin/kvtier serve --socket /tmp/kvtier/kvtier.sock --cache-dir /tmp/kvtier/cache \
        --host-size 256MiB --disk-size 1GiB &
    export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_CPU_KVCACHE_SPACE=1   # CPU: 1 GiB of KV
    .venv-vllm/bin/python examples/vllm/offline_inference.py --tiny /tmp/tiny-llama
    .venv-vllm/bin/python examples/vllm/offline_inference.py --tiny /tmp/tiny-llama

`--tiny DIR` builds (once) a tiny random Llama with a character-level tokenizer in DIR, so
the example runs offline on a CPU; its output text is noise, the cache behaviour is real.
Pass `--model NAME_OR_PATH` for a real model. Each request prints how many prompt tokens
came from vLLM's own prefix cache, how many were loaded from kvtier, and how many blocks it
stored in kvtier. See examples/vllm/README.md and docs/integrations.md.
"""
from __future__ import annotations

import argparse
import os

SYSTEM = (
    "You are a careful assistant for a company that builds storage systems. Answer briefly, cite the "
    "manual section you used, and say when you do not know. The manual follows.\n"
    + "".join(
        f"Section {i}: the {topic} subsystem keeps its state in fixed-size pages; pages move between tiers "
        "under pressure, and a page in use is never moved.\n"
        for i, topic in enumerate(["cache", "journal", "index", "scrubber", "replicator", "allocator"], 1)
    )
)
QUESTIONS = ["What happens to a page in use?", "Which section covers the journal?", "How big is a page?"]


def build_tiny(model_dir: str) -> None:
    """A 2-layer random Llama (head_dim 64: vLLM's CPU attention needs >= 32) and a
    character-level tokenizer, written to model_dir. Nothing is downloaded."""
    if os.path.exists(os.path.join(model_dir, "config.json")):
        return
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>", *chars])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(
        model_dir
    )
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(vocab), hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(model_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", help="Hugging Face model name or local path")
    which.add_argument("--tiny", metavar="DIR", help="build (once) and use a tiny random model in DIR, offline")
    parser.add_argument("--target", default=os.environ.get("KVTIER_TARGET", "unix:///tmp/kvtier/kvtier.sock"),
                        help="kvtier daemon: unix:///path.sock or host:port (default %(default)s)")
    parser.add_argument("--namespace", help="kvtier namespace (default: vllm/<model>)")
    parser.add_argument("--salt", default="", help="per-tenant salt mixed into every block key")
    parser.add_argument("--token-file", help="file holding the daemon's bearer token, if it requires one")
    parser.add_argument("--block-size", type=int, help="vLLM block size = kvtier page tokens (CPU: a multiple of 32)")
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()

    model = args.model
    if args.tiny:
        build_tiny(args.tiny)
        model = args.tiny

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    extra = {"target": args.target, "salt": args.salt}
    if args.namespace:
        extra["namespace"] = args.namespace
    if args.token_file:
        extra["token_file"] = args.token_file
    kv_transfer_config = KVTransferConfig(
        kv_connector="KVTierConnector",
        kv_connector_module_path="kvtier_client.integrations.vllm",
        kv_role="kv_both",  # load and store; kv_consumer only loads, kv_producer only stores
        kv_load_failure_policy="recompute",  # a page evicted between lookup and load is recomputed
        kv_connector_extra_config=extra,
    )
    engine_args = {"model": model, "kv_transfer_config": kv_transfer_config, "max_model_len": 4096,
                   "enforce_eager": True}
    if args.block_size:
        engine_args["block_size"] = args.block_size
    elif args.tiny:
        engine_args["block_size"] = 32
    llm = LLM(**engine_args)

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    print(f"{'prompt tokens':>13} {'vLLM cache':>10} {'from kvtier':>11} {'stored blocks':>13}  answer")
    for question in QUESTIONS:  # one at a time, so each request's blocks are stored before the next
        out = llm.generate([f"{SYSTEM}\nQuestion: {question}\nAnswer:"], params, use_tqdm=False)[0]
        info = (out.kv_transfer_params or {}).get("kvtier", {})
        loaded = info.get("loaded_tokens", 0)
        local = (out.num_cached_tokens or 0) - loaded
        print(f"{len(out.prompt_token_ids):>13} {local:>10} {loaded:>11} {info.get('stored_blocks', 0):>13}  "
              f"{out.outputs[0].text[:40]!r}")
        if info.get("plan"):
            print(f"{'':>13} planner: {info['plan']}")


if __name__ == "__main__":  # vLLM starts worker processes that import this file again
    main()
