"""Saves in flight on the scheduler side: pages it borrowed for the workers to write, and
what becomes of them.

A save of prompt blocks [first, end) of a request borrows, per KV cache group, that many
host pages of the group's pool (every group's or none) and goes to the workers as a
SaveOp. Each worker writes its part of the pages (its heads of its layers) and reports; vLLM
merges the reports of all the engine's workers. Only when every worker reported its part
written are the pages committed under their keys: a page is never visible half written,
whatever the parallel shape. Otherwise they are released. A save no report arrives for
within SAVE_REPORT_STEPS step outputs is given up (released): each worker reports a save in
the output of the step that ran it.

`storing` remembers which live request is storing each block (by the first group's key), so
prompts sharing a prefix that are scheduled side by side store it once.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvtier_client.errors import CapacityError, KVTierError
from kvtier_client.integrations.vllm.events import BlockPayload
from kvtier_client.integrations.vllm.link import DaemonLink, log
from kvtier_client.integrations.vllm.metadata import SaveOutcome
from kvtier_client.keys import BlockKey
from kvtier_client.leases import WriteLease

#: Step outputs after which a save still missing a worker's report is given up.
SAVE_REPORT_STEPS = 8


@dataclass
class SentSave:
    """One group's SaveOp waiting for the workers: its borrowed pages, what to commit them
    as, and (first group only, with KV events on) the BlockStored payload of its blocks."""

    lease: WriteLease
    keys: list[BlockKey]
    parent: BlockKey | None
    token_ids: list[int]
    event: BlockPayload | None
    sent_at: int  # the scheduler's count of step outputs when it was sent


@dataclass(frozen=True)
class SaveEnd:
    """What became of a SentSave: `new`, the indices of the keys the daemon took (None:
    nothing was stored)."""

    req_id: str
    group: int
    sent: SentSave
    new: tuple[int, ...] | None


class Saves:
    """The scheduler's saves in flight (module docstring). `links[g]`: group g's registration;
    `workers`: the ranks that must each report a save."""

    def __init__(self, links: list[DaemonLink], workers: frozenset[int]) -> None:
        self.links = links
        self.workers = workers
        self.storing: dict[BlockKey, str] = {}  # first group's key -> the live request storing it
        self.sent: dict[tuple[str, int, int], SentSave] = {}  # (req_id, first block, group) -> not reported yet

    def borrow(self, groups: list[int], count: int, req_id: str) -> dict[int, WriteLease] | None:
        """`count` pages of each group's pool, or None (any borrowed are given back)."""
        leases: dict[int, WriteLease] = {}
        for g in groups:
            try:
                leases[g] = self.links[g].kv.borrow(count)
                continue
            except CapacityError as exc:
                log.info("kvtier connector: no free pages to store %d blocks of request %s: %s", count, req_id, exc)
            except KVTierError as exc:
                self.links[g].failed(f"borrowing {count} pages", exc)
            for lease in leases.values():
                self.release(lease)
            return None
        return leases

    def reported(self, outcome: SaveOutcome) -> SaveEnd | None:
        """The workers' merged word on one SaveOp: commit its pages if every worker wrote
        its part, else release them. None: given up already."""
        sent = self.sent.pop(outcome.key, None)
        if sent is None:
            return None
        if outcome.ok and outcome.ranks >= self.workers:
            return SaveEnd(outcome.req_id, outcome.group, sent, self._commit(sent, outcome))
        missing = sorted(self.workers - outcome.ranks)
        log.warning("kvtier connector: %d blocks of request %s not stored: %s", len(sent.keys), outcome.req_id,
                    f"workers {missing} did not report" if missing else "a worker could not write its part")
        self.release(sent.lease)
        return SaveEnd(outcome.req_id, outcome.group, sent, None)

    def _commit(self, sent: SentSave, outcome: SaveOutcome) -> tuple[int, ...] | None:
        try:
            result = sent.lease.commit(sent.keys, parent=sent.parent, token_ids=sent.token_ids)
        except KVTierError as exc:
            self.links[outcome.group].failed(f"storing {len(sent.keys)} pages of request {outcome.req_id}", exc)
            self.release(sent.lease)
            return None
        duplicates = set(result.duplicates)
        return tuple(i for i in range(len(sent.keys)) if i not in duplicates)

    def overdue(self, outputs: int) -> list[SaveEnd]:
        """Give up (release) the saves still missing a report after SAVE_REPORT_STEPS outputs."""
        late = [key for key, sent in self.sent.items() if outputs - sent.sent_at > SAVE_REPORT_STEPS]
        ends = []
        for req_id, first, group in late:
            sent = self.sent.pop((req_id, first, group))
            log.warning("kvtier connector: no worker report for %d blocks of request %s after %d steps; not stored",
                        len(sent.keys), req_id, SAVE_REPORT_STEPS)
            self.release(sent.lease)
            ends.append(SaveEnd(req_id, group, sent, None))
        return ends

    def unmark(self, keys: list[BlockKey], req_id: str) -> None:
        """`req_id` no longer stores these blocks (it ended, or its save failed)."""
        for key in keys:
            if self.storing.get(key) == req_id:
                del self.storing[key]

    @staticmethod
    def release(lease: WriteLease) -> None:
        if lease.ended:
            return
        try:
            lease.release()
        except KVTierError as exc:
            log.warning("kvtier connector: could not release lease %s: %s", lease.lease_id, exc)
