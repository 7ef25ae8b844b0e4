"""The shim's wrappers on the real driver: every lookup path a Python client uses hands out
the shim's wrapper (proved by the virtual-handle tag 0xC01E in the returned handle), and an
export/import through a ticket works between two processes on the real GPU."""

from __future__ import annotations

import json
import subprocess
import sys

CLIENT = r"""
import ctypes, json, os
from cuda.bindings import driver as d
TAG = 0xC01E
res = {}
assert d.cuInit(0)[0] == 0
err, dev = d.cuDeviceGet(0)
err, ctx = d.cuDevicePrimaryCtxRetain(dev)
assert d.cuCtxSetCurrent(ctx)[0] == 0
prop = d.CUmemAllocationProp()
prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
prop.location.id = 0
prop.requestedHandleTypes = d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
err, gran = d.cuMemGetAllocationGranularity(
    prop, d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)
res["granularity"] = int(gran)
# Path 1: cuda.bindings resolves through cuGetProcAddress_v2.
err, h = d.cuMemCreate(gran, prop, 0)
res["bindings_create"] = [int(err), int(h) >> 48]
# Path 2: ctypes dlsym on the libcuda handle (the overridden dlsym).
lib = ctypes.CDLL("libcuda.so.1")
h2 = ctypes.c_ulonglong(0)
class Prop(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int),
                ("loc_type", ctypes.c_int), ("loc_id", ctypes.c_int),
                ("win32", ctypes.c_void_p), ("alloc_flags", ctypes.c_ubyte * 8)]
p = Prop(1, 1, 1, 0, None)
rc = lib.cuMemCreate(ctypes.byref(h2), ctypes.c_size_t(gran), ctypes.byref(p), ctypes.c_ulonglong(0))
res["dlsym_create"] = [int(rc), h2.value >> 48]
# Export hands out a ticket (a sealed memfd), not the driver's FD.
err, fd = d.cuMemExportToShareableHandle(
    h, d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)
import fcntl
res["ticket_seals"] = fcntl.fcntl(int(fd), 1034)  # F_GET_SEALS
os.close(int(fd))
assert d.cuMemRelease(h)[0] == 0
assert lib.cuMemRelease(h2) == 0
print(json.dumps(res))
"""


def test_real_driver_lookups_return_wrappers(real_gpu, real_env):
    res = subprocess.run(
        [sys.executable, "-c", CLIENT], capture_output=True, text=True, env=real_env, timeout=300
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["bindings_create"] == [0, 0xC01E]
    assert out["dlsym_create"] == [0, 0xC01E]
    # F_SEAL_SEAL | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE
    assert out["ticket_seals"] == 0x1 | 0x2 | 0x4 | 0x8
