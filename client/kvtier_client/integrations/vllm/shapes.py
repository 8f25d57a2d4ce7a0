"""What a model and its parallel shape mean for kvtier pages.

A page never depends on the parallel shape: it holds every KV head (all of the model's, not
one rank's) and every layer of its block, so a prompt cached by a TP=2 engine is a hit for a
TP=1 engine of the same model and the other way round. Each worker writes and reads only
its part of a page (`WorkerSlice`): the heads it holds (tensor parallel) of the layers it
holds (pipeline parallel). Heads that several ranks hold (fewer KV heads than ranks; MLA's
latent, which every rank holds whole) are written by the first of those ranks and read by
all.

The layouts themselves (one per KV cache group) are kvtier_client.integrations.vllm.kv_groups'.
Context parallelism is refused with its reason: it spreads a block's tokens over ranks.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.config import VllmConfig

_LAYER_INDEX = re.compile(r"\.(\d+)\.")


@dataclass(frozen=True)
class ParallelShape:
    """The engine's workers: tensor and pipeline parallel sizes (data parallel engines
    each have their own connector and do not count)."""

    tp: int = 1
    pp: int = 1

    @property
    def workers(self) -> int:
        return self.tp * self.pp

    @classmethod
    def of(cls, vllm_config: VllmConfig) -> ParallelShape:
        """The engine's shape; context parallelism is refused with what is missing."""
        pc = vllm_config.parallel_config
        context = {name: getattr(pc, name, 1) for name in ("prefill_context_parallel_size", "decode_context_parallel_size")}
        wide = {k: v for k, v in context.items() if v != 1}
        if wide:
            raise ValueError(
                f"kvtier connector: {wide} is not supported: context parallelism spreads a block's tokens over "
                "ranks (each rank holds every n-th token), and a kvtier page holds whole blocks; run without "
                "context parallelism (tensor, pipeline and data parallel are supported)"
            )
        return cls(pc.tensor_parallel_size, pc.pipeline_parallel_size)


@dataclass(frozen=True)
class WorkerSlice:
    """The part of every page one worker holds: page heads [head_start, head_start +
    heads) and, for its local layer i, page layer `page_layers[i]`. `writes`: this worker
    writes its part (False for a replica of heads another rank writes)."""

    rank: int  # among the engine's workers: pp_rank * tp + tp_rank
    head_start: int
    heads: int
    writes: bool
    page_layers: tuple[int, ...]

    @classmethod
    def of(cls, shape: ParallelShape, tp_rank: int, pp_rank: int, total_heads: int, local_heads: int,
           page_layers: tuple[int, ...]) -> WorkerSlice:
        """Rank `tp_rank` of `shape.tp` holds `local_heads` of `total_heads` as vLLM shards
        them: consecutive heads when there are at least as many heads as ranks, else one
        head each, replicated over tp / total_heads consecutive ranks."""
        if total_heads >= shape.tp:
            if local_heads * shape.tp != total_heads:
                raise ValueError(f"kvtier connector: {total_heads} KV heads over {shape.tp} ranks, but this rank "
                                 f"holds {local_heads}")
            start, writes = tp_rank * local_heads, True
        else:
            if local_heads != 1 or shape.tp % total_heads:
                raise ValueError(f"kvtier connector: {total_heads} KV heads over {shape.tp} ranks: expected one "
                                 f"replicated head per rank, this rank holds {local_heads}")
            replicas = shape.tp // total_heads
            start, writes = tp_rank // replicas, tp_rank % replicas == 0
        return cls(pp_rank * shape.tp + tp_rank, start, local_heads, writes, page_layers)


def layer_index(name: str) -> int:
    """The model layer a vLLM attention layer name belongs to ("model.layers.7.self_attn.attn" -> 7)."""
    found = _LAYER_INDEX.findall(f".{name}.")
    if len(found) != 1:
        raise ValueError(f"kvtier connector: cannot tell the layer index of attention layer {name!r}")
    return int(found[0])
