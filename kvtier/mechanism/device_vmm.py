"""The device arena with memory per namespace: one physical allocation per slot (CUDA
virtual memory management), all of them mapped in one flat virtual range of the daemon,
each slot held by one namespace at a time; a client maps only its namespace's allocations,
from descriptors handed to its process. The books (who holds what, what left the daemon,
the namespaces' tables) are kvtier.mechanism.device_book; the driver calls are
kvtier_client.cuda_vmm.

    daemon's range    base + slot * stride, every slot mapped (the copy engine's arithmetic)
    a client's range  its own reservation of the same shape; only its namespace's slots mapped

`stride` is the slot rounded up to the GPU's allocation granularity (2 MiB on current
GPUs): the smallest memory the driver can give one namespace and not another. Layouts
whose pages are not a multiple of it pay the rounding in HBM (docs/tiers.md).
"""
from __future__ import annotations

import logging
import os
import resource
import threading
from collections.abc import Sequence
from typing import Any

from kvtier_client.cuda_vmm import CudaDriverError, Driver
from kvtier_client.errors import CapacityError
from kvtier_client.layout import PageLayout

from kvtier.mechanism.device_book import DeviceBook, NamespaceTables

log = logging.getLogger(__name__)


def _cupy():
    import cupy

    return cupy


class DeviceNoSpace(RuntimeError):
    """The GPU cannot hold another device arena (each page layout gets its own)."""


def device_stride(slot_bytes: int, granularity: int) -> int:
    """Bytes between slots in device memory: the slot rounded up to whole granules."""
    return -(-slot_bytes // granularity) * granularity


class DeviceArena:
    """`pages` slots of one layout in HBM of GPU `device_id`, each its own allocation, held
    by one namespace at a time; see the module docstring."""

    per_namespace = True
    ipc_handle = b""  # nothing opens this arena whole: namespaces get their slots' descriptors

    def __init__(self, layout: PageLayout, pages: int, device_id: int = 0, *, name: str = "kvtier-device",
                 driver: Driver | None = None) -> None:
        if pages <= 0:
            raise ValueError(f"device arena needs at least one page, got {pages}")
        cupy = _cupy()
        with cupy.cuda.Device(device_id):
            cupy.cuda.runtime.free(0)  # the primary context exists before the driver uses it
            self.pci_bus_id: str = cupy.cuda.runtime.deviceGetPCIBusId(device_id)
            self._stream = cupy.cuda.Stream(non_blocking=True)  # zero fills
        self.layout = layout
        self.pages = pages
        self.device_id = device_id
        self._driver = driver or Driver(device_id)
        self.granularity = self._driver.granularity()
        self.stride = device_stride(layout.slot_bytes, self.granularity)
        self.size = pages * self.stride
        _room_for_descriptors(pages)
        self._lock = threading.Lock()  # the books and handles: the handoff thread exports, the core gives
        self._handles: list[int] = []
        self._fds = [-1] * pages  # an exported allocation's descriptor, kept until the allocation goes
        self.book = DeviceBook(pages)
        self.tables = NamespaceTables(name, self.book)
        with self._driver.current():
            self.ptr = self._driver.reserve(self.size, self.granularity)
            try:
                for slot in range(pages):
                    self._handles.append(self._new_memory(slot))
                self._driver.zero(self.ptr, self.size, self._stream.ptr)  # the driver does not promise zeros
                self._stream.synchronize()
            except BaseException:
                self._free_all()
                self._driver.close()
                raise

    def _new_memory(self, slot: int) -> int:
        """A new allocation mapped at the slot's place in the daemon's range; its handle."""
        try:
            handle = self._driver.create(self.stride)
        except CudaDriverError as exc:
            if not exc.out_of_memory:
                raise
            raise DeviceNoSpace(
                f"GPU {self.device_id} has no room for another {self.stride >> 10} KiB device page ({exc}); lower "
                "device_size or max_pools, or let the engines' processes drop device pages they no longer hold"
            ) from None
        try:
            self._driver.map(self.slot_ptr(slot), self.stride, handle)
        except BaseException:
            self._driver.release(handle)
            raise
        return handle

    def _zero(self, slots: Sequence[int]) -> None:
        """Fill the slots with zeros and wait: nothing of a previous holder survives the handover."""
        for slot in slots:
            self._driver.zero(self.slot_ptr(slot), self.stride, self._stream.ptr)
        self._stream.synchronize()

    def slot_ptr(self, slot: int) -> int:
        return self.ptr + slot * self.stride

    # -- slots changing hands ---------------------------------------------------------
    def give(self, slots: Sequence[int], namespace: str) -> None:
        """The slots are about to hold `namespace`'s bytes: slots held by another namespace
        are zeroed, and those whose memory went to a client get new memory first. Raises
        CapacityError (the slot unchanged) when the GPU has no memory for a new allocation."""
        with self._lock, self._driver.current():
            zero = []
            try:
                for slot in slots:
                    handover = self.book.plan(slot, namespace)
                    if handover is None:
                        continue
                    if handover.fresh:
                        self._replace(slot)
                    allocation = self.book.apply(handover)
                    self.tables.handed_over(handover, allocation)
                    zero.append(slot)
            finally:  # before the lock goes: no descriptor of these slots leaves until they are zero
                if zero:
                    self._zero(zero)

    def _replace(self, slot: int) -> None:
        """New memory behind the slot; the old is the daemon's no more (a client of the old
        holder may still map it, with its own bytes, until it unmaps)."""
        ptr = self.slot_ptr(slot)
        try:
            handle = self._driver.create(self.stride)
        except CudaDriverError as exc:
            if not exc.out_of_memory:
                raise
            raise CapacityError(
                f"GPU {self.device_id} has no memory for a device page passing to another namespace: the previous "
                "holder's processes still map the old one; they drop it at their next device call, or free GPU memory"
            ) from None
        self._driver.unmap(ptr, self.stride)
        self._driver.release(self._handles[slot])
        if self._fds[slot] >= 0:
            os.close(self._fds[slot])
            self._fds[slot] = -1
        self._handles[slot] = handle
        self._driver.map(ptr, self.stride, handle)

    # -- what a namespace's processes get ---------------------------------------------
    def table_fd(self, namespace: str) -> int:
        """The namespace's slot table (the caller must not close it)."""
        with self._lock:
            return self.tables.fd(namespace)

    def export(self, namespace: str, slots: Sequence[int]) -> list[tuple[int, int, int]]:
        """(slot, generation, descriptor) of each of `slots` that `namespace` holds; the
        descriptors stay the arena's (the caller sends them and must not close them)."""
        with self._lock, self._driver.current():
            out = []
            for slot, allocation in self.book.export(namespace, slots):
                if self._fds[slot] < 0:
                    self._fds[slot] = self._driver.export(self._handles[slot])
                out.append((slot, allocation.generation, self._fds[slot]))
            return out

    # -- views and the end ------------------------------------------------------------
    def pages_array(self) -> Any:
        """The arena as a CuPy uint8 array [pages, slot_bytes], rows `stride` apart (for
        kernels and tests)."""
        cupy = _cupy()
        memory = cupy.cuda.UnownedMemory(self.ptr, self.size, self, self.device_id)
        return cupy.ndarray((self.pages, self.layout.slot_bytes), cupy.uint8, cupy.cuda.MemoryPointer(memory, 0),
                            strides=(self.stride, 1))

    def _free_all(self) -> None:
        for slot, handle in enumerate(self._handles):
            self._driver.unmap(self.slot_ptr(slot), self.stride)
            self._driver.release(handle)
        self._handles.clear()
        for fd in self._fds:
            if fd >= 0:
                os.close(fd)
        self._fds = [-1] * self.pages
        self._driver.free_range(self.ptr, self.size)
        self.ptr = 0

    def close(self) -> None:
        """Unmap and release every allocation. Clients that still map some keep that memory
        until they unmap it or exit."""
        with self._lock:
            if self.ptr:
                self._stream.synchronize()
                with self._driver.current():
                    self._free_all()
                self.tables.close()
                self._driver.close()


def _room_for_descriptors(pages: int) -> None:
    """Raise the soft limit on open files so that every slot's descriptor can be kept while
    it is exported, with room for everything else; warn where the hard limit is too low."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = pages + 4096
    if soft != resource.RLIM_INFINITY and soft < want:
        target = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        if target < want:
            log.warning("the open-file limit (%d) is below what a device arena of %d pages may export; raise "
                        "LimitNOFILE (ulimit -n) to at least %d", hard, pages, want)
