"""Whether to ask the daemon now, and one log line per kind of failure.

After an Unavailable (the daemon is gone, or restarting) the gate stays shut for
`RETRY_AFTER_SECONDS`: lookups answer "not here" and jobs fail at once, so a missing daemon
costs one `connect_timeout` of retries, not one per job. Other failures (no room, a page
evicted between lookup and load) only fail their job. Each kind is logged the first time it
happens; `counts` keeps how often each happened since.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter

from kvtier_client.errors import KVTierError, Unavailable

log = logging.getLogger("vllm.kvtier_tier")

#: After the daemon could not be reached, skip it for this long.
RETRY_AFTER_SECONDS = 10.0


class DaemonGate:
    """Shared by the scheduler thread and the tier's I/O threads."""

    def __init__(self) -> None:
        self._down_until = 0.0
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter()  # "<what>: <error class>" -> times

    def open(self) -> bool:
        return time.monotonic() >= self._down_until

    def skipped(self, what: str) -> None:
        """A call not made because the gate is shut."""
        with self._lock:
            self.counts[f"{what}: daemon down"] += 1

    def failed(self, what: str, exc: KVTierError) -> None:
        kind = f"{what}: {type(exc).__name__}"
        with self._lock:
            if isinstance(exc, Unavailable):
                self._down_until = time.monotonic() + RETRY_AFTER_SECONDS
            first = kind not in self.counts
            self.counts[kind] += 1
        if first:
            log.warning("kvtier secondary tier: %s failed (%s: %s); vLLM recomputes what it needed%s. Logged once.",
                        what, type(exc).__name__, exc,
                        f"; the daemon is skipped for {RETRY_AFTER_SECONDS:.0f}s after each such failure"
                        if isinstance(exc, Unavailable) else "")
