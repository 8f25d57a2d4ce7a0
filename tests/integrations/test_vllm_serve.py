"""`vllm serve` with the kvtier connector, as docs/integrations.md shows it, against a real
daemon, over the OpenAI API on loopback (tests/integrations/vllm_server.py; .venv-vllm's
`vllm` command, made by scripts/setup_vllm.sh; skipped without it).

The model is the tiny random Llama of vllm_models.py (2 layers, word-level tokenizer: one
token per word "w0".."w508"), blocks of 32 tokens, greedy answers.

- test_vllm_serve_loads_what_its_cache_lost (default suite): the server's own KV cache is
  40 blocks; a 300-token prompt is answered, five other prompts push its blocks out of
  vLLM's prefix cache, and the repeated prompt is answered from kvtier: 288 tokens (its 9
  full blocks) loaded, none from vLLM's own cache, the same answer and logprobs.
- slow: two chats of four turns, the server restarted on the same daemon, one chat replayed
  and the other resumed at its last turn: the same answers, the first turn and what vLLM's
  cache lost loaded from kvtier (test_vllm_serve_restart_multi_turn); every turn cached to
  its last full block (test_vllm_serve_restart_serves_whole_chats: a strict xfail, the
  connector leaves holes in a chat's chain, see its reason).
"""
from __future__ import annotations

import random
import subprocess
from dataclasses import dataclass
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


@dataclass
class RestartRun:
    """Two chats on a server, then on a restarted one (same daemon): chat 1 replayed turn by
    turn, chat 2 resumed at its last turn (the whole chat so far in one request)."""

    chats: list[list[Completion]]  # before the restart: both chats, every turn
    replay: list[Completion]  # after: chat 1's turns
    resumed: Completion  # after: chat 2's last turn, first thing the restarted server sees of it
    metrics: dict[str, float]  # the restarted server's
    startups: list[float]


@pytest.fixture(scope="module")
def restart_run(model: Path, tmp_path_factory) -> RestartRun:
    """Turn 1 has 200 words; each later turn sends the chat so far (the answers included) and
    60 more words: prompts of about 200, 272, 344 and 416 tokens, greedy answers of 12."""
    tmp = tmp_path_factory.mktemp("serve-restart")
    rng = random.Random(5)
    chats = [[_words(rng, 200)] + [_words(rng, 60) for _ in range(3)] for _ in range(2)]
    template = tmp / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    daemon = start_daemon(tmp, host_size="64MiB", disk_size="128MiB")
    try:
        first = VllmServer(model, tmp / "vllm-0.log", daemon.target, NAMESPACE, *SERVE_ARGS, "--chat-template",
                           str(template))
        try:
            before = [_converse(first, turns) for turns in chats]
        finally:
            first.stop()
        second = VllmServer(model, tmp / "vllm-1.log", daemon.target, NAMESPACE, *SERVE_ARGS, "--chat-template",
                            str(template))
        try:
            replay = _converse(second, chats[0])
            resumed = second.chat(_messages(chats[1], before[1][:-1]))
            metrics = second.metrics()
        finally:
            second.stop()
    finally:
        code = daemon.stop()
    assert code == 0, daemon.log()
    return RestartRun(before, replay, resumed, metrics, [first.startup_s, second.startup_s])


def _full_prefix(c: Completion) -> int:
    """The prompt tokens a cache can give: every full block, at most all tokens but the last."""
    return min(c.prompt_tokens // BLOCK * BLOCK, c.prompt_tokens - 1)


@pytest.mark.slow
def test_vllm_serve_restart_multi_turn(restart_run: RestartRun) -> None:
    """After the restart every answer equals the first server's; the first turn comes from
    kvtier whole, and no turn has less of its prompt cached than before the restart (vLLM's
    own cache held the earlier turns then; now kvtier gives what vLLM's cache lost)."""
    run = restart_run
    for turn, (before, after) in enumerate(zip(run.chats[0], run.replay, strict=True)):
        _assert_same_answer(after, before)
        assert after.cached_tokens >= before.cached_tokens, (turn, after, before)
        assert after.kvtier["stored_blocks"] == 0, (turn, after.kvtier)
    assert run.replay[0].kvtier["loaded_tokens"] == run.replay[0].cached_tokens == _full_prefix(run.replay[0])
    _assert_same_answer(run.resumed, run.chats[1][-1])
    loaded = sum(c.kvtier["loaded_tokens"] for c in [*run.replay, run.resumed])
    assert loaded > 0
    assert run.metrics["vllm:external_prefix_cache_hits_total"] == loaded
    assert run.metrics["vllm:kvtier_load_blocks_total"] == loaded // BLOCK
    assert run.metrics["vllm:kvtier_load_failed_blocks_total"] == 0
    seconds = [sum(c.seconds for c in run.chats[0]), sum(c.seconds for c in run.replay)]
    print(f"\nvllm serve: ready in {run.startups[0]:.1f}s, restarted in {run.startups[1]:.1f}s; {loaded} prompt "
          f"tokens loaded from kvtier after the restart; chat 1 took {seconds[0]:.2f}s before, {seconds[1]:.2f}s after")


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason=(
    "connector: a block vLLM's own prefix cache serves is never stored in kvtier, and a block an "
    "answer completes during decode is only ever served that way in the next turn, so each such "
    "block is a hole in the chat's key chain; after a restart the prefix kvtier gives stops at the "
    "first hole (and its later blocks, held by kvtier, go unused)"))
def test_vllm_serve_restart_serves_whole_chats(restart_run: RestartRun) -> None:
    """After the restart every turn of a replayed chat, and a chat resumed at its last turn,
    is cached to its last full block (vLLM's cache and kvtier together)."""
    run = restart_run
    got = [c.cached_tokens for c in [*run.replay, run.resumed]]
    assert got == [_full_prefix(c) for c in [*run.replay, run.resumed]]


def _messages(turns: list[str], answers: list[Completion]) -> list[dict]:
    """The chat so far: each user turn, then its answer (the last turn has none yet)."""
    messages: list[dict] = []
    for i, text in enumerate(turns):
        messages.append({"role": "user", "content": text})
        if i < len(answers):
            messages.append({"role": "assistant", "content": answers[i].text})
    return messages


def _converse(server: VllmServer, turns: list[str]) -> list[Completion]:
    """One chat: each user turn sent with the chat so far, the server's answers included."""
    answers: list[Completion] = []
    for n in range(1, len(turns) + 1):
        answers.append(server.chat(_messages(turns[:n], answers)))
    return answers
