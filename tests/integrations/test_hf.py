"""The transformers helper against a real daemon: restored prefixes continue exactly like a
full recompute, conversations reuse earlier turns, tenants never share pages, bad input is
refused clearly. Models are tiny and randomly initialised from configs (no downloads)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from daemon import Daemon, start_daemon, stop_keeper
from kvtier_client import KVTierClient, PageLayout, Tier
from kvtier_client.integrations.hf import (
    HFPrefixCache,
    LoadEverything,
    model_namespace,
    page_layout,
)
from kvtier_client.integrations.planner import LoadPlan, Planner
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


@pytest.fixture(scope="module")
def daemon(tmp_path_factory) -> Daemon:
    d = start_daemon(tmp_path_factory.mktemp("kvhf"), host_size="8MiB", disk_size="32MiB")
    try:
        yield d
    finally:
        code = d.stop()
        keeper_left = stop_keeper(d)
        assert code == 0 and not keeper_left, f"daemon exit {code}, arena keeper left running {keeper_left}:\n{d.log()}"


@pytest.fixture(scope="module")
def models():
    return {name: make() for name, make in ARCHS.items()}


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


def test_a_sliding_window_config_is_refused_when_the_helper_is_built(client, namespace):
    """Mistral's config sets sliding_window (no layer_types): refused up front, with the message
    a sliding cache layer gets at store time."""
    shape = dict(COMMON, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    sliding = transformers.MistralForCausalLM(transformers.MistralConfig(**shape, sliding_window=32)).eval()
    with pytest.raises(ValueError, match="sliding_window=32") as built:
        HFPrefixCache(client(), sliding, namespace=namespace)
    with pytest.raises(ValueError, match="sliding_window=32"):
        page_layout(sliding.config)

    torch.manual_seed(0)
    full = transformers.MistralForCausalLM(transformers.MistralConfig(**shape, sliding_window=None)).eval()
    cache = HFPrefixCache(client(), full, namespace=namespace, planner=LoadEverything())  # accepted
    ids = _prompt(40, seed=14)
    window = DynamicCache(config=sliding.config)
    with torch.no_grad():
        sliding(input_ids=ids, use_cache=True, **cache.cache_kwargs(window))
    with pytest.raises(ValueError, match="cache layer 0 is a sliding-window layer") as stored:
        cache.store(ids, window)
    reason = "supports models whose every layer is full attention"
    assert str(built.value).split(": ", 1)[1] == str(stored.value).split(": ", 1)[1]
    assert reason in str(built.value)


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

    sliding = transformers.Qwen2Config(**COMMON, num_attention_heads=4, num_key_value_heads=2,
                                       use_sliding_window=True, sliding_window=32, max_window_layers=0)
    with pytest.raises(ValueError, match="sliding"):
        page_layout(sliding, dtype="float32")


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
