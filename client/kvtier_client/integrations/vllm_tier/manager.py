"""KVTierSecondaryTier: kvtier's host, disk and cluster tiers behind vLLM's CPU tier, as a
secondary tier of vLLM's TieringOffloadingManager (loaded by module path; nothing patched).

Everything vLLM calls here runs on its scheduler thread and returns at once: lookups go to
the daemon in batches on vLLM's AsyncLookupManager thread (lookups.py), stores and loads run
on the tier's I/O threads (jobs.py, transfers.py) and report through get_finished_jobs.
kvtier's errors (no room, a page evicted, the daemon gone) become misses and failed jobs,
logged once per kind (gate.py); vLLM then recomputes what it could not load.
"""
from __future__ import annotations

import logging
import os
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import (
    JobId,
    JobResult,
    ScheduleEndContext,
    SecondaryTierManager,
    TransferJob,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier_client.errors import KVTierError
from kvtier_client.integrations.vllm_tier.gate import DaemonGate
from kvtier_client.integrations.vllm_tier.identity import (
    KEY_ALGORITHM,
    TierKeys,
    default_namespace,
    fingerprint,
    row_layout,
)
from kvtier_client.integrations.vllm_tier.jobs import JobRunner
from kvtier_client.integrations.vllm_tier.lookups import KVTierLookups
from kvtier_client.integrations.vllm_tier.settings import TierSettings
from kvtier_client.integrations.vllm_tier.transfers import Moved, load_rows, store_rows
from kvtier_client.keys import BlockKey

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

log = logging.getLogger("vllm.kvtier_tier")


class KVTierSecondaryTier(SecondaryTierManager):
    """A secondary tier whose pages live in a kvtier daemon, shared by every engine on the
    node that uses the same namespace and model configuration, and kept across engine
    restarts. Settings: see kvtier_client.integrations.vllm_tier."""

    # The tier lends pages from the daemon's host memory (a disk or cluster page is brought
    # there first); hits are reported as external because they may have come from any of them.
    medium: ClassVar[Medium] = Medium.CPU
    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init__(self, offloading_spec: OffloadingSpec, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: BackpressureDetector | None = None, **settings: Any) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.settings = TierSettings.from_kwargs(settings)
        self.locality = Locality(self.settings.locality) if self.settings.locality else None
        view = primary_kv_view
        if view.ndim != 2 or view.itemsize != 1 or view.shape[1] != self.block_size_bytes or view.readonly:
            raise ValueError(f"kvtier secondary tier: the CPU tier's view is {view.format!r} {view.shape} with rows "
                             f"{self.block_size_bytes} bytes apart; it needs one writable row of bytes per chunk")
        self.layout = row_layout(self.block_size_bytes)
        self.namespace = self.settings.namespace or default_namespace(offloading_spec)
        self._keys = TierKeys(fingerprint(offloading_spec, self.block_size_bytes, self.settings.salt))
        self._kv = self.settings.client(f"vllm secondary tier pid {os.getpid()}")
        try:
            self._kv.register(self.namespace, self.layout, algorithm=KEY_ALGORITHM)
        except KVTierError as exc:
            self._kv.close()
            raise RuntimeError(
                f"kvtier secondary tier: cannot register namespace {self.namespace!r} (pages of "
                f"{self.block_size_bytes} bytes) at {self.settings.target}: {exc}. Is `kvtier serve` running there "
                "(the tier's 'target'), does its token grant this namespace, and does its host tier hold a row?"
            ) from exc
        self.gate = DaemonGate()
        self._jobs: JobRunner[JobResult] = JobRunner(self.settings.io_threads, "kvtier-vllm-tier")
        self._lookups = KVTierLookups(tier_type, self._kv, self.gate, self._keys.block_keys)
        self._load_keys: dict[JobId, list[OffloadKey]] = {}  # loads in flight (scheduler thread only)
        # Last: until shutdown drops it, this array keeps vLLM from releasing its view.
        self._rows: np.ndarray | None = np.asarray(view).view(np.uint8)  # over the CPU tier's shared memory
        self._closed = False

    # -- lookups ---------------------------------------------------------------
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()

    # -- jobs ------------------------------------------------------------------
    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = self._keys.block_keys(job_metadata.keys)
        chunks = [int(c) for c in job_metadata.chunk_ids]
        self._jobs.submit(lambda: self._run(job_metadata.job_id, "store", store_rows, keys, chunks))

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        self._load_keys[job_metadata.job_id] = keys
        block_keys = self._keys.block_keys(keys)
        chunks = [int(c) for c in job_metadata.chunk_ids]
        self._jobs.submit(lambda: self._run(job_metadata.job_id, "load", load_rows, block_keys, chunks, keys))

    def _run(self, job_id: JobId, what: str, move: Callable[..., Moved], keys: Sequence[BlockKey],
             chunks: Sequence[int], offload_keys: Sequence[OffloadKey] = ()) -> JobResult:
        """One job on an I/O thread; never raises (a job that raised would never report)."""
        started = time.monotonic()
        moved = Moved(0, 0)
        if not self.gate.open():
            self.gate.skipped(what)
        else:
            try:
                moved = move(self._kv, keys, self._rows, chunks)
            except Exception as exc:
                if isinstance(exc, KVTierError):
                    self.gate.failed(what, exc)
                else:  # a bug here must not leave vLLM waiting for the job forever
                    log.exception("kvtier secondary tier: %s job %s failed", what, job_id)
                # The frames keep the CPU tier's rows referenced (a client frame may hold the
                # error: a cycle): vLLM could not release its view at shutdown.
                traceback.clear_frames(exc.__traceback__)
        elapsed = time.monotonic() - started
        if moved.rows == len(keys):
            return JobResult(job_id, success=True, transfer_time=elapsed, transfer_bytes=moved.bytes)
        loaded = tuple(offload_keys[: moved.rows]) or None  # a load keeps the prefix it copied
        return JobResult(job_id, success=False, successful_keys=loaded, transfer_time=elapsed,
                         transfer_bytes=moved.bytes)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results = self._jobs.finished()
        for result in results:
            keys = self._load_keys.pop(result.job_id, None)
            if keys and not result.success:  # not in kvtier after all: stop promoting them
                self._lookups.mark_miss(keys[len(result.successful_keys or ()):])
        return results

    def drain_jobs(self) -> None:
        self._jobs.drain()

    def shutdown(self) -> None:
        """End the I/O and lookup threads, close the session (the daemon keeps the pages),
        and let go of the CPU tier's memory (vLLM releases its view next)."""
        if self._closed:
            return
        self._closed = True
        self._jobs.close()
        self._lookups.shutdown()
        self._kv.close()
        self._rows = None
