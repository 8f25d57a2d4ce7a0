"""The bench directory fixture shared by the benchmark plumbing tests."""
from __future__ import annotations

import os

import pytest

SHM = "/dev/shm"


def _bench_arenas() -> set[str]:
    return {name for name in os.listdir(SHM) if name.startswith("kvtier-bench-")}


@pytest.fixture
def bench_dir(tmp_path):
    """The bench directory; afterwards it must be as empty as it was, and /dev/shm too."""
    arenas = _bench_arenas()
    yield tmp_path
    assert os.listdir(tmp_path) == [], "the benchmark left files in its directory"
    assert _bench_arenas() == arenas, "the benchmark left a host arena in /dev/shm"
