"""Leases as the engine sees them: page views plus the calls that end the lease.

A lease belongs to the session it was taken in. If the daemon restarts, the client
re-registers under a new session and the old leases are gone on the daemon's side:
committing or releasing one raises DaemonRestarted, while leaving its `with` block just
forgets it (there is nothing left to release).

Both kinds are context managers that release on exit unless already ended, so
``with client.borrow(n) as lease:`` cannot leak pages; an engine that keeps a lease across
scheduler steps can hold the object and call `commit` / `release` itself.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Protocol

import numpy as np
import xxhash

from kvtier_client.device import CopyDone, DeviceArenaView
from kvtier_client.errors import KVTierError
from kvtier_client.ids import LeaseId, SessionId, Slot
from kvtier_client.keys import BlockKey
from kvtier_client.results import CommitResult
from kvtier_client.tiers import Tier
from kvtier_client.views import HostArenaView

if TYPE_CHECKING:
    import torch

log = logging.getLogger("kvtier_client")


class SessionLike(Protocol):
    arena: HostArenaView | None

    @property
    def session_id(self) -> SessionId: ...

    @property
    def page_bytes(self) -> int: ...  # the daemon's figure, from Register

    def device_arena(self) -> DeviceArenaView: ...


class LeaseOwner(Protocol):
    """What a lease needs from its client (kvtier_client.client.KVTierClient)."""

    def commit(self, lease: "WriteLease", keys: Sequence[BlockKey], *, parent: BlockKey | None = None,
               token_ids: Sequence[int] | None = None) -> CommitResult:
        ...

    def release(self, lease: "Lease") -> None: ...

    def is_current(self, session: SessionLike) -> bool: ...


class Lease:
    """Common part of read and write leases: id, slots, session, views."""

    _writable = False

    def __init__(self, owner: LeaseOwner, session: SessionLike, lease_id: LeaseId, tier: Tier,
                 slots: Sequence[Slot]) -> None:
        self._owner = owner
        self.session = session
        self.lease_id = lease_id
        self.tier = tier
        self.slots = tuple(slots)
        self.ended = False  # committed or released

    def __repr__(self) -> str:
        state = "ended" if self.ended else "open"
        return f"{type(self).__name__}(id={self.lease_id}, pages={len(self.slots)}, {state})"

    @property
    def count(self) -> int:
        return len(self.slots)

    def _visible_slots(self) -> tuple[Slot, ...]:
        return self.slots

    def _arena(self) -> HostArenaView:
        if self.session.arena is None:
            raise KVTierError(
                "this client does not map the host arena (map_arena=False); "
                "move page bytes with kvtier_client.remote.RemotePages instead"
            )
        if self.tier != Tier.HOST:
            raise KVTierError(f"lease {self.lease_id} holds {self.tier.label} pages; only host pages have views here")
        return self.session.arena

    @cached_property
    def pages(self) -> tuple[np.ndarray, ...]:
        """One zero-copy numpy view per page, shaped like the layout (writable for write leases).
        bfloat16 and float8 pages show their raw bits (uint16 / uint8): see kvtier_client.views."""
        arena, slots = self._mapped_arena()
        return tuple(arena.numpy(slot, writable=self._writable) for slot in slots)

    def tensors(self) -> tuple["torch.Tensor", ...]:
        """One zero-copy torch view per page, with the layout's real dtype. Needs torch.
        Device leases give CUDA tensors in the daemon's HBM (see ReadLease.tensors)."""
        if self.tier == Tier.DEVICE:
            arena = self.session.device_arena()
            return tuple(arena.torch(slot) for slot in self._visible_slots())
        arena, slots = self._mapped_arena()
        return tuple(arena.torch(slot) for slot in slots)

    def _mapped_arena(self) -> tuple[HostArenaView, tuple[Slot, ...]]:
        """The arena and the lease's slots, each mapped in this process in one call the first
        time it sees them (not a page fault per 4 KiB as the engine's copy goes)."""
        arena, slots = self._arena(), self._visible_slots()
        for slot in slots:
            arena.map_slot(slot)
        return arena, slots

    def release(self) -> None:
        self._owner.release(self)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.ended:
            return
        if not self._owner.is_current(self.session):
            self.ended = True  # its session is gone, and with it the lease
            return
        if exc_type is None:
            self.release()
            return
        try:
            self.release()
        except KVTierError as error:
            # Do not hide the caller's exception behind a failed clean-up; the daemon frees the
            # lease when the session ends anyway.
            log.warning("could not release lease %s while handling %s: %s", self.lease_id, exc_type.__name__, error)


#: `WriteLease.write` copies and hashes a page this many bytes at a time, so each piece is
#: hashed while it is still in the CPU's cache (one pass over memory, not two).
WRITE_PIECE_BYTES = 256 * 1024


class WriteLease(Lease):
    """Free host pages to fill (from borrow). `commit` publishes them under block keys.

    Fill a page with `write(i, data)` (a copy that also hashes the page as it goes, so
    `commit` sends the daemon each page's checksum for free), or through its view in
    `pages`/`tensors()` (then `commit` hashes the page itself, a second pass over it)."""

    _writable = True

    def write(self, index: int, data) -> None:
        """Copy `data` (page_bytes of anything numpy can view as bytes: an array, bytes, a
        CPU tensor's .numpy()) into page `index`, hashing it on the way. Writing the page
        again afterwards through its view makes its checksum stale: the page then fails
        its next check (warm restart, a disk or cluster read) and is dropped, never served."""
        arena, slot = self._arena(), self.slots[index]
        arena.map_slot(slot)
        page = arena.raw(slot, writable=True)
        src = data if isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.ndim == 1 else \
            np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        if src.nbytes != page.nbytes:
            raise ValueError(f"page {index} holds {page.nbytes} bytes; got {src.nbytes}")
        if page.nbytes <= WRITE_PIECE_BYTES:
            np.copyto(page, src)
            self.checksums[index] = xxhash.xxh3_64_intdigest(page)
            return
        digest = xxhash.xxh3_64()
        for at in range(0, page.nbytes, WRITE_PIECE_BYTES):
            piece = page[at : at + WRITE_PIECE_BYTES]
            np.copyto(piece, src[at : at + WRITE_PIECE_BYTES])
            digest.update(piece)
        self.checksums[index] = digest.intdigest()

    @cached_property
    def checksums(self) -> dict[int, int]:
        """Checksums of the pages filled with `write`, by page index."""
        return {}

    def commit(self, keys: Sequence[BlockKey], *, parent: BlockKey | None = None,
               token_ids: Sequence[int] | None = None) -> CommitResult:
        """Page i becomes the cached copy of keys[i]; pages beyond len(keys) are freed.
        `parent` is the key of the block before keys[0], if any. `token_ids`: the blocks'
        token ids, `block_tokens` per key, for the daemon's KV events (docs/events.md).
        Ends the lease."""
        return self._owner.commit(self, keys, parent=parent, token_ids=token_ids)


class ReadLease(Lease):
    """Cached pages pinned in a tier (from acquire); only the first `ready` are readable
    (all of them unless acquire was asked not to wait). Views are read-only; torch has no
    read-only tensors, so do not write through `tensors()` of a read lease."""

    def __init__(self, owner: LeaseOwner, session: SessionLike, lease_id: LeaseId, tier: Tier, slots: Sequence[Slot],
                 *, keys: Sequence[BlockKey], ready: int, promoted: int, ready_event: bytes = b"") -> None:
        super().__init__(owner, session, lease_id, tier, slots)
        self.keys = tuple(keys)
        self.ready = ready
        self.promoted = promoted
        self._ready_event = ready_event  # device leases: CUDA IPC event of the host -> device copy
        self._copy_done: CopyDone | None = None

    def _event(self) -> CopyDone | None:
        if self._ready_event and self._copy_done is None:
            self._copy_done = CopyDone(self._ready_event, self.session.device_arena().device_id)
        return self._copy_done

    def wait(self) -> None:
        """Block until the pages are readable (device leases; host leases already are)."""
        if (event := self._event()) is not None:
            event.wait()

    def wait_on(self, stream_ptr: int) -> None:
        """Make a CUDA stream wait until the pages are readable, without a host sync."""
        if (event := self._event()) is not None:
            event.wait_on(stream_ptr)

    def tensors(self) -> tuple["torch.Tensor", ...]:
        """Zero-copy torch views of the ready pages. For a device lease, torch's current
        CUDA stream is first made to wait for the copy, so kernels queued after this call
        on that stream read the landed pages; other streams: call `wait_on` yourself.
        Before `release`, make sure kernels reading these pages have finished (synchronize
        their stream): after release the daemon may reuse the slots."""
        if self.tier == Tier.DEVICE and self._ready_event:
            import torch

            self.wait_on(torch.cuda.current_stream(self.session.device_arena().device_id).cuda_stream)
        return super().tensors()

    def release(self) -> None:
        if self._copy_done is not None:
            self._copy_done.close()
            self._copy_done = None
        super().release()

    def _visible_slots(self) -> tuple[Slot, ...]:
        return self.slots[: self.ready]
