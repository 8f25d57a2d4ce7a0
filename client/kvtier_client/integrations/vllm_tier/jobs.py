"""Stores and loads off the scheduler thread: a few I/O threads run the jobs, and each
job's result waits in a queue until vLLM polls it (`finished`).

The scheduler thread only enqueues and polls; `drain` blocks until every submitted job's
result is queued (vLLM's reset_cache polls right after it), `close` cancels what has not
started and waits for what has.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, TypeVar

R = TypeVar("R")


class JobRunner(Generic[R]):
    """Runs `work()` for each submitted job on one of `threads` threads; a job's `work`
    returns its result and never raises (it turns its own failures into a result)."""

    def __init__(self, threads: int, name: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name)
        self._done: queue.SimpleQueue[R] = queue.SimpleQueue()
        self._pending = 0  # submitted, result not queued yet
        self._idle = threading.Condition()

    def submit(self, work: Callable[[], R]) -> None:
        with self._idle:
            self._pending += 1
        try:
            self._pool.submit(self._run, work)
        except RuntimeError:  # closed
            self._ended()
            raise

    def _run(self, work: Callable[[], R]) -> None:
        try:
            self._done.put(work())
        finally:
            self._ended()

    def _ended(self) -> None:
        with self._idle:
            self._pending -= 1
            if not self._pending:
                self._idle.notify_all()

    def finished(self) -> list[R]:
        """Results of the jobs that ended since the last call."""
        results = []
        while True:
            try:
                results.append(self._done.get_nowait())
            except queue.Empty:
                return results

    def busy(self) -> bool:
        return self._pending > 0

    def drain(self) -> None:
        """Block until every job submitted so far has its result queued."""
        with self._idle:
            self._idle.wait_for(lambda: not self._pending)

    def close(self) -> None:
        """Cancel the jobs not started, wait for the running ones, end the threads."""
        self._pool.shutdown(wait=True, cancel_futures=True)
