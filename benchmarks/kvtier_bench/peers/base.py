"""The one interface every system of the peers benchmark implements, and what it is given.

    PageStore  prepare(rep) untimed, put(rep) and get(rep) timed, close()
    Context    one page size's workload: the same pages, engine buffer and sink for every system
    Servers    servers that outlive one page size (a Mooncake master, an LMCache server)

A system's adapter (one module each in this package) is opened with a Context and raises
`Unavailable` (or `ServiceError`) with the reason when it cannot run here; its row then
keeps that reason instead of numbers.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
from kvtier_client.layout import PageLayout

from kvtier_bench.harness import BATCH

log = logging.getLogger("kvtier_bench")
SETUP_HINT = "scripts/setup_bench_peers.sh installs it"


class Unavailable(Exception):
    """This system cannot run here; the message says why."""


class PageStore(Protocol):
    """A store the peers benchmark moves pages through. The pages are the context's: page i
    is engine[i % ring] on put and lands in sink[i % ring] on get, under page_key(rep, i)."""

    def prepare(self, rep: int) -> None:
        """Untimed, before a repetition's put: leave room for `pages` fresh pages."""

    def put(self, rep: int) -> float | None:
        """Timed: every page from the engine buffer into the store. A store that times itself
        (the LMCache driver, in another process) returns its own seconds."""

    def get(self, rep: int) -> float | None:
        """Timed: every page from the store into the engine's buffer: `landing` if the store
        has that attribute (None: it checks the bytes itself), else the context's sink."""

    def close(self) -> None: ...


def page_key(rep: int, i: int) -> bytes:
    """The key of page `i` in repetition `rep`, the same in every system."""
    return b"bench" + rep.to_bytes(4, "little") + i.to_bytes(8, "little")


@dataclass
class Servers:
    """Servers that outlive one page size (a Mooncake master and real client, an LMCache
    server): started on first use, stopped at the end of the run. A server that failed to
    start is not tried again."""

    root: Path
    max_bytes: int  # the most bytes one system holds at any page size
    started: dict[str, object] = field(default_factory=dict)
    failed: dict[str, BaseException] = field(default_factory=dict)

    def get(self, name: str, start: Callable[[Servers], object]):
        if name in self.failed:
            raise self.failed[name]
        if name not in self.started:
            try:
                self.started[name] = start(self)
            except Exception as exc:
                self.failed[name] = exc
                raise
        return self.started[name]

    def close(self) -> None:
        for server in reversed(list(self.started.values())):
            try:
                server.close()
            except Exception as exc:  # noqa: BLE001 - a server that will not stop must not hide the results
                log.warning("could not stop %s cleanly: %s", type(server).__name__, exc)
        self.started.clear()


@dataclass
class Context:
    """One page size's workload, the same for every system."""

    page_bytes: int
    layout: PageLayout
    pages: int
    engine: np.ndarray  # [ring, page_bytes] uint8: the engine's KV, source of puts
    sink: np.ndarray  # [ring, page_bytes] uint8: where gets land, owned by the engine
    workdir: Path
    servers: Servers
    batch: int = BATCH

    @property
    def ring(self) -> int:
        return len(self.engine)
