"""Tiny random-initialised model directories for the vLLM tests, one per attention layout the
connector meets (run with .venv-vllm's python):

    vllm_models.py build ARCH MODEL_DIR     ARCH: llama, gemma3, mistral, deepseek_v2, granite_hybrid

Each directory holds config.json, float32 safetensors weights (transformers' from_config +
save_pretrained, seed 0) and the offline word-level tokenizer of vllm_engine_run.py ("w0" ..
"w508", one token per word), so tests/integrations/vllm_engine_run.py's prompts work with all
of them. What vLLM 0.32 CPU builds from them (block size 32, VLLM_CPU_KVCACHE_SPACE=1; the groups
of kv_cache_config, with the hybrid KV cache manager on, as it is without a connector or with one
that subclasses SupportsHMA):

    llama            2 full-attention layers, 2 KV heads of 64: one FullAttentionSpec group; per layer
                     a [num_blocks, heads, 32, 2 * 64] float32 view (tensor_parallel_size=2: 1 head)
    gemma3           Gemma-3 text model, layers sliding (window 64), sliding, global, 2 KV heads of 64:
                     three groups of one layer (SlidingWindowSpec, SlidingWindowSpec, FullAttentionSpec)
                     whose views share one allocation (a block id belongs to one group at a time).
                     Without the hybrid manager: one FullAttentionSpec group (sliding_window=64)
    mistral          every layer sliding (window 64), 2 KV heads of 64: one SlidingWindowSpec group.
                     Two layers of window 64 see 128 tokens back: older prompt blocks do not change
                     the output
    deepseek_v2      DeepSeek-V2-Lite-style MLA (kv_lora_rank 512, qk_rope_head_dim 64, no q LoRA,
                     dense MLPs): one MLAAttentionSpec group (1 head of 576), per layer a
                     [num_blocks, block, 576] view. On a CPU with AMX vLLM picks AMX_MLA, which needs
                     dtype bfloat16 (block 32, prefix caching on); attention_backend="CPU_MLA" runs
                     float32 but forces block size 16 and turns prefix caching and chunked prefill off
    granite_hybrid   Granite-4.0-H-style Mamba2 hybrid, layers mamba, attention, mamba, mamba (dense
                     MLPs, no positional embedding): three MambaSpec groups (conv (3, 288) + SSM
                     (4, 64, 16) states, padded to the attention page) and a FullAttentionSpec group,
                     all over one allocation. With prefix caching (mamba_cache_mode "align") vLLM 0.32
                     CPU fails in the first prefill that spans several blocks (its CPU SSD kernel
                     returns no intermediate states) unless max_num_batched_tokens is the block size;
                     without the hybrid manager it does not start

The Llama is vllm_engine_run.build itself; the others reuse it for the tokenizer (it writes the
tokenizer and a Llama, whose config and weights are then replaced).
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from vllm_engine_run import BLOCK_SIZE, VOCAB_WORDS
from vllm_engine_run import build as build_llama

VOCAB = VOCAB_WORDS + 3  # "<unk>", "<s>", "</s>", then the words
BOS, EOS = 1, 2
SLIDING_WINDOW = 64  # tokens: two vLLM CPU blocks of BLOCK_SIZE, so a 300-token prompt slides past it
_MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors")

__all__ = [
    "ARCHS", "BLOCK_SIZE", "SLIDING_WINDOW", "build", "build_deepseek_v2", "build_gemma3",
    "build_granite_hybrid", "build_llama", "build_mistral",
]


def _save(model_dir: str, make_model: Callable[[], object]) -> None:
    """The tokenizer (from vllm_engine_run.build), then the model `make_model` builds, in float32."""
    import torch

    build_llama(model_dir)
    for name in _MODEL_FILES:
        Path(model_dir, name).unlink(missing_ok=True)
    torch.manual_seed(0)
    make_model().to(torch.float32).save_pretrained(model_dir)


def build_gemma3(model_dir: str, sliding_window: int = SLIDING_WINDOW) -> None:
    """Gemma-3 text (Gemma3ForCausalLM): two sliding-window layers, then a global one."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=2, head_dim=64, query_pre_attn_scalar=64,
        sliding_window=sliding_window, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        max_position_embeddings=2048, pad_token_id=0, bos_token_id=BOS, eos_token_id=EOS,
        initializer_range=0.2, tie_word_embeddings=False,  # tied, the random model repeats one token
    )
    _save(model_dir, lambda: Gemma3ForCausalLM(config))


def build_mistral(model_dir: str, sliding_window: int = SLIDING_WINDOW) -> None:
    """Mistral (MistralForCausalLM) with a sliding window on every layer."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, head_dim=64, sliding_window=sliding_window,
        max_position_embeddings=2048, bos_token_id=BOS, eos_token_id=EOS, initializer_range=0.2,
        tie_word_embeddings=False,
    )
    _save(model_dir, lambda: MistralForCausalLM(config))


def build_deepseek_v2(model_dir: str) -> None:
    """DeepSeek-V2-Lite-style MLA (DeepseekV2ForCausalLM): kv_lora_rank 512 and qk_rope_head_dim 64
    (the latent width 576 is the only one vLLM's CPU MLA kernels take), no q LoRA, and no MoE
    layer (first_k_dense_replace covers every layer)."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    config = DeepseekV2Config(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=512, q_lora_rank=None,
        qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64, first_k_dense_replace=2,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, n_shared_experts=1,
        max_position_embeddings=2048, bos_token_id=BOS, eos_token_id=EOS, initializer_range=0.2,
        tie_word_embeddings=False,
    )
    _save(model_dir, lambda: DeepseekV2ForCausalLM(config))


def build_granite_hybrid(model_dir: str) -> None:
    """Granite-4.0-H-style Mamba2 hybrid (GraniteMoeHybridForCausalLM) with dense MLPs (no local
    experts, as granite-4.0-h-micro) and no positional embedding: mamba, attention, mamba, mamba."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    config = GraniteMoeHybridConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, shared_intermediate_size=256,
        num_local_experts=0, num_hidden_layers=4, layer_types=["mamba", "attention", "mamba", "mamba"],
        num_attention_heads=2, num_key_value_heads=2, position_embedding_type="nope",
        mamba_n_heads=4, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4,
        mamba_expand=2, mamba_chunk_size=64,
        max_position_embeddings=2048, bos_token_id=BOS, eos_token_id=EOS, initializer_range=0.2,
        tie_word_embeddings=False,
    )
    _save(model_dir, lambda: GraniteMoeHybridForCausalLM(config))


ARCHS: dict[str, Callable[[str], None]] = {
    "llama": build_llama,
    "gemma3": build_gemma3,
    "mistral": build_mistral,
    "deepseek_v2": build_deepseek_v2,
    "granite_hybrid": build_granite_hybrid,
}


def build(arch: str, model_dir: str) -> None:
    """Write the tiny model of `arch` (a key of ARCHS) into model_dir."""
    ARCHS[arch](model_dir)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build")
    b.add_argument("arch", choices=sorted(ARCHS))
    b.add_argument("model_dir")
    args = parser.parse_args()
    build(args.arch, args.model_dir)
