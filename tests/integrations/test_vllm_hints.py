"""Requests' kvtier hints in the vLLM connector (tests/integrations/vllm_hint_checks.py, run
with .venv-vllm's python against a real daemon whose tokens file gives the namespace a
guarantee of 4 host pages): pins and retains land on the request's pages once they are
stored, demote and drop act then, prefetch at arrival; unknown and bad hints are ignored and
counted, and nothing they do fails a request. Skipped when .venv-vllm is absent."""
from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest
from daemon import start_daemon

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("KVTIER_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
CHECKS = Path(__file__).with_name("vllm_hint_checks.py")
TOKEN, NAMESPACE = "token-vllm-hints-5a7c9e1b3d", "checks/hints"

pytestmark = pytest.mark.skipif(
    not VLLM_PYTHON.exists(),
    reason=f"{VLLM_PYTHON} is absent: run scripts/setup_vllm.sh to create .venv-vllm (vLLM CPU + kvtier-client)",
)


@pytest.fixture(scope="module")
def checks(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("vllm-hints")
    tokens = tmp / "tokens.toml"
    tokens.write_text(textwrap.dedent(f"""
        [tokens]
        "{TOKEN}" = ["{NAMESPACE}"]
        [namespaces."{NAMESPACE}"]
        guaranteed_host_pages = 4
    """))
    daemon = start_daemon(tmp, "--tokens-file", str(tokens), host_size="16MiB", disk_size="32MiB")
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KVTIER_", "VLLM_"))}
        env.update(VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
        command = [str(VLLM_PYTHON), str(CHECKS), "--target", daemon.target, "--token", TOKEN, "--namespace", NAMESPACE]
        proc = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=tmp, check=False)
    finally:
        code = daemon.stop()
    assert proc.returncode == 0, f"{' '.join(command)}\n{proc.stderr[-6000:]}"
    assert code == 0, daemon.log()
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_pin_hint_leaves_the_requests_pages_pinned_in_the_daemon(checks):
    soft = checks["connector"]["soft"]
    assert len(soft["hints"]) == 3 and all(h.startswith("soft pin by session") and "for 60 s" in h for h in soft["hints"])
    assert soft["report"]["hints"] == {"actions": ["kvtier.pin"], "ignored": 0, "invalid": 0}
    assert soft["report"]["stored_blocks"] == 3


def test_a_hint_waits_for_the_requests_last_save(checks):
    """vLLM may finish a request before the output of its last step (which commits its pages)."""
    late = checks["connector"]["late"]
    assert late["before"] == ["", ""]
    assert all(h.startswith("soft pin") for h in late["after"]) and len(late["after"]) == 2


def test_retain_from_kv_transfer_params_covers_only_the_prefix_asked(checks):
    retain = checks["connector"]["retain"]
    # prefix_tokens = 2 blocks and 7 tokens: the 2 pages wholly within it.
    assert [h.split(" by ")[0] for h in retain["hints"]] == ["retain high", "retain high", "", ""]


def test_hard_pins_hold_within_the_guarantee_and_are_refused_past_it(checks):
    hard = checks["connector"]["hard"]
    assert all(h.startswith("hard pin") for h in hard["hints"]) and len(hard["hints"]) == 3
    # 3 more would take the namespace to 6 of its 4 guaranteed pages: the daemon refuses the
    # pin, and the request's next action (retain cold) still applies.
    assert [h.split(" by ")[0] for h in hard["past_guarantee"]] == ["retain cold"] * 3
    assert checks["connector"]["stats"]["hint_actions_failed"] == 1


def test_unknown_and_bad_hints_are_ignored_and_the_request_served(checks):
    noisy = checks["connector"]["noisy"]
    assert noisy["hints"] == ["", ""]
    assert noisy["report"]["stored_blocks"] == 2
    # teleport: an unknown kvtier type; kvcr.pin: another component's, not counted; a payload
    # with "ttl" for "ttl_s", an unknown priority and a kv_transfer_params entry that is no envelope.
    assert noisy["report"]["hints"] == {"actions": [], "ignored": 1, "invalid": 3}
    stats = checks["connector"]["stats"]
    assert (stats["hint_actions_ignored"], stats["hint_actions_invalid"]) == (1, 3)


def test_demote_drop_and_prefetch_hints_move_the_pages(checks):
    c = checks["connector"]
    assert c["demote"] == ["cached:disk:", "cached:disk:"]
    assert all(w.startswith("dropped:") for w in c["drop"]) and c["drop"], c["drop"]
    assert c["prefetch"] == ["cached:host:", "cached:host:"]
    # soft, late, retain, hard (pin), too_many (retain), demote, drop, prefetch
    assert c["stats"]["hint_actions_applied"] == 8


def test_the_parser_takes_kvtiers_actions_and_judges_only_those(checks):
    p = checks["parser"]
    assert p["good"] == [
        "Pin(mode=<PinMode.HARD: 'hard'>, ttl_s=30.0, prefix_tokens=None)",
        "Retain(priority=<Priority.COLD: 0>, ttl_s=0.0, prefix_tokens=None)",
        "Prefetch(hold_s=5.0)",
        "Demote(tier=<Tier.DISK: 2>, prefix_tokens=None)",
        "Drop(prefix_tokens=64)",
    ]
    assert p["good_counts"] == [0, 0]
    assert p["bad"] == [0, 0, 8]  # six bad pins, a retain without priority, a demote to the device
    assert p["others"] == {"actions": [], "ignored": 1, "invalid": 0}
    assert p["old_version"] == {"actions": [], "ignored": 1, "invalid": 0}
    assert p["transfer_list"] == {"actions": ["kvtier.pin"], "ignored": 0, "invalid": 0}
    assert p["transfer_envelope"] == {"actions": ["kvtier.drop"], "ignored": 0, "invalid": 0}
    assert p["not_envelopes"] == [{"actions": [], "ignored": 0, "invalid": 1}] * 2 + [
        {"actions": ["kvtier.pin"], "ignored": 0, "invalid": 0}]
    assert p["payload_not_object"] == {"actions": [], "ignored": 0, "invalid": 1}


def test_a_vllm_engine_carries_kv_hints_to_the_daemon(tmp_path):
    """LLMEngine.add_request(..., kv_hints=...) through a real engine (its core in its own
    process, so the envelope crosses vLLM's serialisation) to the daemon's hints."""
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(f'[tokens]\n"{TOKEN}" = ["{NAMESPACE}"]\n')
    daemon = start_daemon(tmp_path, "--tokens-file", str(tokens), host_size="16MiB", disk_size="32MiB")
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KVTIER_", "VLLM_"))}
        env.update(VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        command = [str(VLLM_PYTHON), str(CHECKS), "--target", daemon.target, "--token", TOKEN, "--namespace", NAMESPACE,
                   "--engine", str(tmp_path / "model")]
        proc = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path, check=False)
        assert proc.returncode == 0, f"{' '.join(command)}\n{proc.stderr[-6000:]}"
        # (vLLM logs to stdout too: the report is the one JSON line)
        reports = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith('{"engine"')))["engine"]
        stats = subprocess.run([str(ROOT / ".venv" / "bin" / "kvtier"), "stats", "--socket", str(daemon.socket), "--token",
                                TOKEN, "--json"], capture_output=True, text=True, timeout=60, check=False)
        assert stats.returncode == 0, stats.stderr
    finally:
        code = daemon.stop()
    assert code == 0, daemon.log()
    assert {rid: (r["tokens"], r["kvtier"]["stored_blocks"]) for rid, r in reports.items()} == {
        "pinned": (2, 3), "retained": (2, 2), "noisy": (2, 2)}
    assert reports["pinned"]["kvtier"]["hints"] == {"actions": ["kvtier.pin"], "ignored": 0, "invalid": 0}
    assert reports["retained"]["kvtier"]["hints"] == {"actions": ["kvtier.retain"], "ignored": 0, "invalid": 0}
    assert reports["noisy"]["kvtier"]["hints"] == {"actions": [], "ignored": 1, "invalid": 2}
    hints = [ns["hints"] for pool in json.loads(stats.stdout)["pools"] for ns in pool.get("namespaces", [])
             if ns["namespace"] == NAMESPACE]
    assert len(hints) == 1, stats.stdout
    # Hints with a TTL outlive the engine's session: 3 blocks soft-pinned, 2 retained high.
    assert (int(hints[0].get("soft_pinned", 0)), int(hints[0].get("high", 0))) == (3, 2), hints
