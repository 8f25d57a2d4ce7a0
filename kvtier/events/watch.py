"""One WatchEvents stream's queue: the publisher's thread puts each batch of a namespace the
watcher may see, the stream's gRPC thread takes them. Bounded, because a watcher that
reads slowly must not hold the daemon's memory: past `capacity` block events the oldest
batches are dropped and counted, and the watcher is told how many it missed.

Streams are few (each holds a gRPC thread), so each holder — the credential that opened it:
its token, or without one the namespaces it watches — may hold only a few of them, and no
tenant can take every stream from the others (`check_room`)."""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Collection, Sequence

from kvtier_client.errors import CapacityError

from kvtier.events.records import Event

#: Block events a watcher may have waiting before the oldest are dropped.
WATCHER_CAPACITY = 100_000
#: Streams one holder may have open at once.
MAX_WATCHERS_PER_HOLDER = 2


def holder_of(token: str | None, namespaces: Collection[str]) -> str:
    """Whose stream it is, for the limit per holder: the token that opened it; without one
    (auth none), the namespaces it watches, so one namespace's watchers leave room for another's."""
    return f"token {token}" if token is not None else "namespaces " + ",".join(sorted(namespaces))


def check_room(watchers: Sequence[Watcher], holder: str, total: int) -> None:
    """Raise CapacityError unless `holder` may open one more stream beside `watchers` (at
    most MAX_WATCHERS_PER_HOLDER of its own, `total` in all)."""
    if sum(w.holder == holder for w in watchers) >= MAX_WATCHERS_PER_HOLDER:
        raise CapacityError(f"this token (or, without tokens, these namespaces) holds {MAX_WATCHERS_PER_HOLDER} event "
                            "watches already, the most one may; close one, or subscribe to the ZMQ events instead "
                            "(docs/events.md)")
    if len(watchers) >= total:
        raise CapacityError(f"the daemon serves {total} event watchers already; close one, or subscribe to its ZMQ "
                            "events instead (docs/events.md)")


class Watcher:
    def __init__(self, visible: Callable[[str], bool], holder: str = "", capacity: int = WATCHER_CAPACITY) -> None:
        """`visible(namespace)`: whether this watcher may see the namespace's events now;
        asked for every batch, so a token revoked by a reload stops them at once.
        `holder`: whose stream it is (`holder_of`)."""
        self.visible = visible
        self.holder = holder
        self.capacity = capacity
        self._cond = threading.Condition()
        self._batches: deque[list[Event]] = deque()
        self._waiting = 0  # block events in _batches
        self._missed = 0
        self._closed = False

    def put(self, events: list[Event], missed: int = 0) -> int:
        """Queue one namespace's events; `missed`: that namespace's events the daemon
        dropped before publishing them. Returns the block events this watcher's own queue
        dropped to make room."""
        lost = 0
        with self._cond:
            if self._closed:
                return 0
            if events:
                self._batches.append(events)
                self._waiting += sum(e.blocks for e in events)
            while self._waiting > self.capacity:
                oldest = sum(e.blocks for e in self._batches.popleft())
                self._waiting -= oldest
                lost += oldest
            self._missed += missed + lost
            self._cond.notify()
        return lost

    def next(self) -> tuple[list[Event], int] | None:
        """The events queued since the last call and how many were missed meanwhile; waits
        for some. None once the watch is closed."""
        with self._cond:
            self._cond.wait_for(lambda: self._batches or self._missed or self._closed)
            if self._closed:
                return None
            events = [e for batch in self._batches for e in batch]
            missed, self._missed, self._waiting = self._missed, 0, 0
            self._batches.clear()
            return events, missed

    def close(self) -> None:
        """End the watch: `next` returns None (the stream was cancelled, or the daemon stops)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
