"""The drain gate: on SIGTERM the daemon stops granting new leases (`check_open` raises
UNAVAILABLE) and waits, bounded, until the open ones are released. Whoever ends a lease
calls `lease_ended`, which wakes the wait to count again."""
from __future__ import annotations

import threading
from collections.abc import Callable

from kvtier_client.errors import Unavailable


class DrainGate:
    def __init__(self, open_leases: Callable[[], int]) -> None:
        self._open_leases = open_leases
        self._draining = False
        self._idle = threading.Condition()

    def check_open(self) -> None:
        """Refuse work that would take new pages while the daemon drains."""
        if self._draining:
            raise Unavailable("daemon is draining for shutdown; retry with backoff against its successor")

    def close(self) -> None:
        """Start draining: from now on `check_open` refuses."""
        self._draining = True

    def lease_ended(self) -> None:
        with self._idle:
            self._idle.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no lease is open; False if `timeout` seconds passed first."""
        with self._idle:
            return self._idle.wait_for(lambda: self._open_leases() == 0, timeout=timeout)
