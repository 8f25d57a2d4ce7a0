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
