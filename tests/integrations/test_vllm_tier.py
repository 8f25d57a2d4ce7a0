"""kvtier as a secondary tier of vLLM's OffloadingConnector (kvtier_client.integrations.vllm_tier),
loaded by module path into vLLM's own TieringOffloadingManager on CPU and driven through its
scheduler-side calls (tests/integrations/vllm_tier_checks.py, run with .venv-vllm's python
against a real daemon; importing vLLM takes ~8 s, so one subprocess runs every check).
Skipped when .venv-vllm is absent."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from daemon import start_daemon

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("KVTIER_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
CHECKS = Path(__file__).with_name("vllm_tier_checks.py")

pytestmark = pytest.mark.skipif(
    not VLLM_PYTHON.exists(),
    reason=f"{VLLM_PYTHON} is absent: run scripts/setup_vllm.sh to create .venv-vllm (vLLM CPU + kvtier-client)",
)


@pytest.fixture(scope="module")
def checks(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("vllm-tier")
    daemon = start_daemon(tmp, host_size="16MiB", disk_size="32MiB")
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KVTIER_", "VLLM_"))}
        env.update(VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
        command = [str(VLLM_PYTHON), str(CHECKS), "--target", daemon.target, "--daemon-pid", str(daemon.proc.pid)]
        proc = subprocess.run(command, check=False, capture_output=True, text=True, timeout=120, env=env, cwd=tmp)
    finally:
        code = daemon.stop()  # the last check stopped it already
    assert proc.returncode == 0, f"{' '.join(command)}\n{proc.stderr[-6000:]}"
    assert code == 0, daemon.log()
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["stderr"] = proc.stderr
    return out


def test_a_fresh_engine_loads_the_bytes_another_engine_stored(checks):
    r = checks["restart"]
    assert r["stored_by_cpu_tier"] == 6 and r["a_failures"] == {}
    # Engine B never saw these blocks: each lookup is deferred while kvtier is asked, then
    # promoted into B's CPU tier, then a hit there; the rows equal what A wrote.
    assert r["hits"] == 6 and r["equal"]
    assert r["answers"][0] == " ".join(["RETRY"] * 6) and r["answers"][-1] == " ".join(["HIT"] * 6)
    assert any("HIT_PENDING" in answer for answer in r["answers"])
    # A known prefix followed by new blocks: the prefix loads, byte-equal.
    assert r["mixed_hits"] == 3 and r["mixed_equal"]


def test_rows_through_the_tier_are_timed_against_a_plain_copy(checks):
    r = checks["rates"]
    # Measured in this run, printed, never asserted: each way includes vLLM's scheduler steps
    # (a load waits a step for its lookup batch and another for the promotion).
    print(f"\n{r['MiB']:.0f} MiB of rows: memcpy {r['memcpy_MiBps']} MiB/s; stored through the tier "
          f"{r['store_MiBps']} MiB/s ({r['store_vs_memcpy']}x memcpy), loaded by a fresh engine "
          f"{r['load_MiBps']} MiB/s ({r['load_vs_memcpy']}x) in {r['load_scans']} lookup scans")


def test_unknown_blocks_and_other_configurations_miss(checks):
    r = checks["restart"]
    assert r["unknown_hits"] == 0 and r["unknown_answers"][-1] == "MISS"
    # Same namespace and offload keys, another model: the keys' fingerprint differs.
    assert r["other_model_hits"] == 0


def test_a_store_kvtier_has_no_room_for_fails_as_a_job(checks):
    f = checks["full"]
    assert f["refused"] == {"store: CapacityError": 1}  # a failed job, logged once; nothing raised
    assert f["after"] == f["refused"] and f["later_hits"] == 2  # stores again once pages are free


def test_an_engine_with_a_misspelt_setting_or_no_daemon_does_not_start(checks):
    r = checks["refused"]
    assert r["unknown_setting"].startswith("ValueError: kvtier secondary tier: unknown setting(s) ['namspace']"), r
    assert r["no_daemon"].startswith("RuntimeError: kvtier secondary tier: cannot register namespace"), r
    assert "Is `kvtier serve` running there" in r["no_daemon"]
    assert r["threads"] == []


def test_a_daemon_gone_means_misses_and_failed_jobs_without_blocking_the_scheduler(checks):
    g = checks["gone"]
    assert g["hits"] == 0 and g["last_scan"] == "MISS"
    assert g["failures"] == {"lookup: Unavailable": 1, "store: daemon down": 1}
    # Lookups retried the daemon for the connect timeout on the lookup thread; each
    # scheduler-thread call returned at once meanwhile.
    ratio = g["max_call_s"] / g["connect_timeout_s"]
    print(f"\nslowest scheduler-thread call while the daemon was gone: {ratio:.4f}x the connect timeout "
          f"({g['scans']} lookup scans before the miss)")
    assert ratio < 0.25


def test_shutdown_leaves_no_thread_session_or_shared_memory(checks):
    for end in (checks["restart"]["a_end"], checks["restart"]["b_end"], checks["full"]["end"]):
        assert end == {"threads": [], "daemon_sessions": 0, "region_file": False}
    assert checks["gone"]["threads"] == []
    # vLLM releases the CPU tier's memory after the tier's shutdown; a view the tier kept
    # would make it log this.
    assert "Failed to close mmap_obj" not in checks["stderr"]
