"""`kvtier demo` end to end: its own daemon, the narrated round trip, a clean exit."""
from __future__ import annotations

import os
import subprocess
import sys


def test_demo_runs_the_round_trip_and_exits_cleanly():
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    done = subprocess.run(
        [sys.executable, "-m", "kvtier", "demo"], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    out = done.stdout
    steps = ["register", "block keys", "lookup", "borrow", "commit", "lookup", "acquire", "release", "stats"]
    positions = [out.index(f"{i}. {name}") for i, name in enumerate(steps, 1)]
    assert positions == sorted(positions)
    assert ": miss" in out and ": hit" in out
    assert "bytes equal to what was written: yes" in out
    assert "host" in out and "disk" in out  # the stats table lists both tiers
    assert "exit code 0" in out


def test_demo_fails_loudly_when_the_prompt_has_no_full_block():
    done = subprocess.run(
        [sys.executable, "-m", "kvtier", "demo", "--prompt", "too short"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0
    assert "at least 16 tokens" in done.stderr
