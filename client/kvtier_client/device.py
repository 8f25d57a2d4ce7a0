"""The engine's side of the device tier: the daemon's HBM arena opened over CUDA IPC, page
tensors over it (torch, through DLPack, zero copy), and the copy-done events of device
leases.

Opened lazily, on the first device lease of a session: a client that never asks for device
pages never imports CuPy. The arena is opened once per session on the GPU the daemon named
by PCI bus id (device numbering differs between processes under CUDA_VISIBLE_DEVICES).

A device lease's pages are readable once its event completes: `ReadLease.tensors()` makes
the engine's current torch stream wait on it (no host sync); `ReadLease.wait()` blocks the
host instead.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvtier_client.errors import KVTierError
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
