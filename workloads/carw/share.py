"""How a carw rank shares its data and signal ranges with its peers (``--share``).

Three ways real inference stacks share GPU-visible memory between processes (issue 10):

- ``ipc``: legacy CUDA IPC, as vLLM's/SGLang's custom all-reduce: ``cuMemAlloc`` (what
  ``cudaMalloc`` calls), ``cuIpcGetMemHandle`` (64 bytes, sent as hex over the launcher's
  socket), ``cuIpcOpenMemHandle`` with ``CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`` (the one flag the
  driver API documents), ``cuIpcCloseMemHandle``, ``cuMemFree``.
- ``pidfd``: PyTorch's expandable-segment IPC: a device ``cuMemCreate`` allocation exportable
  as a POSIX file descriptor, mapped in a reservation; the creator sends only its pid and the FD
  *number*; the importer takes the FD itself with ``pidfd_open(2)`` + ``pidfd_getfd(2)``
  (syscall 438 on x86-64 and arm64, Linux >= 5.6; the caller needs ptrace access to the
  creator, the same uid without Yama), imports it with ``cuMemImportFromShareableHandle``,
  closes it and maps it at a reservation of its own. The creator closes its exported FD once
  every peer imported (``after_start``).
- ``host``: NCCL's SHM transport on cuMem (driver >= 12.6): ``cuMemCreate`` with location
  ``CU_MEM_LOCATION_TYPE_HOST_NUMA`` (node 0), POSIX-FD exportable, sent with ``SCM_RIGHTS``
  over the launcher's socket (closed by the creator right after sending, as NCCL does), access
  granted to the device and to the host location, so the CPU reads and writes the mapping
  directly: this share's ``read``/``write`` are CPU copies at the mapped VA, not driver calls.

Every share: ``alloc(nbytes, what) -> va`` (this rank's range, zeroed), ``export(va) ->
(info dict, fds)`` (what the launcher relays to the peers), ``open(info, fd, peer, what) -> va``,
``read(va, n) -> bytes``, ``write(va, data)``, ``after_start()``, ``close_peer(va)``,
``free(va)``. Failures raise ``CudaError`` (afdwin/cudrv.py) naming the driver function, or
``OSError`` for the pidfd system calls.
"""

from __future__ import annotations

import ctypes
import os

from cuda.bindings import driver as cu

from ..afdwin.cudrv import call, rw_access
from .layout import SHARES

SYS_PIDFD_GETFD = 438  # include/uapi/asm-generic/unistd.h (x86-64 and arm64 alike)
POSIX_FD = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def pidfd_getfd(pid: int, fd: int) -> int:
    """A duplicate of process ``pid``'s file descriptor ``fd`` (``pidfd_getfd(2)``, close-on-exec
    set, sharing the file offset). Raises ``OSError`` (ESRCH gone, EBADF no such fd, EPERM no
    ptrace access)."""
    pidfd = os.pidfd_open(pid)
    try:
        got = _libc.syscall(SYS_PIDFD_GETFD, pidfd, fd, 0)
        if got < 0:
            e = ctypes.get_errno()
            raise OSError(e, f"pidfd_getfd(pid {pid}, fd {fd}): {os.strerror(e)}")
        return int(got)
    finally:
        os.close(pidfd)


def dptr(va: int) -> cu.CUdeviceptr:
    return cu.CUdeviceptr(va)


class IpcShare:
    """``ipc``: cuMemAlloc + cuIpc*."""

    name = "ipc"
    cpu = False

    def __init__(self, device_ordinal: int):
        self.device_ordinal = device_ordinal

    def alloc(self, nbytes: int, what: str) -> int:
        va = int(call(cu.cuMemAlloc, nbytes, detail=f"{what}, {nbytes} bytes"))
        call(cu.cuMemsetD8, dptr(va), 0, nbytes)
        return va

    def export(self, va: int) -> tuple[dict, list[int]]:
        h = call(cu.cuIpcGetMemHandle, dptr(va))
        return {"handle": ctypes.string_at(h.getPtr(), 64).hex()}, []

    def open(self, info: dict, fd: int | None, peer: int, what: str) -> int:
        raw = bytes.fromhex(info["handle"])
        if len(raw) != 64:  # CU_IPC_HANDLE_SIZE
            raise ValueError(f"rank {peer}'s {what} IPC handle is {len(raw)} bytes, not 64")
        h = cu.CUipcMemHandle()
        ctypes.memmove(h.getPtr(), raw, 64)
        flags = cu.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
        return int(call(cu.cuIpcOpenMemHandle, h, flags, detail=f"rank {peer}'s {what}"))

    def read(self, va: int, n: int) -> bytes:
        buf = bytearray(n)
        call(cu.cuMemcpyDtoH, buf, dptr(va), n, detail=f"{n} bytes from {va:#x}")
        return bytes(buf)

    def write(self, va: int, data: bytes) -> None:
        call(cu.cuMemcpyHtoD, dptr(va), data, len(data), detail=f"{len(data)} bytes to {va:#x}")

    def after_start(self) -> None:
        pass

    def close_peer(self, va: int) -> None:
        call(cu.cuIpcCloseMemHandle, dptr(va))

    def free(self, va: int) -> None:
        call(cu.cuMemFree, dptr(va))


class VmmShare(IpcShare):
    """``pidfd`` (device location, FD taken with pidfd_getfd) and ``host`` (HOST_NUMA location,
    FD sent with SCM_RIGHTS): one cuMemCreate allocation per range in its own reservation."""

    def __init__(self, device_ordinal: int, host: bool):
        super().__init__(device_ordinal)
        self.host = host
        self.name = "host" if host else "pidfd"
        self.cpu = host
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        if host:
            prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST_NUMA
            prop.location.id = 0
        else:
            prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            prop.location.id = device_ordinal
        prop.requestedHandleTypes = POSIX_FD
        self.prop = prop
        gran = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        self.granularity = int(call(cu.cuMemGetAllocationGranularity, prop, gran))
        self.access = [rw_access(device_ordinal)]
        if host:
            h = cu.CUmemAccessDesc()
            h.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST_NUMA
            h.location.id = 0
            h.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            self.access.append(h)
        self.sizes: dict[int, int] = {}
        self.handles: dict[int, object] = {}
        self.exported: list[int] = []

    def rounded(self, nbytes: int) -> int:
        return -(-nbytes // self.granularity) * self.granularity

    def map(self, handle, size: int, what: str) -> int:
        va = int(call(cu.cuMemAddressReserve, size, self.granularity, 0, 0, detail=what))
        call(cu.cuMemMap, va, size, 0, handle, 0, detail=what)
        call(cu.cuMemSetAccess, va, size, self.access, len(self.access), detail=what)
        self.sizes[va] = size
        return va

    def alloc(self, nbytes: int, what: str) -> int:
        size = self.rounded(nbytes)
        handle = call(cu.cuMemCreate, size, self.prop, 0, detail=f"{what}, {size} bytes")
        va = self.map(handle, size, what)
        self.handles[va] = handle
        if self.cpu:
            ctypes.memset(va, 0, size)
        else:
            call(cu.cuMemsetD8, dptr(va), 0, size)
        return va

    def export(self, va: int) -> tuple[dict, list[int]]:
        fd = int(call(cu.cuMemExportToShareableHandle, self.handles[va], POSIX_FD, 0))
        info = {"size": self.sizes[va]}
        if self.host:  # sent with SCM_RIGHTS; the caller closes it once sent
            return info, [fd]
        self.exported.append(fd)  # taken by the peers with pidfd_getfd: keep it until then
        return dict(info, pid=os.getpid(), fd=fd), []

    def open(self, info: dict, fd: int | None, peer: int, what: str) -> int:
        if not self.host:
            fd = pidfd_getfd(int(info["pid"]), int(info["fd"]))
        try:
            handle = call(
                cu.cuMemImportFromShareableHandle, fd, POSIX_FD, detail=f"rank {peer}'s {what}"
            )
        finally:
            os.close(fd)
        va = self.map(handle, int(info["size"]), f"rank {peer}'s {what}")
        call(cu.cuMemRelease, handle)  # the mapping keeps the memory
        return va

    def read(self, va: int, n: int) -> bytes:
        if self.cpu:
            return ctypes.string_at(va, n)
        return super().read(va, n)

    def write(self, va: int, data: bytes) -> None:
        if self.cpu:
            ctypes.memmove(va, data, len(data))
        else:
            super().write(va, data)

    def after_start(self) -> None:
        """Every peer imported: close the exported FDs (a held one would make the driver's
        native checkpoint refuse, and PyTorch and NCCL let go of theirs too)."""
        for fd in self.exported:
            os.close(fd)
        self.exported = []

    def close_peer(self, va: int) -> None:
        self.unmap(va)

    def unmap(self, va: int) -> None:
        size = self.sizes.pop(va)
        call(cu.cuMemUnmap, va, size)
        call(cu.cuMemAddressFree, va, size)

    def free(self, va: int) -> None:
        self.unmap(va)
        call(cu.cuMemRelease, self.handles.pop(va))


def make(name: str, device_ordinal: int):
    """The share named ``name`` (one of :data:`SHARES`) for this rank's device."""
    if name == "ipc":
        return IpcShare(device_ordinal)
    if name in ("pidfd", "host"):
        return VmmShare(device_ordinal, host=name == "host")
    raise ValueError(f"--share must be one of {', '.join(SHARES)}, not {name!r}")
