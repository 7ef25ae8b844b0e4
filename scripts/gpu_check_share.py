"""The experiments of scripts/gpu_check_probe.py ``semantics`` for what PyTorch and NCCL share
besides memory (issue 24; docs/fakecuda.md "Events", "Peer access", "Memory pools",
"Registered shared memory"): where the driver documentation is silent fakecuda fails closed,
and these record what the real driver does, so that the next device run settles each question
(a result that differs from fakecuda's is reported by scripts/gpu_check.py).

- :func:`x_events`: ``cuIpcGetEventHandle`` of an event without CU_EVENT_INTERPROCESS, and
  ``cuIpcOpenEventHandle`` of a handle in the process that created it (fakecuda:
  INVALID_HANDLE, INVALID_CONTEXT; the documentation names no code).
- :func:`x_peer`: with two devices, a copy from device 1's context of device 0's VMM memory
  granted to device 0 only, and of its ``cuMemAlloc`` memory without peer access (fakecuda:
  ILLEGAL_ADDRESS, SUCCESS); ``cuCtxEnablePeerAccess`` codes. With one device: the device count.
- :func:`x_event_orphan`: an event opened from a child that then destroys its own (PyTorch's
  producer frees the event once the consumer dropped the storage; the consumer keeps its opened
  one, and the shim's capture synchronizes and destroys it): ``cuEventSynchronize`` and
  ``cuEventDestroy`` of the opened event after that (the documentation calls any use undefined).
- :func:`x_share_checkpoint`: native checkpoint (lock, checkpoint, restore, unlock) of a child
  process holding an interprocess event (``ipc_event_checkpoint``), a memory pool exported by
  IPC (``pool_ipc_checkpoint``), and a ``cuMemHostRegister`` over an unlinked /dev/shm mapping
  (``hostregister_shared_checkpoint``); where the checkpoint succeeds, what the child sees
  afterwards (``..._after``). fakecuda refuses all three with CUDA_ERROR_NOT_SUPPORTED.

``python gpu_check_share.py target KIND`` is that child: it builds the object, prints ``ready``,
and on the line ``check`` prints one JSON object of what works after the restore, then exits.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import subprocess
import sys

from cuda.bindings import driver as cu

KINDS = ("ipc_event", "pool_ipc", "hostregister_shared")
#: the exporter child of :func:`x_event_orphan` (not a checkpoint target)
EXPORTER = "ipc_event_exporter"
EV_FLAGS = cu.CUevent_flags
POSIX_FD = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR


def name_of(res) -> str:
    return (res[0] if isinstance(res, tuple) else res).name


def _ctx(dev: int):
    err, d = cu.cuDeviceGet(dev)
    err, ctx = cu.cuDevicePrimaryCtxRetain(d)
    cu.cuCtxSetCurrent(ctx)
    return ctx


def x_events() -> dict:
    out = {}
    err, plain = cu.cuEventCreate(EV_FLAGS.CU_EVENT_DISABLE_TIMING)
    out["ipc_event_get_non_interprocess"] = name_of(cu.cuIpcGetEventHandle(plain))
    cu.cuEventDestroy(plain)
    out["event_create_interprocess_with_timing"] = name_of(
        cu.cuEventCreate(EV_FLAGS.CU_EVENT_INTERPROCESS)
    )
    flags = EV_FLAGS.CU_EVENT_INTERPROCESS | EV_FLAGS.CU_EVENT_DISABLE_TIMING
    err, ev = cu.cuEventCreate(flags)
    if err == 0:
        err, h = cu.cuIpcGetEventHandle(ev)
        out["ipc_event_get"] = err.name
        if err == 0:
            res = cu.cuIpcOpenEventHandle(h)
            out["ipc_event_open_same_process"] = name_of(res)
            if res[0] == 0:
                cu.cuEventDestroy(res[1])
        cu.cuEventDestroy(ev)
    return out


def x_peer() -> dict:
    err, n = cu.cuDeviceGetCount()
    if err != 0 or n < 2:
        return {"info_peer_devices": int(n) if err == 0 else err.name}
    out = {"peer_can_access_0_1": cu.cuDeviceCanAccessPeer(0, 1)[1]}
    ctx0 = _ctx(0)
    err, legacy = cu.cuMemAlloc(4096)
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = 0
    gran = cu.cuMemGetAllocationGranularity(prop, 0)[1]
    err, h = cu.cuMemCreate(gran, prop, 0)
    err, va = cu.cuMemAddressReserve(gran, 0, 0, 0)
    cu.cuMemMap(va, gran, 0, h, 0)
    acc = cu.CUmemAccessDesc()
    acc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    acc.location.id = 0
    acc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    cu.cuMemSetAccess(va, gran, [acc], 1)
    ctx1 = _ctx(1)
    buf = bytearray(16)
    out["copy_legacy_other_device_no_peer"] = name_of(cu.cuMemcpyDtoH(buf, legacy, 16))
    out["peer_enable_flags_1"] = name_of(cu.cuCtxEnablePeerAccess(ctx0, 1))
    out["peer_enable_self"] = name_of(cu.cuCtxEnablePeerAccess(ctx1, 0))
    out["peer_disable_not_enabled"] = name_of(cu.cuCtxDisablePeerAccess(ctx0))
    out["peer_enable"] = name_of(cu.cuCtxEnablePeerAccess(ctx0, 0))
    out["peer_enable_again"] = name_of(cu.cuCtxEnablePeerAccess(ctx0, 0))
    # last: a copy without access may poison device 1's context
    out["copy_vmm_other_device_peer_enabled"] = name_of(cu.cuMemcpyDtoH(buf, va, 16))
    cu.cuCtxSetCurrent(ctx0)
    return out


def _shm(size: int):
    path = f"/dev/shm/gpu-check-share-{os.getpid()}"
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, size)
    m = mmap.mmap(fd, size, mmap.MAP_SHARED)
    os.close(fd)
    os.unlink(path)  # as NCCL does once its peer attached (src/misc/shmutils.cc)
    return m


def exporter() -> int:
    """The child of x_event_orphan: an interprocess event, its handle in hex on stdout; on
    "destroy" it destroys the event and says "destroyed"; on "exit" it exits."""
    cu.cuInit(0)
    _ctx(0)
    err, stream = cu.cuStreamCreate(0)
    err, ev = cu.cuEventCreate(EV_FLAGS.CU_EVENT_INTERPROCESS | EV_FLAGS.CU_EVENT_DISABLE_TIMING)
    cu.cuEventRecord(ev, stream)
    err, h = cu.cuIpcGetEventHandle(ev)
    print(bytes(ctypes.string_at(h.getPtr(), 64)).hex(), flush=True)
    for line in sys.stdin:
        if line.strip() == "destroy":
            cu.cuEventDestroy(ev)
            print("destroyed", flush=True)
        elif line.strip() == "exit":
            break
    return 0


def x_event_orphan() -> dict:
    child = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), EXPORTER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        raw = bytes.fromhex(child.stdout.readline().strip())
        h = cu.CUipcEventHandle()
        ctypes.memmove(h.getPtr(), raw, 64)
        err, ev = cu.cuIpcOpenEventHandle(h)
        out = {"orphan_open": err.name}
        if err == 0:
            child.stdin.write("destroy\n")
            child.stdin.flush()
            child.stdout.readline()
            out["orphan_sync_after_creator_destroyed"] = name_of(cu.cuEventSynchronize(ev))
            out["orphan_destroy_after_creator_destroyed"] = name_of(cu.cuEventDestroy(ev))
        child.stdin.write("exit\n")
        child.stdin.flush()
        return out
    finally:
        child.wait(timeout=60)


def target(kind: str) -> int:
    """The checkpointed child: build `kind`, say ready, report after `check`."""
    cu.cuInit(0)
    _ctx(0)
    err, stream = cu.cuStreamCreate(0)
    keep = []
    if kind == "ipc_event":
        flags = EV_FLAGS.CU_EVENT_INTERPROCESS | EV_FLAGS.CU_EVENT_DISABLE_TIMING
        err, ev = cu.cuEventCreate(flags)
        cu.cuEventRecord(ev, stream)
        cu.cuIpcGetEventHandle(ev)
        keep.append(ev)
    elif kind == "pool_ipc":
        props = cu.CUmemPoolProps()
        props.allocType = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        props.handleTypes = POSIX_FD
        props.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        props.location.id = 0
        props.maxSize = 2 << 20
        err, pool = cu.cuMemPoolCreate(props)
        err, ptr = cu.cuMemAllocFromPoolAsync(4096, pool, stream)
        cu.cuStreamSynchronize(stream)
        keep += [pool, ptr, cu.cuMemPoolExportToShareableHandle(pool, POSIX_FD, 0)[1]]
    else:
        m = _shm(4 << 20)
        base = ctypes_addr(m)
        m[0:4] = b"ck01"
        err = cu.cuMemHostRegister(base, len(m), 1 | 2)[0]  # PORTABLE | DEVICEMAP, as NCCL
        keep += [m, base]
    print("ready" if err == 0 else f"failed {err.name}", flush=True)
    if sys.stdin.readline().strip() != "check":
        return 1
    after = {}
    if kind == "ipc_event":
        after["record"] = name_of(cu.cuEventRecord(keep[0], stream))
        after["sync"] = name_of(cu.cuEventSynchronize(keep[0]))
    elif kind == "pool_ipc":
        buf = bytearray(16)
        after["read"] = name_of(cu.cuMemcpyDtoH(buf, keep[1], 16))
    else:
        dptr = cu.cuMemHostGetDevicePointer(keep[1], 0)
        after["device_pointer"] = name_of(dptr)
        after["bytes_kept"] = bytes(keep[0][0:4]) == b"ck01"
    print(json.dumps(after), flush=True)
    return 0


def ctypes_addr(m) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(m))


def x_share_checkpoint() -> dict:
    out = {}
    for kind in KINDS:
        child = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "target", kind],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            ready = child.stdout.readline().strip()
            if ready != "ready":
                out[f"{kind}_checkpoint"] = f"target: {ready or 'no answer'}"
                continue
            args = cu.CUcheckpointLockArgs()
            args.timeoutMs = 10000
            lock = name_of(cu.cuCheckpointProcessLock(child.pid, args))
            res = (
                name_of(cu.cuCheckpointProcessCheckpoint(child.pid, None))
                if lock == "CUDA_SUCCESS"
                else lock
            )
            out[f"{kind}_checkpoint"] = res
            if res == "CUDA_SUCCESS":
                out[f"{kind}_restore"] = name_of(cu.cuCheckpointProcessRestore(child.pid, None))
            cu.cuCheckpointProcessUnlock(child.pid, None)
            child.stdin.write("check\n")
            child.stdin.flush()
            line = child.stdout.readline()
            out[f"{kind}_after"] = json.loads(line) if line.startswith("{") else line.strip()
        finally:
            child.kill()
            child.wait()
    return out


if __name__ == "__main__":
    if sys.argv[1:2] == ["target"] and len(sys.argv) == 3 and sys.argv[2] in KINDS:
        sys.exit(target(sys.argv[2]))
    if sys.argv[1:] == [EXPORTER]:
        sys.exit(exporter())
    print(f"usage: gpu_check_share.py target {'|'.join(KINDS)}", file=sys.stderr)
    sys.exit(2)
