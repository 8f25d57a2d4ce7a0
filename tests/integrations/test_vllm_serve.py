"""`vllm serve` with the kvtier connector, as docs/integrations.md shows it, against a real
daemon, over the OpenAI API on loopback (tests/integrations/vllm_server.py; .venv-vllm's
`vllm` command, made by scripts/setup_vllm.sh; skipped without it).

The model is the tiny random Llama of vllm_models.py (2 layers, word-level tokenizer: one
token per word "w0".."w508"), blocks of 32 tokens, greedy answers.

- test_vllm_serve_loads_what_its_cache_lost (default suite): the server's own KV cache is
  40 blocks; a 300-token prompt is answered, five other prompts push its blocks out of
  vLLM's prefix cache, and the repeated prompt is answered from kvtier: 288 tokens (its 9
  full blocks) loaded, none from vLLM's own cache, the same answer and logprobs.
- test_vllm_serve_restart_multi_turn (slow): a chat of several turns, the server restarted,
  the same chat again: every turn of the second pass loads from kvtier and answers the same.
"""
from __future__ import annotations

import random
import subprocess
from pathlib import Path

import pytest
from daemon import start_daemon
from kvtier_client import KVTierClient, Tier
from vllm_engines import VLLM_PYTHON, needs_vllm
from vllm_server import START_TIMEOUT, Completion, VllmServer

BLOCK = 32  # vllm_models.BLOCK_SIZE: vLLM's CPU attention needs a multiple of 32
NAMESPACE = "serve/tiny-llama"
SERVE_ARGS = ("--dtype", "float32", "--block-size", str(BLOCK), "--max-model-len", "1024", "--enforce-eager",
              "--max-num-seqs", "4", "--seed", "0", "--enable-prompt-tokens-details")
ENGINE_BLOCKS = 40  # vLLM's own KV cache in the default test: 1280 tokens, five 300-token prompts overflow it

pytestmark = [needs_vllm, pytest.mark.timeout(2 * START_TIMEOUT + 300)]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """The tiny Llama's directory (written by .venv-vllm's python: transformers lives there)."""
    directory = tmp_path_factory.mktemp("serve") / "model"
    helper = Path(__file__).with_name("vllm_models.py")
    proc = subprocess.run([str(VLLM_PYTHON), str(helper), "build", "llama", str(directory)], check=False,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return directory


def _words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(509)}" for _ in range(n))


def _host_hits(target: str) -> int:
    """Blocks the daemon found in host memory for the engine's page layout, so far."""
    with KVTierClient(target) as client:
        pools = [p for p in client.stats().pools if p.layout.block_tokens == BLOCK]
    assert len(pools) == 1, pools
    return pools[0].tier(Tier.HOST).hits


def _assert_same_answer(got: Completion, want: Completion) -> None:
    assert got.text == want.text
    assert got.logprobs == pytest.approx(want.logprobs, abs=1e-3)


def test_vllm_serve_loads_what_its_cache_lost(tmp_path: Path, model: Path) -> None:
    rng = random.Random(11)
    prompt = _words(rng, 300)  # 9 full blocks and 12 tokens
    daemon = start_daemon(tmp_path, host_size="32MiB", disk_size="64MiB")
    try:
        server = VllmServer(model, tmp_path / "vllm.log", daemon.target, NAMESPACE, *SERVE_ARGS,
                            "--num-gpu-blocks-override", str(ENGINE_BLOCKS))
        try:
            first = server.complete(prompt)
            # Straight after, vLLM's own prefix cache holds the prompt: kvtier loads nothing.
            local = server.complete(prompt)
            flush = [server.complete(_words(rng, 300)) for _ in range(5)]
            before, hits_before = server.metrics(), _host_hits(daemon.target)
            again = server.complete(prompt)
            after, hits_after = server.metrics(), _host_hits(daemon.target)
        finally:
            server.stop()
    finally:
        code = daemon.stop()
    assert code == 0, daemon.log()

    assert (first.kvtier["loaded_tokens"], first.kvtier["stored_blocks"]) == (0, 9), first.kvtier
    assert (local.kvtier["loaded_tokens"], local.cached_tokens) == (0, 9 * BLOCK), local.kvtier
    assert [f.kvtier["stored_blocks"] for f in flush] == [9] * 5
    # The repeat: vLLM's own cache lost every block of it, kvtier served all 9 full blocks.
    delta = {name: after[name] - before.get(name, 0.0) for name in after}
    assert delta["vllm:prefix_cache_hits_total"] == 0
    assert again.kvtier["loaded_tokens"] == again.cached_tokens == 9 * BLOCK, again.kvtier
    assert delta["vllm:external_prefix_cache_hits_total"] == 9 * BLOCK
    assert delta["vllm:kvtier_load_blocks_total"] == 9
    assert delta["vllm:kvtier_load_failed_blocks_total"] == 0
    assert hits_after - hits_before >= 9  # the daemon found them in host memory
    _assert_same_answer(local, first)
    _assert_same_answer(again, first)
    print(f"\nvllm serve: ready in {server.startup_s:.1f}s; first answer {first.seconds * 1000:.0f} ms, "
          f"from vLLM's cache {local.seconds * 1000:.0f} ms, from kvtier {again.seconds * 1000:.0f} ms")


CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }} {% endfor %}"


@pytest.mark.slow
def test_vllm_serve_restart_multi_turn(tmp_path: Path, model: Path) -> None:
    """Two chats of four turns each (turn 1: 200 words, each later turn the chat so far, the
    answer and 60 more words), the server stopped and started again on the same daemon, the
    same chats again. Pass 2: every turn's prompt is cached to its last full block (vLLM's
    own cache holds the turns before; kvtier the rest), the first turn of each chat comes
    from kvtier whole, nothing new is stored, and every answer equals pass 1's."""
    rng = random.Random(5)
    chats = [[_words(rng, 200)] + [_words(rng, 60) for _ in range(3)] for _ in range(2)]
    template = tmp_path / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    daemon = start_daemon(tmp_path, host_size="64MiB", disk_size="128MiB")
    passes: list[list[list[Completion]]] = []
    startups = []
    try:
        for run in range(2):
            server = VllmServer(model, tmp_path / f"vllm-{run}.log", daemon.target, NAMESPACE, *SERVE_ARGS,
                                "--chat-template", str(template))
            try:
                passes.append([_converse(server, turns) for turns in chats])
                metrics = server.metrics()
            finally:
                server.stop()
            startups.append(server.startup_s)
        hits = _host_hits(daemon.target)
    finally:
        code = daemon.stop()
    assert code == 0, daemon.log()

    cold, warm = passes
    for cold_chat, warm_chat in zip(cold, warm, strict=True):
        for turn, (c, w) in enumerate(zip(cold_chat, warm_chat, strict=True)):
            _assert_same_answer(w, c)
            full = w.prompt_tokens // BLOCK * BLOCK
            assert w.cached_tokens == min(full, w.prompt_tokens - 1), (turn, w)
            assert w.kvtier["loaded_tokens"] > 0 and w.kvtier["stored_blocks"] == 0, (turn, w.kvtier)
        assert warm_chat[0].kvtier["loaded_tokens"] == warm_chat[0].cached_tokens
    loaded = sum(w.kvtier["loaded_tokens"] for chat in warm for w in chat)
    assert metrics["vllm:external_prefix_cache_hits_total"] == loaded
    assert metrics["vllm:kvtier_load_blocks_total"] == loaded // BLOCK
    assert metrics["vllm:kvtier_load_failed_blocks_total"] == 0
    assert hits >= loaded // BLOCK
    seconds = [sum(c.seconds for chat in p for c in chat) for p in passes]
    print(f"\nvllm serve: ready in {startups[0]:.1f}s, restarted in {startups[1]:.1f}s; {loaded} prompt tokens "
          f"loaded from kvtier after the restart; all turns {seconds[0]:.2f}s before, {seconds[1]:.2f}s after")


def _converse(server: VllmServer, turns: list[str]) -> list[Completion]:
    """One chat: each user turn sent with the chat so far, the server's answers included."""
    messages: list[dict] = []
    answers = []
    for text in turns:
        messages.append({"role": "user", "content": text})
        answers.append(server.chat(messages))
        messages.append({"role": "assistant", "content": answers[-1].text})
    return answers
