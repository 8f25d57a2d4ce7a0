"""The connector's scheduler side (vLLM's engine-core process): lookups, load planning and
the per-step metadata that tells the worker what to load and store.

Per request, in the order vLLM calls it:

    on_new_request               block keys (salted), prefetch
    get_num_new_matched_tokens   lookup; the planner's load beyond vLLM's own prefix hit
    update_state_after_alloc     the offered load, as blocks of the request
    build_connector_meta         (every step) LoadOps for those blocks, SaveOps for the full
                                 prompt blocks this step completes that are new (below)
    update_connector_output      the worker's timings -> planner; what each save became ->
                                 the request's count, KV events
    request_finished             kv_transfer_params={"kvtier": {...}}

A request's kvtier hints (`kv_hints`, hints.py) are read at arrival: a prefetch acts then,
the others once it has finished and its last save has settled.

A block is stored once. A full prompt block goes into a SaveOp only if kvtier did not hold
it at the request's lookup, vLLM's own prefix cache did not serve it (the request's computed
tokens when it was scheduled: the request that put those blocks in vLLM's cache computed
and stored them), and no other live request of this engine is storing it (`Saves.storing`:
prompts sharing a prefix that are scheduled in one step, or chunk by chunk side by side).
The scheduler borrows the pages of a save when it sends the SaveOp and commits them once
every worker has written its part (saves.py). A block the daemon already had (another
engine stored it meanwhile) comes off the request's `stored_blocks`; the keys of a save that
failed are freed so that a later request stores them.

A model with several KV cache groups (kv_groups.py) has a key chain, a registration and
pages per group: one group lookup says how long a prefix every group can restore, each
group loads only what its layers read, and each group's pages are saved and committed on
their own; the first group's keys name the blocks.
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import KVCacheEvent
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier_client.errors import KVTierError
from kvtier_client.groups import GroupMode, GroupQuery, needed_blocks
from kvtier_client.integrations.planner import Planner
from kvtier_client.integrations.vllm.config import ConnectorConfig
from kvtier_client.integrations.vllm.events import block_payload
from kvtier_client.integrations.vllm.extra_keys import block_extras
from kvtier_client.integrations.vllm.hints import Hinter
from kvtier_client.integrations.vllm.kv_groups import KVGroup
from kvtier_client.integrations.vllm.link import DaemonLink, log
from kvtier_client.integrations.vllm.metadata import (
    SKIP,
    KVTierConnectorMetadata,
    KVTierWorkerMetadata,
    LoadOp,
    SaveOp,
)
from kvtier_client.integrations.vllm.request_state import RequestState, request_salt
from kvtier_client.integrations.vllm.saves import SaveEnd, Saves, SentSave
from kvtier_client.integrations.vllm.stats import KVTierConnectorStats
from kvtier_client.integrations.vllm.tier_events import TierEvents
from kvtier_client.keys import BlockKey
from kvtier_client.results import LookupResult
from kvtier_client.tiers import Tier

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

#: vLLM's cache-hit source for each kvtier tier. The cluster tier is a store shared by
#: nodes: vLLM's "remote store" source.
_TIER_SOURCES = {
    Tier.DEVICE: CacheHitSource.DEVICE, Tier.HOST: CacheHitSource.HOST, Tier.DISK: CacheHitSource.DISK,
    Tier.CLUSTER: CacheHitSource.EXTERNAL_UNSPECIFIED,
}
#: vLLM's null block: a block table's placeholder for a block a window group has dropped.
NULL_BLOCK = 0


class KVTierScheduler:
    """The scheduler half of KVTierConnector: one per engine core. `groups`: the engine's
    KV cache groups, `links[i]` the registration of group i's layout; `workers`: the
    engine's workers, each of which must report a save before it is committed; `events`: keep
    KV events for vLLM's publisher (when the engine enables them): the BlockStored of each
    commit, and kvtier's later tier changes of those pages (tier_events.py);
    `hash_block_size`: the granularity of vLLM's request block hashes (the block size, for
    one KV cache group)."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, links: list[DaemonLink], groups: list[KVGroup], config: ConnectorConfig, block_size: int, *,
                 do_load: bool, do_save: bool, workers: int = 1, events: bool = False,
                 hash_block_size: int | None = None, weights: bytes = b"", page_tokens: int | None = None) -> None:
        self.links, self.groups = links, groups
        self.link = links[0]  # lookups go through the first group's registration
        self.kv = self.link.kv
        #: One full-attention group: a plain prefix lookup answers; else a group lookup.
        self._plain = len(groups) == 1 and groups[0].mode is GroupMode.FULL
        self.config = config
        self.block_size = block_size
        #: A kvtier page holds `per_page` vLLM blocks (page_tokens; keys, lookups, loads and
        #: saves go by pages, the copies by blocks).
        self.page = page_tokens or block_size
        self.per_page = self.page // block_size
        self.hash_block_size = hash_block_size or block_size
        self.do_load = do_load
        self.do_save = do_save
        self.saves = Saves(links, frozenset(range(workers)))
        #: KV events on: the commits' BlockStored and kvtier's later tier changes (None: off, no thread).
        self.tier_events = TierEvents(config.client(f"vllm events pid {os.getpid()}", map_arena=False),
                                      config.namespace, groups, block_size=block_size, per_page=self.per_page,
                                      hash_block_size=self.hash_block_size,
                                      max_pages=config.kv_events_pages) if events else None
        self.planner = Planner(self.kv) if config.use_planner else None
        self._requests: dict[str, RequestState] = {}
        self._stats = KVTierConnectorStats()
        #: Requests' kvtier hint actions (hints.py): prefetch at arrival, the rest once saved.
        self.hints = Hinter(links, self.page, self._stats.add)
        self._outputs = 0  # step outputs seen (update_connector_output)
        self._loading: list[str] = []  # requests whose background load goes out with the next metadata
        #: Mixed into every key: the checkpoint (weights.py) and the epoch a reset_cache starts.
        self.weights = weights
        self._epoch = b""

    def _state(self, request: Request) -> RequestState | None:
        state = self._requests.get(request.request_id)
        if state is not None and state.epoch != self._epoch and state.load is None:
            self._renew(state)  # keys from before a reset_cache: never load or store under them
        if state is not None:
            return state
        if request.prompt_token_ids is None:
            return None  # prompt embeddings only: no token ids to name the KV by
        state = RequestState(request, self._keys(request), len(request.prompt_token_ids), epoch=self._epoch)
        self._requests[request.request_id] = state
        return state

    def _keys(self, request: Request) -> list[list[BlockKey]]:
        """The request's key chain per group, in the current epoch."""
        salt = request_salt(self.config.salt + self.weights + self._epoch, request)
        extras = block_extras(request, self.page)
        return [self.kv.block_keys(request.prompt_token_ids, salt=salt + g.salt, extras=extras) for g in self.groups]

    def _renew(self, state: RequestState) -> None:
        """A request that outlived a reset_cache (vLLM preempts running requests when it
        resets) starts over in the new epoch: new keys, nothing of it known to be stored."""
        self.saves.unmark(state.storing, state.request.request_id)
        state.group_keys, state.epoch = self._keys(state.request), self._epoch
        state.storing, state.save_upto, state.kvtier_blocks = [], 0, 0

    def on_new_request(self, request: Request) -> None:
        state = self._state(request)
        if state is None:
            return
        prefetch = self.hints.arrived(request.request_id, getattr(request, "kv_hints", None),
                                      request.kv_transfer_params, state.group_keys)
        if not state.keys or not self.do_load or not self.link.available():
            return
        if prefetch is not None:  # the hint's deadline, even with the connector's prefetch off
            self.hints.prefetch(prefetch, state.group_keys)
            return
        if not self.config.prefetch:
            return
        try:  # disk pages start climbing to host before the request is scheduled
            for link, keys in zip(self.links, state.group_keys):
                link.kv.prefetch(keys)
        except KVTierError as exc:
            self.link.failed("prefetch", exc)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        state = self._state(request)
        if state is None or state.load_failed or not self.do_load or not state.keys or not self.link.available():
            return 0, False
        state.candidate = None
        state.found = (0, 0)
        block = self.page
        local = num_computed_tokens // block
        try:
            hit, tiers = self._lookup(state, min(local, len(state.keys)))
        except KVTierError as exc:
            self.link.failed("lookup", exc)
            return 0, False
        state.kvtier_blocks = hit
        state.save_upto = max(state.save_upto, hit)
        if hit <= local:
            return 0, False
        beyond = LookupResult(hit - local, tiers[local:hit])
        if self.planner is not None:
            plan = self.planner.plan(beyond)
            n, state.plan_reason = plan.load_blocks, plan.reason
        else:
            n, state.plan_reason = beyond.hit_blocks, "planner off: loading every cached block"
        limit = self.config.max_load_tokens
        if limit is not None and n * block > limit:
            n, state.plan_reason = limit // block, f"{state.plan_reason}; at most max_load_tokens={limit}"
        if not self._plain and 0 < n < beyond.hit_blocks:
            # A hybrid prefix restores only at an end every group was asked about.
            n, state.plan_reason = 0, f"{state.plan_reason}; a hybrid prefix is loaded whole or not at all"
        state.found = (beyond.hit_blocks, n)
        # vLLM computes at least the last prompt token itself.
        target = min((local + n) * block, state.prompt_tokens - 1)
        external = target - num_computed_tokens
        if external <= 0:
            return 0, False
        end = -(-target // block)
        state.candidate = (num_computed_tokens, end, external)
        state.local_blocks = num_computed_tokens // self.block_size
        state.candidate_tiers = tuple(tiers[local:end])
        state.candidate_async = self._in_background(state.candidate_tiers)
        return external, state.candidate_async

    def _in_background(self, tiers: tuple[Tier, ...]) -> bool:
        """Whether a load from these tiers runs asynchronously (ConnectorConfig.async_loads):
        the request waits for it while the others' steps go on."""
        mode = self.config.async_loads
        if mode != "auto":
            return mode == "always"
        return len(self.groups) > 1 or any(t >= Tier.DISK for t in tiers)

    def _lookup(self, state: RequestState, local: int) -> tuple[int, tuple[Tier, ...]]:
        """How many leading blocks kvtier can restore, and the tier each must be loaded
        from: for several groups (or a window), in one group lookup, the slowest tier among
        the groups that need the block (HOST where none does: nothing to load). `local`:
        the leading blocks vLLM's own prefix cache holds, told to the daemon so that it
        counts them as the engine's, not as its hits (docs/metrics.md, "Found and served")."""
        if self._plain:
            found = self.kv.lookup(state.keys, known=local)
            return found.hit_blocks, tuple(found.tiers[: found.hit_blocks])
        found = self.kv.lookup_groups([GroupQuery(keys, g.mode, g.window, g.layout)
                                       for g, keys in zip(self.groups, state.group_keys)], known=local)
        tiers = [Tier.HOST] * found.hit_blocks
        for hit in found.groups:
            for i, tier in zip(hit.blocks, hit.tiers):
                tiers[i] = max(tiers[i], tier)
        return found.hit_blocks, tuple(tiers)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        state = self._requests.get(request.request_id)
        if state is None:
            return
        hit, planned = state.found
        state.found = (0, 0)
        self._stats.add(hit_blocks=hit, declined_blocks=hit - planned)
        if num_external_tokens <= 0 or state.candidate is None:
            return
        computed, end, offered = state.candidate
        if num_external_tokens != offered:  # vLLM took fewer tokens: the load ends where they do
            end = -(-(computed + num_external_tokens) // self.page)
        start = computed // self.page
        state.load = (start, end)
        state.load_tiers = state.candidate_tiers[: end - start]
        state.load_needs = tuple(needed_blocks(g.mode, g.window, end) for g in self.groups)
        state.loaded_tokens += num_external_tokens
        state.candidate = None
        if self.tier_events is not None:
            for g, need in enumerate(state.load_needs):  # each group's pages this load reads
                self.tier_events.loaded(request, g, state.group_keys[g], max(start, need.start), need.stop)
        if state.candidate_async:
            # The request waits (vLLM's WAITING_FOR_REMOTE_KVS) and is not scheduled until the
            # load is done: its LoadOps go out with the next metadata, from these blocks.
            state.block_ids = self._group_ids(blocks.get_block_ids())
            self._loading.append(request.request_id)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        state = self._requests.get(request.request_id)
        if num_external_tokens <= 0:
            return {}
        if state is None or not state.load_tiers:
            return {self._cache_hit_source: num_external_tokens}
        counts: dict[CacheHitSource, int] = {}
        left = num_external_tokens
        for tier in state.load_tiers:
            take = min(left, self.page)
            source = _TIER_SOURCES.get(tier, CacheHitSource.EXTERNAL_UNSPECIFIED)
            counts[source] = counts.get(source, 0) + take
            left -= take
        if left > 0:
            counts[self._cache_hit_source] = counts.get(self._cache_hit_source, 0) + left
        return {k: v for k, v in counts.items() if v}

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVTierConnectorMetadata:
        meta = KVTierConnectorMetadata(step_tokens=scheduler_output.total_num_scheduled_tokens)
        for req_id in self._loading:
            state = self._requests.get(req_id)
            if state is not None and state.load is not None:
                (start, end), state.load = state.load, None
                self._add_loads(state, req_id, start, end, meta, background=True)
        self._loading.clear()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is not None:
                state.block_ids = self._group_ids(new.block_ids)
                self._skip_computed(state, new.num_computed_tokens)
                self._plan_step(state, new.req_id, new.num_computed_tokens, scheduled.get(new.req_id, 0), meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = self._group_ids(new_ids)
                self._skip_computed(state, cached.num_computed_tokens[i])
            elif new_ids:
                for ids, more in zip(state.block_ids, new_ids):
                    ids.extend(more)
            self._plan_step(state, req_id, cached.num_computed_tokens[i], scheduled.get(req_id, 0), meta)
        return meta

    def _group_ids(self, block_ids: tuple[list[int], ...] | None) -> list[list[int]]:
        """A request's vLLM block ids, one list per KV cache group."""
        return [list(ids) for ids in block_ids] if block_ids else [[] for _ in self.groups]

    def _skip_computed(self, state: RequestState, computed: int) -> None:
        """A request just (re)scheduled starts with `computed` tokens: vLLM's prefix-cache hit and
        kvtier's load. Neither is stored again: the loaded blocks are kvtier's, and the request
        that put the others in vLLM's cache computed and stored them."""
        served = min(computed, state.prompt_tokens) // self.page
        if served > state.save_upto:
            self._stats.add(skipped_store_blocks=served - state.save_upto)
            state.save_upto = served

    def _plan_step(self, state: RequestState, req_id: str, computed: int, scheduled: int,
                   meta: KVTierConnectorMetadata) -> None:
        if computed < state.prompt_tokens:
            meta.prefill_tokens += min(scheduled, state.prompt_tokens - computed)
        if state.load is not None:
            start, end = state.load
            state.load = None
            self._add_loads(state, req_id, start, end, meta)
        if not self.do_save or not self.link.available() or state.epoch != self._epoch:
            return  # while the daemon is away, blocks wait; a later step of the request stores them
        full = min(computed + scheduled, state.prompt_tokens) // self.page
        full = min(full, len(state.keys), *(len(ids) // self.per_page for ids in state.block_ids))
        first = state.save_upto
        while first < full and state.keys[first] in self.saves.storing:
            first += 1  # another live request stores it (keys are chained: theirs come first)
        if first > state.save_upto:
            self._stats.add(skipped_store_blocks=first - state.save_upto)
            state.save_upto = first
        if full <= first:
            return
        state.save_upto = full
        self._add_saves(state, req_id, first, full, computed, meta)

    def _add_loads(self, state: RequestState, req_id: str, start: int, end: int,
                   meta: KVTierConnectorMetadata, *, background: bool = False) -> None:
        """LoadOps for pages [start, end) of the request: per group, those a restore to `end`
        needs (all of them for full attention, the trailing window for a window), as the
        vLLM blocks of each page (SKIP for a block vLLM holds already, or has not allocated:
        past the tokens loaded)."""
        k = self.per_page
        for g, (need, ids, keys) in enumerate(zip(state.load_needs, state.block_ids, state.group_keys)):
            pages = range(max(start, need.start), end)
            blocks = [ids[b] if state.local_blocks <= b < len(ids) and not self._dropped(g, ids[b]) else SKIP
                      for p in pages for b in range(p * k, (p + 1) * k)]
            if any(b != SKIP for b in blocks):
                meta.loads.append(LoadOp(req_id, blocks, [keys[p] for p in pages], g, background))

    def _add_saves(self, state: RequestState, req_id: str, first: int, full: int, computed: int,
                   meta: KVTierConnectorMetadata) -> None:
        """SaveOps for prompt pages [first, full), one per group, into pages borrowed now:
        every group's or none. A window group whose blocks vLLM may have freed (behind its
        window once `computed` tokens were computed: the connector's copy of the block table
        does not see that) is left out."""
        k = self.per_page
        groups = [g for g, ids in enumerate(state.block_ids)
                  if first * self.page >= self.groups[g].kept_from(computed)
                  and not any(self._dropped(g, i) for i in ids[first * k : full * k])]
        leases = self.saves.borrow(groups, full - first, req_id)
        if leases is None:
            self._stats.add(store_failed_blocks=full - first)
            return  # a miss later; the blocks are not tried again for this request
        tokens = list(state.request.prompt_token_ids[first * self.page : full * self.page])
        for g, lease in leases.items():
            keys = state.group_keys[g]
            meta.saves.append(SaveOp(req_id, first, state.block_ids[g][first * k : full * k], list(lease.slots), g))
            payload = None
            if self.tier_events is not None:
                payload = block_payload(state.request, first * k, full * k, self.block_size, self.hash_block_size)
                if payload is not None:
                    self.tier_events.expect(keys[first:full])
            self.saves.sent[(req_id, first, g)] = SentSave(lease, keys[first:full], keys[first - 1] if first else None,
                                                           tokens, payload, self._outputs)
        for key in state.keys[first:full]:
            self.saves.storing[key] = req_id
        state.storing.extend(state.keys[first:full])
        state.stored_blocks += full - first

    def _dropped(self, group: int, block_id: int) -> bool:
        """A window group's block vLLM has dropped (outside the window): its null block."""
        return block_id == NULL_BLOCK and self.groups[group].mode is GroupMode.WINDOW

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._outputs += 1
        for req_id in connector_output.failed_recving or ():
            if (state := self._requests.get(req_id)) is not None:
                state.load_failed = True  # vLLM recomputes it; asking again would loop on the same hit
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, KVTierWorkerMetadata):
            for outcome in meta.saves:
                self._settle(self.saves.reported(outcome))
        for end in self.saves.overdue(self._outputs):
            self._settle(end)
        if not isinstance(meta, KVTierWorkerMetadata) or self.planner is None:
            return
        self.planner.observe_copy(meta.copy_bytes, meta.copy_seconds)
        # A step that was mostly prompt tokens measures the prefill rate.
        if meta.prefill_tokens >= self.block_size and 2 * meta.prefill_tokens >= meta.step_tokens:
            self.planner.observe_prefill(meta.step_tokens, meta.forward_seconds)
            log.debug("kvtier connector: prefill of %d tokens took %.4fs", meta.step_tokens, meta.forward_seconds)

    def _settle(self, end: SaveEnd | None) -> None:
        """Count what became of one group's save; the first group's keys name the blocks
        (the request's `stored_blocks`, the keys being stored, the KV events)."""
        if end is None:
            return  # given up already
        if not self._saving(end.req_id):
            self.hints.settled(end.req_id)  # a finished request's hints wait for its last save
        sent, new = end.sent, end.new
        if new is None:
            self._stats.add(store_failed_blocks=len(sent.keys))
        else:
            self._stats.add(store_blocks=len(new), store_duplicate_blocks=len(sent.keys) - len(new))
        if sent.event is not None and self.tier_events is not None:
            self.tier_events.committed(end.group, sent.keys, new, sent.event)
        if end.group != 0:
            return
        state = self._requests.get(end.req_id)
        if state is not None:
            state.stored_blocks -= len(sent.keys) - len(new or ())
        if new is None:
            self.saves.unmark(sent.keys, end.req_id)

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self.tier_events.take() if self.tier_events is not None else ()

    def get_kv_connector_stats(self) -> KVTierConnectorStats | None:
        if self.tier_events is not None:
            self._stats.add(kv_events_dropped=self.tier_events.take_dropped())
        return self._stats.take()

    def reset_cache(self) -> bool:
        """vLLM's reset_prefix_cache(reset_connector=True), which it calls after a weight update,
        on pause_generation(clear_cache=True) and before sleep: from now on this engine reads
        only pages stored after the reset (a new key epoch; on_reset="keep": the same keys, for
        engines whose weights never change in memory), so KV computed with other weights is
        never served to it. The pages themselves stay: they belong to the namespace, which
        other engines share. Requests already known keep their keys; the keys being stored
        and the KV events not taken yet are forgotten, as are the pages whose tiers it relayed
        (vLLM's reset tells the router to forget this engine's blocks)."""
        if self.config.on_reset == "new_epoch":
            self._epoch = os.urandom(8)
        self.saves.storing.clear()  # (saves in flight still end as the workers report them)
        if self.tier_events is not None:
            self.tier_events.forget()
        for state in self._requests.values():
            state.storing.clear()
        log.info("kvtier connector: reset_cache (on_reset=%s) for namespace %r; pages stored before stay in kvtier "
                 "for the engines that did not reset", self.config.on_reset, self.config.namespace)
        return True

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        state = self._requests.pop(request.request_id, None)
        if state is None:
            return False, None
        self.saves.unmark(state.storing, request.request_id)
        hints = self.hints.describe(request.request_id)
        self.hints.finished(request.request_id, self._saving(request.request_id))
        # Its blocks are never held: the workers wrote its saves within their steps (the commits
        # of the last step may come with that step's output, after this call).
        return False, {"kvtier": {
            **({"hints": hints} if hints else {}),
            "loaded_tokens": state.loaded_tokens,
            "cached_blocks": state.kvtier_blocks,
            "stored_blocks": state.stored_blocks,
            "plan": state.plan_reason,
            "prefill_tokens_per_second": self.planner.prefill_tokens_per_second if self.planner else None,
            "copy_bytes_per_second": self.planner.copy_bytes_per_second if self.planner else None,
        }}

    def _saving(self, req_id: str) -> bool:
        """Whether some save of the request has not settled yet."""
        return any(key[0] == req_id for key in self.saves.sent)

    def shutdown(self) -> None:
        if self.tier_events is not None:
            self.tier_events.close()
