"""The transformers helper against a real daemon: restored prefixes continue exactly like a
full recompute, conversations reuse earlier turns, tenants never share pages, bad input is
refused clearly; sliding-window and attention/recurrent hybrid models restore only what
every cache group has (a window's blocks, a state at a block boundary). Models are tiny and
randomly initialised from configs (no downloads)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the hybrids' kernels fall back to torch; nothing is fetched
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from daemon import Daemon, start_daemon, stop_keeper
from kvtier_client import KVTierClient, PageLayout, Tier
from kvtier_client.integrations.hf import (
    GroupPages,
    HFPrefixCache,
    LoadEverything,
    model_namespace,
    page_layout,
)
from kvtier_client.integrations.planner import LoadPlan, Planner
from prometheus_client.parser import text_string_to_metric_families
from transformers import DynamicCache

ROOT = Path(__file__).resolve().parents[2]
B = 16
TOL = 1e-4
COMMON = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, max_position_embeddings=1024,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)


def _llama(seed: int = 0, **overrides):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**{**COMMON, "num_attention_heads": 4, "num_key_value_heads": 2, **overrides})
    return transformers.LlamaForCausalLM(config).eval()


def _qwen2(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.Qwen2Config(**COMMON, num_attention_heads=4, num_key_value_heads=2)
    return transformers.Qwen2ForCausalLM(config).eval()


def _neox(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.GPTNeoXConfig(**COMMON, num_attention_heads=4)  # multi-head: no num_key_value_heads
    return transformers.GPTNeoXForCausalLM(config).eval()


ARCHS = {"llama": _llama, "qwen2": _qwen2, "gpt_neox": _neox}

# Sliding-window and hybrid models: head_dim 32 and 2 KV heads everywhere, so their groups
# share the pools of the models above; a window of 24 tokens spans two or three blocks.
HEADS = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32)
WINDOW = 24
MAMBA = dict(mamba_n_heads=8, mamba_d_head=32, mamba_d_state=16, mamba_n_groups=1, mamba_expand=2, mamba_chunk_size=16)
WINDOWED = {  # name: a function building the model
    "gemma2": lambda: transformers.Gemma2ForCausalLM(
        transformers.Gemma2Config(**COMMON, **HEADS, sliding_window=WINDOW)),
    "gemma3": lambda: transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        **{**COMMON, "num_hidden_layers": 3}, **HEADS, sliding_window=WINDOW, sliding_window_pattern=3)),
    "mistral_sliding": lambda: transformers.MistralForCausalLM(
        transformers.MistralConfig(**COMMON, **HEADS, sliding_window=WINDOW)),
    "llama4_chunked": lambda: transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(
        **COMMON, **HEADS, attention_chunk_size=WINDOW, num_local_experts=1, intermediate_size_mlp=256,
        no_rope_layers=[1, 1], moe_layers=[])),
}
HYBRID = {
    "granite4_h": lambda: transformers.GraniteMoeHybridForCausalLM(transformers.GraniteMoeHybridConfig(
        **COMMON, **HEADS, layer_types=["mamba", "attention"], num_local_experts=0, **MAMBA)),
    "falcon_h1": lambda: transformers.FalconH1ForCausalLM(
        transformers.FalconH1Config(**COMMON, **HEADS, mamba_d_ssm=256, **MAMBA)),
    "qwen3_next": lambda: transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(
        **COMMON, **HEADS, layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32, num_experts=0,
        mlp_only_layers=[0, 1])),
}


def _made(make, seed: int = 0):
    torch.manual_seed(seed)
    return make().eval()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory) -> Daemon:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = start_daemon(tmp_path_factory.mktemp("kvhf"), "--max-pools", "12", "--metrics-port", str(port),
                     host_size="8MiB", disk_size="32MiB")
    d.metrics_port = port
    try:
        yield d
    finally:
        code = d.stop()
        keeper_left = stop_keeper(d)
        assert code == 0 and not keeper_left, f"daemon exit {code}, arena keeper left running {keeper_left}:\n{d.log()}"


@pytest.fixture(scope="module")
def models():
    return {name: make() for name, make in ARCHS.items()}


@pytest.fixture(scope="module")
def grouped():
    """The sliding-window and hybrid models, built once (a few seconds of imports in all)."""
    return {name: _made(make) for name, make in {**WINDOWED, **HYBRID}.items()}


@pytest.fixture
def client(daemon, request):
    made = []

    def make() -> KVTierClient:
        c = KVTierClient(daemon.target)
        made.append(c)
        return c

    try:
        yield make
    finally:
        for c in made:
            c.close()


@pytest.fixture
def namespace(request) -> str:
    return f"test-hf/{request.node.name}"


def _prompt(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def _full_logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=True).logits


@pytest.mark.parametrize("arch", list(ARCHS))
def test_restored_prefix_continues_exactly_like_a_full_recompute(arch, models, client, namespace):
    model = models[arch]
    cache = HFPrefixCache(client(), model, namespace=namespace, planner=LoadEverything())
    ids = _prompt(75, seed=1)
    full = _full_logits(model, ids)

    first = cache.prefill(ids)
    assert first.restored.tokens == 0 and first.restored.cached_blocks == 0
    assert (first.stored.full_blocks, first.stored.stored_blocks, first.stored.already_cached) == (4, 4, 0)
    assert (first.logits - full).abs().max().item() <= TOL

    second = cache.prefill(ids)
    r = second.restored
    assert (r.blocks, r.tokens, r.suffix_tokens) == (4, 64, 11)
    assert r.tiers == (Tier.HOST,) * 4 and r.blocks_from(Tier.HOST) == 4 and r.promoted == 0
    assert second.cache.get_seq_length() == 75
    # Every suffix position, not only the last: the restored KV is the recomputed KV.
    assert (second.logits - full[:, 64:]).abs().max().item() <= TOL
    assert second.stored.stored_blocks == 0 and second.stored.already_cached == 4


@pytest.mark.parametrize("arch", list(ARCHS))
def test_generate_with_a_restored_prefix_gives_the_same_tokens(arch, models, client, namespace):
    model = models[arch]
    cache = HFPrefixCache(client(), model, namespace=namespace, planner=LoadEverything())
    ids = _prompt(53, seed=2)
    with torch.no_grad():
        plain = model.generate(ids, max_new_tokens=12, do_sample=False, attention_mask=torch.ones_like(ids))
    cold = cache.generate(ids, max_new_tokens=12, do_sample=False)
    # The cache holds the prompt and all generated tokens but the last: (53 + 12 - 1) // 16 blocks.
    assert cold.stored.stored_blocks == 4
    warm = cache.generate(ids, max_new_tokens=12, do_sample=False)
    assert warm.restored.tokens == 48  # 3 blocks; the prompt's 4th block is incomplete
    assert cold.new_tokens == warm.new_tokens == plain[0, 53:].tolist()
    assert torch.equal(warm.sequences, plain)


def test_multi_turn_conversation_restores_earlier_turns(models, client, namespace):
    model = models["llama"]
    cache = HFPrefixCache(client(), model, namespace=namespace, planner=LoadEverything())
    conversation = _prompt(40, seed=3)[0].tolist()
    first_prompt_tokens, stored_before = len(conversation), 0
    for turn in range(3):
        out = cache.generate(conversation, max_new_tokens=10, do_sample=False)
        with torch.no_grad():
            ids = torch.tensor([conversation])
            plain = model.generate(ids, max_new_tokens=10, do_sample=False, attention_mask=torch.ones_like(ids))
        assert out.sequences[0].tolist() == plain[0].tolist(), f"turn {turn}"
        # Everything the previous turn stored (its prompt and its reply) comes back.
        assert out.restored.tokens == stored_before * B
        if turn:
            assert out.restored.tokens > first_prompt_tokens
        stored_before = (len(out.sequences[0]) - 1) // B  # the cache holds all but the last new token
        assert out.stored.full_blocks == stored_before
        conversation = out.sequences[0].tolist() + _prompt(21, seed=10 + turn)[0].tolist()


def test_tenants_with_different_salts_never_share_pages(models, client, daemon):
    model = models["llama"]
    kv = client()
    tenant_a = HFPrefixCache(kv, model, salt=b"tenant-a", planner=LoadEverything())  # registers the model namespace
    tenant_b = HFPrefixCache(kv, model, salt="tenant-b", planner=LoadEverything())
    assert tenant_a.namespace == tenant_b.namespace == model_namespace(model)
    ids = _prompt(70, seed=4)

    assert tenant_a.prefill(ids).stored.stored_blocks == 4
    assert tenant_a.restore(ids).blocks == 4
    b = tenant_b.restore(ids)
    assert (b.cached_blocks, b.blocks, b.tokens) == (0, 0, 0)
    assert tenant_b.prefill(ids).stored.stored_blocks == 4  # its own pages, not A's
    assert tenant_a.restore(ids, salt=b"tenant-c").cached_blocks == 0  # a per-call salt too
    # Another client on another namespace (same model, another name) sees nothing either.
    other = HFPrefixCache(client(), model, model_id="same-weights-other-name", salt=b"tenant-a",
                          planner=LoadEverything())
    assert other.namespace != tenant_a.namespace and other.restore(ids).cached_blocks == 0


def test_pages_demoted_to_disk_are_promoted_and_still_exact(models, client, namespace):
    model = models["qwen2"]
    kv = client()
    cache = HFPrefixCache(kv, model, namespace=namespace, planner=LoadEverything())
    ids = _prompt(100, seed=5)
    full = _full_logits(model, ids)
    cache.prefill(ids)
    with kv.borrow(kv.pool.capacity(Tier.HOST)):  # fills the host tier: every cached page goes to disk
        pass
    assert kv.lookup(kv.block_keys(ids[0].tolist())).tiers == (Tier.DISK,) * 6
    out = cache.prefill(ids)
    assert (out.restored.blocks, out.restored.tiers, out.restored.promoted) == (6, (Tier.DISK,) * 6, 6)
    assert (out.logits - full[:, 96:]).abs().max().item() <= TOL


def test_small_batches_and_a_prefix_of_whole_blocks(models, client, namespace):
    model = models["llama"]
    cache = HFPrefixCache(client(), model, namespace=namespace, planner=LoadEverything(), batch_blocks=2)
    ids = _prompt(5 * B, seed=6)  # whole blocks: all restored but the last token, which is prefilled
    full = _full_logits(model, ids)
    assert cache.prefill(ids).stored.stored_blocks == 5  # in batches of 2, chained by parent
    out = cache.prefill(ids)
    assert (out.restored.cached_blocks, out.restored.blocks, out.restored.tokens) == (5, 5, 5 * B - 1)
    assert out.restored.suffix_tokens == 1 and out.cache.get_seq_length() == 5 * B
    assert (out.logits - full[:, -1:]).abs().max().item() <= TOL
    assert cache.restore(ids, max_blocks=2).tokens == 2 * B
    short = cache.prefill(_prompt(B - 1, seed=7))  # no full block: nothing to store or restore
    assert short.restored.tokens == 0 and short.stored.full_blocks == 0


def test_bfloat16_kv_round_trips_bit_for_bit(client, namespace):
    model = _llama(seed=3).to(torch.bfloat16)
    cache = HFPrefixCache(client(), model, namespace=namespace, planner=LoadEverything())
    assert cache.layout.dtype == "bfloat16"  # numpy sees raw bits; torch the real dtype
    ids = _prompt(50, seed=12)
    first = cache.prefill(ids)
    restored = cache.restore(ids)
    assert restored.tokens == 48
    for mine, original in zip(restored.cache.layers, first.cache.layers):
        assert mine.keys.dtype == torch.bfloat16
        assert torch.equal(mine.keys, original.keys[:, :, :48]) and torch.equal(mine.values, original.values[:, :, :48])


class _FixedPlanner:
    def __init__(self, load: int) -> None:
        self.load = load
        self.observed: list[tuple[int, float]] = []

    def plan(self, lookup):
        n = min(self.load, lookup.hit_blocks)
        return LoadPlan(n, lookup.hit_blocks, 0.0, 0.0, "fixed")

    def observe_prefill(self, tokens, seconds):
        self.observed.append((tokens, seconds))


def test_only_the_planned_blocks_are_loaded_and_prefills_are_reported(models, client, namespace):
    model = models["llama"]
    planner = _FixedPlanner(load=1)
    cache = HFPrefixCache(client(), model, namespace=namespace, planner=planner)
    ids = _prompt(70, seed=8)
    full = _full_logits(model, ids)
    cache.prefill(ids)
    out = cache.prefill(ids)
    assert (out.restored.cached_blocks, out.restored.plan.load_blocks, out.restored.blocks) == (4, 1, 1)
    assert (out.logits - full[:, 16:]).abs().max().item() <= TOL
    assert [t for t, _ in planner.observed] == [70, 54] and all(s > 0 for _, s in planner.observed)


def test_default_planner_decides_and_the_result_is_exact_either_way(models, client, namespace):
    model = models["llama"]
    kv = client()
    cache = HFPrefixCache(kv, model, namespace=namespace)
    assert isinstance(cache.planner, Planner)
    ids = _prompt(90, seed=9)
    full = _full_logits(model, ids)
    cache.prefill(ids)  # a measured prefill: the planner now weighs loading against recomputing
    assert cache.planner.prefill_tokens_per_second > 0
    out = cache.prefill(ids)
    assert out.restored.blocks == out.restored.plan.load_blocks <= out.restored.cached_blocks == 5
    assert (out.logits - full[:, out.restored.tokens :]).abs().max().item() <= TOL


def test_model_identity_and_layout_come_from_the_model(models):
    want = PageLayout(layers=2, kv_heads=2, head_dim=32, block_tokens=16, dtype="float32")
    assert page_layout(models["llama"]) == want
    assert page_layout(models["gpt_neox"], block_tokens=8).kv_heads == 4
    assert page_layout(models["llama"].config, dtype=torch.bfloat16).dtype == "bfloat16"
    with pytest.raises(ValueError, match="dtype"):
        page_layout(transformers.LlamaConfig(**COMMON))
    same = _llama(seed=0)
    assert model_namespace(same) == model_namespace(models["llama"])  # same weights, same namespace
    assert model_namespace(_llama(seed=1)) != model_namespace(same)  # another initialisation
    assert model_namespace(same, model_id="org/my-model").startswith("hf/org/my-model/")


def test_one_checkpoint_at_two_paths_shares_pages_and_other_weights_do_not(tmp_path, client):
    """Replicas that mount the same weights at different paths get one namespace (the load path
    is not part of it) and restore each other's pages; other weights or another config do not."""
    model = _llama(seed=5)
    replicas = []
    for where in (tmp_path / "replica-a", tmp_path / "mnt" / "models" / "replica-b"):
        model.save_pretrained(where)
        replicas.append(transformers.AutoModelForCausalLM.from_pretrained(where).eval())
    a, b = replicas
    assert a.config._name_or_path != b.config._name_or_path
    assert model_namespace(a) == model_namespace(b) == model_namespace(model)
    assert model_namespace(_llama(seed=6)) != model_namespace(a)  # other weights
    assert model_namespace(_llama(seed=5, rms_norm_eps=1e-5)) != model_namespace(a)  # same weights, other config

    ids = _prompt(70, seed=13)
    stored = HFPrefixCache(client(), a, planner=LoadEverything()).prefill(ids).stored
    restored = HFPrefixCache(client(), b, planner=LoadEverything()).restore(ids)
    assert stored.stored_blocks + stored.already_cached == 4 and restored.blocks == 4


def _helper(model, client, namespace, **kwargs) -> HFPrefixCache:
    """A helper that loads everything it finds, with `client` (the fixture) for further layouts."""
    return HFPrefixCache(client(), model, namespace=namespace, planner=LoadEverything(), connect=client, **kwargs)


@pytest.mark.parametrize("arch", [*WINDOWED, *HYBRID])
def test_windowed_and_hybrid_models_restore_exactly(arch, grouped, client, namespace):
    """Second prefill of a 75-token prompt: 4 blocks come back, every group has what it needs
    (a window group all its blocks, stored while the cache recorded them; a state group the
    state at the last block boundary, 64, where the first prefill stopped a piece)."""
    model = grouped[arch]
    cache = _helper(model, client, namespace)
    window = f"window-{WINDOW}"
    assert tuple(g.name for g in cache.groups) == {
        "gemma2": ("full", window), "gemma3": ("full", window), "mistral_sliding": (window,),
        "llama4_chunked": (window,),
    }.get(arch, ("full", "state"))
    ids = _prompt(75, seed=21)
    full = _full_logits(model, ids)

    first = cache.prefill(ids)
    assert first.restored.tokens == 0 and first.stored.full_blocks == 4
    assert (first.logits - full).abs().max().item() <= TOL  # a prefill in pieces is the same prefill
    stored = {g.group: g.pages for g in first.stored.groups}
    assert stored == {g.name: 1 if g.kind.value == "state" else 4 for g in cache.groups}

    second = cache.prefill(ids)
    r = second.restored
    assert (r.blocks, r.tokens, r.cached_blocks) == (4, 64, 4), r.note
    read = {g.group: g.pages for g in r.groups}
    assert read == {g.name: {"full": 4, "window": 2, "state": 1}[g.kind.value] for g in cache.groups}
    assert (second.logits - full[:, 64:]).abs().max().item() <= TOL
    assert second.stored.stored_blocks == 0 and second.stored.already_cached == 4
    cache.close()


@pytest.mark.parametrize("arch", ["gemma3", "mistral_sliding", "granite4_h", "falcon_h1"])
def test_windowed_and_hybrid_generate_gives_the_same_tokens(arch, grouped, client, namespace):
    model = grouped[arch]
    cache = _helper(model, client, namespace)
    ids = _prompt(53, seed=22)
    with torch.no_grad():
        plain = model.generate(ids, max_new_tokens=12, do_sample=False, attention_mask=torch.ones_like(ids))
    cold = cache.generate(ids, max_new_tokens=12, do_sample=False)
    assert cold.stored.stored_blocks == 4  # (53 + 12 - 1) // 16
    warm = cache.generate(ids, max_new_tokens=12, do_sample=False)
    assert warm.restored.tokens == 48, warm.restored.note  # a state too: the head stopped a piece at 48
    assert cold.new_tokens == warm.new_tokens == plain[0, 53:].tolist()
    for layer in warm.cache.layers:  # window layers are back to their window once stored
        if getattr(layer, "is_sliding", False):
            assert layer.keys.shape[2] == WINDOW - 1 and not layer.record_past


def test_a_hybrid_conversation_restores_each_earlier_turn_from_its_last_state(grouped, client, namespace):
    """The state at the last block boundary of each turn's reply is taken during generate()
    (a logits processor that only watches), so the next turn restores the whole of it."""
    model = grouped["granite4_h"]
    cache = _helper(model, client, namespace)
    conversation, stored_before = _prompt(40, seed=23)[0].tolist(), 0
    for turn in range(2):
        out = cache.generate(conversation, max_new_tokens=10, do_sample=False)
        with torch.no_grad():
            ids = torch.tensor([conversation])
            plain = model.generate(ids, max_new_tokens=10, do_sample=False, attention_mask=torch.ones_like(ids))
        assert out.sequences[0].tolist() == plain[0].tolist(), f"turn {turn}"
        assert out.restored.tokens == stored_before * B, out.restored.note
        stored_before = (len(out.sequences[0]) - 1) // B
        conversation = out.sequences[0].tolist() + _prompt(21, seed=30 + turn)[0].tolist()
    assert stored_before * B > 40  # the second turn restored past the first prompt


def test_missing_window_blocks_stop_the_restore_where_a_window_is_whole(grouped, client, namespace):
    """A cache that did not record its window layers' past (the model's own) gives only the
    last window's blocks: a later restore stops where a whole window is cached."""
    model = grouped["gemma2"]
    cache = _helper(model, client, namespace)
    short = _prompt(40, seed=24)
    cache.prefill(short)  # full and window blocks 0, 1
    long = torch.cat([short, _prompt(60, seed=25)], dim=1)  # 100 tokens
    own = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=long, use_cache=True, **cache.cache_kwargs(own))
    stored = cache.store(long, own)  # the window layer holds tokens [77, 100): block 5 only
    assert stored.groups == (GroupPages("full", 4, 2), GroupPages(f"window-{WINDOW}", 1, 2))

    full = _full_logits(model, long)
    out = cache.prefill(long, store=False)
    r = out.restored
    # At 6 blocks the window [73, 96) needs block 4: missing. At 4, [41, 64) needs 2: missing.
    # At 2, [9, 32) is blocks 0 and 1: cached.
    assert (r.cached_blocks, r.blocks, r.tokens) == (2, 2, 32)
    assert (out.logits - full[:, 32:]).abs().max().item() <= TOL


def test_a_missing_state_stops_the_restore_at_a_boundary_that_has_one(grouped, client, namespace):
    model = grouped["granite4_h"]
    cache = _helper(model, client, namespace)
    short = _prompt(40, seed=26)
    assert cache.prefill(short).stored.groups[1] == GroupPages("state", 1, 0)  # at 32 tokens
    long = torch.cat([short, _prompt(45, seed=27)], dim=1)  # 85 tokens
    own = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=long, use_cache=True, **cache.cache_kwargs(own))
    stored = cache.store(long, own)  # its state is at 85 tokens, no boundary: KV only
    assert stored.groups == (GroupPages("full", 3, 2), GroupPages("state", 0, 0))

    full = _full_logits(model, long)
    out = cache.prefill(long)  # states at 5, 4 and 3 blocks are missing; 2 has one
    assert (out.restored.cached_blocks, out.restored.tokens) == (2, 32)
    assert (out.logits - full[:, 32:]).abs().max().item() <= TOL
    again = cache.prefill(long)  # the prefill kept the state at 80
    assert again.restored.tokens == 80 and (again.logits - full[:, 80:]).abs().max().item() <= TOL


def _calls(daemon: Daemon) -> dict[str, float]:
    """The daemon's served calls so far, by method (every transport)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics", timeout=10) as response:
        families = text_string_to_metric_families(response.read().decode())
    calls: dict[str, float] = {}
    for family in families:
        for sample in family.samples:
            if sample.name == "kvtier_rpc_duration_seconds_count":
                method = sample.labels["method"]
                calls[method] = calls.get(method, 0) + sample.value
    return calls


@pytest.mark.parametrize("arch", ["gemma2", "granite4_h"])
def test_a_hybrid_restore_asks_the_daemon_once_for_every_group(arch, grouped, client, daemon, namespace):
    """A restore whose point moves down (window blocks missing, states missing) still asks
    the daemon once: one LookupGroups over every group's pool, no Lookup per group and point."""
    model = grouped[arch]
    cache = _helper(model, client, namespace)
    short = _prompt(40, seed=31)
    cache.prefill(short)  # blocks 0 and 1 (and a state at 32)
    long = torch.cat([short, _prompt(60, seed=32)], dim=1)  # 100 tokens: points 6 .. 3 miss, 2 is whole
    before = _calls(daemon)
    restored = cache.restore(long)
    after = _calls(daemon)
    assert restored.tokens == 32, restored.note
    assert after.get("LookupGroups", 0) - before.get("LookupGroups", 0) == 1
    assert after.get("Lookup", 0) == before.get("Lookup", 0)
    cache.close()


def test_state_every_keeps_states_a_shared_prefix_restores_from(grouped, client, namespace):
    model = grouped["qwen3_next"]
    shared = _prompt(40, seed=28)
    other = torch.cat([shared, _prompt(30, seed=29)], dim=1)
    plain = _helper(model, client, namespace)
    plain.prefill(torch.cat([shared, _prompt(35, seed=30)], dim=1))  # a state at 64 only
    assert plain.restore(other).tokens == 0  # blocks 0-1 are cached, but no state at 32
    every = _helper(model, client, namespace + "-every", state_every=1)
    every.prefill(torch.cat([shared, _prompt(35, seed=30)], dim=1))  # states at 16, 32, 48, 64
    out = every.prefill(other)
    assert out.restored.tokens == 32
    assert (out.logits - _full_logits(model, other)[:, 32:]).abs().max().item() <= TOL


def test_groups_with_equal_layouts_share_a_client_but_never_a_key(grouped, client, namespace):
    """Gemma 2's one window layer and one full layer have the same page layout: one client,
    one pool, and keys salted per group (if they collided, the window pages would be found
    as duplicates of the full ones)."""
    model = grouped["gemma2"]
    kv = client()
    cache = HFPrefixCache(kv, model, namespace=namespace, planner=LoadEverything())  # no connect needed
    assert len({g.layout for g in cache.groups}) == 1 and all(cache.client_for(g) is kv for g in cache.groups)
    ids = _prompt(70, seed=31)
    assert cache.prefill(ids).stored.groups == (GroupPages("full", 4, 0), GroupPages(f"window-{WINDOW}", 4, 0))
    full_keys, window_keys = (g.keys(kv.block_keys, ids[0].tolist(), b"") for g in cache.groups)
    assert full_keys == kv.block_keys(ids[0].tolist()) and not set(full_keys) & set(window_keys)


def test_models_the_helper_cannot_restore_are_refused_when_it_is_built(grouped, client, namespace):
    torch.manual_seed(0)
    mamba = transformers.Mamba2ForCausalLM(transformers.Mamba2Config(
        vocab_size=256, hidden_size=128, num_hidden_layers=2, num_heads=8, head_dim=32, state_size=16, n_groups=1,
        expand=2, chunk_size=16)).eval()
    with pytest.raises(ValueError, match="no attention layer"):
        HFPrefixCache(client(), mamba, namespace=namespace)
    with pytest.raises(ValueError, match="pass connect="):  # a hybrid needs a client per layout
        HFPrefixCache(client(), grouped["granite4_h"], namespace=namespace)
    with pytest.raises(ValueError, match="several kinds of layers"):
        page_layout(grouped["gemma2"])
    assert page_layout(grouped["mistral_sliding"]) == page_layout(_llama())  # one window group: one layout


def test_bad_input_is_refused_clearly(models, client, namespace):
    model = models["llama"]
    kv = client()
    kv.register(namespace, PageLayout(layers=2, kv_heads=2, head_dim=32, block_tokens=16, dtype="float16"))
    with pytest.raises(ValueError, match="model config mismatch"):
        HFPrefixCache(kv, model)

    cache = HFPrefixCache(client(), model, namespace=namespace + "-ok", planner=LoadEverything())
    with pytest.raises(ValueError, match="batch size 2"):
        cache.restore(torch.zeros((2, 20), dtype=torch.long))
    with pytest.raises(ValueError, match="empty"):
        cache.restore([])
    with pytest.raises(ValueError, match="do not pass a cache"):
        cache.generate([1, 2, 3], cache=DynamicCache())
    # A cache from another model (4 kv heads, not 2) is refused before anything is written.
    foreign = DynamicCache()
    with torch.no_grad():
        models["gpt_neox"](input_ids=_prompt(40, seed=11), use_cache=True, **cache.cache_kwargs(foreign))
    with pytest.raises(ValueError, match="model config mismatch"):
        cache.store(_prompt(40, seed=11), foreign)
    # A sliding-window cache (same shapes) is not this model's either.
    window = DynamicCache(config=transformers.MistralConfig(**COMMON, **HEADS, sliding_window=WINDOW))
    with torch.no_grad():
        models["llama"](input_ids=_prompt(40, seed=11), use_cache=True, **cache.cache_kwargs(window))
    with pytest.raises(ValueError, match="cache layer 0 is not a full layer"):
        cache.store(_prompt(40, seed=11), window)


def test_importing_the_client_and_the_helper_loads_neither_torch_nor_transformers():
    code = (
        "import sys, kvtier_client, kvtier_client.integrations.hf\n"
        "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_chat_example_runs_two_turns_against_a_daemon(daemon):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "hf_chat.py"), "--socket", str(daemon.socket),
         "--max-new-tokens", "8"],
        input="hello there, how are you today?\nand now something else entirely\n",
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    replies = [line for line in done.stdout.splitlines() if "bot>" in line]
    stats = [line for line in done.stdout.splitlines() if "[kvtier:" in line]
    assert len(replies) == 2 and len(stats) == 2, done.stdout
    assert "0 of" in stats[0] and "new blocks stored" in stats[0]
