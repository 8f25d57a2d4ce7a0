"""kvtier as SGLang's HiCache storage backend (client/kvtier_client/integrations/sglang/),
built and called as SGLang builds and calls it (tests/integrations/sglang_checks.py, run with
.venv-sglang's python) against real daemons: one process stores pages, a fresh one reads
them back. Skipped when .venv-sglang is absent (scripts/setup_sglang.sh creates it)."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from daemon import start_daemon

ROOT = Path(__file__).resolve().parents[2]
SGLANG_PYTHON = Path(os.environ.get("KVTIER_SGLANG_PYTHON", ROOT / ".venv-sglang" / "bin" / "python"))
CHECKS = Path(__file__).with_name("sglang_checks.py")
STORED = [True] * 6

pytestmark = pytest.mark.skipif(
    not SGLANG_PYTHON.exists(),
    reason=f"{SGLANG_PYTHON} is absent: run scripts/setup_sglang.sh to create .venv-sglang (SGLang + kvtier-client)",
)


def _run(step: str, tmp: Path, *args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVTIER_", "SGLANG_"))}
    command = [str(SGLANG_PYTHON), str(CHECKS), step, *args]
    proc = subprocess.run(command, check=False, capture_output=True, text=True, timeout=120, env=env, cwd=tmp)
    assert proc.returncode == 0, f"{' '.join(command)}\n{proc.stderr[-6000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def checks(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("sglang")
    daemon = start_daemon(tmp_path_factory.mktemp("daemon"), "--max-pools", "8", host_size="64MiB", disk_size="128MiB")
    # 16 host pages and a little disk: another writer can hold every host page at once.
    small = start_daemon(tmp_path_factory.mktemp("small"), host_size="64KiB", disk_size="1MiB")
    try:
        written = _run("write", tmp, "--target", daemon.target, "--full-target", small.target,
                       "--full-pid", str(small.proc.pid))  # which it stops at the end
        read = _run("read", tmp, "--target", daemon.target)
    finally:
        codes = daemon.stop(), small.stop()
    assert codes == (0, 0), daemon.log() + small.log()
    return {"write": written, "read": read}


def test_pages_read_back_byte_equal_in_a_fresh_process_from_any_layout(checks):
    """Every supported host layout (MHA layer_first, page_first, page_first_direct, page_head;
    MLA layer_first, page_first, page_first_direct) writes pages another layout reads back
    bit for bit: kvtier holds each page in its own order (checked on the daemon's copy)."""
    for name, w in checks["write"]["cases"].items():
        r = checks["read"]["cases"][name]
        assert (w["before"], w["set"], w["after"]) == (0, STORED, 6), (name, w)
        assert w["again"] == STORED, name  # already stored: True, not copied again
        assert r["exists"] == 6 and r["got"] == STORED + [False, False], (name, r)
        assert all(r["pages_equal"]) and all(r["untouched"]) and r["stored_order"], (name, r)
    layouts = {r["layout"] for r in checks["read"]["cases"].values()}
    assert any("order='latent'" in layout for layout in layouts)
    assert any("order='page_first'" in layout for layout in layouts)


def test_unknown_keys_miss(checks):
    for name, r in checks["read"]["cases"].items():
        assert (r["unknown_exists"], r["unknown_get"]) == (0, [False, False]), name


def test_exists_counts_the_stored_prefix_of_the_keys(checks):
    assert checks["write"]["gap_exists"] == 2  # pages 0, 1 and 3 stored: SGLang may load 2


def test_tensor_parallel_ranks_keep_their_own_pages_and_mla_ranks_share_one(checks):
    w, r = checks["write"], checks["read"]
    assert w["tp0_set"] == w["tp1_set"] == STORED  # the same keys, each rank its heads
    for rank in (0, 1):
        assert r[f"tp{rank}"] == {"got": STORED, "own_pages": STORED}, rank
    assert w["mla_tp0_set"] == STORED
    assert r["mla_tp1"] == {"got": STORED, "equal": True}  # rank 1 reads the copy rank 0 wrote


def test_a_full_kvtier_fails_the_store_cleanly_and_takes_it_once_pages_are_free(checks):
    full = checks["write"]["full"]
    assert full["capacity"] == 16
    assert full["refused"] == [False, False] and full["exists_while_full"] == 0
    assert full["writing_while_full"] == 16  # the other writer's pages only: the store left none borrowed
    assert full["stored"] == [True, True] and full["after"] == 2


def test_errors_answer_false_and_raise_nothing_into_sglang(checks):
    w = checks["write"]
    assert w["bad_indices"] == [False]  # host indices of half a page
    assert w["bad_hash"] == 0
    assert "page_unified" in w["refused"] and "--hicache-mem-layout" in w["refused"]  # at attach, with the fix
    assert "'mamba'" in w["hybrid_refused"]  # a hybrid model's side pool (SGLang's v2 calls)
    assert "unix:///nonexistent/kvtier.sock" in w["unreachable"] and "kvtier serve" in w["unreachable"]


def test_a_daemon_that_stops_answers_nothing_stored_and_is_skipped_meanwhile(checks):
    gone = checks["write"]["gone"]
    assert gone["exists"]["answer"] == 0
    assert gone["set"]["answer"] == [False, False] and gone["get"]["answer"] == [False, False]
    # The first call spent its retries (connect_timeout 1 s); the next ones skip the daemon.
    first = gone["exists"]["seconds"]
    assert gone["set"]["seconds"] < first / 10 and gone["get"]["seconds"] < first / 10, gone


def test_the_generic_interface_with_flat_data_pages(checks):
    assert checks["write"]["generic_set"] is True
    assert checks["read"]["generic"] == {"got": [True, True, False], "equal": [True, True]}


def test_store_and_load_are_timed_against_the_copy_alone(checks):
    s = checks["write"]["speed"]
    assert s["page_bytes"] == 256 * 1024
    # Measured in this run against the same bytes copied without kvtier; printed, never asserted.
    mib = s["pages"] * s["page_bytes"] / 2**20
    print(f"\n{s['pages']} pages of 256 KiB ({mib:.0f} MiB): copy alone {s['copy_s'] * 1000:.2f} ms; "
          f"batch_set_v1 {s['set_s'] * 1000:.2f} ms ({s['set_vs_copy']:.2f}x); "
          f"batch_get_v1 {s['get_s'] * 1000:.2f} ms ({s['get_vs_copy']:.2f}x)")
