"""The connector's link to the daemon: one registered client per connector (per role and
process), and a gate that keeps an unreachable daemon from stalling every request.

Both roles use it the same way: check `available()` before a call, hand a KVTierError to
`failed(what, exc)`. After an Unavailable the gate stays shut for RETRY_AFTER_SECONDS, so the
daemon going away costs one `connect_timeout` of retries, not one per request; meanwhile
lookups answer "no hit", stores wait for a later step and loads are reported failed (vLLM
recomputes them). The client itself registers again once the daemon is back.
"""
from __future__ import annotations

import os
import time

from vllm.logger import init_logger

from kvtier_client.client import KVTierClient
from kvtier_client.errors import KVTierError, Unavailable
from kvtier_client.integrations.vllm.config import ConnectorConfig
from kvtier_client.layout import PageLayout

#: Under vLLM's logger tree, so the connector's messages appear in the engine's log.
log = init_logger("vllm.kvtier_connector")

#: After the daemon could not be reached, skip kvtier for this long instead of stalling
#: every request on connection retries.
RETRY_AFTER_SECONDS = 10.0


class DaemonLink:
    """A client registered for the engine's namespace and layout, and whether to use it now."""

    def __init__(self, kv: KVTierClient) -> None:
        self.kv = kv
        self._down_until = 0.0

    @classmethod
    def open(cls, config: ConnectorConfig, layout: PageLayout, side: str) -> DaemonLink:
        """Connect and register, or fail the engine's start with what to check."""
        # The scheduler only borrows and commits pages the workers write: it maps no memory.
        kv = config.client(f"vllm {side} pid {os.getpid()}", map_arena=side == "worker")
        try:
            kv.register(config.namespace, layout)
        except KVTierError as exc:
            kv.close()
            raise RuntimeError(
                f"kvtier connector: cannot register namespace {config.namespace!r} with layout {layout} "
                f"at {config.target}: {exc}. Is `kvtier serve` running there (kv_connector_extra_config "
                "'target'), and does its token grant this namespace?"
            ) from exc
        return cls(kv)

    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def failed(self, what: str, exc: KVTierError) -> None:
        if isinstance(exc, Unavailable):
            self._down_until = time.monotonic() + RETRY_AFTER_SECONDS
            log.warning("kvtier connector: %s: daemon unavailable (%s); not using kvtier for %.0fs",
                        what, exc, RETRY_AFTER_SECONDS)
        else:
            log.warning("kvtier connector: %s failed: %s", what, exc)

    def close(self) -> None:
        self.kv.close()
