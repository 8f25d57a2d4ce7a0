"""Ports that keep only the books: no bytes, every page verifies, every copy lands at once.
Trace replay (kvtier.replay) and the core's own tests drive a real BlockStore with them,
so policies and the index run exactly as in the daemon, without any tier."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

from kvtier_client.ids import SessionId, Slot

from kvtier.core.ports import LoadJob, Mechanism, PageRecord


@dataclass(frozen=True)
class LandedTransfer:
    """A promotion that has already landed (the ports' Transfer, with no CUDA event)."""

    ipc_handle: bytes = b""

    def wait(self, timeout: float | None = None) -> bool:
        return True


class BookkeepingHost:
    def give(self, slot: Slot, namespace: str) -> None:
        pass

    def populate(self, slots: Sequence[Slot], namespace: str) -> None:
        pass

    def stage(self, records: Sequence[PageRecord]) -> list[PageRecord]:
        return []

    def publish(self, records: Sequence[PageRecord]) -> None:
        pass

    def unpublish(self, slots: Sequence[Slot]) -> None:
        pass


class BookkeepingDisk:
    """`page_bytes` is what stored records say they hold. Loads land at once, inside the
    request that starts them."""

    space = None  # a chunk per page: nothing is encoded

    def __init__(self, page_bytes: int) -> None:
        self.page_bytes = page_bytes

    def store(self, moves: Sequence[tuple[Slot, PageRecord]]) -> list[PageRecord]:
        return [replace(record, length=self.page_bytes) for _, record in moves]

    def forget(self, records: Iterable[PageRecord]) -> None:
        pass

    def load(self, job: LoadJob) -> None:
        job.on_done(job, True)

    def prefetch_room(self) -> int:
        return 0

    def boost(self, job: LoadJob) -> None:
        pass

    def cancel(self, session: SessionId | None, cancellable: Callable[[LoadJob], bool]) -> list[LoadJob]:
        return []


class BookkeepingDevice:
    def give(self, slots: Sequence[Slot], namespace: str) -> None:
        pass

    def promote(self, pairs: Sequence[tuple[Slot, Slot]], on_done: Callable[[LandedTransfer, bool], None]) -> LandedTransfer:
        transfer = LandedTransfer()
        on_done(transfer, True)
        return transfer

    def marker(self) -> LandedTransfer:
        return LandedTransfer()

    def demote(self, pairs: Sequence[tuple[Slot, Slot]]) -> None:
        pass


def bookkeeping_ports(page_bytes: int, *, host: BookkeepingHost | None = None, disk: BookkeepingDisk | None = None,
                      device: BookkeepingDevice | None = None) -> Mechanism:
    """Books-only host, disk and device ports (a store uses those its tiers need); pass one
    to replace it (a test's port that records, or fails pages)."""
    return Mechanism(host or BookkeepingHost(), disk or BookkeepingDisk(page_bytes), None, device or BookkeepingDevice())
