"""Device tier: an HBM arena per (GPU, layout), the pinned host arena, and the copy engine
that moves pages between them. Byte movement only; the core decides what moves.

    DeviceArena   memory per namespace (kvtier.mechanism.device_vmm): one CUDA virtual-
                  memory allocation per slot, slot i at i * stride in the daemon's flat
                  range, each slot held by one namespace at a time (`give`); a client
                  gets, over the handoff socket, its namespace's slot table and the file
                  descriptors of its namespace's allocations, nothing else.
    SharedDeviceArena  the fallback where the GPU cannot export allocations as file
                  descriptors: one plain cudaMalloc allocation whose CUDA IPC handle goes
                  to every client at Register (any tenant's process can open every
                  tenant's pages; the daemon says so when it builds one).
    open_device_arena  the first where the driver can, else the second, sized in bytes.
    pin_host      cudaHostRegister of each namespace file of the host arena, so host <-> device
                  copies are DMA from and to the very pages engines map; undone at close.
    CopyEngine    two non-blocking streams, promotion (host -> device) and demotion
                  (device -> host): a load never queues behind a store, and the two
                  directions run on the GPU's separate copy engines. (Stream priorities
                  would not help: CUDA applies them to kernels, not to memory copies.)
                  A promotion is many pages (adjacent slots coalesced into one copy, a
                  pitched one where device slots are padded to the granularity) ending in
                  one interprocess CUDA event: its handle goes
                  to the engine, which can make its own stream wait on it without a host
                  sync (or wait on the host). A completion thread hears each event and
                  calls the core back, which is when a source host page may be reused.
                  A demotion is waited for by its caller on its own stream (it never
                  goes through the completion thread, whose callbacks take the store
                  lock that the demoting caller holds).

CuPy is imported only here and only when a device tier is configured: a daemon without a GPU
never imports it (cuda_device_count() says whether one can be built).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier_client.cuda_vmm import CudaDriverError, Driver
from kvtier_client.layout import PageLayout

from kvtier.mechanism.bandwidth import Throughput
from kvtier.mechanism.device_vmm import DeviceArena, DeviceNoSpace, device_stride
from kvtier.mechanism.host import HostArena, NamespaceMemory

log = logging.getLogger(__name__)

_HOST_TO_DEVICE = 1  # cudaMemcpyHostToDevice
_DEVICE_TO_HOST = 2  # cudaMemcpyDeviceToHost
_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context


def _cupy():
    import cupy

    return cupy


def cuda_device_count() -> int:
    """CUDA devices this process can use: 0 without CuPy, a driver or a GPU."""
    try:
        cupy = _cupy()
    except ImportError:
        return 0
    try:
        return cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError:  # no driver, or no device
        return 0


class SharedDeviceArena:
    """`pages` slots of one layout in one cudaMalloc allocation of GPU `device_id`, exported
    whole over CUDA IPC: every namespace's clients can open all of it."""

    per_namespace = False

    def __init__(self, layout: PageLayout, pages: int, device_id: int = 0) -> None:
        if pages <= 0:
            raise ValueError(f"device arena needs at least one page, got {pages}")
        cupy = _cupy()
        self.layout = layout
        self.pages = pages
        self.device_id = device_id
        self.stride = layout.slot_bytes
        self.size = pages * layout.slot_bytes
        with cupy.cuda.Device(device_id):
            try:
                self.ptr = cupy.cuda.runtime.malloc(self.size)
            except cupy.cuda.runtime.CUDARuntimeError as exc:
                raise DeviceNoSpace(
                    f"GPU {device_id} cannot allocate a {self.size >> 20} MiB device arena ({exc}); "
                    "lower device_size or max_pools (every page layout gets device_size)"
                ) from None
            try:
                cupy.cuda.runtime.memset(self.ptr, 0, self.size)
                cupy.cuda.runtime.deviceSynchronize()  # zeroed before any other stream copies in
                self.ipc_handle: bytes = bytes(cupy.cuda.runtime.ipcGetMemHandle(self.ptr))
                self.pci_bus_id: str = cupy.cuda.runtime.deviceGetPCIBusId(device_id)
            except BaseException:
                cupy.cuda.runtime.free(self.ptr)
                raise

    def slot_ptr(self, slot: int) -> int:
        return self.ptr + slot * self.stride

    def give(self, slots: Sequence[int], namespace: str) -> None:
        """Nothing to do: every namespace maps the whole arena."""

    def pages_array(self) -> Any:
        """The whole arena as a CuPy uint8 array [pages, slot_bytes] (for kernels and tests)."""
        cupy = _cupy()
        memory = cupy.cuda.UnownedMemory(self.ptr, self.size, self, self.device_id)
        return cupy.ndarray((self.pages, self.layout.slot_bytes), cupy.uint8, cupy.cuda.MemoryPointer(memory, 0))

    def close(self) -> None:
        if self.ptr:
            cupy = _cupy()
            with cupy.cuda.Device(self.device_id):
                cupy.cuda.runtime.free(self.ptr)
            self.ptr = 0


AnyDeviceArena = DeviceArena | SharedDeviceArena


def open_device_arena(layout: PageLayout, device_bytes: int, device_id: int = 0, *,
                      name: str = "kvtier-device") -> AnyDeviceArena:
    """The device arena of `device_bytes` for a layout: memory per namespace where the GPU
    can export allocations as file descriptors, else one shared allocation (with a warning:
    then any tenant's process can read every tenant's device pages)."""
    driver = Driver(device_id)  # the device's primary context, the one CuPy uses
    try:
        supported = driver.supports_fd_sharing()
    except CudaDriverError as exc:
        log.warning("cannot ask GPU %d whether it exports memory as file descriptors (%s)", device_id, exc)
        supported = False
    if not supported:
        driver.close()
        log.warning("GPU %d cannot export device memory as file descriptors (CUDA virtual memory management with "
                    "POSIX descriptors): its device tier is one allocation shared by every namespace, and a client of "
                    "any namespace can open every namespace's device pages", device_id)
        return SharedDeviceArena(layout, layout.pages_in(device_bytes, "device"), device_id)
    stride = device_stride(layout.slot_bytes, driver.granularity())
    if device_bytes < stride:
        driver.close()
        raise ValueError(f"device tier of {device_bytes} bytes cannot hold one page: a device page of this layout "
                         f"takes {stride} bytes (its slot rounded up to the GPU's allocation granularity)")
    if stride > layout.slot_bytes:
        log.info("device pages of layout %s take %d KiB each for a %d KiB slot (rounded up to the GPU's allocation "
                 "granularity, so that each belongs to one namespace)", layout.layout_id, stride >> 10,
                 layout.slot_bytes >> 10)
    return DeviceArena(layout, device_bytes // stride, device_id, name=name, driver=driver)


def pin_host(arena: HostArena, device_id: int = 0) -> Callable[[], None]:
    """Page-lock the host arena's memory files for DMA, each as it is mapped (one per
    namespace); returns the function that unpins them. Pinning makes a whole file resident:
    with a device tier every namespace that has used a layout holds host_size of RAM."""
    cupy = _cupy()
    pinned: list[NamespaceMemory] = []
    lock = threading.Lock()

    def pin(memory: NamespaceMemory) -> None:
        with lock, cupy.cuda.Device(device_id):
            cupy.cuda.runtime.hostRegister(memory.address, arena.size, _HOST_REGISTER_PORTABLE)
            memory.pinned = True
            pinned.append(memory)

    for memory in arena.on_map(pin):
        pin(memory)

    def unpin() -> None:
        with lock, cupy.cuda.Device(device_id):
            for memory in pinned:
                cupy.cuda.runtime.hostUnregister(memory.address)
                memory.pinned = False
            pinned.clear()

    return unpin


def coalesce(pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(src slot, dst slot) pairs as (src, dst, count) runs of consecutive slots on both
    sides, in the given order: one cudaMemcpyAsync per run instead of one per page."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in pairs:
        if runs:
            s, d, n = runs[-1]
            if src == s + n and dst == d + n:
                runs[-1] = (s, d, n + 1)
                continue
        runs.append((src, dst, 1))
    return runs


@dataclass(eq=False)
class Transfer:
    """One submission: its interprocess event (handle for engines) and who hears the end."""

    event: Any  # cupy.cuda.Event(interprocess=True); None where no bytes move (replay)
    ipc_handle: bytes
    on_done: Callable[["Transfer", bool], None] | None = None  # (transfer, ok) on the completion thread
    nbytes: int = 0
    submitted: float = field(default_factory=time.monotonic)
    done: threading.Event = field(default_factory=threading.Event)

    def wait(self, timeout: float | None = None) -> bool:
        """Host-side wait for the copy (and its callback) to finish."""
        return self.done.wait(timeout)


class CopyEngine:
    """Host <-> device page copies on two prioritised streams; see the module docstring."""

    def __init__(self, host: HostArena, device: AnyDeviceArena) -> None:
        cupy = _cupy()
        self.host = host
        self.device = device
        self.slot_bytes = host.layout.slot_bytes
        with cupy.cuda.Device(device.device_id):
            self.promote_stream = cupy.cuda.Stream(non_blocking=True)
            self.demote_stream = cupy.cuda.Stream(non_blocking=True)
            self._probe_stream = cupy.cuda.Stream(non_blocking=True)
        self._closed = False
        #: Promotion bandwidth: submit to landed, as the completion thread sees it.
        self.throughput = Throughput(self._probe)
        self._pending: queue.Queue[Transfer | None] = queue.Queue()
        self._completer = threading.Thread(target=self._complete, name="kvtier-copy-done", daemon=True)
        self._completer.start()

    def _copy(self, stream: Any, pairs: Sequence[tuple[int, int]], kind: int) -> None:
        cupy = _cupy()
        if self._closed:
            raise RuntimeError("copy engine is closed")
        to_device = kind == _HOST_TO_DEVICE
        stride, runtime = self.device.stride, cupy.cuda.runtime
        for src, dst, count in coalesce(pairs):
            host_first, device_first = (src, dst) if to_device else (dst, src)
            for offset, n in self._same_file_runs(host_first, count):
                host = self.host.slot_address(host_first + offset)
                device = self.device.slot_ptr(device_first + offset)
                dst_ptr, src_ptr = (device, host) if to_device else (host, device)
                if n == 1 or stride == self.slot_bytes:
                    runtime.memcpyAsync(dst_ptr, src_ptr, n * self.slot_bytes, kind, stream.ptr)
                else:  # device slots padded to the granularity: one pitched copy per run
                    dst_pitch, src_pitch = (stride, self.slot_bytes) if to_device else (self.slot_bytes, stride)
                    runtime.memcpy2DAsync(dst_ptr, dst_pitch, src_ptr, src_pitch, self.slot_bytes, n, kind, stream.ptr)

    def _same_file_runs(self, first: int, count: int) -> list[tuple[int, int]]:
        """(offset, length) runs of host slots first..first+count-1 held by one namespace
        file each: consecutive slots of two namespaces are not consecutive in memory."""
        runs: list[tuple[int, int]] = []
        for offset in range(count):
            if runs and self.host.holder(first + offset) is self.host.holder(first + offset - 1):
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((offset, 1))
        return runs

    def promote(self, pairs: Sequence[tuple[int, int]], on_done: Callable[[Transfer, bool], None] | None) -> Transfer:
        """Copy (host slot, device slot) pairs on the promotion stream; returns at once.
        `on_done(transfer, ok)` runs on the completion thread when they have landed."""
        cupy = _cupy()
        with cupy.cuda.Device(self.device.device_id):
            self._copy(self.promote_stream, pairs, _HOST_TO_DEVICE)
            # block=True: the completion thread sleeps in cudaEventSynchronize instead of spinning.
            event = cupy.cuda.Event(block=True, disable_timing=True, interprocess=True)
            event.record(self.promote_stream)
            handle = bytes(cupy.cuda.runtime.ipcGetEventHandle(event.ptr))
        transfer = Transfer(event, handle, on_done, nbytes=len(pairs) * self.slot_bytes)
        self._pending.put(transfer)
        return transfer

    def marker(self) -> Transfer:
        """An event after every promotion submitted so far (the stream runs in order)."""
        return self.promote(())

    def demote(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy (device slot, host slot) pairs on the demotion stream and wait for them here:
        the device slots are reused as soon as this returns."""
        cupy = _cupy()
        with cupy.cuda.Device(self.device.device_id):
            self._copy(self.demote_stream, pairs, _DEVICE_TO_HOST)
            self.demote_stream.synchronize()

    def _probe(self, nbytes: int = 64 << 20) -> float:
        """Bytes per second of one pinned host -> device copy (on a stream of its own, so real
        promotions are not queued behind it)."""
        cupy = _cupy()
        with cupy.cuda.Device(self.device.device_id):
            host = cupy.cuda.alloc_pinned_memory(nbytes)
            dev = cupy.cuda.runtime.malloc(nbytes)
            try:
                best = float("inf")
                for _ in range(3):
                    start = time.perf_counter()
                    cupy.cuda.runtime.memcpyAsync(dev, host.ptr, nbytes, _HOST_TO_DEVICE, self._probe_stream.ptr)
                    self._probe_stream.synchronize()
                    best = min(best, time.perf_counter() - start)
            finally:
                cupy.cuda.runtime.free(dev)
        return nbytes / best

    def _complete(self) -> None:
        while (transfer := self._pending.get()) is not None:
            try:
                transfer.event.synchronize()
                ok = True
                if transfer.nbytes:  # markers move nothing
                    self.throughput.observe(transfer.nbytes, time.monotonic() - transfer.submitted)
            except Exception:
                # A sticky CUDA error: these pages cannot be trusted, the core drops them.
                log.exception("a device copy failed")
                ok = False
            try:
                if transfer.on_done is not None:
                    transfer.on_done(transfer, ok)
            except Exception:
                log.exception("a device copy's completion callback failed")  # keep serving the others
            finally:
                transfer.done.set()

    def close(self) -> None:
        """Finish every submitted copy, then stop the completion thread."""
        self._closed = True
        self._pending.put(None)
        self._completer.join()
