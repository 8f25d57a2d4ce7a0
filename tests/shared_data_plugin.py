"""The shared data sets for the tests that replay them (the Mooncake conversation trace),
found where kvtier_bench.shared_data finds them: beside the clone, or under
$KVTIER_SHARED_DATA. Never an absolute machine path.

A test whose data is absent is skipped with a reason that says where the data was looked
for, and the run's summary says how many were skipped so (pytest -q shows no skip reasons):
a clone without the shared folder must not pass those checks silently. CI has the data (a
copy of shared/ beside the clone).
"""
from __future__ import annotations

from pathlib import Path

import pytest
from kvtier_bench.shared_data import absent
from kvtier_bench.shared_data import mooncake_trace as trace_path


@pytest.fixture(scope="session")
def mooncake_trace() -> Path:
    """The trace's path; the test is skipped, saying where it was looked for, when it is absent."""
    path = trace_path()
    if not path.exists():
        pytest.skip(absent(path))
    return path


def pytest_terminal_summary(terminalreporter) -> None:
    reason = absent(trace_path())
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if reason in str(r.longrepr)]
    if skipped:
        terminalreporter.write_line(f"{len(skipped)} tests skipped: {reason}", yellow=True, bold=True)
