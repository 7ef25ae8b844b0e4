#!/usr/bin/env python3
"""Child programs of scripts/gpu_check.py, run without the shim on whichever ``libcuda.so.1``
the loader finds (the real driver, or fakecuda when ``LD_LIBRARY_PATH`` names it).

``probe``: one JSON object on stdout with the driver's facts this project depends on:
``driver_version`` (``cuDriverGetVersion``, e.g. 13000), ``devices``, and for device 0
``name``, ``uuid`` (``GPU-`` + the 16 bytes of ``cuDeviceGetUuid`` as the driver prints them),
``compute_capability``, ``total_mem_bytes``, ``attributes`` (name -> the
``cuDeviceGetAttribute`` value of each ``CU_DEVICE_ATTRIBUTE_*`` in :data:`ATTRIBUTES`, or
the CUresult name where the query failed), ``granularity`` (bytes, ``cuMemGetAllocationGranularity``
MINIMUM and RECOMMENDED for a POSIX-FD device allocation, and for multicast where supported),
``exports`` (each ``cuCheckpoint*`` entry point: exported by the library's ELF table),
``checkpoint_state_self`` (``cuCheckpointProcessGetState(getpid())``: the CUresult name, and the
state where it succeeded) and ``library`` (the path of the ``libcuda.so.1`` mapped, from
/proc/self/maps).

``memcpy BYTES``: the pinned-copy baseline, one JSON object: ``bytes``, ``host`` (what the host
buffer was: pinned, or pageable where the driver has no ``cuMemHostAlloc``), and for ``dtoh`` and
``htod`` the best and mean GB/s (10^9 bytes/s) of :data:`ROUNDS` synchronous ``cuMemcpy*`` of
BYTES between a ``cuMemAlloc`` buffer and a ``cuMemHostAlloc`` (pinned) buffer, after one
warm-up copy each way.

``semantics``: one JSON object, experiment name -> what the driver did (CUresult names,
values), for the VMM, export/import, IPC, multicast and checkpoint behaviours fakecuda models
(:data:`EXPERIMENTS`; events, peer access and the native checkpoint of IPC events, pools shared
by IPC and registered shared memory are in gpu_check_share.py), and what the documents leave
open about controllers and the ``cuda-checkpoint`` utility (scripts/gpu_check_open.py).
scripts/gpu_check.py runs it on the real driver and on fakecuda in the same run and reports
every experiment whose results differ; keys starting with ``info_`` are reported, not compared
(paths, inode numbers), and a key only one side has (an experiment keyed by a device attribute
the two report differently) is listed, not compared.

Exit status 0 with the JSON, or 1 with the failing call on stderr.
"""

from __future__ import annotations

import ctypes
import json
import os
import stat
import subprocess
import sys
import time

from cuda.bindings import driver as cu
from gpu_check_open import x_cli, x_controller  # noqa: E402 (issue 25's open questions)
from gpu_check_share import x_event_orphan, x_events, x_peer, x_share_checkpoint
from gpu_check_steps import CHECKPOINT_API

from cuinterpose.workloads.afdwin.cudrv import alloc_prop, rw_access

#: the device attributes the shim, the coordinator and the agent depend on (cuda.h 13.x)
ATTRIBUTES = (
    "VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED",  # cuMemCreate/Map: every share we track
    "HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED",  # cuMemExportToShareableHandle(POSIX FD)
    "HANDLE_TYPE_FABRIC_SUPPORTED",
    "MULTICAST_SUPPORTED",  # cuMulticast* (NVLS)
    "CAN_USE_64_BIT_STREAM_MEM_OPS",  # cuStreamWriteValue64 / WaitValue64 (afdwin's flags)
    "CAN_USE_STREAM_WAIT_VALUE_NOR",
    "HOST_REGISTER_SUPPORTED",  # the shim's staging ring is cuMemHostRegister'ed
    "UNIFIED_ADDRESSING",
    "IPC_EVENT_SUPPORTED",
    "MEMORY_POOLS_SUPPORTED",
    "GPU_DIRECT_RDMA_SUPPORTED",
    "HOST_NUMA_ID",
    "HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED",  # host cuMem shares (carw --share host)
    "MULTIPROCESSOR_COUNT",
)
#: every native-checkpoint entry point (cuda.h 12.8+; OperationComplete is 13.4+)
CHECKPOINT_EXPORTS = CHECKPOINT_API + ("cuCheckpointOperationComplete",)
ROUNDS = 3


def call(fn, *args):
    out = fn(*args)
    if out[0] != cu.CUresult.CUDA_SUCCESS:
        raise SystemExit(f"gpu_check_probe: {fn.__name__} failed: {out[0].name}")
    return out[1] if len(out) == 2 else out[1:]


def mapped_libcuda() -> str:
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.split()[-1] if len(line.split()) >= 6 else ""
            if os.path.basename(path).startswith("libcuda.so"):
                return os.path.realpath(path)
    return ""


def granularities(dev_ordinal: int) -> dict:
    prop = alloc_prop(dev_ordinal)
    flags = cu.CUmemAllocationGranularity_flags
    out = {}
    for label, flag in (
        ("minimum", flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM),
        ("recommended", flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
    ):
        err, g = cu.cuMemGetAllocationGranularity(prop, flag)
        out[label] = int(g) if err == 0 else err.name
    mc = cu.CUmulticastObjectProp()
    mc.numDevices = 1
    mc.size = 2 << 20
    mc.handleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    err, g = cu.cuMulticastGetGranularity(
        mc, cu.CUmulticastGranularity_flags.CU_MULTICAST_GRANULARITY_MINIMUM
    )
    out["multicast_minimum"] = int(g) if err == 0 else err.name
    return out


def probe() -> dict:
    call(cu.cuInit, 0)
    out: dict = {"driver_version": int(call(cu.cuDriverGetVersion))}
    out["devices"] = int(call(cu.cuDeviceGetCount))
    dev = call(cu.cuDeviceGet, 0)
    name = call(cu.cuDeviceGetName, 256, dev)
    out["name"] = bytes(name).split(b"\0", 1)[0].decode(errors="replace")
    raw = bytes(call(cu.cuDeviceGetUuid, dev).bytes)
    h = raw.hex()
    out["uuid"] = f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"
    out["total_mem_bytes"] = int(call(cu.cuDeviceTotalMem, dev))
    attrs = {}
    for a in ATTRIBUTES + ("COMPUTE_CAPABILITY_MAJOR", "COMPUTE_CAPABILITY_MINOR"):
        enum = getattr(cu.CUdevice_attribute, f"CU_DEVICE_ATTRIBUTE_{a}", None)
        if enum is None:
            attrs[a] = "not in these bindings"
            continue
        err, v = cu.cuDeviceGetAttribute(enum, dev)
        attrs[a] = int(v) if err == 0 else err.name
    major = attrs.pop("COMPUTE_CAPABILITY_MAJOR")
    minor = attrs.pop("COMPUTE_CAPABILITY_MINOR")
    out["compute_capability"] = f"{major}.{minor}"
    out["attributes"] = attrs
    out["granularity"] = granularities(0)
    lib = ctypes.CDLL("libcuda.so.1")
    out["exports"] = {fn: hasattr(lib, fn) for fn in CHECKPOINT_EXPORTS}
    err, state = cu.cuCheckpointProcessGetState(os.getpid())
    out["checkpoint_state_self"] = {"result": err.name}
    if err == 0:
        out["checkpoint_state_self"]["state"] = cu.CUprocessState(state).name
    out["library"] = mapped_libcuda()
    return out


def gbps(n: int, seconds: list[float]) -> dict:
    return {
        "best_gbps": round(n / min(seconds) / 1e9, 3),
        "mean_gbps": round(n * len(seconds) / sum(seconds) / 1e9, 3),
    }


def memcpy(n: int) -> dict:
    call(cu.cuInit, 0)
    dev = call(cu.cuDeviceGet, 0)
    call(cu.cuCtxSetCurrent, call(cu.cuDevicePrimaryCtxRetain, dev))
    d = call(cu.cuMemAlloc, n)
    out = {"bytes": n, "rounds": ROUNDS, "host": "pinned (cuMemHostAlloc)"}
    try:
        host, keep = int(call(cu.cuMemHostAlloc, n, 0)), None
    except Exception as e:  # fakecuda has no cuMemHostAlloc: a pageable buffer instead
        keep = ctypes.create_string_buffer(n)
        host = ctypes.addressof(keep)
        out["host"] = f"pageable ({type(e).__name__}: {e})"
    try:
        for label, fn, args in (
            ("dtoh", cu.cuMemcpyDtoH, (host, d, n)),
            ("htod", cu.cuMemcpyHtoD, (d, host, n)),
        ):
            call(fn, *args)  # warm-up: first touch of the pinned pages' mappings
            times = []
            for _ in range(ROUNDS):
                t0 = time.perf_counter()
                call(fn, *args)
                times.append(time.perf_counter() - t0)
            out[label] = gbps(n, times)
        return out
    finally:
        if keep is None:
            cu.cuMemFreeHost(host)
        cu.cuMemFree(d)


# ---- semantics: small experiments whose outcome fakecuda must match ------------------------
POSIX_FD = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR


def name_of(res) -> str:
    return res[0].name if isinstance(res, tuple) else res.name


def fd_prop(handle_types=POSIX_FD, loc_type=None, loc_id=0) -> cu.CUmemAllocationProp:
    """afdwin's POSIX-FD device allocation (cudrv.alloc_prop), with other handle types or
    another location where an experiment needs them."""
    prop = alloc_prop(loc_id)
    if loc_type is not None:
        prop.location.type = loc_type
    prop.requestedHandleTypes = handle_types
    return prop


def access(n_va: int, size: int):
    return cu.cuMemSetAccess(n_va, size, [rw_access(0)], 1)


class Mapped:
    """A ``size``-byte POSIX-FD allocation mapped read-write at a fresh reservation."""

    def __init__(self, size: int, gran: int):
        self.size = size
        self.h = call(cu.cuMemCreate, size, fd_prop(), 0)
        self.va = int(call(cu.cuMemAddressReserve, size, gran, 0, 0))
        self.map_result = name_of(cu.cuMemMap(self.va, size, 0, self.h, 0))
        self.access_result = name_of(access(self.va, size))

    def close(self, release=True):
        cu.cuMemUnmap(self.va, self.size)
        cu.cuMemAddressFree(self.va, self.size)
        if release:
            cu.cuMemRelease(self.h)


def fd_facts(fd: int) -> dict:
    st = os.fstat(fd)
    kind = "chr" if stat.S_ISCHR(st.st_mode) else "reg" if stat.S_ISREG(st.st_mode) else "other"
    return {"kind": kind, "info_link": os.readlink(f"/proc/self/fd/{fd}"), "info_ino": st.st_ino}


def x_vmm(gran: int) -> dict:
    out = {}
    err, h = cu.cuMemCreate(gran + 4096, fd_prop(), 0)
    out["create_unaligned_size"] = err.name
    if err == 0:
        cu.cuMemRelease(h)
    err, va = cu.cuMemAddressReserve(4 * gran, 0, 0, 0)
    out["reserve_alignment0"] = [err.name, int(va) % gran if err == 0 else None]
    if err == 0:
        cu.cuMemAddressFree(va, 4 * gran)
    m = Mapped(2 * gran, gran)
    out["map"] = [m.map_result, m.access_result]
    out["map_twice"] = name_of(cu.cuMemMap(m.va, 2 * gran, 0, m.h, 0))
    out["unmap_partial"] = name_of(cu.cuMemUnmap(m.va, gran))
    out["address_free_while_mapped"] = name_of(cu.cuMemAddressFree(m.va, 2 * gran))
    out["memset"] = name_of(cu.cuMemsetD8(m.va, 0x5A, 2 * gran))
    err, h2 = cu.cuMemRetainAllocationHandle(m.va)
    out["retain_from_va"] = [err.name, err == 0 and int(h2) == int(m.h)]
    if err == 0:
        cu.cuMemRelease(h2)
    err, p = cu.cuMemGetAllocationPropertiesFromHandle(m.h)
    out["properties_from_handle"] = [err.name] + (
        [int(p.type), int(p.location.type), p.location.id, int(p.requestedHandleTypes)]
        if err == 0
        else []
    )
    out["release_while_mapped"] = name_of(cu.cuMemRelease(m.h))
    buf = bytearray(16)
    out["read_after_release"] = [
        name_of(cu.cuMemcpyDtoH(buf, m.va, 16)),
        bytes(buf) == b"\x5a" * 16,
    ]
    m.close(release=False)
    err, va = cu.cuMemAddressReserve(gran, gran, 0, 0)
    out["set_access_unmapped"] = name_of(access(va, gran))
    h = call(cu.cuMemCreate, 2 * gran, fd_prop(), 0)
    out["map_unaligned_offset"] = name_of(cu.cuMemMap(va, gran, 4096, h, 0))
    r = cu.cuMemMap(va, gran, gran, h, 0)
    out["map_aligned_offset"] = name_of(r)
    if name_of(r) == "CUDA_SUCCESS":
        cu.cuMemUnmap(va, gran)
    cu.cuMemRelease(h)
    cu.cuMemAddressFree(va, gran)
    return out


def props_of(h) -> list:
    err, p = cu.cuMemGetAllocationPropertiesFromHandle(h)
    if err != 0:
        return [err.name]
    return [err.name, int(p.type), int(p.location.type), p.location.id, int(p.requestedHandleTypes)]


IMPORTER = r"""
import json, sys
from cuda.bindings import driver as cu
cu.cuInit(0)
err, dev = cu.cuDeviceGet(0)
err, ctx = cu.cuDevicePrimaryCtxRetain(dev)
cu.cuCtxSetCurrent(ctx)
POSIX_FD = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
err, h = cu.cuMemImportFromShareableHandle(int(sys.argv[1]), POSIX_FD)
out = [err.name]
if err == 0:
    e, p = cu.cuMemGetAllocationPropertiesFromHandle(h)
    out += [e.name] + ([int(p.type), int(p.location.type), p.location.id,
                        int(p.requestedHandleTypes)] if e == 0 else [])
print(json.dumps(out))
"""


def import_elsewhere(fd: int) -> list:
    """Import ``fd`` in a child process (inherited) and read the properties there."""
    res = subprocess.run(
        [sys.executable, "-c", IMPORTER, str(fd)],
        pass_fds=(fd,),
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = res.stdout.strip().splitlines()
    return (
        json.loads(lines[-1]) if lines else [f"exit {res.returncode}: {res.stderr.strip()[-150:]}"]
    )


def x_export(gran: int) -> dict:
    out = {}
    err, h = cu.cuMemCreate(gran, fd_prop(handle_types=0), 0)
    out["export_without_handle_type"] = (
        name_of(cu.cuMemExportToShareableHandle(h, POSIX_FD, 0))
        if err == 0
        else f"create {err.name}"
    )
    if err == 0:
        cu.cuMemRelease(h)
    h = call(cu.cuMemCreate, gran, fd_prop(), 0)
    err, fd = cu.cuMemExportToShareableHandle(h, POSIX_FD, 0)
    err2, fd2 = cu.cuMemExportToShareableHandle(h, POSIX_FD, 0)
    out["export"] = [err.name, err2.name]
    if err == 0 and err2 == 0:
        a, b = fd_facts(int(fd)), fd_facts(int(fd2))
        out["export_fd"] = {**a, "second_same_inode": a["info_ino"] == b["info_ino"]}
        err, h3 = cu.cuMemImportFromShareableHandle(int(fd), POSIX_FD)
        out["import_own_export"] = [err.name, err == 0 and int(h3) == int(h)]
        if err == 0:
            out["import_props_same_process"] = props_of(h3)
            e2, fd3 = cu.cuMemExportToShareableHandle(h3, POSIX_FD, 0)
            out["export_of_import"] = e2.name
            if e2 == 0:
                os.close(int(fd3))
            cu.cuMemRelease(h3)
        out["import_props_other_process"] = import_elsewhere(int(fd))
        os.close(int(fd))
        os.close(int(fd2))
    out["import_bad_fd"] = name_of(cu.cuMemImportFromShareableHandle(9999, POSIX_FD))
    plain = os.memfd_create("gpu-check-not-a-driver-fd")
    os.ftruncate(plain, 3 * 4096)
    err, h4 = cu.cuMemImportFromShareableHandle(plain, POSIX_FD)
    out["import_memfd"] = err.name
    if err == 0:
        cu.cuMemRelease(h4)
    os.close(plain)
    out["release"] = name_of(cu.cuMemRelease(h))
    host = fd_prop(loc_type=cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST_NUMA, loc_id=0)
    err, g = cu.cuMemGetAllocationGranularity(
        host, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
    )
    out["host_numa_granularity"] = [err.name, int(g) if err == 0 else None]
    if err == 0:
        err, h = cu.cuMemCreate(int(g), host, 0)
        out["host_numa_create"] = err.name
        if err == 0:
            cu.cuMemRelease(h)
    return out


def x_ipc() -> dict:
    out = {}
    d = call(cu.cuMemAlloc, 2 << 20)
    err, handle = cu.cuIpcGetMemHandle(d)
    out["ipc_get_memalloc"] = err.name
    if err == 0:
        flags = cu.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
        out["ipc_open_same_process"] = name_of(cu.cuIpcOpenMemHandle(handle, flags))
    cu.cuMemFree(d)
    return out


def x_multicast(gran: int) -> dict:
    """Keyed by the device's MULTICAST_SUPPORTED, so that only like devices are compared."""
    err, dev = cu.cuDeviceGet(0)
    attr = cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED
    supported = cu.cuDeviceGetAttribute(attr, dev)[1] == 1
    mc = cu.CUmulticastObjectProp()
    mc.numDevices = 1
    mc.size = gran
    mc.handleTypes = POSIX_FD
    err, h = cu.cuMulticastCreate(mc)
    if err == 0:
        cu.cuMemRelease(h)
    return {
        "multicast_create_1dev" if supported else "multicast_create_unsupported_device": err.name
    }


def x_checkpoint() -> dict:
    out = {}
    child = subprocess.Popen(["sleep", "30"])
    try:
        out["state_non_cuda_pid"] = name_of(cu.cuCheckpointProcessGetState(child.pid))
        args = cu.CUcheckpointLockArgs()
        args.timeoutMs = 200
        out["lock_non_cuda_pid"] = name_of(cu.cuCheckpointProcessLock(child.pid, args))
    finally:
        child.kill()
        child.wait()
    out["state_no_such_pid"] = name_of(cu.cuCheckpointProcessGetState(2**22 + 1))
    return out


def x_last(gran: int) -> dict:
    """Last, since a fault here may poison the context for every later call."""
    va = int(call(cu.cuMemAddressReserve, gran, gran, 0, 0))
    buf = bytearray(16)
    out = {"memcpy_dtoh_unmapped": name_of(cu.cuMemcpyDtoH(buf, va, 16))}
    out["memset_unmapped"] = name_of(cu.cuMemsetD8(va, 0, 16))
    out["after_memset_unmapped"] = name_of(cu.cuCtxSynchronize())
    cu.cuMemAddressFree(va, gran)
    return out


EXPERIMENTS = (
    "vmm",
    "export",
    "ipc",
    "events",
    "event_orphan",
    "multicast",
    "checkpoint",
    "share_checkpoint",
    "peer",
    "controller",
    "cli",
    "last",
)


def semantics() -> dict:
    call(cu.cuInit, 0)
    dev = call(cu.cuDeviceGet, 0)
    call(cu.cuCtxSetCurrent, call(cu.cuDevicePrimaryCtxRetain, dev))
    gran = granularities(0)["minimum"]
    out = {}
    for name, fn in (
        ("vmm", lambda: x_vmm(gran)),
        ("export", lambda: x_export(gran)),
        ("ipc", x_ipc),
        ("events", x_events),  # gpu_check_share.py: issue 24's questions
        ("event_orphan", x_event_orphan),
        ("multicast", lambda: x_multicast(gran)),
        ("checkpoint", x_checkpoint),
        ("share_checkpoint", x_share_checkpoint),
        ("peer", x_peer),
        ("controller", x_controller),
        ("cli", x_cli),
        ("last", lambda: x_last(gran)),
    ):
        try:
            out.update(fn())
        except Exception as e:  # one experiment's crash is its result, not the probe's
            out[f"{name}_raised"] = f"{type(e).__name__}: {e}"[:200]
    return out


def main(argv: list[str]) -> int:
    if argv[:1] == ["probe"]:
        print(json.dumps(probe()))
    elif argv[:1] == ["semantics"]:
        print(json.dumps(semantics()))
    elif argv[:1] == ["memcpy"] and len(argv) == 2:
        print(json.dumps(memcpy(int(argv[1]))))
    else:
        print("usage: gpu_check_probe.py probe | semantics | memcpy BYTES", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
