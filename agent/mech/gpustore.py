"""Chunk files for GPU memory moved outside CRIU (issue 12's chunk format, native custom storage).

A *stream* is one GPU's custom-storage region of one process: one file
``DIR/chunks/gpu-<pid>-<ordinal>.bin`` (named and opened by agent/snapshot/snapdir.py; this
module writes and reads the descriptor it is given) whose size is the region's (``ftruncate`` first); chunk
``i`` lies at ``i * chunk_bytes``, the last one may be short; an all-zero chunk is not written
(the file stays sparse there) and has no checksum. Checksums: 32-byte digests, the
checkpoint's chunk checksum (``Options.checksum``, decisions D36: "sha256", FIPS 180-4, where
the node's CPU has SHA extensions, else "blake2b-256", RFC 7693 with no key; hashlib), computed
once while the chunk sits in its staging slot.

The device side is a :class:`Region` (``to_host``/``from_host``/``zero`` on a byte range): the
driver's mapped ``devPtr`` and stream (agent/mech/native_storage.py), or plain memory in tests.
Several writer threads (``writers`` of the checkpoint's ``ChunkSettings``, the value its shim
carriers use too: default 4) each take whole chunks: copy into their own staging slot (at most
``staging_bytes`` in all, default 64 MiB per stream: pinned host memory on a real GPU when
the caller allocates it so, plain buffers on fakecuda), hash, ``os.pwrite``
(hashlib and ``os.pwrite`` release the GIL). Readers read each chunk into a slot, verify its
checksum before the bytes reach the device, and zero zero-chunks on the device (a fresh
region is not guaranteed zeroed).

Errors: :class:`GpuStoreError` (an ``AgentError``) naming the pid, the GPU ordinal, the chunk,
the file, and the errno (a write) or both checksums (a read).
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno as errno_mod
import os
import threading
from typing import Callable, Optional, Protocol

from cuinterpose.agent.errors import AgentError
from cuinterpose.coordinator.protocol import DEFAULT_CHUNK_CHECKSUM, ChunkSettings, chunk_digest

CHECKSUM = DEFAULT_CHUNK_CHECKSUM  # a record without one (before decisions D36)


class GpuStoreError(AgentError):
    """A stream could not be written or read: ``phase`` the step, ``pid`` the process; the
    reason names the ordinal, the chunk, the file and the errno or both checksums."""


class Region(Protocol):
    """``size`` bytes of device memory. Each method is synchronous (the bytes are there when
    it returns) and may be called from several threads at once on disjoint ranges; ``addr``
    is a host address of ``n`` bytes."""

    size: int

    def to_host(self, off: int, addr: int, n: int) -> None: ...

    def from_host(self, off: int, addr: int, n: int) -> None: ...

    def zero(self, off: int, n: int) -> None: ...


def checksum(data, name: str = CHECKSUM) -> str:
    """The chunk checksum ``name`` (coordinator/protocol ``CHUNK_CHECKSUMS``: "blake2b-256",
    RFC 7693 with no key, or "sha256", FIPS 180-4) of ``data`` as 64 hex digits."""
    return chunk_digest(name, data).hex()


def nchunks(nbytes: int, chunk_bytes: int) -> int:
    return -(-int(nbytes) // int(chunk_bytes))


@dataclasses.dataclass(frozen=True)
class Options:
    """How streams are written and read: ``settings`` (the checkpoint's
    :class:`~cuinterpose.coordinator.protocol.ChunkSettings`, the same value its shim
    carriers are written with: ``chunk_bytes``, ``staging_bytes`` in all per stream,
    ``writers`` threads, ``checksum`` written or verified) and ``alloc(n) -> (addr, free)``: a
    staging slot of n bytes (default: a ctypes buffer)."""

    settings: ChunkSettings = ChunkSettings()
    alloc: Optional[Callable[[int], tuple[int, Callable[[], None]]]] = None

    @property
    def chunk_bytes(self) -> int:
        return self.settings.chunk_bytes

    @property
    def checksum(self) -> str:
        return self.settings.checksum

    def slots(self) -> int:
        """Writer threads, each with its own staging slot of one chunk: ``writers``, at most
        ``staging_bytes // chunk_bytes`` (``ChunkSettings`` makes that at least 1)."""
        s = self.settings
        return max(1, min(s.writers, s.staging_bytes // s.chunk_bytes))


def _plain_alloc(n: int) -> tuple[int, Callable[[], None]]:
    buf = ctypes.create_string_buffer(n)
    return ctypes.addressof(buf), lambda: buf  # the closure keeps the buffer alive


class _Pool:
    """``slots`` worker threads, each with its own staging slot, taking chunk indices in
    order until all are done or one fails (the first error is re-raised by :meth:`run`)."""

    def __init__(self, opts: Options, n: int):
        self.opts = opts
        self.n = n
        self.next = 0
        self.mu = threading.Lock()
        self.error: Optional[BaseException] = None

    def take(self) -> Optional[int]:
        with self.mu:
            if self.error is not None or self.next >= self.n:
                return None
            i = self.next
            self.next += 1
            return i

    def run(self, work: Callable[[int, int, memoryview], None]) -> None:
        cb = self.opts.chunk_bytes
        alloc = self.opts.alloc or _plain_alloc

        def worker():
            try:
                addr, free = alloc(cb)
            except BaseException as e:  # noqa: BLE001 - reported by run()
                with self.mu:
                    self.error = self.error or e
                return
            try:
                view = memoryview((ctypes.c_char * cb).from_address(addr)).cast("B")
                while (i := self.take()) is not None:
                    work(i, addr, view)
            except BaseException as e:  # noqa: BLE001 - reported by run()
                with self.mu:
                    self.error = self.error or e
            finally:
                free()

        k = min(self.opts.slots(), max(1, self.n))
        threads = [threading.Thread(target=worker, name=f"gpustore-{j}") for j in range(k)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if self.error is not None:
            raise self.error


def write_stream(
    region: Region, fd: int, *, pid: int, ordinal: int, file: str, opts: Options, phase: str
) -> dict:
    """Write ``region`` to the open file ``fd`` (truncated to ``region.size`` first); returns the
    manifest record ``{"file", "kind": "gpu", "pid", "ordinal", "bytes", "zero", "checksums"}``.
    Raises :class:`GpuStoreError` (ENOSPC, EIO, a short write) naming pid, ordinal, chunk, errno."""
    size, cb = int(region.size), opts.chunk_bytes
    n = nchunks(size, cb)
    sums: list[Optional[str]] = [None] * n
    zeros = bytes(cb)

    def fail(i: Optional[int], err: int, what: str) -> GpuStoreError:
        at = f"chunk {i} " if i is not None else ""
        return GpuStoreError(
            phase,
            f"GPU ordinal {ordinal}: {what} {at}of {file} failed: "
            f"{errno_mod.errorcode.get(err, err)} ({os.strerror(err)}); the checkpoint rolls "
            "back, free space or fix the disk and checkpoint again",
            pid=pid,
        )

    try:
        os.ftruncate(fd, size)
    except OSError as e:
        raise fail(None, e.errno or errno_mod.EIO, "sizing") from e

    def work(i: int, addr: int, view: memoryview) -> None:
        off = i * cb
        k = min(cb, size - off)
        region.to_host(off, addr, k)
        data = view[:k]
        if data == zeros[:k]:
            return
        sums[i] = checksum(data, opts.checksum)
        put = 0
        while put < k:
            try:
                w = os.pwrite(fd, data[put:], off + put)
            except OSError as e:
                raise fail(i, e.errno or errno_mod.EIO, "write") from e
            if w <= 0:
                raise fail(i, errno_mod.EIO, "short write")
            put += w

    _Pool(opts, n).run(work)
    return {
        "file": file,
        "kind": "gpu",
        "pid": int(pid),
        "ordinal": int(ordinal),
        "bytes": size,
        "zero": [i for i, s in enumerate(sums) if s is None],
        "checksums": sums,
    }


def read_stream(region: Region, fd: int, record: dict, *, opts: Options, phase: str) -> None:
    """Read the stream ``record`` (its chunks at ``opts.chunk_bytes``) from ``fd`` into
    ``region``: each chunk is verified before its bytes are copied to the device; zero chunks
    are zeroed on the device. Raises :class:`GpuStoreError` naming the file, pid, ordinal, chunk
    and its byte range in the file, and both checksums (a bad chunk), or the errno (a failed
    read); the file is only read."""
    size, cb = int(record["bytes"]), opts.chunk_bytes
    pid, ordinal, file = record["pid"], record["ordinal"], record["file"]
    if size != region.size:
        raise GpuStoreError(
            phase,
            f"GPU ordinal {ordinal}: {file} holds {size} bytes, the driver's region is "
            f"{region.size}; restore refused, snapshot untouched",
            pid=pid,
        )
    sums = record["checksums"]

    def work(i: int, addr: int, view: memoryview) -> None:
        off = i * cb
        k = min(cb, size - off)
        if sums[i] is None:
            region.zero(off, k)
            return
        got = 0
        while got < k:
            try:
                b = os.preadv(fd, [view[got:k]], off + got)
            except OSError as e:
                raise GpuStoreError(
                    phase,
                    f"GPU ordinal {ordinal}: read of chunk {i} (bytes {off}..{off + k - 1}) of {file} failed: "
                    f"{errno_mod.errorcode.get(e.errno, e.errno)} ({e.strerror})",
                    pid=pid,
                ) from e
            if b <= 0:
                raise GpuStoreError(
                    phase,
                    f"GPU ordinal {ordinal}: {file} ends inside chunk {i} (bytes {off}..{off + k - 1})",
                    pid=pid,
                )
            got += b
        have = checksum(view[:k], opts.checksum)
        if have != sums[i]:
            raise GpuStoreError(
                phase,
                f"GPU ordinal {ordinal}: chunk {i} (bytes {off}..{off + k - 1}) of {file} has a bad checksum: manifest "
                f"{sums[i]}, file {have}; restore refused, snapshot untouched",
                pid=pid,
            )
        region.from_host(off, addr, k)

    _Pool(opts, nchunks(size, cb)).run(work)


class MemoryRegion:
    """A :class:`Region` over host bytes (a ``bytearray``): for tests and for rescuing a
    region into memory."""

    def __init__(self, buf: bytearray):
        self.buf = buf
        self.size = len(buf)
        self._base = ctypes.addressof((ctypes.c_char * max(1, len(buf))).from_buffer(buf))

    def to_host(self, off: int, addr: int, n: int) -> None:
        ctypes.memmove(addr, self._base + off, n)

    def from_host(self, off: int, addr: int, n: int) -> None:
        ctypes.memmove(self._base + off, addr, n)

    def zero(self, off: int, n: int) -> None:
        ctypes.memset(self._base + off, 0, n)
