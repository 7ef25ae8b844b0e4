"""Memory of a tmsh run: the payload layout, the producer's pool of segments (its
caching-allocator blocks) and the consumer's cache of opened segments, for both variants.

- ``ipc`` (PyTorch's default CUDA caching allocator): a segment is a ``cuMemAlloc`` (what
  ``cudaMalloc`` calls); its share handle is ``cuIpcGetMemHandle`` of the segment base, and a
  storage is (handle, offset in the segment) (``CUDACachingAllocator::shareIpcHandle``,
  ``SHAREABLE_CUDA_MALLOC``). The consumer opens it with ``cuIpcOpenMemHandle`` and
  ``CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`` once per handle, kept while any storage of it lives
  (``getIpcDevPtr``'s cache), closed after the last.
- ``expandable`` (``expandable_segments:True``; ``SHAREABLE_CUDA_EXPANDABLE_SEGMENT``): a
  segment is a ``cuMemCreate`` allocation exportable as a POSIX file descriptor, mapped in a
  reservation; the share handle is the producer's pid and the exported FD's number (kept open
  while the segment lives); the consumer takes the FD with ``pidfd_getfd(2)``, imports, maps in
  its own reservation with read-write access, closes the FD.

Payload of a storage: :data:`HEADER` (magic, sequence number, body bytes, checksum) then the
body, ``shake_128(seq)`` bytes; the checksum is the first 8 bytes of BLAKE2b of the body.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import struct

from cuda.bindings import driver as cu

from ..afdwin.cudrv import alloc_prop, call, rw_access
from ..carw.share import pidfd_getfd

HEADER = struct.Struct("<8sQQQ")
MAGIC = b"TMSHPAY1"
VARIANTS = ("ipc", "expandable", "event")  # "event": ipc plus a pickled long-lived event


def body(seq: int, nbytes: int) -> bytes:
    return hashlib.shake_128(seq.to_bytes(8, "little")).digest(nbytes)


def checksum(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def payload(seq: int, storage_bytes: int) -> bytes:
    b = body(seq, storage_bytes - HEADER.size)
    return HEADER.pack(MAGIC, seq, len(b), checksum(b)) + b


def check_payload(data: bytes, seq: int) -> str | None:
    """None when ``data`` is storage ``seq``'s payload, else what is wrong."""
    magic, got, n, ck = HEADER.unpack_from(data)
    if magic != MAGIC:
        return f"magic {magic!r}"
    if got != seq:
        return f"holds storage {got}, not {seq} (its memory was reused while referenced)"
    b = data[HEADER.size : HEADER.size + n]
    if n != len(data) - HEADER.size or checksum(b) != ck:
        return f"checksum {checksum(b):#x} != {ck:#x}"
    return None


def dptr(va: int) -> cu.CUdeviceptr:
    return cu.CUdeviceptr(va)


class Segments:
    """The producer's segments: ``va[i]`` and ``handle(i)`` (what a message carries)."""

    def __init__(self, variant: str, device: int, count: int, seg_bytes: int):
        self.expandable = variant == "expandable"
        self.device = device
        self.va: list[int] = []
        self.fds: list[int] = []
        self.handles: list[object] = []
        prop = alloc_prop(device)
        gran = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        g = int(call(cu.cuMemGetAllocationGranularity, prop, gran))
        self.seg_bytes = (seg_bytes + g - 1) // g * g if self.expandable else seg_bytes
        for i in range(count):
            if self.expandable:
                h = call(cu.cuMemCreate, self.seg_bytes, prop, 0, detail=f"segment {i}")
                va = int(call(cu.cuMemAddressReserve, self.seg_bytes, 0, 0, 0))
                call(cu.cuMemMap, va, self.seg_bytes, 0, h, 0)
                call(cu.cuMemSetAccess, va, self.seg_bytes, [rw_access(device)], 1)
                fd = int(call(cu.cuMemExportToShareableHandle, h, prop.requestedHandleTypes, 0))
                self.handles.append(h)
                self.fds.append(fd)
            else:
                va = int(call(cu.cuMemAlloc, self.seg_bytes, detail=f"segment {i}"))
            self.va.append(va)

    def handle(self, i: int) -> tuple:
        if self.expandable:
            return ("e", os.getpid(), self.fds[i], self.seg_bytes)
        h = call(cu.cuIpcGetMemHandle, dptr(self.va[i]))
        return ("c", ctypes.string_at(h.getPtr(), 64))

    def free(self) -> None:
        for i, va in enumerate(self.va):
            if self.expandable:
                os.close(self.fds[i])
                call(cu.cuMemUnmap, va, self.seg_bytes)
                call(cu.cuMemRelease, self.handles[i])
                call(cu.cuMemAddressFree, va, self.seg_bytes)
            else:
                call(cu.cuMemFree, dptr(va))


class Opened:
    """The consumer's opened segments by share handle: ``open`` counts one more storage (opening
    the segment on the first), ``release`` one less (closing it after the last)."""

    def __init__(self, device: int):
        self.device = device
        self.by_handle: dict[tuple, list] = {}  # handle -> [va, storages, mapping info]
        self.opens = 0

    def open(self, handle: tuple) -> int:
        e = self.by_handle.get(handle)
        if e is None:
            e = [*self._open(handle), 0]
            self.by_handle[handle] = e
            self.opens += 1
        e[2] += 1
        return e[0]

    def _open(self, handle: tuple) -> tuple[int, object]:
        if handle[0] == "c":
            h = cu.CUipcMemHandle()
            ctypes.memmove(h.getPtr(), handle[1], 64)
            flags = cu.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
            return int(call(cu.cuIpcOpenMemHandle, h, flags, detail="storage segment")), None
        _, pid, fd, size = handle
        got = pidfd_getfd(pid, fd)
        try:
            posix = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
            h = call(cu.cuMemImportFromShareableHandle, got, posix, detail=f"pid {pid} fd {fd}")
        finally:
            os.close(got)
        va = int(call(cu.cuMemAddressReserve, size, 0, 0, 0))
        call(cu.cuMemMap, va, size, 0, h, 0)
        call(cu.cuMemSetAccess, va, size, [rw_access(self.device)], 1)
        return va, (h, size)

    def release(self, handle: tuple) -> None:
        e = self.by_handle[handle]
        e[2] -= 1
        if e[2]:
            return
        del self.by_handle[handle]
        if e[1] is None:
            call(cu.cuIpcCloseMemHandle, dptr(e[0]))
        else:
            h, size = e[1]
            call(cu.cuMemUnmap, e[0], size)
            call(cu.cuMemRelease, h)
            call(cu.cuMemAddressFree, e[0], size)

    def vas(self) -> dict[str, int]:
        """The opened segments' VAs, by a short key of their handle."""
        return {key(h): e[0] for h, e in sorted(self.by_handle.items(), key=lambda x: key(x[0]))}


def key(handle: tuple) -> str:
    if handle[0] == "c":
        return "c:" + hashlib.blake2b(handle[1], digest_size=6).hexdigest()
    return f"e:{handle[1]}:{handle[2]}"
