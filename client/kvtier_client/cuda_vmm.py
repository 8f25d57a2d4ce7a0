"""The CUDA driver's virtual memory management calls, through ctypes on libcuda: the daemon
makes one physical allocation per device slot and exports it as a POSIX file descriptor;
a client imports the descriptors it was handed and maps them. Nothing else here: the books
are kernel-free (kvtier.mechanism.device_book, kvtier_client.device_plan).

CuPy exposes none of these calls (cupy.cuda.driver has no cuMem* of the VMM family), and
cuda-python would be one more dependency for eleven functions. libcuda is loaded on first
use only; every call runs with the device's primary context current (the one CuPy and
torch use), so pointers mapped here are valid in theirs.
"""
from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_ALLOCATION_PINNED = 1  # CU_MEM_ALLOCATION_TYPE_PINNED
_HANDLE_POSIX_FD = 1  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
_LOCATION_DEVICE = 1  # CU_MEM_LOCATION_TYPE_DEVICE
_ACCESS_READWRITE = 3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE
_GRANULARITY_MINIMUM = 0  # CU_MEM_ALLOC_GRANULARITY_MINIMUM
_ATTR_VMM = 102  # CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
_ATTR_POSIX_FD = 103  # CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class CudaDriverError(RuntimeError):
    """A driver call failed; `name` is the CUresult's name (CUDA_ERROR_OUT_OF_MEMORY, ...)."""

    def __init__(self, call: str, code: int, name: str) -> None:
        super().__init__(f"{call} failed: {name} ({code})")
        self.call, self.code, self.name = call, code, name

    @property
    def out_of_memory(self) -> bool:
        return self.code == 2


class Driver:
    """libcuda's VMM calls for one device (by CUDA ordinal in this process)."""

    _lib: ctypes.CDLL | None = None
    _load_lock = threading.Lock()

    def __init__(self, device_id: int) -> None:
        self.lib = self._load()
        self.device_id = device_id
        device = ctypes.c_int()
        self._check("cuDeviceGet", self.lib.cuDeviceGet(ctypes.byref(device), device_id))
        self._device = device.value
        context = ctypes.c_void_p()
        self._check("cuDevicePrimaryCtxRetain", self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), self._device))
        self._context = context

    @classmethod
    def _load(cls) -> ctypes.CDLL:
        with cls._load_lock:
            if cls._lib is None:
                lib = ctypes.CDLL("libcuda.so.1")
                lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
                code = lib.cuInit(0)
                if code:
                    raise CudaDriverError("cuInit", code, _name(lib, code))
                cls._lib = lib
            return cls._lib

    def _check(self, call: str, code: int) -> None:
        if code:
            raise CudaDriverError(call, code, _name(self.lib, code))

    @contextmanager
    def current(self) -> Iterator[None]:
        """The device's primary context current on this thread for the calls inside."""
        self._check("cuCtxPushCurrent", self.lib.cuCtxPushCurrent_v2(self._context))
        try:
            yield
        finally:
            popped = ctypes.c_void_p()
            self._check("cuCtxPopCurrent", self.lib.cuCtxPopCurrent_v2(ctypes.byref(popped)))

    def _prop(self) -> _AllocationProp:
        prop = _AllocationProp()
        prop.type = _ALLOCATION_PINNED
        prop.requestedHandleTypes = _HANDLE_POSIX_FD
        prop.location.type = _LOCATION_DEVICE
        prop.location.id = self._device
        return prop

    def supports_fd_sharing(self) -> bool:
        """Whether the device does virtual memory management with allocations exportable as
        POSIX file descriptors (not on every GPU: some virtualised and older ones lack it)."""
        for attribute in (_ATTR_VMM, _ATTR_POSIX_FD):
            value = ctypes.c_int()
            self._check("cuDeviceGetAttribute", self.lib.cuDeviceGetAttribute(ctypes.byref(value), attribute, self._device))
            if value.value != 1:
                return False
        return True

    def granularity(self) -> int:
        value = ctypes.c_size_t()
        prop = self._prop()
        self._check("cuMemGetAllocationGranularity",
                    self.lib.cuMemGetAllocationGranularity(ctypes.byref(value), ctypes.byref(prop), _GRANULARITY_MINIMUM))
        return value.value

    def create(self, size: int) -> int:
        """A new physical allocation of `size` bytes (a multiple of the granularity), exportable
        as a file descriptor; returns its handle."""
        handle = ctypes.c_uint64()
        prop = self._prop()
        self._check("cuMemCreate", self.lib.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(prop),
                                                        ctypes.c_uint64(0)))
        return handle.value

    def release(self, handle: int) -> None:
        """Let go of a handle: the memory is freed once nothing maps it and no handle or
        descriptor (in any process) refers to it."""
        self._check("cuMemRelease", self.lib.cuMemRelease(ctypes.c_uint64(handle)))

    def export(self, handle: int) -> int:
        """A new file descriptor for the allocation (the caller owns it)."""
        fd = ctypes.c_int()
        self._check("cuMemExportToShareableHandle",
                    self.lib.cuMemExportToShareableHandle(ctypes.byref(fd), ctypes.c_uint64(handle), _HANDLE_POSIX_FD,
                                                          ctypes.c_uint64(0)))
        return fd.value

    def import_fd(self, fd: int) -> int:
        """A handle to the allocation a descriptor names (the descriptor can be closed after)."""
        handle = ctypes.c_uint64()
        self._check("cuMemImportFromShareableHandle",
                    self.lib.cuMemImportFromShareableHandle(ctypes.byref(handle), ctypes.c_void_p(fd), _HANDLE_POSIX_FD))
        return handle.value

    def reserve(self, size: int, alignment: int) -> int:
        ptr = ctypes.c_uint64()
        self._check("cuMemAddressReserve", self.lib.cuMemAddressReserve(
            ctypes.byref(ptr), ctypes.c_size_t(size), ctypes.c_size_t(alignment), ctypes.c_uint64(0), ctypes.c_uint64(0)))
        return ptr.value

    def free_range(self, ptr: int, size: int) -> None:
        self._check("cuMemAddressFree", self.lib.cuMemAddressFree(ctypes.c_uint64(ptr), ctypes.c_size_t(size)))

    def map(self, ptr: int, size: int, handle: int) -> None:
        """Map the whole allocation at `ptr` (reserved here) and let this device read and write it."""
        self._check("cuMemMap", self.lib.cuMemMap(ctypes.c_uint64(ptr), ctypes.c_size_t(size), ctypes.c_size_t(0),
                                                  ctypes.c_uint64(handle), ctypes.c_uint64(0)))
        access = _AccessDesc()
        access.location.type = _LOCATION_DEVICE
        access.location.id = self._device
        access.flags = _ACCESS_READWRITE
        try:
            self._check("cuMemSetAccess", self.lib.cuMemSetAccess(ctypes.c_uint64(ptr), ctypes.c_size_t(size),
                                                                  ctypes.byref(access), ctypes.c_size_t(1)))
        except CudaDriverError:
            self.unmap(ptr, size)
            raise

    def unmap(self, ptr: int, size: int) -> None:
        self._check("cuMemUnmap", self.lib.cuMemUnmap(ctypes.c_uint64(ptr), ctypes.c_size_t(size)))

    def zero(self, ptr: int, size: int, stream: int) -> None:
        """Queue a fill of zeros on `stream` (a CUstream, as an int)."""
        self._check("cuMemsetD8Async", self.lib.cuMemsetD8Async(ctypes.c_uint64(ptr), ctypes.c_ubyte(0),
                                                                ctypes.c_size_t(size), ctypes.c_void_p(stream)))

    def close(self) -> None:
        if self._context:
            self.lib.cuDevicePrimaryCtxRelease_v2(self._device)
            self._context = ctypes.c_void_p()


def _name(lib: ctypes.CDLL, code: int) -> str:
    name = ctypes.c_char_p()
    if lib.cuGetErrorName(code, ctypes.byref(name)) == 0 and name.value:
        return name.value.decode()
    return "CUDA_ERROR_UNKNOWN"
