"""Native checkpoint to custom storage through the driver API (cuda.h 13.4+).

``cuCheckpointProcessCheckpoint(pid, args)`` with ``args.customStorageInfo_out`` set leaves the
process CHECKPOINTING and hands the caller a driver-allocated ``CUcheckpointCustomStorageInfo``:
per GPU holding data, a zero-copy mapped ``devPtr``, its ``size`` and a ``stream`` of the
caller's primary context of that GPU. The agent copies each region to the chunk file
``chunks/gpu-<pid>-<ordinal>.bin`` (agent/mech/gpustore.py; created and opened by the
snapshot's SnapshotDir, agent/snapshot/snapdir.py), then calls
``cuCheckpointOperationComplete(handle)`` (the driver synchronizes the streams, unmaps, and the
process is CHECKPOINTED: its GPU memory is in the files only, and CRIU dumps CPU state). A
restore is the mirror image (CHECKPOINTED -> RESTORING -> complete -> LOCKED). The caller
must have called ``cuInit`` and retain the primary context of every GPU the target uses
(else CUDA_ERROR_INVALID_CONTEXT): :func:`retain_contexts` does it once per process.
``<ordinal>`` is this process's ordinal of the region's GPU (``cuStreamGetDevice``).

A failure while writing (ENOSPC, EIO) must leave the workload with its memory: the driver has
no abort, so the region (still mapped) is copied into agent memory, the operation completed,
and the process restored from that copy at once (LOCKED again, then the rollback unlocks it).
The files of a checkpoint stay open in this process (:data:`_held`) so that a rollback after a
later step (CRIU, the manifest) reads them back even if the snapshot's files were removed.

Module state (one checkpoint or restore at a time per agent process): :func:`begin_checkpoint`
sets where the streams go; :func:`register_sources` the streams a restore reads.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
from typing import Callable, Optional, Sequence

from cuinterpose.agent.errors import AgentError, NativeError
from cuinterpose.agent.mech import gpustore
from cuinterpose.agent.options import GPU_STORAGE_MODES
from cuinterpose.agent.snapshot.snapdir import SnapshotDir, gpu_rel

COMPLETE_SYMBOL = "cuCheckpointOperationComplete"
MIN_DRIVER_VERSION = 13040  # cuda.h 13.4: customStorageInfo_out
MODES = GPU_STORAGE_MODES


class _Info(ctypes.Structure):  # CUcheckpointCustomStorageInfo (cuda.h 13.5)
    _fields_ = [
        ("handle", ctypes.c_void_p),
        ("perDeviceData", ctypes.c_void_p),
        ("deviceCount", ctypes.c_uint),
    ]


class _PerDevice(ctypes.Structure):  # CUcheckpointCustomStoragePerDeviceData
    _fields_ = [("devPtr", ctypes.c_uint64), ("size", ctypes.c_size_t), ("stream", ctypes.c_void_p)]


def mode(value: str) -> str:
    """``value`` (the ``gpu_storage`` option: auto | custom | host), checked; ``AgentError``
    phase "gpu storage" for another word."""
    m = value.strip().lower()
    if m not in MODES:
        raise AgentError("gpu storage", f"--gpu-storage {m!r}: expected one of {MODES}")
    return m


def probe(backend_name: str, library: str, version: int) -> tuple[bool, str]:
    """(available, why): custom storage needs the driver-API backend, a library exporting
    ``cuCheckpointOperationComplete`` and a driver version ≥ 13040."""
    if backend_name != "driver-api":
        return False, f"the {backend_name} backend has no custom storage (host staging)"
    if version < MIN_DRIVER_VERSION:
        return False, f"driver {version} predates custom storage (needs {MIN_DRIVER_VERSION})"
    try:
        lib = ctypes.CDLL(library, mode=os.RTLD_NOLOAD | os.RTLD_NOW)
    except OSError:
        return False, f"{library} cannot be opened"
    if not hasattr(lib, COMPLETE_SYMBOL):
        return False, f"{library} lacks {COMPLETE_SYMBOL}"
    return True, f"driver {version} at {library} has custom storage ({COMPLETE_SYMBOL})"


@dataclasses.dataclass
class Sink:
    """Where a checkpoint's streams go: the snapshot directory and the writer options."""

    snap: SnapshotDir
    opts: gpustore.Options


_sink: Optional[Sink] = None
#: pid -> [(record, fd)] written by this process's last checkpoint (read back by a rollback)
_held: dict[int, list[tuple[dict, int]]] = {}
#: pid -> [(record, fd)] a restore reads (from the snapshot), and the options to read them with
_sources: dict[int, list[tuple[dict, int]]] = {}
_source_opts: Optional[gpustore.Options] = None
_held_opts: Optional[gpustore.Options] = None
_contexts: dict[int, object] = {}


def begin_checkpoint(snap: SnapshotDir, opts: gpustore.Options) -> None:
    """Checkpoints from now on go to custom storage under ``chunks/`` of the snapshot ``snap``;
    the files of the previous checkpoint are closed."""
    global _sink
    forget()
    _sink = Sink(snap, opts)  # chunks/ is made by the first stream


def end_checkpoint() -> list[dict]:
    """Stop sending checkpoints to custom storage; the stream records written, pid order."""
    global _sink
    _sink = None
    return [rec for pid in sorted(_held) for rec, _fd in _held[pid]]


def held_files() -> list[str]:
    """The stream files (relative paths) of this process's last checkpoint."""
    return [rec["file"] for pid in sorted(_held) for rec, _fd in _held[pid] if rec]


def forget() -> None:
    """Close every held stream file (of the last checkpoint, and of a restore)."""
    for table in (_held, _sources):
        for streams in table.values():
            for _rec, fd in streams:
                try:
                    os.close(fd)
                except OSError:
                    pass
        table.clear()


def register_sources(
    snap: SnapshotDir, pids: Sequence[int], streams: Sequence[dict], opts: gpustore.Options
) -> None:
    """A restore of ``pids`` (checkpointed to custom storage, with or without GPU memory) reads
    these stream records (validated by trust.check_gpu_storage) from the snapshot ``snap``:
    the files are opened now (read-only: the snapshot is never modified)."""
    global _source_opts
    forget()
    for pid in pids:
        _sources[int(pid)] = []
    for rec in streams:
        fd = snap.open_stream(rec["file"])
        _sources.setdefault(int(rec["pid"]), []).append((rec, fd))
    for streams in _sources.values():
        streams.sort(key=lambda s: int(s[0]["ordinal"]))
    _source_opts = opts


def wants_checkpoint(pid: int) -> bool:
    return _sink is not None


def wants_restore(pid: int) -> bool:
    """The pid's GPU memory is in streams (a pid checkpointed to custom storage without any GPU
    memory restores through the chosen backend like a host checkpoint)."""
    return bool(_held.get(pid) or _sources.get(pid))


def retain_contexts(drv) -> None:
    """``cuDevicePrimaryCtxRetain`` of every device, once per process (the driver requires the
    caller to retain the primary context of every GPU the target uses)."""
    if _contexts:
        return
    err, n = drv.cuDeviceGetCount()
    if int(err) != 0:
        raise NativeError("checkpoint", None, f"cuDeviceGetCount: {err.name}")
    for d in range(int(n)):
        err, ctx = drv.cuDevicePrimaryCtxRetain(d)
        if int(err) != 0:
            raise NativeError("checkpoint", None, f"cuDevicePrimaryCtxRetain({d}): {err.name}")
        _contexts[d] = ctx


class DriverRegion:
    """A :class:`gpustore.Region` over a mapped ``devPtr`` of ``size`` bytes, copied on the
    driver's ``stream`` (``cuMemcpy{DtoH,HtoD}Async`` + ``cuStreamSynchronize``) with the
    primary context of ``ordinal`` current in the calling thread."""

    def __init__(self, drv, pid: int, ordinal: int, devptr: int, size: int, stream):
        self.drv, self.pid, self.ordinal = drv, pid, ordinal
        self.devptr, self.size, self.stream = int(devptr), int(size), stream

    def _check(self, what: str, res) -> None:
        err = res[0] if isinstance(res, tuple) else res
        if int(err) != 0:
            raise NativeError(
                "checkpoint", self.pid, f"{what} on GPU ordinal {self.ordinal}: {err.name}"
            )

    def _run(self, what: str, fn, *args) -> None:
        self._check("cuCtxSetCurrent", self.drv.cuCtxSetCurrent(_contexts[self.ordinal]))
        self._check(what, fn(*args))
        self._check("cuStreamSynchronize", self.drv.cuStreamSynchronize(self.stream))

    def to_host(self, off: int, addr: int, n: int) -> None:
        dp = self.drv.CUdeviceptr(self.devptr + off)
        self._run("cuMemcpyDtoHAsync", self.drv.cuMemcpyDtoHAsync, addr, dp, n, self.stream)

    def from_host(self, off: int, addr: int, n: int) -> None:
        dp = self.drv.CUdeviceptr(self.devptr + off)
        self._run("cuMemcpyHtoDAsync", self.drv.cuMemcpyHtoDAsync, dp, addr, n, self.stream)

    def zero(self, off: int, n: int) -> None:
        dp = self.drv.CUdeviceptr(self.devptr + off)
        self._run("cuMemsetD8Async", self.drv.cuMemsetD8Async, dp, 0, n, self.stream)


Call = Callable[..., object]


def _begin(drv, pid: int, call: Call, args, action: str):
    """Issue the checkpoint/restore with ``customStorageInfo_out``; returns (handle, regions
    sorted by ordinal)."""
    retain_contexts(drv)
    out = ctypes.c_void_p(0)
    args.customStorageInfo_out = ctypes.addressof(out)
    call(action, pid, args)
    info = _Info.from_address(out.value)
    regions = []
    for i in range(info.deviceCount):
        e = _PerDevice.from_address(info.perDeviceData + i * ctypes.sizeof(_PerDevice))
        stream = drv.CUstream(e.stream or 0)
        err, dev = drv.cuStreamGetDevice(stream)
        if int(err) != 0:
            raise NativeError(action, pid, f"cuStreamGetDevice: {err.name}")
        regions.append(DriverRegion(drv, pid, int(dev), e.devPtr, e.size, stream))
    handle = drv.CUcheckpointOperationHandle(info.handle or 0)
    return handle, sorted(regions, key=lambda r: r.ordinal)


def _complete(drv, pid: int, handle, action: str) -> None:
    (err,) = drv.cuCheckpointOperationComplete(handle)
    if int(err) != 0:
        raise NativeError(action, pid, f"cuCheckpointOperationComplete: {err.name}")


def _buf_addr(buf: bytearray) -> int:
    return ctypes.addressof((ctypes.c_char * max(1, len(buf))).from_buffer(buf))


def _rescue(drv, pid: int, call: Call, handle, regions, restore_args) -> None:
    """A write failed while the regions are still mapped: keep the bytes in memory, complete,
    and restore the process from them (LOCKED again, memory intact)."""
    bufs = [bytearray(r.size) for r in regions]
    for r, b in zip(regions, bufs):
        if r.size:
            r.to_host(0, _buf_addr(b), r.size)
    _complete(drv, pid, handle, "checkpoint")
    h2, back = _begin(drv, pid, call, restore_args(), "restore")
    for r, b in zip(back, bufs):
        if r.size:
            r.from_host(0, _buf_addr(b), r.size)
    _complete(drv, pid, h2, "restore")


def checkpoint(drv, pid: int, call: Call, restore_args: Callable[[], object]) -> list[dict]:
    """LOCKED -> CHECKPOINTED through custom storage; returns the stream records. A failed
    write rescues the process (see the module doc) and re-raises; the pid's files are removed."""
    assert _sink is not None
    handle, regions = _begin(drv, pid, call, drv.CUcheckpointCheckpointArgs(), "checkpoint")
    written: list[tuple[dict, int]] = []
    paths: list[str] = []
    try:
        for r in regions:
            rel = gpu_rel(pid, r.ordinal)
            fd = _sink.snap.create_stream(rel)
            paths.append(rel)
            written.append(({}, fd))
            rec = gpustore.write_stream(
                r,
                fd,
                pid=pid,
                ordinal=r.ordinal,
                file=rel,
                opts=_sink.opts,
                phase="native checkpoint",
            )
            written[-1] = (rec, fd)
    except BaseException:
        try:
            _rescue(drv, pid, call, handle, regions, restore_args)
        finally:
            for _rec, fd in written:
                os.close(fd)
            for rel in paths:
                _sink.snap.unlink(rel)
        raise
    _complete(drv, pid, handle, "checkpoint")
    global _held_opts
    _held[pid] = written
    _held_opts = _sink.opts
    return [rec for rec, _fd in written]


def restore(drv, pid: int, call: Call, args) -> None:
    """CHECKPOINTED -> LOCKED from the pid's streams (held or registered): each chunk verified
    before it reaches the device. A mismatch (stream count, sizes, a bad chunk) raises
    ``GpuStoreError``/``NativeError`` without completing: the process is not resumed on
    wrong bytes."""
    held = pid in _held
    streams = _held[pid] if held else _sources.get(pid, [])
    opts = (_held_opts if held else _source_opts) or gpustore.Options()
    handle, regions = _begin(drv, pid, call, args, "restore")
    if [r.size for r in regions] != [int(rec["bytes"]) for rec, _fd in streams]:
        raise gpustore.GpuStoreError(
            "native restore",
            f"the driver hands out {len(regions)} GPU region(s) of "
            f"{[r.size for r in regions]} bytes, the snapshot holds "
            f"{[int(rec['bytes']) for rec, _fd in streams]} (files "
            f"{', '.join(rec['file'] for rec, _fd in streams) or 'none'}); restore refused",
            pid=pid,
        )
    for r, (rec, fd) in zip(regions, streams):
        gpustore.read_stream(r, fd, rec, opts=opts, phase="native restore")
    _complete(drv, pid, handle, "restore")
