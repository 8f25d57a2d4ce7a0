"""Which engines use each namespace: the audience of its KV events (kvtier.events.topics).

An engine that names its endpoint at Register is counted once per open session (an engine
may hold several: one per layout, a restarted client); its topic goes away with its last
session. Joins and departures are queued for the publisher's thread, which re-announces the
namespace's pages under a new engine's topic and takes them back from a departed one's.
"""
from __future__ import annotations

import threading
from collections import Counter

from kvtier.events.topics import EngineIdentity

#: Engines at once per namespace whose topics are published: each costs a copy of every
#: batch of that namespace; more sessions with other endpoints are not credited.
MAX_ENGINES = 64


class Engines:
    def __init__(self) -> None:
        self._sessions: dict[str, Counter[EngineIdentity]] = {}
        self._changes: list[tuple[bool, str, EngineIdentity]] = []  # (joined, namespace, engine)
        self._lock = threading.Lock()

    def joined(self, namespace: str, engine: EngineIdentity) -> None:
        with self._lock:
            sessions = self._sessions.setdefault(namespace, Counter())
            if engine not in sessions and len(sessions) >= MAX_ENGINES:
                return
            sessions[engine] += 1
            if sessions[engine] == 1:
                self._changes.append((True, namespace, engine))

    def left(self, namespace: str, engine: EngineIdentity) -> None:
        with self._lock:
            sessions = self._sessions.get(namespace)
            if sessions is None or engine not in sessions:
                return
            sessions[engine] -= 1
            if sessions[engine] <= 0:
                del sessions[engine]
                self._changes.append((False, namespace, engine))
                if not sessions:
                    del self._sessions[namespace]

    def of(self, namespace: str) -> list[EngineIdentity]:
        """The engines attached to a namespace, in the order they came."""
        with self._lock:
            return list(self._sessions.get(namespace, ()))

    def changes(self) -> list[tuple[bool, str, EngineIdentity]]:
        """The joins (True) and departures (False) since the last call, in order."""
        with self._lock:
            changes, self._changes = self._changes, []
            return changes
