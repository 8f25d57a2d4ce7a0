"""What a model and its parallel shape mean for kvtier pages.

A page never depends on the parallel shape: it holds every KV head (all of the model's, not
one rank's) and every layer of its block, so a prompt cached by a TP=2 engine is a hit for a
TP=1 engine of the same model and the other way round. Each worker writes and reads only
its part of a page (`WorkerSlice`): the heads it holds (tensor parallel) of the layers it
holds (pipeline parallel). Heads that several ranks hold (fewer KV heads than ranks; MLA's
latent, which every rank holds whole) are written by the first of those ranks and read by
all.

`page_layout_for` gives the layout of an engine's KV cache: full attention pages hold K and
V (`page_first`), MLA pages the latent vector of each token (`latent`). What is refused says
why: context parallelism (a block's tokens are spread over ranks), several KV cache groups
(kvtier_client.integrations.vllm.groups takes those), K and V head sizes that differ, a
dtype kvtier has no page for.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier_client.layout import DTYPE_BYTES, PageLayout

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

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


def page_layout_for(kv_cache_config: KVCacheConfig, vllm_config: VllmConfig) -> tuple[PageLayout, list[str]]:
    """The kvtier page layout of an engine with one KV cache group, the same for every
    parallel shape, and this process's attention layers (page layers in `page_layers_of`)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(f"kvtier connector: page_layout_for takes one KV cache group, this model has {len(groups)}")
    spec = groups[0].kv_cache_spec
    if not isinstance(spec, FullAttentionSpec) or getattr(spec, "sliding_window", None) is not None:
        raise ValueError(f"kvtier connector: KV cache spec {type(spec).__name__} is not full attention")
    mla = isinstance(spec, MLAAttentionSpec)
    head_v = getattr(spec, "head_size_v", None) or spec.head_size
    if not mla and head_v != spec.head_size:
        raise ValueError(f"kvtier connector: K head size {spec.head_size} differs from V head size {head_v}; "
                         "kvtier pages hold K and V of one head size")
    if spec.block_size != vllm_config.cache_config.block_size:
        raise ValueError(f"kvtier connector: KV spec block size {spec.block_size} differs from cache block size "
                         f"{vllm_config.cache_config.block_size}")
    dtype = str(spec.dtype).removeprefix("torch.")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"kvtier connector: KV cache dtype {dtype} has no kvtier page dtype ({', '.join(DTYPE_BYTES)})")
    model = vllm_config.model_config
    layout = PageLayout(
        layers=model.get_total_num_hidden_layers(),
        kv_heads=1 if mla else model.get_total_num_kv_heads(),
        head_dim=spec.head_size, block_tokens=spec.block_size, dtype=dtype,
        order="latent" if mla else "page_first",
    )
    return layout, list(groups[0].layer_names)


def page_layers_of(layer_names: list[str], layout: PageLayout) -> tuple[int, ...]:
    """The page layer of each local attention layer: its model layer index (a pipeline stage
    holds some of the model's layers; a page holds them all)."""
    indices = tuple(layer_index(name) for name in layer_names)
    if len(set(indices)) != len(indices) or any(not 0 <= i < layout.layers for i in indices):
        raise ValueError(f"kvtier connector: attention layers {layer_names} do not map one to one onto the "
                         f"{layout.layers} layers of a page")
    return indices
