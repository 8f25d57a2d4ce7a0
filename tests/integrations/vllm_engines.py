"""Running vLLM engine processes for the end-to-end tests (vllm_engine_run.py under
.venv-vllm's python, created by scripts/setup_vllm.sh; tests skip without it)."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("KVTIER_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
HELPER = Path(__file__).with_name("vllm_engine_run.py")
ENGINE_TIMEOUT = 600

needs_vllm = pytest.mark.skipif(
    not VLLM_PYTHON.exists(),
    reason=f"{VLLM_PYTHON} is absent: run scripts/setup_vllm.sh to create .venv-vllm (vLLM CPU + kvtier-client)",
)


def run_engine(tmp_path: Path, name: str, model: Path, prompts: Path, *args: str) -> dict:
    """One engine run (vllm_engine_run.py run): its JSON report, or an AssertionError with
    the tail of its log."""
    out = tmp_path / f"{name}.json"
    log_path = tmp_path / f"{name}.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVTIER_", "VLLM_"))}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               VLLM_CPU_KVCACHE_SPACE="1")
    command = [str(VLLM_PYTHON), str(HELPER), "run", "--model", str(model), "--prompts", str(prompts),
               "--out", str(out), *args]
    with open(log_path, "wb") as log:
        try:
            proc = subprocess.run(command, check=False, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path,
                                  timeout=ENGINE_TIMEOUT)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    if code != 0 or not out.exists():
        tail = log_path.read_text(errors="replace")[-6000:]
        raise AssertionError(f"{name} engine run failed ({code}): {' '.join(command)}\n--- log tail ---\n{tail}")
    return json.loads(out.read_text())


def assert_same_outputs(got: list[dict], want: list[dict]) -> None:
    """Greedy tokens equal to the reference's, and their logprobs too."""
    for g, w in zip(got, want, strict=True):
        assert g["prompt_token_ids"] == w["prompt_token_ids"]
        assert g["token_ids"] == w["token_ids"]
        assert g["logprobs"] == pytest.approx(w["logprobs"], abs=1e-3)
