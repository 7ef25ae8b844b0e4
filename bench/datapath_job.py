#!/usr/bin/env python3
"""The job bench/datapath.py checkpoints: two processes sharing B bytes of VMM memory.

``creator`` (the tree's root) makes one ``cuMemCreate`` allocation of B bytes (rounded up to
the granularity) exportable as a POSIX file descriptor, maps it, fills it (``--zero-fraction``
0: every unit holds bytes, 0.9: nine units of ten are zero, set with ``cuMemsetD8`` since a
fresh allocation is not guaranteed zeroed), starts the ``importer`` with the exported FD
(inherited, its number in ``--fd``), which imports, maps and checks it. Both then park; the creator answers the quiesce
contract (docs/workload-contract.md: ``.request`` -> ``.ready`` naming both pids, then waits for
``.resume``). After a restore (``"restored": true``; with ``--cuts`` above 1 also after a
last cut resumed without one: a rollback or a release rebuilt the job) each process hashes the
whole mapping
(``cuMemcpyDtoH``) and compares it with the SHA-256 of what was written; the creator writes
``OUT/result.json`` (``verified``, ``bytes_compared``) and both exit.

With ``--cuts N`` the creator answers N quiesces: after each one that resumes without a
restore (``checkpoint --leave-running``) it rewrites the first ``--change-bytes`` bytes with
new random bytes, writes ``OUT/changed-K.json`` ({"bytes", "sha256" of the whole allocation})
and waits for the next request (the incremental case of bench/datapath.py).

``OUT/ready.json`` ({"creator", "importer", "bytes", "zero_bytes", "sha256", "rss_bytes": the
creator's VmRSS once parked}) says that the
job is parked and may be checkpointed. Files are written atomically (contract.write_atomic).
The waits poll the contract's files every 5 ms (the contract has no other signal), each with
a deadline (``--timeout-s``).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import pathlib
import random
import subprocess
import sys
import time

from cuda.bindings import driver as cu

from cuinterpose.coordinator.contract import quiesce_path, read_json, remove_if_id, write_atomic
from cuinterpose.workloads.afdwin.cudrv import alloc_prop, call, rw_access

POSIX_FD = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
UNIT_MAX = 8 << 20  # the fill unit: one chunk of the chunk format's default size
PIECE = 64 << 20  # bytes per cuMemcpy


def unit_bytes(size: int) -> int:
    """The fill unit for ``size`` bytes: 8 MiB, or size/10 (64 KiB aligned) when smaller."""
    return max(64 << 10, min(UNIT_MAX, (size // 10) >> 16 << 16))


def pattern(size: int, zero_fraction: float):
    """Yield (offset, bytes or None for zeros) units covering ``size`` bytes."""
    unit = unit_bytes(size)
    block = random.Random(size).randbytes(unit)
    every = 10 if zero_fraction >= 0.5 else 1  # 0.9: one unit in ten holds bytes
    for i, off in enumerate(range(0, size, unit)):
        n = min(unit, size - off)
        if i % every:
            yield off, None, n
        else:
            yield off, i.to_bytes(8, "little") + block[8:n], n


def setup_context():
    call(cu.cuInit, 0)
    dev = call(cu.cuDeviceGet, 0)
    call(cu.cuCtxSetCurrent, call(cu.cuDevicePrimaryCtxRetain, dev))


def map_handle(handle, size: int, gran: int) -> int:
    va = int(call(cu.cuMemAddressReserve, size, gran, 0, 0))
    call(cu.cuMemMap, va, size, 0, handle, 0)
    call(cu.cuMemSetAccess, va, size, [rw_access(0)], 1)
    return va


def digest(va: int, size: int) -> str:
    h = hashlib.sha256()
    buf = bytearray(min(PIECE, size))
    for off in range(0, size, len(buf)):
        n = min(len(buf), size - off)
        view = memoryview(buf)[:n]
        call(cu.cuMemcpyDtoH, view, cu.CUdeviceptr(va + off), n)
        h.update(view)
    return h.hexdigest()


def status_bytes(key: str) -> int:
    """``key`` (VmRSS, VmHWM) of /proc/self/status in bytes."""
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def wait_file(path: pathlib.Path, pred, deadline: float, what: str) -> dict:
    while True:
        obj = read_json(path)
        if obj is not None and pred(obj):
            return obj
        if time.monotonic() > deadline:
            raise SystemExit(f"datapath_job: no {what} ({path}) before the deadline")
        time.sleep(0.005)


def creator(args) -> int:
    out = pathlib.Path(args.out)
    setup_context()
    prop = alloc_prop(0)
    gran_flag = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
    gran = int(call(cu.cuMemGetAllocationGranularity, prop, gran_flag))
    size = -(-args.bytes // gran) * gran
    handle = call(cu.cuMemCreate, size, prop, 0)
    va = map_handle(handle, size, gran)
    h, zero = hashlib.sha256(), 0
    for off, data, n in pattern(size, args.zero_fraction):
        if data is None:
            call(cu.cuMemsetD8, cu.CUdeviceptr(va + off), 0, n)
            h.update(bytes(n))
            zero += n
        else:
            call(cu.cuMemcpyHtoD, cu.CUdeviceptr(va + off), data, n)
            h.update(data)
    want = h.hexdigest()
    fd = int(call(cu.cuMemExportToShareableHandle, handle, POSIX_FD, 0))
    imp = subprocess.Popen(
        [sys.executable, __file__, "importer", "--bytes", str(size), "--sha256", want]
        + ["--fd", str(fd)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        pass_fds=(fd,),
        text=True,
    )
    os.close(fd)  # a held exported FD would make the driver's native checkpoint refuse
    if imp.stdout.readline().strip() != "imported":
        raise SystemExit("datapath_job: the importer did not import the allocation")
    root = os.getpid()
    write_atomic(
        out / "ready.json",
        {
            "creator": root,
            "importer": imp.pid,
            "bytes": size,
            "zero_bytes": zero,
            "sha256": want,
            "rss_bytes": status_bytes("VmRSS"),  # before any checkpoint: the job's own memory
        },
    )
    deadline = time.monotonic() + args.timeout_s
    last = None
    for cut in range(1, args.cuts + 1):
        req = wait_file(
            quiesce_path(args.ctl, root, "request"),
            lambda o, last=last: "id" in o and o["id"] != last,
            deadline,
            "request",
        )
        last = req["id"]
        write_atomic(
            quiesce_path(args.ctl, root, "ready"),
            {"id": req["id"], "ranks": [{"pid": root}, {"pid": imp.pid}]},
        )
        # dumped and killed here; a restored tree goes on from this wait (CLOCK_MONOTONIC is
        # the node's, so the deadline still holds after a restore on the same boot)
        resume = wait_file(
            quiesce_path(args.ctl, root, "resume"),
            lambda o, rid=req["id"]: o.get("id") == rid,
            deadline,
            "resume",
        )
        # its own files, .request last: the agent's next request waits for that (the contract)
        for kind in ("ready", "resume", "request"):
            remove_if_id(quiesce_path(args.ctl, root, kind), req["id"])
        if resume.get("restored") or cut == args.cuts:
            break
        # left running: the first --change-bytes change before the next cut
        n = min(args.change_bytes, size)
        call(cu.cuMemcpyHtoD, cu.CUdeviceptr(va), os.urandom(n), n)
        want = digest(va, size)
        write_atomic(out / f"changed-{cut}.json", {"bytes": n, "sha256": want})
    result = {"restored": bool(resume.get("restored")), "bytes": size, "cuts": cut}
    if result["restored"] or args.cuts > 1:  # restored, or rebuilt by a rollback or release
        got = digest(va, size)
        imp.stdin.write("verify\n")
        imp.stdin.flush()
        theirs = imp.stdout.readline().strip()
        result.update(
            verified=got == want and theirs == want,
            bytes_compared=2 * size,
            creator_sha256=got,
            importer_sha256=theirs,
        )
    imp.stdin.close()
    imp.wait()
    write_atomic(out / "result.json", result)
    return 0


def importer(args) -> int:
    setup_context()
    prop = alloc_prop(0)
    gran_flag = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
    gran = int(call(cu.cuMemGetAllocationGranularity, prop, gran_flag))
    handle = call(cu.cuMemImportFromShareableHandle, args.fd, POSIX_FD)
    os.close(args.fd)
    va = map_handle(handle, args.bytes, gran)
    call(cu.cuMemRelease, handle)  # the mapping keeps the memory
    if digest(va, args.bytes) != args.sha256:
        raise SystemExit("datapath_job: the importer's mapping differs from what was written")
    print("imported", flush=True)
    for line in sys.stdin:  # parked: blocked in read(2) until the creator asks
        if line.strip() == "verify":
            print(digest(va, args.bytes), flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("role", choices=("creator", "importer"))
    ap.add_argument("--bytes", type=int, required=True)
    ap.add_argument("--zero-fraction", type=float, default=0.0)
    ap.add_argument("--out", default=".")
    ap.add_argument("--ctl", default=None)
    ap.add_argument("--sha256", default="")
    ap.add_argument("--fd", type=int, default=-1, help="importer: the exported FD it inherited")
    ap.add_argument("--timeout-s", type=float, default=3600.0)
    ap.add_argument(
        "--cuts", type=int, default=1, help="quiesces answered (each but the last left running)"
    )
    ap.add_argument(
        "--change-bytes",
        type=int,
        default=0,
        help="bytes at the start of the allocation rewritten after each left-running cut",
    )
    args = ap.parse_args(argv)
    return creator(args) if args.role == "creator" else importer(args)


if __name__ == "__main__":
    sys.exit(main())
