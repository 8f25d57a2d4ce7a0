"""vLLM with the kvtier connector across model and parallel shapes, end to end on CPU:
real engine processes (vllm_engine_run.py under .venv-vllm), one real daemon, tiny
random-initialised models of the real architectures (nothing downloaded). Every run with
kvtier must give the greedy tokens and logprobs of a reference run without it.

Tensor parallel: a TP=2 engine (two worker processes, one core each) stores P1; a TP=1
engine of the same model finds P1 in the pages TP=2 wrote (an external hit of all its full
blocks) and stores P2; a TP=2 engine then finds P2 in the pages TP=1 wrote.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from daemon import start_daemon
from vllm_engines import ENGINE_TIMEOUT, assert_same_outputs, needs_vllm, run_engine

BLOCK = 32  # vllm_engine_run.py BLOCK_SIZE

pytestmark = [needs_vllm, pytest.mark.timeout(5 * ENGINE_TIMEOUT)]


def _words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(509)}" for _ in range(n))


def _prompt_files(tmp_path: Path, **prompts: list[str]) -> dict[str, Path]:
    files = {}
    for name, texts in prompts.items():
        files[name] = tmp_path / f"{name}.json"
        files[name].write_text(json.dumps(texts))
    return files


def test_tensor_parallel_engines_share_pages_both_ways(tmp_path: Path) -> None:
    rng = random.Random(11)
    p1, p2 = _words(rng, 300), _words(rng, 200)
    files = _prompt_files(tmp_path, both=[p1, p2], p1=[p1], p2=[p2])
    model = tmp_path / "model"
    daemon = start_daemon(tmp_path, host_size="32MiB", disk_size="64MiB")
    try:
        kv = ("--kvtier", daemon.target, "--namespace", "e2e/tiny-llama")
        ref = run_engine(tmp_path, "reference", model, files["both"], "--build-model", "--in-process",
                         "--no-prefix-caching")
        tp2 = run_engine(tmp_path, "tp2-stores-p1", model, files["p1"], *kv, "--tp", "2")
        tp1 = run_engine(tmp_path, "tp1", model, files["both"], *kv, "--in-process")
        tp2_again = run_engine(tmp_path, "tp2-loads-p2", model, files["p2"], *kv, "--tp", "2")
    finally:
        code = daemon.stop()
    assert code == 0, daemon.log()
    full = [len(r["prompt_token_ids"]) // BLOCK for r in ref["results"]]  # 9 and 6 full blocks
    stored = tp2["results"][0]["kv_transfer_params"]["kvtier"]
    assert (stored["loaded_tokens"], stored["stored_blocks"]) == (0, full[0])
    hit, new = (r["kv_transfer_params"]["kvtier"] for r in tp1["results"])
    assert hit["loaded_tokens"] == full[0] * BLOCK  # every full block of P1, written by two ranks
    assert (new["loaded_tokens"], new["stored_blocks"]) == (0, full[1])
    back = tp2_again["results"][0]["kv_transfer_params"]["kvtier"]
    assert back["loaded_tokens"] == full[1] * BLOCK  # P2's blocks, written by one rank, read by two
    assert_same_outputs(tp2["results"], ref["results"][:1])
    assert_same_outputs(tp1["results"], ref["results"])
    assert_same_outputs(tp2_again["results"], ref["results"][1:])
    print(f"\nTP=2 engine start {tp2['startup_s']:.1f}s + {tp2['generate_s']:.1f}s; TP=1 "
          f"{tp1['startup_s']:.1f}s + {tp1['generate_s']:.1f}s; external hit tokens TP2->TP1 {hit['loaded_tokens']}, "
          f"TP1->TP2 {back['loaded_tokens']}")


#: Architectures: arch -> (vLLM block size, dtype, prefill chunk of the runs that compute
#: every token). Prompts of 300 and 200 tokens.
ARCH_CASES = {
    # Gemma-3 text: sliding-window (64 tokens) and global layers, vLLM's hybrid allocator:
    # two groups, loaded in the background.
    "gemma3": (32, "float32", None),
    # Mistral with a 64-token window on every layer: one WINDOW group (2 blocks).
    "mistral": (32, "float32", None),
    # DeepSeek-V2-style MLA: latent pages; vLLM's CPU MLA kernels (AMX_MLA) take bfloat16
    # weights only, and vLLM turns its own prefix caching off for them. In bfloat16 a prefill
    # over cached context rounds differently from one over the whole prompt, so the runs that
    # compute every token prefill in chunks of 96 tokens: their last chunk starts where the
    # warm run's loaded prefix ends (288 and 192 tokens) and is the same computation, so the
    # outputs must still be equal to the bit.
    "deepseek_v2": (32, "bfloat16", 96),
}


@pytest.mark.parametrize("arch", sorted(ARCH_CASES))
def test_architecture_round_trip(tmp_path: Path, arch: str) -> None:
    """Cold run stores every full prompt block; a fresh engine gets them as external hits
    with the reference's tokens and logprobs."""
    block, dtype, chunk = ARCH_CASES[arch]
    rng = random.Random(5)
    p1, p2 = _words(rng, 300), _words(rng, 200)
    files = _prompt_files(tmp_path, both=[p1, p2])
    model = tmp_path / "model"
    daemon = start_daemon(tmp_path, host_size="64MiB", disk_size="64MiB")
    try:
        shape = ("--block-size", str(block), "--dtype", dtype)
        chunked = ("--max-num-batched-tokens", str(chunk)) if chunk else ()
        kv = ("--kvtier", daemon.target, "--namespace", f"e2e/{arch}", *shape)
        ref = run_engine(tmp_path, "reference", model, files["both"], "--build-model", "--arch", arch, "--in-process",
                         "--no-prefix-caching", *shape, *chunked)
        cold = run_engine(tmp_path, "cold", model, files["both"], *kv, "--in-process", *chunked)
        warm = run_engine(tmp_path, "warm", model, files["both"], *kv, "--in-process")
    finally:
        code = daemon.stop()
    assert code == 0, daemon.log()
    full = [len(r["prompt_token_ids"]) // block for r in ref["results"]]
    stored = [r["kv_transfer_params"]["kvtier"] for r in cold["results"]]
    assert [s["stored_blocks"] for s in stored] == full, stored
    loaded = [r["kv_transfer_params"]["kvtier"]["loaded_tokens"] for r in warm["results"]]
    assert loaded == [n * block for n in full], loaded
    assert_same_outputs(cold["results"], ref["results"])
    assert_same_outputs(warm["results"], ref["results"])
    print(f"\n{arch}: warm engine {warm['startup_s']:.1f}s + {warm['generate_s']:.1f}s, external hit tokens {loaded}")


def test_a_mamba_hybrid_is_refused_with_the_reason(tmp_path: Path) -> None:
    """Granite-4.0-H-style (Mamba2 + attention): the engine does not start with the connector,
    and says why (vLLM keeps Mamba state per block only with prefix caching's align mode)."""
    files = _prompt_files(tmp_path, one=[_words(random.Random(1), 40)])
    daemon = start_daemon(tmp_path, host_size="32MiB", disk_size="32MiB")
    try:
        with pytest.raises(AssertionError) as failed:
            run_engine(tmp_path, "granite", tmp_path / "model", files["one"], "--build-model", "--arch",
                       "granite_hybrid", "--in-process", "--no-prefix-caching", "--kvtier", daemon.target)
    finally:
        daemon.stop()
    assert "Mamba / linear-attention layers are not supported yet" in str(failed.value)
