"""Thin checked wrappers over ``cuda.bindings.driver`` (the only CUDA API afdwin uses).

Every wrapper raises ``CudaError`` naming the driver function and the CUresult. Device
pointers and host addresses are plain ints (bytes, virtual addresses).
"""

from __future__ import annotations

import ctypes

from cuda.bindings import driver as cu


class CudaError(RuntimeError):
    """A driver call failed. ``func``: driver function name; ``result``: the CUresult."""

    def __init__(self, func: str, result, detail: str = ""):
        self.func = func
        self.result = result
        name = getattr(result, "name", str(result))
        super().__init__(f"{func} failed: {name}{': ' + detail if detail else ''}")


def call(fn, *args, detail: str = ""):
    """Call a driver binding; return its outputs (None, one value, or a tuple)."""
    out = fn(*args)
    err, rest = out[0], out[1:]
    if err != cu.CUresult.CUDA_SUCCESS:
        raise CudaError(fn.__name__, err, detail)
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


def stream_done(stream) -> bool:
    """``cuStreamQuery``: True when all work on ``stream`` completed, False while pending."""
    (err,) = cu.cuStreamQuery(stream)
    if err == cu.CUresult.CUDA_SUCCESS:
        return True
    if err == cu.CUresult.CUDA_ERROR_NOT_READY:
        return False
    raise CudaError("cuStreamQuery", err)


def alloc_prop(device_ordinal: int) -> cu.CUmemAllocationProp:
    """PINNED device allocation on ``device_ordinal`` exportable as a POSIX file descriptor."""
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device_ordinal
    prop.requestedHandleTypes = (
        cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    )
    return prop


def rw_access(device_ordinal: int) -> cu.CUmemAccessDesc:
    desc = cu.CUmemAccessDesc()
    desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = device_ordinal
    desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return desc


class HostBuffer:
    """Host staging memory: pinned (``cuMemAllocHost``) or pageable (a bytearray).

    ``addr``: its address (int); ``view``: a writable byte memoryview of ``size`` bytes.
    """

    def __init__(self, size: int, pinned: bool):
        self.size = size
        self.pinned = pinned
        if pinned:
            self.addr = int(call(cu.cuMemAllocHost, size, detail=f"{size} bytes"))
            self._arr = (ctypes.c_ubyte * size).from_address(self.addr)
        else:
            self._ba = bytearray(size)
            self._arr = (ctypes.c_ubyte * size).from_buffer(self._ba)
            self.addr = ctypes.addressof(self._arr)
        self.view = memoryview(self._arr).cast("B")

    def write(self, data: bytes, off: int = 0) -> None:
        self.view[off : off + len(data)] = data

    def read(self, off: int = 0, n: int | None = None) -> bytes:
        n = self.size - off if n is None else n
        return bytes(self.view[off : off + n])
