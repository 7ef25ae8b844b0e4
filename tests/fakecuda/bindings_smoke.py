"""cuda.bindings (cuda-python) against fakecuda: run as a child with LD_LIBRARY_PATH set.
Asserts exact results; prints "bindings smoke ok" at the end."""

import ctypes
import os

from cuda.bindings import driver as d

S = d.CUresult.CUDA_SUCCESS


def ok(ret):
    assert ret[0] == S, ret
    return ret[1] if len(ret) == 2 else ret[1:]


assert d.cuCheckpointProcessGetState(os.getpid())[0] == d.CUresult.CUDA_ERROR_NOT_INITIALIZED
assert d.cuDeviceGetCount()[0] == d.CUresult.CUDA_ERROR_NOT_INITIALIZED
assert d.cuInit(0) == (S,)
assert ok(d.cuDriverGetVersion()) == 13010
assert ok(d.cuDeviceGetCount()) == 2
dev = ok(d.cuDeviceGet(1))
assert ok(d.cuDeviceGetName(32, dev)).rstrip(b"\0 ") == b"fakecuda GPU 1"
A = d.CUdevice_attribute
assert (
    ok(d.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev)) == 1
)
assert ok(d.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED, dev)) == 0
assert len(bytes(ok(d.cuDeviceGetUuid(dev)).bytes)) == 16
assert d.cuGetErrorName(d.CUresult.CUDA_ERROR_ILLEGAL_ADDRESS) == (S, b"CUDA_ERROR_ILLEGAL_ADDRESS")
ctx = ok(d.cuDevicePrimaryCtxRetain(dev))
assert d.cuCtxSetCurrent(ctx) == (S,)

prop = d.CUmemAllocationProp()
prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
prop.location.id = 1
prop.requestedHandleTypes = d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
g = ok(
    d.cuMemGetAllocationGranularity(
        prop, d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
    )
)
assert g == 2 << 20
assert d.cuMemCreate(g // 2, prop, 0)[0] == d.CUresult.CUDA_ERROR_INVALID_VALUE
h = ok(d.cuMemCreate(g, prop, 0))
assert int(h) == 0
va = ok(d.cuMemAddressReserve(2 * g, 0, 0, 0))
assert d.cuMemMap(va, g, 0, h, 0) == (S,)
buf = bytes(range(64))
assert d.cuMemcpyHtoD(va, buf, 64)[0] == d.CUresult.CUDA_ERROR_ILLEGAL_ADDRESS
acc = d.CUmemAccessDesc()
acc.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
acc.location.id = 1
acc.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
assert d.cuMemSetAccess(va, g, [acc], 1) == (S,)
assert d.cuMemcpyHtoD(va, buf, 64) == (S,)
out = bytearray(64)
assert d.cuMemcpyDtoH(out, va, 64) == (S,)
assert bytes(out) == buf
assert ctypes.c_uint8.from_address(int(va) + 63).value == 63  # host view of device memory
fd = ok(
    d.cuMemExportToShareableHandle(
        h, d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0
    )
)
h2 = ok(
    d.cuMemImportFromShareableHandle(
        fd, d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    )
)
assert int(h2) == 1
os.close(fd)
assert ok(d.cuMemGetAllocationPropertiesFromHandle(h2)).location.id == 1
assert int(ok(d.cuMemRetainAllocationHandle(int(va) + 5))) == 0
base, size = ok(d.cuMemGetAddressRange(int(va) + 100))
assert (int(base), size) == (int(va), g)

s = ok(d.cuStreamCreate(d.CUstream_flags.CU_STREAM_NON_BLOCKING))
flag = int(va) + 256
assert d.cuStreamWaitValue32(s, flag, 3, d.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ) == (S,)
assert d.cuStreamQuery(s) == (d.CUresult.CUDA_ERROR_NOT_READY,)
assert d.cuStreamWriteValue32(0, flag, 3, 0) == (S,)  # legacy stream
assert d.cuStreamSynchronize(s) == (S,)
assert d.cuCtxSynchronize() == (S,)
assert ctypes.c_uint32.from_address(flag).value == 3

me = os.getpid()
assert d.cuCheckpointProcessGetState(me) == (S, d.CUprocessState.CU_PROCESS_STATE_RUNNING)
err, tid = d.cuCheckpointProcessGetRestoreThreadId(me)
assert err == S and tid not in (0, me)
assert d.cuCheckpointProcessUnlock(me, None) == (d.CUresult.CUDA_ERROR_ILLEGAL_STATE,)

# a name the bindings resolve but fakecuda does not provide fails cleanly when called
try:
    d.cuMemcpyPeer(0, None, 0, None, 0)
except RuntimeError as e:
    assert "cuMemcpyPeer" in str(e) and "not found" in str(e), e
else:
    raise AssertionError("cuMemcpyPeer should be missing")

assert d.cuMemUnmap(va, g) == (S,)
assert d.cuMemRelease(h) == (S,) and d.cuMemRelease(h) == (S,) and d.cuMemRelease(h2) == (S,)
assert d.cuMemRelease(h)[0] == d.CUresult.CUDA_ERROR_INVALID_VALUE
assert d.cuMemAddressFree(va, 2 * g) == (S,)
print("bindings smoke ok")
