"""The device tier's CPU-side parts: run coalescing of page copies, and how the daemon and
client behave where there is no GPU (the tier is absent, nothing imports CuPy)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvtier.mechanism.device import coalesce


def test_adjacent_pages_on_both_sides_become_one_copy():
    assert coalesce([(0, 3), (1, 4), (2, 5)]) == [(0, 3, 3)]


def test_runs_break_where_either_side_jumps_and_keep_their_order():
    pairs = [(0, 3), (1, 4), (5, 5), (6, 9), (7, 10), (2, 0)]
    assert coalesce(pairs) == [(0, 3, 2), (5, 5, 1), (6, 9, 2), (2, 0, 1)]
    # Every page is copied exactly once, to where it was asked.
    expanded = [(s + i, d + i) for s, d, n in coalesce(pairs) for i in range(n)]
    assert expanded == pairs


def test_nothing_to_copy():
    assert coalesce([]) == []


def test_daemon_and_client_import_without_cupy():
    code = (
        "import sys, kvtier.server.pools, kvtier.server.daemon, kvtier_client, kvtier_client.device;"
        "sys.exit('cupy' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_a_cpu_daemon_lends_no_device_memory_over_the_handoff(tmp_path):
    """The handoff's device requests on a daemon without a device tier: attaching gives the
    host arena alone, a device map request from the attached process is refused with the
    documented status, and one from another process is refused before anything else."""
    from daemon import start_daemon
    from kvtier_client import KVTierClient, PageLayout
    from kvtier_client.errors import FailedPrecondition
    from kvtier_client.handoff import attach, fetch_device_slots

    daemon = start_daemon(tmp_path, disk_size="0")
    try:
        with KVTierClient(daemon.target) as kv:
            kv.register("ns", PageLayout(layers=1, kv_heads=1, head_dim=64, block_tokens=16))
            info = kv.pool
            again = attach(info.handoff_socket, info.session_id, None)  # the same process may attach again
            os.close(again.arena_fd)
            assert again.device is None
            with pytest.raises(FailedPrecondition, match="no device memory per namespace"):
                fetch_device_slots(info.handoff_socket, info.session_id, None, [0])
            code = (
                "import sys; from kvtier_client.handoff import fetch_device_slots;"
                "from kvtier_client.errors import PermissionDenied\n"
                "try: fetch_device_slots(sys.argv[1], sys.argv[2], None, [0])\n"
                "except PermissionDenied as e: print('refused', e)"
            )
            out = subprocess.run([sys.executable, "-c", code, info.handoff_socket, info.session_id],
                                 capture_output=True, text=True, timeout=60)
            assert out.stdout.startswith("refused") and "another process" in out.stdout, out.stderr
    finally:
        assert daemon.stop() == 0, daemon.log()
