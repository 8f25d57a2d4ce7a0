"""Which weights computed a page: a fingerprint of the checkpoint (and of the settings that
change its KV: dtype, quantization, config overrides, load format) mixed into every block key,
so an engine never loads KV another checkpoint computed, even under the same namespace and
served model name (a fine-tune replacing its base at the same path, two revisions).

Both of the connector's processes compute it from the same files: config.json as it is, and
per weight file its size and `SAMPLES` 4 KiB pieces at evenly spaced offsets (cheap for
hundreds of GB; two fine-tunes of one architecture have equal sizes and headers, but not
equal bytes). A model named by hub id that is not on local disk yet is named by id and
revision only. Where the checkpoint is mounted does not enter it, so replicas that mount it
at different paths share pages.

Weights replaced in memory (RL weight sync) do not change the files: vLLM then resets the
prefix cache, and the scheduler starts a new key epoch (scheduler.KVTierScheduler.reset_cache).
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.config import VllmConfig

SAMPLES = 16
PIECE = 4096
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def checkpoint_fingerprint(vllm_config: VllmConfig) -> bytes:
    """16 bytes naming the engine's checkpoint and the dtype its KV is computed in."""
    model = vllm_config.model_config
    load = getattr(getattr(vllm_config, "load_config", None), "load_format", None)
    h = hashlib.sha256()
    # What changes the KV besides the files: dtype, quantization, config overrides (rope
    # scaling and the like), random "dummy" weights, a sliding window turned off.
    h.update(f"{model.dtype}|{getattr(model, 'quantization', None)}|{getattr(model, 'hf_overrides', None)}|"
             f"{load}|{getattr(model, 'disable_sliding_window', None)}|".encode())
    directory = Path(model.model)
    if directory.is_dir():
        config = directory / "config.json"
        if config.is_file():
            h.update(config.read_bytes())
        for path in sorted(p for p in directory.iterdir() if p.suffix in WEIGHT_SUFFIXES):
            h.update(path.name.encode())
            h.update(_sampled(path))
    else:
        h.update(f"{model.model}@{getattr(model, 'revision', None) or 'main'}".encode())
    return h.digest()[:16]


def _sampled(path: Path) -> bytes:
    """A weight file's size and SAMPLES pieces of it at evenly spaced offsets."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        for i in range(SAMPLES):
            f.seek(max(0, (size - PIECE) * i // max(1, SAMPLES - 1)), os.SEEK_SET)
            h.update(f.read(PIECE))
    return h.digest()
