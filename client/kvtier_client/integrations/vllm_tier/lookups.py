"""Lookups off the scheduler thread, through vLLM's own AsyncLookupManager: the keys a step
asks about go to the daemon in one batch per request after the step (a lookup answers RETRY
until then), and each verdict is kept for the requests that asked.

kvtier answers how many leading keys of a batch it holds; a key after the first missing one
is answered missing without another call (vLLM's prefix scan stops at the first miss; a
sliding-window scan then recomputes what it could have loaded: a miss is always safe).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager

from kvtier_client.client import KVTierClient
from kvtier_client.errors import KVTierError
from kvtier_client.integrations.vllm_tier.gate import DaemonGate
from kvtier_client.keys import BlockKey


class KVTierLookups(AsyncLookupManager):
    def __init__(self, tier_type: str, kv: KVTierClient, gate: DaemonGate,
                 block_keys: Callable[[Iterable[OffloadKey]], list[BlockKey]]) -> None:
        self._kv, self._gate, self._block_keys = kv, gate, block_keys
        super().__init__(tier_type=tier_type)  # starts the lookup thread: the fields above first

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        if not self._gate.open():
            self._gate.skipped("lookup")
            return [False] * len(keys)
        try:
            hits = self._kv.lookup(self._block_keys(keys)).hit_blocks
        except KVTierError as exc:
            self._gate.failed("lookup", exc)
            return [False] * len(keys)
        return [i < hits for i in range(len(keys))]
