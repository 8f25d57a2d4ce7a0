"""The engine's side of the device tier: the daemon's device pages mapped in this process,
page tensors over them (torch, through DLPack, zero copy), and the copy-done events of
device leases.

    NamespaceDeviceView  memory per namespace: a virtual range shaped like the daemon's
                         (slot s at s * stride), where only this namespace's slots are
                         mapped, from the descriptors the daemon hands this process over
                         the handoff socket; the namespace's slot table (read-only, shared
                         with the daemon) says which slots it holds at which generation,
                         so a page is mapped once, and memory the namespace lost is dropped
                         (kvtier_client.device_plan)
    DeviceArenaView      the fallback (a GPU that cannot export memory as descriptors): the
                         daemon's one allocation opened over CUDA IPC

Opened lazily, on the first device lease of a session: a client that never asks for device
pages never imports CuPy. The arena is opened on the GPU the daemon named by PCI bus id
(device numbering differs between processes under CUDA_VISIBLE_DEVICES).

A device lease's pages are readable once its event completes: `ReadLease.tensors()` makes
the engine's current torch stream wait on it (no host sync); `ReadLease.wait()` blocks the
host instead.
"""
from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtier_client.device_plan import SlotMappings, table_bytes
from kvtier_client.errors import KVTierError
from kvtier_client.handoff import DeviceGrant
from kvtier_client.ids import Slot
from kvtier_client.layout import PageLayout
from kvtier_client.views import import_torch, torch_dtype

if TYPE_CHECKING:
    import torch

_IPC_LAZY_ENABLE_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess


def _cupy():
    try:
        import cupy
    except ImportError:
        raise KVTierError("device pages need CuPy for this machine's CUDA (pip install cupy-cuda12x or cupy-cuda13x)") from None
    return cupy


class DeviceArenaView:
    """This process's mapping of a daemon's device arena; page i at i * slot_bytes."""

    def __init__(self, handle: bytes, size: int, pci_bus_id: str, layout: PageLayout, slot_bytes: int) -> None:
        if not handle:
            raise KVTierError("this daemon has no device tier (no GPU, or device_size 0); acquire into host")
        cupy = _cupy()
        self.layout = layout
        self.slot_bytes = slot_bytes
        self.size = size
        self.device_id = cupy.cuda.runtime.deviceGetByPCIBusId(pci_bus_id)
        with cupy.cuda.Device(self.device_id):
            self.ptr = cupy.cuda.runtime.ipcOpenMemHandle(handle, _IPC_LAZY_ENABLE_PEER_ACCESS)
        memory = cupy.cuda.UnownedMemory(self.ptr, size, self, self.device_id)
        self._bytes = cupy.ndarray((size,), cupy.uint8, cupy.cuda.MemoryPointer(memory, 0))

    def raw(self, slot: Slot) -> Any:
        """The page's bytes as a CuPy uint8 array, zero copy."""
        start = slot * self.slot_bytes
        return self._bytes[start : start + self.layout.page_bytes]

    def torch(self, slot: Slot) -> "torch.Tensor":
        """The page as a torch CUDA tensor shaped like the layout, zero copy (DLPack)."""
        torch = import_torch()
        return torch.from_dlpack(self.raw(slot)).view(torch_dtype(self.layout.dtype)).view(self.layout.shape)

    def close(self) -> None:
        if self.ptr:
            cupy = _cupy()
            with cupy.cuda.Device(self.device_id):
                cupy.cuda.runtime.ipcCloseMemHandle(self.ptr)
            self.ptr = 0


#: Asks the daemon for (slot, generation, descriptor) of the listed slots of this namespace.
FetchSlots = Callable[[list[int]], list[tuple[int, int, int]]]


class NamespaceDeviceView:
    """This process's mapping of its namespace's device slots; page i at i * stride."""

    def __init__(self, grant: DeviceGrant, layout: PageLayout, fetch: FetchSlots) -> None:
        """Takes the grant's table descriptor (closed here, or by `close`)."""
        from kvtier_client.cuda_vmm import Driver

        self.layout = layout
        self.stride = grant.stride
        self.pages = grant.pages
        self.size = grant.pages * grant.stride
        self._fetch = fetch
        self._lock = threading.Lock()
        self._mappings = SlotMappings(grant.pages)
        try:
            self._table_mm = mmap.mmap(grant.table_fd, table_bytes(grant.pages), mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(grant.table_fd)
        self._table = np.frombuffer(self._table_mm, dtype=np.uint64)
        cupy = _cupy()
        self.device_id = cupy.cuda.runtime.deviceGetByPCIBusId(grant.pci_bus_id)
        with cupy.cuda.Device(self.device_id):
            cupy.cuda.runtime.free(0)  # the primary context, which the driver calls below use
        self._driver = Driver(self.device_id)
        with self._driver.current():
            self.ptr = self._driver.reserve(self.size, self._driver.granularity())
        memory = cupy.cuda.UnownedMemory(self.ptr, self.size, self, self.device_id)
        self._bytes = cupy.ndarray((self.size,), cupy.uint8, cupy.cuda.MemoryPointer(memory, 0))

    def raw(self, slot: Slot) -> Any:
        """The page's bytes as a CuPy uint8 array, zero copy (mapped first if need be)."""
        if not self._mappings.current(self._table, slot):
            self.sync()
            if not self._mappings.current(self._table, slot):
                raise KVTierError(f"device slot {slot} is not this namespace's: lease it before reading it "
                                  "(or the daemon and client disagree)")
        start = slot * self.stride
        return self._bytes[start : start + self.layout.page_bytes]

    def torch(self, slot: Slot) -> "torch.Tensor":
        """The page as a torch CUDA tensor shaped like the layout, zero copy (DLPack)."""
        torch = import_torch()
        return torch.from_dlpack(self.raw(slot)).view(torch_dtype(self.layout.dtype)).view(self.layout.shape)

    def sync(self) -> None:
        """Match the table: unmap what the namespace lost, map what it holds and this process
        has not mapped (at its current generation)."""
        with self._lock, self._driver.current():
            plan = self._mappings.plan(self._table)
            for slot in plan.drop:
                self._driver.unmap(self.ptr + slot * self.stride, self.stride)
                self._mappings.dropped(slot)
            for batch in plan.batches():
                for slot, generation, fd in self._fetch(batch):
                    try:
                        self._map(slot, generation, fd)
                    finally:
                        os.close(fd)

    def _map(self, slot: int, generation: int, fd: int) -> None:
        handle = self._driver.import_fd(fd)
        try:
            self._driver.map(self.ptr + slot * self.stride, self.stride, handle)
        finally:
            self._driver.release(handle)  # the mapping keeps the memory
        self._mappings.mapped(slot, generation)

    def mapped_slots(self) -> list[int]:
        """The slots this process maps now (for tests and diagnostics)."""
        return self._mappings.held()

    def close(self) -> None:
        if self.ptr:
            with self._lock, self._driver.current():
                for slot in self._mappings.held():
                    self._driver.unmap(self.ptr + slot * self.stride, self.stride)
                    self._mappings.dropped(slot)
                self._driver.free_range(self.ptr, self.size)
            self.ptr = 0
            self._driver.close()
            del self._table
            self._table_mm.close()


class CopyDone:
    """A device lease's interprocess CUDA event: its pages are readable once it completes."""

    def __init__(self, handle: bytes, device_id: int) -> None:
        cupy = _cupy()
        self.device_id = device_id
        with cupy.cuda.Device(device_id):
            self._event = cupy.cuda.runtime.ipcOpenEventHandle(handle)

    def wait(self) -> None:
        """Block the host until the copy is done."""
        _cupy().cuda.runtime.eventSynchronize(self._event)

    def wait_on(self, stream_ptr: int) -> None:
        """Make a CUDA stream (e.g. `torch.cuda.current_stream().cuda_stream`) wait for the
        copy, without blocking the host."""
        _cupy().cuda.runtime.streamWaitEvent(stream_ptr, self._event)

    def close(self) -> None:
        if self._event:
            _cupy().cuda.runtime.eventDestroy(self._event)
            self._event = 0
