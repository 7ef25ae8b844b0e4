"""cuda.bindings (cuda-python) against fakecuda: run as a child with LD_LIBRARY_PATH set.
Asserts exact results; prints "bindings smoke ok" at the end."""

import ctypes
import os
import subprocess
import sys

from cuda.bindings import driver as d

S = d.CUresult.CUDA_SUCCESS
LAZY = d.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS


def ipc_bytes(h) -> bytes:
    """The 64 bytes of a CUipcMemHandle (cuda-bindings 13.5 no longer exposes `reserved`)."""
    return ctypes.string_at(h.getPtr(), 64)  # CU_IPC_HANDLE_SIZE


def ok(ret):
    assert ret[0] == S, ret
    return ret[1] if len(ret) == 2 else ret[1:]


if sys.argv[1:2] == ["ipc-child"]:  # the importer: open the handle, check and write, close
    assert d.cuInit(0) == (S,)
    assert d.cuCtxSetCurrent(ok(d.cuDevicePrimaryCtxRetain(ok(d.cuDeviceGet(0))))) == (S,)
    handle = d.CUipcMemHandle()
    ctypes.memmove(handle.getPtr(), bytes.fromhex(sys.argv[2]), 64)
    p = ok(d.cuIpcOpenMemHandle(handle, LAZY))
    assert int(ok(d.cuIpcOpenMemHandle(handle, LAZY))) == int(p)  # same VA, two references
    got = bytearray(64)
    assert d.cuMemcpyDtoH(got, p, 64) == (S,)
    assert bytes(got) == bytes(range(64)), bytes(got)
    assert d.cuMemcpyHtoD(int(p) + 64, b"from the importer", 17) == (S,)
    A = d.CUpointer_attribute
    assert d.cuPointerGetAttribute(A.CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, p) == (
        S,
        False,
    )
    assert d.cuPointerGetAttribute(A.CU_POINTER_ATTRIBUTE_RANGE_SIZE, p) == (S, 10000)
    assert d.cuIpcCloseMemHandle(p) == (S,) and d.cuIpcCloseMemHandle(p) == (S,)
    assert d.cuIpcCloseMemHandle(p) == (d.CUresult.CUDA_ERROR_INVALID_VALUE,)
    print("ipc child ok")
    sys.exit(0)


assert d.cuCheckpointProcessGetState(os.getpid())[0] == d.CUresult.CUDA_ERROR_NOT_INITIALIZED
assert d.cuDeviceGetCount()[0] == d.CUresult.CUDA_ERROR_NOT_INITIALIZED
assert d.cuInit(0) == (S,)
assert ok(d.cuDriverGetVersion()) == 13050
assert ok(d.cuDeviceGetCount()) == 2
dev = ok(d.cuDeviceGet(1))
assert ok(d.cuDeviceGetName(32, dev)).rstrip(b"\0 ") == b"fakecuda GPU"
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

# legacy CUDA IPC of cuMemAlloc memory, with a second process opening the 64-byte handle
dm = ok(d.cuMemAlloc(10000))
assert d.cuMemcpyHtoD(dm, buf, 64) == (S,)
ipc = ok(d.cuIpcGetMemHandle(dm))
assert ipc_bytes(ipc) == ipc_bytes(ok(d.cuIpcGetMemHandle(dm)))
assert d.cuIpcOpenMemHandle(ipc, LAZY) == (d.CUresult.CUDA_ERROR_INVALID_CONTEXT, None)
assert d.cuIpcGetMemHandle(int(dm) + 8)[0] == d.CUresult.CUDA_ERROR_INVALID_VALUE
assert d.cuIpcGetMemHandle(va)[0] == d.CUresult.CUDA_ERROR_INVALID_VALUE  # VMM memory
child = subprocess.run(
    [sys.executable, __file__, "ipc-child", ipc_bytes(ipc).hex()],
    capture_output=True,
    text=True,
    timeout=120,
)
assert child.returncode == 0 and "ipc child ok" in child.stdout, child.stdout + child.stderr
got = bytearray(17)
assert d.cuMemcpyDtoH(got, int(dm) + 64, 17) == (S,)
assert bytes(got) == b"from the importer"
PA = d.CUpointer_attribute
assert d.cuPointerGetAttribute(PA.CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, dm) == (S, True)
assert d.cuPointerGetAttribute(PA.CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, va) == (S, False)
assert int(
    ok(d.cuPointerGetAttribute(PA.CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, int(dm) + 9))
) == int(dm)
assert ok(d.cuPointerGetAttribute(PA.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, va)) == 2  # DEVICE
assert d.cuPointerGetAttributes(
    2, [PA.CU_POINTER_ATTRIBUTE_RANGE_SIZE, PA.CU_POINTER_ATTRIBUTE_HOST_POINTER], dm
) == (S, [10000, 0])
assert d.cuMemFree(dm) == (S,)

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
