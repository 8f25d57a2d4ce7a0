"""The device tier's CPU-side parts: run coalescing of page copies, and how the daemon and
client behave where there is no GPU (the tier is absent, nothing imports CuPy)."""
from __future__ import annotations

import subprocess
import sys

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
