"""The vLLM connector's halves without an engine (tests/integrations/vllm_checks.py, run with
.venv-vllm's python against a real daemon): each block stored once, the worker's report, the
stats and KV events; and the batched copies, timed against the per-page copies they replaced.
One subprocess runs both (importing vLLM takes ~10 s); skipped when .venv-vllm is absent."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from daemon import start_daemon

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("KVTIER_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
CHECKS = Path(__file__).with_name("vllm_checks.py")

pytestmark = pytest.mark.skipif(
    not VLLM_PYTHON.exists(),
    reason=f"{VLLM_PYTHON} is absent: run scripts/setup_vllm.sh to create .venv-vllm (vLLM CPU + kvtier-client)",
)


@pytest.fixture(scope="module")
def checks(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("vllm-checks")
    daemon = start_daemon(tmp, "--max-pools", "12", host_size="16MiB", disk_size="32MiB")
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KVTIER_", "VLLM_"))}
        env.update(VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
        # A small copy shape keeps this quick; vllm_checks.py copies alone runs the full-size one.
        command = [str(VLLM_PYTHON), str(CHECKS), "--target", daemon.target, "dedupe", "shapes", "groups", "keys", "async", "served", "copies", "--pages", "64",
                   "--layers", "4"]
        proc = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=tmp)
    finally:
        code = daemon.stop()
    assert proc.returncode == 0, f"{' '.join(command)}\n{proc.stderr[-6000:]}"
    assert code == 0, daemon.log()
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_each_block_is_stored_once_and_reported_as_the_daemon_took_it(checks):
    d = checks["dedupe"]
    first, second, third = d["steps"]
    # r2's first 4 blocks came from vLLM's prefix cache (r1 computes them in this step); r4 is
    # r3 again in blocks of its own, and r3 is storing them: each stores only what is new.
    assert first["saves"] == [["r1", 0, 5], ["r2", 4, 1], ["r3", 0, 3]]
    # r5's blocks were committed by another engine between its lookup and its save: the
    # daemon reports duplicates, and r5 says it stored none.
    assert second["saves"] == [["r5", 0, 2]]
    # r6 (r1's prompt) loads r1's 5 blocks, and they equal what r1 stored.
    assert third["loads"] == [["r6", [20, 21, 22, 23, 24]]] and third["copy_bytes"] > 0
    assert d["loaded_pages_equal_stored_blocks"]
    assert {k: v for k, v in d["stored_blocks"].items() if k != "r7"} == {
        "r1": 5, "r2": 1, "r3": 3, "r4": 0, "r5": 0, "r6": 0, "r6b": 0}
    assert d["loaded_tokens"]["r6"] == 5 * 32
    assert d["daemon_cached_pages"] == 5 + 1 + 3 + 2  # r5's 2 are the other engine's
    stats = d["stats"]
    assert (stats["store_blocks"], stats["store_duplicate_blocks"], stats["store_failed_blocks"]) == (9, 2, 0)
    assert stats["skipped_store_blocks"] == 4 + 3  # r2's served blocks, r4's blocks r3 stores
    assert (stats["hit_blocks"], stats["load_blocks"], stats["load_failed_blocks"]) == (10, 10, 0)  # r6, r6b


def test_the_blocks_vllm_holds_count_as_the_engines_and_loads_as_served(checks):
    """The connector tells the daemon how many leading blocks vLLM's prefix cache holds
    (docs/metrics.md, "Found and served"): those are not kvtier hits; what the worker loads is
    what kvtier served. Before, r2's lookup counted all 6 blocks as host hits."""
    s = checks["served"]
    assert s["r1"]["saved_blocks"] == 6 and s["r2"]["loads"] == [[10, 11]]  # blocks 4-5 into vLLM blocks 10, 11
    assert s["before"] == {"engine_blocks": 0, "lookup_blocks": 6, "miss_blocks": 6, "host_hits": 0, "host_served": 0,
                           "served_rate": 0.0}
    after = s["after"]
    assert (after["engine_blocks"], after["lookup_blocks"], after["miss_blocks"]) == (4, 6 + 2, 6)
    assert (after["host_hits"], after["host_served"]) == (2, 2)
    assert after["served_rate"] == 2 / 8


def test_kv_events_name_the_blocks_kvtier_took_with_vllms_hashes(checks):
    events = checks["dedupe"]["events"]
    assert [(e["req"], e["first"], e["blocks"]) for e in events] == [("r1", 0, 5), ("r2", 4, 1), ("r3", 0, 3)]
    for e in events:
        assert (e["medium"], e["locality"], e["ownership"], e["block_size"]) == ("CPU", "LOCAL", "kvtier", 32)
        assert e["hashes_match"] and e["tokens_match"] and e["parent_match"], e


def test_reset_cache_starts_a_new_key_epoch(checks):
    """vLLM resets after a weight update (and before sleep): the engine must never read pages
    stored before, which may hold other weights' KV; pages stay for other engines."""
    reset = checks["dedupe"]["reset"]
    assert reset["saves_sent"] == 1 and reset["storing_before"]
    assert reset["answer"] is True  # so vLLM's pause and sleep go on
    assert (reset["storing_after"], reset["sent_after"]) == (0, 1)
    assert reset["hit_after"] == 0  # r1's prompt, cached before the reset, is not a hit after it
    assert reset["renewed"]  # a request from before the reset never loads or stores under old keys


def test_the_worker_drops_and_restores_its_kv_around_sleep(checks):
    assert checks["dedupe"]["sleep_and_wake"]


def test_batched_copies_give_the_same_blocks_and_are_timed(checks):
    c = checks["copies"]
    assert c["same_blocks"]
    # Measured in this run, against a plain copy of the same bytes; printed, never asserted.
    print(f"\ncopies {c['shape']}: memcpy {c['memcpy_GBps']} GB/s; load per page {c['before_load_GBps']} GB/s "
          f"({c['before_load_vs_memcpy']}x memcpy) -> batched {c['after_load_GBps']} GB/s "
          f"({c['after_load_vs_memcpy']}x); save {c['before_save_GBps']} -> {c['after_save_GBps']} GB/s")


def test_engines_of_every_tensor_parallel_size_share_pages(checks):
    """A page holds every KV head: what a TP=2 engine stored is a TP=1 engine's hit and the
    other way round, each rank writing and reading only its heads."""
    s = checks["shapes"]
    for case, blocks in {"tp2_to_tp1": 3, "tp1_to_tp2": 2, "replicated": 2, "mla": 2}.items():
        assert s[case]["stored"] == blocks, (case, s[case])
        assert s[case]["loaded_tokens"] == blocks * 32, (case, s[case])
        assert s[case]["equal"], (case, s[case])
    assert s["replicated"]["writers"] == [True, False]  # one KV head, two ranks: rank 0 writes it


def test_a_page_is_committed_only_when_every_rank_wrote_its_part(checks):
    m = checks["shapes"]["missing_report"]
    assert m["stored"] == 0  # rank 1 never reported: the scheduler did not commit
    assert m["after"] == m["before"]  # nothing cached, no page left borrowed
    assert (m["then_loaded_tokens"], m["then_stored"]) == (0, 2)  # a miss; stored by the next engine


def test_multimodal_prompts_are_keyed_as_vllm_hashes_them(checks):
    """Equal token ids with different images (or none) share exactly the blocks vLLM's own
    prefix cache would share: those before the image."""
    k = checks["keys"]
    assert k["blocks"] == 4
    assert k["ours_equal"] == k["vllm_equal"]
    assert k["ours_equal"]["AB"] == [True, False, False, False]  # the image starts in block 1
    assert k["text_only_extras"] is None  # text prompts keep the keys they always had


def test_a_hybrid_model_loads_each_group_only_what_it_needs(checks):
    both = checks["groups"]["both"]
    assert both["stored"]["stored_blocks"] == 5 and sorted(both["stored"]["saves"]) == ["0", "1"]
    # All 5 blocks of the full-attention group; the window group only its last 2 (vLLM dropped 0-2).
    assert both["loaded"]["loaded_tokens"] == 5 * 32
    assert both["loaded"]["loads"] == {"0": [13, 14, 15, 16, 17], "1": [22, 23]}
    # A hybrid model's loads run in the background (vLLM takes their failures only per request).
    assert both["loaded"]["background"] and both["loaded"]["finished"]
    assert both["equal"]


def test_a_hybrid_hit_is_never_reported_unless_every_group_can_restore_it(checks):
    gone = checks["groups"]["window_gone"]
    assert gone["stored"]["stored_blocks"] == 5  # group 0 took them; group 1's pages were released
    assert gone["again"]["loaded_tokens"] == 0 and gone["again"]["loads"] == {}  # group 0 alone restores nothing
    part = checks["groups"]["window_part"]
    # The window group holds blocks 0-2 only: the longest prefix both can restore is 3 blocks.
    assert part["again"]["loaded_tokens"] == 3 * 32
    assert part["again"]["loads"] == {"0": [13, 14, 15], "1": [20, 21]}


def test_keys_carry_the_checkpoint(checks):
    """Another checkpoint (same architecture, size and config) or dtype never shares keys; the
    same checkpoint mounted at another path does."""
    fp = checks["keys"]["weights"]
    assert fp["a"] == fp["b"]
    assert len({fp["a"], fp["c"], fp["a_bf16"], fp["hub"]}) == 4


def test_pages_of_several_vllm_blocks(checks):
    """page_tokens = 2 blocks: keys, lookups and saves by pages, copies by blocks; a block vLLM's
    own cache served is not copied over."""
    p = checks["shapes"]["pages"]
    assert p["stored"] == 2  # 2 pages of 2 blocks; the partial block is not stored
    assert p["loaded_tokens"] == 4 * 32 - 32  # 4 blocks from kvtier, less the one vLLM served
    assert p["equal"] and p["served_block_untouched"]


def test_a_load_from_disk_runs_beside_the_step_in_the_background(checks):
    """async_loads: the step the other requests are in does not wait for a request's disk
    load (times measured in this run, printed; only what happened is asserted)."""
    a = checks["async"]
    assert a["tiers_before"] == [2, 2]  # the prompt's pages were on disk both times
    fg, bg = a["foreground"], a["background"]
    assert (fg["background"], bg["background"]) == (False, True)
    assert fg["external"] == bg["external"] == 48 * 32
    assert a["equal"]
    print(f"\nstep with a 48-page load from disk: in the step {fg['step_s'] * 1000:.2f} ms; in the background "
          f"{bg['step_s'] * 1000:.2f} ms (the load itself {bg['load_s'] * 1000:.2f} ms, beside it)")


def test_a_failed_background_load_is_not_offered_again(checks):
    failed = checks["groups"]["after_failed_load"]
    assert failed["first"] == [5 * 32, True]
    assert failed["again"] == [0, False]


def test_kvtier_tier_changes_reach_vllms_publisher_as_kv_events(tmp_path):
    """The connector relays kvtier's tier changes of its own pages through vLLM's publisher
    (tests/integrations/vllm_event_checks.py: every event decoded with vLLM's classes): a
    page's disk write is a token-less BlockStored DISK under the commit's hashes, its host
    eviction a BlockRemoved CPU; the relay survives a daemon restart and ends on shutdown; a
    hybrid model's groups are each told under their own group_idx and kind."""
    daemon = start_daemon(tmp_path, "--events", f"ipc://{tmp_path}/kvtier-events.ipc", "--write-through",
                          host_size="1MiB", disk_size="8MiB")
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KVTIER_", "VLLM_"))}
        env.update(VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
        command = [str(VLLM_PYTHON), str(CHECKS.with_name("vllm_event_checks.py")), "--target", daemon.target,
                   "--daemon-pid", str(daemon.proc.pid), "--daemon-command", json.dumps(daemon.args)]
        proc = subprocess.run(command, check=False, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    finally:
        daemon.stop()
    assert proc.returncode == 0, f"{proc.stderr[-6000:]}\n--- daemon ---\n{daemon.log()[-3000:]}"
    e = json.loads(proc.stdout.strip().splitlines()[-1])
    assert e["thread"]
    save = e["save"]
    assert save["cpu_hashes"] and save["cpu_tokens"] == [3 * 32], save  # the commit's BlockStored, with tokens
    assert save["disk_hashes"] and save["disk_tokens"] == [0] and save["disk_after_cpu"], save  # a location update
    assert e["evicted"]["cpu_removed"], e["evicted"]
    assert e["evicted"]["followed"] == 3  # r1 is still on disk: still followed
    restart = e["restart"]
    assert restart["cpu_removed"], restart  # the daemon stopped: its host tier went with it
    assert restart["disk_after_restart"], restart  # watching again by itself
    assert e["only_ours"] and e["ownership"] == ["kvtier"]
    bounded = e["bounded"]
    assert bounded["withdrawn"] and bounded["disk"] and bounded["followed"] == 2, bounded
    assert e["off"] == {"relay": False, "events": 0, "threads_added": 0}
    # Every group of a hybrid model is told, under its own group_idx and kind (was: group 0 only).
    assert e["hybrid"] == {"cpu": {"0": ["full_attention", None, True], "1": ["sliding_window", 4096, True]},
                           "disk": {"0": ["full_attention", None, True], "1": ["sliding_window", 4096, True]}}, e["hybrid"]
    assert e["threads_left"] == 0 and e["dropped"] == 0
    print(f"\nrelay: watching again {restart['watching_again_s']} s after the daemon restarted; "
          f"shutdown of 3 schedulers {e['shutdown_s']} s; {e['decoded']} events decoded")
