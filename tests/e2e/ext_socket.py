"""A test workload whose tree CRIU refuses to dump: it holds a Unix socket connected to a
listener *outside* its tree ($EXT_SOCKET, bound by the test), which CRIU does not dump
without --ext-unix-sk.

It runs under the shim on fakecuda as an ordinary participant: through the normal (hooked)
paths it creates a VMM allocation, maps it, fills it with a pattern and exports it (the shim
hands out a ticket), so the coordinator captures it as a creator. It follows
docs/workload-contract.md for its own pid as root and prints JSON lines:
``{"event": "ready", "pid", "va", "size"}``, ``{"event": "resumed", "restored", "cancelled"}``,
``{"event": "done", "ok": bool, "intact": bool}`` (``intact``: the allocation still holds the
pattern and the socket still works after the resume). Exits 0 when both hold.
"""

from __future__ import annotations

import os
import socket
import sys
import time

from contract_side import check, emit, park_on_request
from cuda.bindings import driver as cu


def pattern(n: int) -> bytes:
    return bytes((i * 7 + 3) & 0xFF for i in range(n))


def main():
    ctl = os.environ.get("CUINTERPOSE_CONTROL_DIR", "/tmp/cuinterpose")
    me = os.getpid()
    ext = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    ext.connect(os.environ["EXT_SOCKET"])
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
    size = int(
        check(
            cu.cuMemGetAllocationGranularity(
                prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
            ),
            "cuMemGetAllocationGranularity",
        )
    )
    handle = check(cu.cuMemCreate(size, prop, 0), "cuMemCreate")
    va = check(cu.cuMemAddressReserve(size, 0, 0, 0), "cuMemAddressReserve")
    check(cu.cuMemMap(va, size, 0, handle, 0), "cuMemMap")
    acc = cu.CUmemAccessDesc()
    acc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    acc.location.id = 0
    acc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    check(cu.cuMemSetAccess(va, size, [acc], 1), "cuMemSetAccess")
    data = pattern(size)
    check(cu.cuMemcpyHtoD(va, data, size), "cuMemcpyHtoD")
    ticket = check(
        cu.cuMemExportToShareableHandle(
            handle, cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0
        ),
        "cuMemExportToShareableHandle",
    )
    emit({"event": "ready", "pid": me, "va": int(va), "size": size, "ticket": int(ticket)})
    deadline = time.monotonic() + float(os.environ.get("EXT_LIFETIME_S", "120"))
    while time.monotonic() < deadline:
        res = park_on_request(ctl, me, deadline)
        if res is None:
            break
        emit(
            {"event": "resumed", "restored": res.get("restored"), "cancelled": res.get("cancelled")}
        )
        back = bytearray(size)
        ok = cu.cuMemcpyDtoH(back, va, size)[0] == cu.CUresult.CUDA_SUCCESS
        intact = ok and bytes(back) == data
        try:
            ext.sendall(b"still here\n")
        except OSError:
            intact = False
        emit({"event": "done", "ok": ok, "intact": intact})
        return 0 if ok and intact else 4
    emit({"event": "done", "ok": False, "message": "no quiesce request"})
    return 5


if __name__ == "__main__":
    sys.exit(main())
