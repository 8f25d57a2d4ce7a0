"""A PageMover that keeps only the books: no bytes, every page verifies, every copy lands
at once. Trace replay (kvtier.replay) and the core's own tests drive a real BlockStore
with it, so policies and the index run exactly as in the daemon, without any tier."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

from kvtier_client.ids import SessionId, Slot
from kvtier_client.tiers import Tier

from kvtier.core.ports import PageRecord, LoadJob


@dataclass(frozen=True)
class LandedTransfer:
    """A promotion that has already landed (the ports' Transfer, with no CUDA event)."""

    ipc_handle: bytes = b""

    def wait(self, timeout: float | None = None) -> bool:
        return True


class BookkeepingMover:
    """Accounts for moves without bytes. `page_bytes` is what stored disk records say
    they hold."""

    def __init__(self, page_bytes: int) -> None:
        self.page_bytes = page_bytes

    def give_host(self, slot: Slot, namespace: str) -> None:
        pass

    def populate_host(self, slots: Sequence[Slot], namespace: str) -> None:
        pass

    def stage_host(self, records: Sequence[PageRecord]) -> list[PageRecord]:
        return []

    def publish_host(self, records: Sequence[PageRecord]) -> None:
        pass

    def unpublish_host(self, slots: Sequence[Slot]) -> None:
        pass

    def store(self, moves: Sequence[tuple[Slot, PageRecord]]) -> list[PageRecord]:
        return [replace(record, length=self.page_bytes) for _, record in moves]

    def load(self, job: LoadJob) -> None:
        job.on_done(job, True)

    def prefetch_room(self, source: Tier = Tier.DISK) -> int:
        return 0

    def remote_present(self, namespace: str, keys: Sequence[bytes]) -> int:
        return 0

    def remote_write(self, namespace: str, pages: Sequence[tuple[bytes, Slot]],
                     on_done: Callable[[list[bool]], None], *, copy: bool = False) -> bool:
        return False

    def boost(self, job: LoadJob) -> None:
        pass

    def cancel(self, session: SessionId | None, cancellable: Callable[[LoadJob], bool]) -> list[LoadJob]:
        return []

    def forget(self, records: Iterable[PageRecord]) -> None:
        pass

    def give_device(self, slots: Sequence[Slot], namespace: str) -> None:
        pass

    def promote(self, pairs: Sequence[tuple[Slot, Slot]], on_done: Callable[[LandedTransfer, bool], None]) -> LandedTransfer:
        transfer = LandedTransfer()
        on_done(transfer, True)
        return transfer

    def marker(self) -> LandedTransfer:
        return LandedTransfer()

    def demote(self, pairs: Sequence[tuple[Slot, Slot]]) -> None:
        pass
