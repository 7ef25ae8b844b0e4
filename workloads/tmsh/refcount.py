"""The producer's reference-counter file, as PyTorch keeps one (torch/csrc/CudaIPCTypes.h
``CudaIPCRefCountersFile``, torch/csrc/CudaIPCTypes.cpp ``GetNewRefCountedSentData``).

A shared-memory file ``/dev/shm/tmsh_<pid>_<random>`` (PyTorch: ``/torch_<pid>_<random>``
through ``shm_open``) of :data:`SLOTS` signed 64-bit counters. Every storage the producer sends
takes the next slot (never reused within a file), set to 1; the consumer that rebuilt it
decrements it once it drops the storage (``StorageSharing.cpp``: ``_release_ipc_counter`` and the
rebuilt storage's deleter), or at once when the storage was already in its cache. The producer
reuses the storage's memory only when its counter reads 0 (``CudaIPCSentDataLimbo::collect``).
A full file is replaced by a new one (PyTorch's ``next_available_ref_counters_file_``).
"""

from __future__ import annotations

import mmap
import os
import secrets
import struct

SLOTS = 10000  # CUDA_IPC_REF_COUNTER_FILE_SIZE
SHM_DIR = "/dev/shm"


class RefCounterFile:
    """One counter file, created (``create=True``, the producer) or opened by name."""

    def __init__(self, name: str, create: bool = False):
        self.name = name
        path = os.path.join(SHM_DIR, name)
        flags = os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, SLOTS * 8)
            self.map = mmap.mmap(fd, SLOTS * 8, mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.next = 0

    @classmethod
    def new_for_self(cls) -> "RefCounterFile":
        return cls(f"tmsh_{os.getpid()}_{secrets.randbits(32)}", create=True)

    def full(self) -> bool:
        return self.next >= SLOTS

    def take(self) -> int:
        """The next slot, its counter set to 1 (the storage is being sent)."""
        slot = self.next
        self.next += 1
        self.set(slot, 1)
        return slot

    def get(self, slot: int) -> int:
        return struct.unpack_from("<q", self.map, slot * 8)[0]

    def set(self, slot: int, value: int) -> None:
        struct.pack_into("<q", self.map, slot * 8, value)

    def decrement(self, slot: int) -> int:
        """One reference dropped (one process per slot decrements it, as in PyTorch)."""
        v = self.get(slot) - 1
        self.set(slot, v)
        return v

    def unlink(self) -> None:
        try:
            os.unlink(os.path.join(SHM_DIR, self.name))
        except FileNotFoundError:
            pass

    def close(self) -> None:
        self.map.close()
