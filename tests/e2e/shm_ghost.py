"""A test workload holding NCCL's SHM fallback buffer (src/misc/shmutils.cc): a file made with
mkstemp under /dev/shm/nccl-XXXXXX, fallocate'd, mapped shared, registered with
``cuMemHostRegister(PORTABLE | DEVICEMAP)`` and unlinked (NCCL unlinks once its peer attached),
the fd kept open. Under the shim on fakecuda; docs/workload-contract.md for its own pid.

JSON lines: ``{"event": "ready", "pid", "path", "bytes", "checksum"}``, ``{"event": "resumed",
"restored", "cancelled"}``, ``{"event": "done", "ok", "checksum", "device_pointer"}``. Exit 0
when the bytes and the registration are back after the resume.

``python shm_ghost.py BYTES``
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import sys
import tempfile
import time

from contract_side import check, emit, park_on_request
from cuda.bindings import driver as cu

PORTABLE_DEVICEMAP = 1 | 2  # CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP


def main():
    size = int(sys.argv[1])
    ctl = os.environ.get("CUINTERPOSE_CONTROL_DIR", "/tmp/cuinterpose")
    check(cu.cuInit(0), "cuInit")
    ctx = check(cu.cuDevicePrimaryCtxRetain(check(cu.cuDeviceGet(0), "cuDeviceGet")), "retain")
    check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    fd, path = tempfile.mkstemp(prefix="nccl-", dir="/dev/shm")
    os.posix_fallocate(fd, 0, size)
    m = mmap.mmap(fd, size, mmap.MAP_SHARED)
    want = hashlib.shake_128(b"nccl-shm").digest(size)
    m[:] = want
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    check(cu.cuMemHostRegister(addr, size, PORTABLE_DEVICEMAP), "cuMemHostRegister")
    check(cu.cuMemHostGetDevicePointer(addr, 0), "cuMemHostGetDevicePointer")
    os.unlink(path)  # NCCL: the last peer to attach unlinks it
    digest = hashlib.sha256(m).hexdigest()
    emit({"event": "ready", "pid": os.getpid(), "path": path, "bytes": size, "checksum": digest})
    res = park_on_request(ctl, os.getpid(), time.monotonic() + 300)
    if res is None:
        emit({"event": "error", "message": "no quiesce request"})
        sys.exit(2)
    emit(
        {
            "event": "resumed",
            "restored": bool(res.get("restored")),
            "cancelled": bool(res.get("cancelled")),
        }
    )
    after = hashlib.sha256(m).hexdigest()
    err, dptr = cu.cuMemHostGetDevicePointer(addr, 0)  # registered again at the same address
    emit(
        {
            "event": "done",
            "ok": after == digest and err == 0,
            "checksum": after,
            "device_pointer": err.name,
        }
    )
    check(cu.cuMemHostUnregister(addr), "cuMemHostUnregister")
    os.close(fd)
    sys.exit(0 if after == digest and err == 0 else 1)


if __name__ == "__main__":
    main()
