"""A test workload that shares memory *behind the shim's back*.

It runs under the shim (LD_PRELOAD) on fakecuda, initialises CUDA through the normal path (so
the shim starts its control socket and the agent counts it as a participant), then creates an
allocation and exports it as a POSIX FD by calling fakecuda's own ``cuMemCreate`` and
``cuMemExportToShareableHandle`` at their addresses in the mapped ``libcuda.so.1`` (found from
its ELF dynamic symbol table), bypassing every lookup path the shim hooks. It keeps the FD
open, so the native checkpoint of this process must fail (CUDA_ERROR_NOT_SUPPORTED on
fakecuda), exactly as the real driver cannot dump an exported FD.

It follows docs/workload-contract.md for its own pid as root and prints JSON lines:
``{"event": "exported", "pid", "fd", "size"}``, ``{"event": "resumed", "restored", "cancelled"}``,
``{"event": "done", "ok": bool}``. Exits 0 when the driver still works after the resume.

``python rogue_export.py``  (control dir from $CUINTERPOSE_CONTROL_DIR)
"""

from __future__ import annotations

import ctypes
import os
import struct
import sys
import time

from contract_side import check, emit, park_on_request
from cuda.bindings import driver as cu


def libcuda_symbol(name: str) -> int:
    """Absolute address of ``name`` in the mapped libcuda.so.1 (ELF .dynsym + load base)."""
    base = path = None
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if (
                len(parts) == 6
                and os.path.basename(parts[5].strip()) == "libcuda.so.1"
                and int(parts[2], 16) == 0
            ):
                base, path = int(parts[0].split("-")[0], 16), parts[5].strip()
                break
    data = open(path, "rb").read()
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    dynsym = next(s for s in secs if s[1] == 11)  # SHT_DYNSYM
    strtab = secs[dynsym[6]]  # sh_link -> .dynstr
    for off in range(dynsym[4], dynsym[4] + dynsym[5], 24):
        st_name, _, _, st_shndx, st_value, _ = struct.unpack_from("<IBBHQQ", data, off)
        s = data[strtab[4] + st_name : data.index(b"\0", strtab[4] + st_name)].decode()
        if s == name and st_shndx != 0:
            return base + st_value
    raise LookupError(name)


def main():
    ctl = os.environ.get("CUINTERPOSE_CONTROL_DIR", "/tmp/cuinterpose")
    me = os.getpid()
    check(cu.cuInit(0), "cuInit")
    dev = check(cu.cuDeviceGet(0), "cuDeviceGet")
    ctx = check(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = 0
    prop.requestedHandleTypes = (
        cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    )
    gran = int(
        check(
            cu.cuMemGetAllocationGranularity(
                prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
            ),
            "cuMemGetAllocationGranularity",
        )
    )
    create = ctypes.CFUNCTYPE(
        ctypes.c_int,
        ctypes.POINTER(ctypes.c_ulonglong),
        ctypes.c_size_t,
        ctypes.c_void_p,
        ctypes.c_ulonglong,
    )(libcuda_symbol("cuMemCreate"))
    export = ctypes.CFUNCTYPE(
        ctypes.c_int, ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_int, ctypes.c_ulonglong
    )(libcuda_symbol("cuMemExportToShareableHandle"))
    handle = ctypes.c_ulonglong(0)
    r = create(ctypes.byref(handle), gran, prop.getPtr(), 0)
    if r != 0:
        emit({"event": "error", "message": f"real cuMemCreate: {r}"})
        return 3
    fd = ctypes.c_int(-1)
    r = export(ctypes.byref(fd), handle.value, 1, 0)  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    if r != 0:
        emit({"event": "error", "message": f"real cuMemExportToShareableHandle: {r}"})
        return 3
    emit({"event": "exported", "pid": me, "fd": fd.value, "size": gran})
    deadline = time.monotonic() + float(os.environ.get("ROGUE_LIFETIME_S", "120"))
    while time.monotonic() < deadline:
        res = park_on_request(ctl, me, deadline)
        if res is None:
            break
        emit(
            {"event": "resumed", "restored": res.get("restored"), "cancelled": res.get("cancelled")}
        )
        ok = cu.cuCtxSynchronize()[0] == cu.CUresult.CUDA_SUCCESS
        os.close(fd.value)
        emit({"event": "done", "ok": ok})
        return 0 if ok else 4
    emit({"event": "done", "ok": False, "message": "no quiesce request"})
    return 5


if __name__ == "__main__":
    sys.exit(main())
