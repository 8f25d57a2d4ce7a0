"""vLLM with the kvtier connector, end to end on CPU: two real daemons as two nodes on one
loopback Redis Cluster, a tiny random Llama and four separate engine processes (run with
.venv-vllm's python, see scripts/setup_vllm.sh), the first three on node A:

1. reference: no connector, no prefix caching: every token recomputed;
2. cold: with the connector; kvtier is empty, so every full prompt block is stored, chunk
   by chunk (prefill in chunks of 64 tokens);
3. warm: a fresh engine (nothing in vLLM's own cache) with the connector, in separate
   engine-core and worker processes as `vllm serve` runs them, with vLLM's KV events and
   stats on. After P1-P3 it runs three new prompts in one generate() call, at most 64
   prompt tokens per request and step, so they prefill side by side.
4. node B: a fresh engine on the second daemon, which holds nothing of its own: it gets the
   warm run's external hits from the cluster tier, with the reference's outputs.

Prompts: P1 (300 tokens), P2 (its first 200 tokens, then 60 others) and P3 (256 tokens,
exactly 8 blocks). Blocks are 32 tokens: vLLM's CPU attention needs a multiple of 32.
In the warm run P1 loads all 9 full blocks (288 tokens) from kvtier; P2 gets its first 6
blocks from vLLM's own prefix cache (P1 just ran) and the 2 more the cold run stored from
kvtier; P3, cached in full, loads 255 tokens because vLLM computes the last prompt token
itself. Greedy outputs and their logprobs equal the reference run's.

The batch: Q1 (200 new tokens), Q2 (Q1's first 160, then 60 others), Q3 (Q1's first 96,
then 40 others). Side by side, Q2 and Q3 get Q1's first blocks from vLLM's prefix cache in
the step Q1 computes them, and Q1 later computes blocks Q2 already stores: a connector that
stored what vLLM's cache served or what another request stores would say it stored twice
the blocks the daemon holds. What the requests say they stored, what the daemon holds, the
connector's Prometheus counters and its KV events must all be the 8 distinct new blocks.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path

import pytest
from daemon import start_daemon
from kvtier_client import KVTierClient, Tier
from vllm_engines import ENGINE_TIMEOUT, VLLM_PYTHON, assert_same_outputs, needs_vllm, run_engine

BLOCK = 32  # tests/integrations/vllm_engine_run.py BLOCK_SIZE

pytestmark = [needs_vllm, pytest.mark.timeout(3 * ENGINE_TIMEOUT)]


def _prompts() -> tuple[list[list[str]], list[list[str]]]:
    """P1-P3, run one by one, and the batch Q1-Q3 (module docstring)."""
    rng = random.Random(7)

    def words(n: int) -> list[str]:
        return [f"w{rng.randrange(509)}" for _ in range(n)]

    p1 = words(300)
    p2 = p1[:200] + words(60)
    p3 = words(256)
    q1 = words(200)
    return [p1, p2, p3], [q1, q1[:160] + words(60), q1[:96] + words(40)]


def _distinct_blocks(prompts: list[list[str]]) -> int:
    """Full blocks of distinct content (a block is named by its whole prefix)."""
    return len({tuple(p[: (i + 1) * BLOCK]) for p in prompts for i in range(len(p) // BLOCK)})


def _host_pages(daemon) -> int:
    """Pages the daemon holds in host memory for the engines' layout."""
    with KVTierClient(daemon.target) as client:
        pools = [p for p in client.stats().pools if p.layout.block_tokens == BLOCK]
    assert len(pools) == 1
    return pools[0].tier(Tier.HOST).cached_pages


def test_vllm_connector_end_to_end(tmp_path: Path, redis_cluster) -> None:
    prompts, batch = _prompts()
    prompt_file = tmp_path / "prompts.json"
    prompt_file.write_text(json.dumps([" ".join(p) for p in prompts]))
    batch_file = tmp_path / "batch.json"
    batch_file.write_text(json.dumps([" ".join(p) for p in batch]))
    model = tmp_path / "model"
    # Two nodes on one Redis Cluster: node A's daemon serves the reference, cold and warm
    # engines; node B's (its own socket, cache dir and arena) then serves a fresh engine
    # that finds A's prompts in the cluster tier.
    cluster = ("--cluster", redis_cluster.url)
    daemon = start_daemon(tmp_path, *cluster, host_size="32MiB", disk_size="64MiB")
    (tmp_path / "node-b").mkdir()
    node_b = start_daemon(tmp_path / "node-b", *cluster, host_size="32MiB", disk_size="64MiB")
    try:
        kv = ("--kvtier", daemon.target, "--namespace", "e2e/tiny-llama")
        ref = run_engine(tmp_path, "reference", model, prompt_file, "--build-model", "--in-process", "--no-prefix-caching",
                      "--batch-prompts", str(batch_file))
        # Prefill in chunks of 2 blocks: each chunk stores the blocks it completes.
        cold = run_engine(tmp_path, "cold", model, prompt_file, *kv, "--in-process", "--max-num-batched-tokens", "64")
        after_cold = _host_pages(daemon)
        warm = run_engine(tmp_path, "warm", model, prompt_file, *kv, "--batch-prompts", str(batch_file),
                       "--long-prefill-token-threshold", "64", "--kv-events", f"ipc://{tmp_path}/kv-events.sock",
                       "--stats")
        after_warm = _host_pages(daemon)
        remote = run_engine(tmp_path, "node-b", model, prompt_file, "--kvtier", node_b.target, "--namespace",
                         "e2e/tiny-llama", "--in-process")
        with KVTierClient(node_b.target) as client:
            node_b_pool = next(p for p in client.stats().pools if p.layout.block_tokens == BLOCK)
    finally:
        code = daemon.stop()
        code_b = node_b.stop()
    assert code == 0, daemon.log()
    assert code_b == 0, node_b.log()

    lengths = [len(r["prompt_token_ids"]) for r in ref["results"]]
    assert lengths == [len(p) for p in prompts]  # one token per word
    full = [n // BLOCK for n in lengths]  # full blocks: 9, 8, 8
    shared = 200 // BLOCK  # P2's blocks that are P1's: 6

    # Reference: nothing cached anywhere.
    assert [r["num_cached_tokens"] for r in ref["results"]] == [0, 0, 0]

    # Cold: nothing loaded; every full prompt block stored, P2's from where P1's chain ends.
    cold_kv = [r["kv_transfer_params"]["kvtier"] for r in cold["results"]]
    assert [c["loaded_tokens"] for c in cold_kv] == [0, 0, 0]
    assert [c["stored_blocks"] for c in cold_kv] == [full[0], full[1] - shared, full[2]]
    assert cold["results"][1]["num_cached_tokens"] == shared * BLOCK  # vLLM's own prefix cache
    # The worker measured P1's prefill and the scheduler's planner got it.
    assert cold_kv[2]["prefill_tokens_per_second"], cold_kv

    # Warm: the external hits, with vLLM computing the last token of a fully cached prompt.
    warm_kv = [r["kv_transfer_params"]["kvtier"] for r in warm["results"]]
    external = [c["loaded_tokens"] for c in warm_kv]
    assert external == [
        min(full[0] * BLOCK, lengths[0] - 1),  # 288: every full block of P1
        (full[1] - shared) * BLOCK,  # 64: P2's blocks beyond vLLM's local hit
        lengths[2] - 1,  # 255: P3 cached in full
    ], warm_kv
    assert [r["num_cached_tokens"] for r in warm["results"]] == [external[0], full[1] * BLOCK, external[2]]
    assert [c["stored_blocks"] for c in warm_kv] == [0, 0, 0]

    # Node B: a fresh engine on a fresh daemon gets the same external hits, from the cluster.
    remote_kv = [r["kv_transfer_params"]["kvtier"] for r in remote["results"]]
    assert [c["loaded_tokens"] for c in remote_kv] == external, remote_kv
    assert [c["stored_blocks"] for c in remote_kv] == [0, 0, 0]
    assert node_b_pool.tier(Tier.CLUSTER).hits >= loaded_blocks_of(full, shared)
    assert node_b_pool.tier(Tier.CLUSTER).corrupt_pages == node_b_pool.tier(Tier.CLUSTER).io_errors == 0

    # Same greedy tokens as recomputing everything, and the same logprobs.
    for run in (cold, warm, remote):
        assert_same_outputs(run["results"], ref["results"])
    assert_same_outputs(warm["batch_results"], ref["batch_results"])

    # The daemon holds each distinct block once, and the cold run says it stored exactly those.
    assert after_cold == _distinct_blocks(prompts) == sum(c["stored_blocks"] for c in cold_kv)

    # The batch: what the requests say they stored is what the daemon took, the 8 distinct new blocks.
    batch_kv = [r["kv_transfer_params"]["kvtier"] for r in warm["batch_results"]]
    new_blocks = _distinct_blocks(batch)
    assert new_blocks == 8
    assert [len(r["prompt_token_ids"]) for r in warm["batch_results"]] == [len(q) for q in batch]
    assert sum(b["stored_blocks"] for b in batch_kv) == after_warm - after_cold == new_blocks, batch_kv
    # The worker timed its copies of loaded pages, and the planner has the rate.
    assert all(b["copy_bytes_per_second"] for b in batch_kv), batch_kv

    # The connector's counters (vLLM's stats -> Prometheus vllm:kvtier_*).
    metrics = warm["metrics"]
    loaded_blocks = loaded_blocks_of(full, shared)
    assert metrics["vllm:kvtier_hit_blocks"] == metrics["vllm:kvtier_load_blocks"] == loaded_blocks
    assert metrics["vllm:kvtier_store_blocks"] == new_blocks
    assert metrics["vllm:kvtier_store_duplicate_blocks"] == metrics["vllm:kvtier_store_failed_blocks"] == 0
    # (How many of the batch's shared blocks were skipped because another request was storing
    # them, rather than served by vLLM's prefix cache or loaded once committed, depends on
    # when each commit lands: vllm:kvtier_skipped_store_blocks is not checked.)
    assert metrics["vllm:kvtier_load_bytes"] > 0

    # KV events: a BlockStored for each block kvtier took, in vLLM's format, with vLLM's own block hashes.
    events = warm["events"]["kvtier"]
    assert sum(len(e["block_hashes"]) for e in events) == new_blocks, events
    batch_tokens = [r["prompt_token_ids"] for r in warm["batch_results"]]
    for e in events:
        assert (e["medium"], e["locality"], e["ownership"], e["block_size"]) == ("CPU", "LOCAL", "kvtier", BLOCK)
        assert len(e["token_ids"]) == BLOCK * len(e["block_hashes"])
        assert any(_contains_blocks(t, e["token_ids"]) for t in batch_tokens), e
        assert set(e["block_hashes"]) <= set(warm["events"]["vllm_block_hashes"])

    print(f"\nvLLM engines: reference {ref['startup_s']:.1f}s start + {ref['generate_s']:.1f}s, cold "
          f"{cold['startup_s']:.1f}s + {cold['generate_s']:.1f}s, warm {warm['startup_s']:.1f}s + "
          f"{warm['generate_s']:.1f}s; warm external hit tokens {external}; batch stored "
          f"{[b['stored_blocks'] for b in batch_kv]} of {new_blocks} new blocks; node B {remote['startup_s']:.1f}s + "
          f"{remote['generate_s']:.1f}s, external hit tokens from the cluster {[c['loaded_tokens'] for c in remote_kv]}; counters "
          f"{ {k.removeprefix('vllm:kvtier_'): v for k, v in metrics.items()} }")


def loaded_blocks_of(full: list[int], shared: int) -> int:
    """Blocks a warm engine loads: P1's, P2's beyond vLLM's own hit, P3's (9 + 2 + 8)."""
    return full[0] + (full[1] - shared) + full[2]


def _contains_blocks(prompt: list[int], tokens: list[int]) -> bool:
    """`tokens` are whole blocks of `prompt`, at a block boundary."""
    return any(prompt[i : i + len(tokens)] == tokens for i in range(0, len(prompt) - len(tokens) + 1, BLOCK))


CONFIG_CHECK = r"""
import json, sys
from kvtier_client.integrations.vllm import ConnectorConfig
answers = {}
for name, extra in json.loads(sys.argv[1]).items():
    try:
        answers[name] = repr(ConnectorConfig.from_extra(extra, default_namespace="vllm/m"))
    except ValueError as exc:
        answers[name] = "ValueError: " + str(exc)
print(json.dumps(answers))
"""


def test_vllm_connector_config_errors(tmp_path: Path) -> None:
    """kv_connector_extra_config mistakes are refused at engine start with what to fix."""
    token = tmp_path / "token"
    token.write_text("s3cret-token-0123456789\n")
    cases = {
        "typo": {"targt": "unix:///x.sock"},
        "target": {"target": "kvtier.sock"},
        "token_file": {"token_file": str(tmp_path / "missing")},
        "both_tokens": {"token": "a" * 16, "token_file": str(token)},
        "planner": {"planner": "maybe"},
        "timeout": {"connect_timeout": 0},
        "format": {"kv_cache_format": "nhd"},
        "async": {"async_loads": "sometimes"},
        "max_load": {"max_load_tokens": -5},
        "tls_on_unix": {"target": "unix:///x.sock", "tls_ca": str(token)},
        "good": {"target": "unix:///run/kvtier.sock", "token_file": str(token), "salt": "t", "planner": False},
    }
    proc = subprocess.run([str(VLLM_PYTHON), "-c", CONFIG_CHECK, json.dumps(cases)], check=False, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    answers = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "unknown kv_connector_extra_config key(s) ['targt']" in answers["typo"]
    assert "neither 'unix:///abs/path.sock' nor 'host:port'" in answers["target"]
    assert "cannot read token_file" in answers["token_file"]
    assert "either token or token_file" in answers["both_tokens"]
    assert "must be true or false" in answers["planner"]
    assert "connect_timeout must be positive" in answers["timeout"]
    assert "kv_cache_format must be one of" in answers["format"]
    assert "async_loads must be one of" in answers["async"]
    assert "max_load_tokens must be a whole number" in answers["max_load"]
    assert "not a unix socket" in answers["tls_on_unix"]
    good = answers["good"]
    assert good.startswith("ConnectorConfig(") and "use_planner=False" in good and "salt=b't'" in good
    assert "s3cret" not in good  # the token never shows in a repr (or a log line)
