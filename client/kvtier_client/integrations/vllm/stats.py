"""The connector's counters in vLLM's connector-stats channel (`KVConnectorStats`): each role
counts what it sees, vLLM sums them per step (worker stats ride the model runner's output,
the scheduler's are added to them) and hands them to its stat loggers: the periodic
"KV Transfer metrics: ..." log line, and Prometheus counters `vllm:kvtier_<name>_total`
(`KVTierPromMetrics`; read them with `LLM.get_metrics()` or on `vllm serve`'s /metrics).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

#: Every counter and what it counts (the Prometheus help text).
COUNTERS = {
    # scheduler side
    "hit_blocks": "Prompt blocks kvtier held beyond vLLM's own prefix-cache hit, at scheduling.",
    "declined_blocks": "Of those, blocks the load planner chose to recompute (loading would be slower).",
    "skipped_store_blocks": "Full prompt blocks not stored: vLLM's prefix cache served them, or another request "
                            "of this engine is storing them.",
    "hint_actions_applied": "Requests' kvtier hint actions (kv_hints) applied to their pages.",
    "hint_actions_ignored": "kvtier hint actions of an unknown type or version, ignored.",
    "hint_actions_invalid": "kvtier hint actions (or envelopes) with a bad payload, ignored.",
    "hint_actions_failed": "kvtier hint actions the daemon refused (e.g. a hard pin past the guarantee) or missed.",
    # worker side
    "load_blocks": "Pages copied from kvtier into vLLM's KV blocks.",
    "load_bytes": "Bytes of those pages.",
    "load_seconds": "Seconds spent loading (acquire, waiting for disk, copies).",
    "load_failed_blocks": "Blocks that could not be loaded (evicted, daemon away); vLLM recomputes them.",
    "store_blocks": "Pages newly committed to kvtier.",
    "store_duplicate_blocks": "Pages committed that kvtier already held (another engine stored them meanwhile).",
    "store_bytes": "Bytes copied out of vLLM's KV blocks into kvtier pages.",
    "store_seconds": "Seconds spent storing (borrow, copies, commit).",
    "store_failed_blocks": "Blocks that could not be stored (no free pages, daemon away).",
    "kv_events_dropped": "KV events of kvtier's pages not handed to vLLM's publisher: its queue was full.",
}


@dataclass
class KVTierConnectorStats(KVConnectorStats):
    """Counters (`COUNTERS`) since the last report; they only ever add up."""

    def __post_init__(self) -> None:
        self.data = {name: self.data.get(name, 0) for name in COUNTERS}

    def add(self, **counts: float) -> None:
        for name, value in counts.items():
            self.data[name] += value

    def reset(self) -> None:
        self.data = dict.fromkeys(COUNTERS, 0)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name in COUNTERS:
            self.data[name] += other.data.get(name, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        summary: dict[str, int | float] = {k: round(v, 4) if isinstance(v, float) else v for k, v in self.data.items()}
        if self.data["load_seconds"] > 0:
            summary["load_GBps"] = round(self.data["load_bytes"] / self.data["load_seconds"] / 1e9, 3)
        return summary

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def take(self) -> KVTierConnectorStats | None:
        """These counts for vLLM (None if all zero), and start counting afresh."""
        if self.is_empty():
            return None
        taken = KVTierConnectorStats(dict(self.data))
        self.reset()
        return taken


class KVTierPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per `COUNTERS` entry, `vllm:kvtier_<name>`, per engine."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: create_metric_per_engine(
                self._counter_cls(name=f"vllm:kvtier_{name}", documentation=doc, labelnames=labelnames),
                per_engine_labelvalues,
            )
            for name, doc in COUNTERS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            if value and name in self._counters:
                self._counters[name][engine_idx].inc(value)
