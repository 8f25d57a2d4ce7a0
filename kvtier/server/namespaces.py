"""How many namespaces the daemon serves. Each costs memory for as long as the daemon runs
(a host memory file and its mapping per pool, counters and metric label sets per pool, the
hashings Explain remembers), and with auth = none, or a token that grants "*", a client can
name new ones at will. So namespaces the tokens file does not name are admitted up to
`max_namespaces`; past it Register refuses a new one (RESOURCE_EXHAUSTED). Those the file
names (in a token's list, or a [namespaces.<name>] quota) are always admitted: the operator
listed them, and the file bounds them."""
from __future__ import annotations

import threading
from collections.abc import Callable

from kvtier_client.errors import CapacityError

from kvtier.server.wire_guard import cut


class NamespaceGate:
    """The namespaces admitted since the daemon started. `named(namespace)`: whether the
    tokens file names it (read at each new namespace: a reload applies at once)."""

    def __init__(self, limit: int, named: Callable[[str], bool]) -> None:
        self.limit = limit
        self._named = named
        self._admitted: set[str] = set()
        self._unnamed = 0
        self._lock = threading.Lock()

    def admit(self, namespace: str) -> None:
        """Let `namespace` in (it stays in), or raise CapacityError (RESOURCE_EXHAUSTED), changing nothing."""
        if namespace in self._admitted:  # the common case, without the lock (a set read is atomic)
            return
        named = self._named(namespace)
        with self._lock:
            if namespace in self._admitted:
                return
            if not named:
                if self._unnamed >= self.limit:
                    raise CapacityError(
                        f"namespace {cut(namespace)!r} would be the daemon's {self.limit + 1}th namespace beyond those "
                        f"the tokens file names; raise max_namespaces (now {self.limit}) or name it in the tokens file"
                    )
                self._unnamed += 1
            self._admitted.add(namespace)

    def count(self) -> int:
        return len(self._admitted)
