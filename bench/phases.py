#!/usr/bin/env python3
"""Shim phase timings for a synthetic job: K allocations shared by two processes.

For each K, a creator process makes K POSIX-exportable allocations of --size bytes, maps them,
fills them, and passes them to an importer that maps them too (tests/coordinator/c/cuipair.c,
both under libcuinterpose.so, on fakecuda unless --driver real). The coordinator then runs
capture() (INSPECT, SAVE_ALLOCATIONS, PREPARE_UNICAST, INSPECT) and restore() (INSPECT,
LOAD_ALLOCATIONS, RESTORE_UNICAST, INSPECT) with the processes alive, and the bytes are
verified afterwards.

Printed per K and phase: the coordinator's wall time (send to last reply), the slowest
shim's elapsed_ns, records changed, carrier bytes, the shim's copy time and rate
(bytes / copy_ns), a plain memcpy of the same number of bytes measured in the same run, and
the ratio carrier rate / memcpy rate. No thresholds: this prints, it does not judge.

    .venv/bin/python bench/phases.py [--k 10,100,1000] [--size BYTES] [--driver fake|real]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import pathlib
import resource
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

from cuda_include_dir import cuda_include_dir  # noqa: E402

from cuinterpose.agent import paths  # noqa: E402
from cuinterpose.agent.units import arg_bytes  # noqa: E402
from cuinterpose.coordinator.claim import Claim  # noqa: E402
from cuinterpose.coordinator.phases import Coordinator, Participant  # noqa: E402
from cuinterpose.coordinator.protocol import socket_path  # noqa: E402


def _load_pair():
    spec = importlib.util.spec_from_file_location(
        "cuipair_driver", REPO / "tests" / "coordinator" / "pair.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


pair_mod = _load_pair()


def build_cuipair(driver: str) -> pathlib.Path:
    """Compile cuipair.c into build/bench/ (cached by source hash)."""
    out_dir = REPO / "build" / "bench"
    out_dir.mkdir(parents=True, exist_ok=True)
    src = pair_mod.CUIPAIR_C
    if driver == "fake":
        link = [f"-L{paths.fakecuda_dir()}", "-l:libcuda.so.1"]
    else:
        link = ["-l:libcuda.so.1"]
    cmd = [
        "cc",
        "-std=gnu11",
        "-O2",
        f"-I{cuda_include_dir()}",
        "-o",
        None,
        str(src),
        *link,
        "-ldl",
        "-lpthread",
    ]
    key = hashlib.sha256(src.read_bytes() + " ".join(map(str, cmd[:5] + cmd[6:])).encode())
    exe = out_dir / f"cuipair-{driver}"
    stamp = out_dir / f"cuipair-{driver}.sha256"
    if exe.exists() and stamp.exists() and stamp.read_text() == key.hexdigest():
        return exe
    cmd[cmd.index(None)] = str(exe)
    subprocess.run(cmd, check=True)
    stamp.write_text(key.hexdigest())
    return exe


def memcpy_ns(nbytes: int, repeat: int = 3) -> int:
    """Best of ``repeat`` plain copies of ``nbytes`` (bytearray slice assignment = memmove)."""
    src = bytearray(os.urandom(min(nbytes, 1 << 20))) * max(1, nbytes // (1 << 20))
    src = src[:nbytes] if len(src) >= nbytes else src + bytearray(nbytes - len(src))
    dst = bytearray(nbytes)
    best = None
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        dst[:] = src
        dt = time.perf_counter_ns() - t0
        best = dt if best is None else min(best, dt)
    return max(best, 1)


def driver_granularity() -> int:
    """The real driver's minimum granularity (bytes) of a POSIX-FD device allocation on device
    0 (cuMemGetAllocationGranularity), in this process, without the shim."""
    from cuda.bindings import driver as cu

    from cuinterpose.workloads.afdwin.cudrv import alloc_prop, call

    call(cu.cuInit, 0)
    flag = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
    return int(call(cu.cuMemGetAllocationGranularity, alloc_prop(0), flag))


def env_for(driver: str, ctl: str, granularity: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env["LD_PRELOAD"] = str(paths.shim_path())
    env["CUINTERPOSE_CONTROL_DIR"] = ctl
    if driver == "fake":
        env["LD_LIBRARY_PATH"] = str(paths.fakecuda_dir())
        env["FAKECUDA_GRANULARITY"] = str(granularity)
    return env


def run_one(exe, driver: str, k: int, size: int, granularity: int, timeout_s: float) -> list:
    with tempfile.TemporaryDirectory(prefix="cui-bench-") as ctl:
        pair = pair_mod.Pair(exe, env_for(driver, ctl, granularity), k, size)
        try:
            parts = [Participant(pid, socket_path(ctl, pid)) for pid in pair.pids]
            pair_mod.wait_sockets([p.socket_path for p in parts])
            before = pair.sums()
            # the bench drives the shims as the agent does: holding a claim (protocol.h "Claims")
            claim = Claim.take(ctl, pair.pids, kind="bench")
            t0 = time.perf_counter_ns()
            cap = Coordinator(parts, timeout_s=timeout_s, claim=claim).capture()
            t1 = time.perf_counter_ns()
            res = Coordinator(parts, timeout_s=timeout_s, claim=claim).restore(cap)
            t2 = time.perf_counter_ns()
            after = pair.sums()
            if after != before or before[0] != before[1]:
                raise SystemExit(f"K={k}: bytes differ after restore: {before} -> {after}")
        finally:
            pair.close()
    rows = []
    for label, phases, total in (
        ("capture", cap.phases, t1 - t0),
        ("restore", res.phases, t2 - t1),
    ):
        for p in phases:
            rows.append(
                (
                    k,
                    label,
                    p.phase,
                    p.wall_ns,
                    p.max_elapsed_ns,
                    p.records_changed,
                    p.bytes,
                    p.max_copy_ns,
                )
            )
        rows.append((k, label, "(total)", total, None, None, None, None))
    return rows


def fmt_ms(ns):
    return "" if ns is None else f"{ns / 1e6:9.3f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", default="10,100,1000", help="allocation counts, comma separated")
    ap.add_argument(
        "--size",
        type=arg_bytes,
        default=None,
        help="bytes per allocation, a multiple of the granularity (default: 65536 on fakecuda, "
        "the driver's minimum granularity on a GPU: 2 MiB on an H200)",
    )
    ap.add_argument(
        "--granularity",
        type=arg_bytes,
        default=64 << 10,
        help="FAKECUDA_GRANULARITY (fakecuda only)",
    )
    ap.add_argument("--driver", choices=("fake", "real"), default="fake")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    args = ap.parse_args(argv)
    if args.size is None:
        args.size = 64 << 10 if args.driver == "fake" else driver_granularity()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # K exported FDs per process
    exe = build_cuipair(args.driver)
    ks = [int(x) for x in args.k.split(",") if x]

    gran = f"{args.granularity} B" if args.driver == "fake" else "the driver's"
    print(
        f"driver={args.driver} size={args.size} B per allocation (a multiple of the "
        f"granularity: {gran}), two processes (creator + importer)"
    )
    head = (
        f"{'K':>5} {'seq':<8} {'phase':<17} {'wall ms':>9} {'shim ms':>9} {'changed':>7} "
        f"{'carrier B':>11} {'copy ms':>9} {'GB/s':>7} {'memcpy GB/s':>11} {'ratio':>6}"
    )
    print(head)
    print("-" * len(head))
    for k in ks:
        rows = run_one(exe, args.driver, k, args.size, args.granularity, args.timeout)
        for k_, label, phase, wall, elapsed, changed, nbytes, copy in rows:
            rate = base = ratio = ""
            if nbytes and copy:
                r = nbytes / copy  # bytes/ns == GB/s
                b = nbytes / memcpy_ns(nbytes)
                rate, base, ratio = f"{r:7.2f}", f"{b:11.2f}", f"{r / b:6.2f}"
            print(
                f"{k_:>5} {label:<8} {phase:<17} {fmt_ms(wall)} {fmt_ms(elapsed):>9} "
                f"{'' if changed is None else changed:>7} "
                f"{'' if nbytes is None else nbytes:>11} {fmt_ms(copy) if copy else '':>9} "
                f"{rate:>7} {base:>11} {ratio:>6}"
            )
    print(
        "wall: coordinator send -> last reply (the barrier); shim: slowest participant's "
        "elapsed_ns; copy/GB/s: the creator's copy_ns; memcpy: same bytes, this process."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
