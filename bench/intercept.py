#!/usr/bin/env python3
"""Per-call cost of the shim's hot path: cuMemMap, cuMemSetAccess, cuMemRetainAllocationHandle,
cuMemRelease (of the retained handle) and cuMemUnmap, with N live mappings.

A small C driver (compiled here against the wheel's cuda.h, linked to fakecuda's libcuda.so.1)
first maps a background allocation N times (with access; always through the normal path, so
under the shim these are N tracked mappings), then creates the measured allocation, reserves N
granules and, per round, maps the allocation N times, sets access on each mapping, retains by
an address inside each mapping, releases each retained handle and unmaps each mapping; every
loop is timed as a whole and divided by N. Per N it runs, in the same Python run against the
same fakecuda:

  base       the driver program without any preload (the baseline)
  tracked    under the shim, the allocation created through the shim (a virtual handle)
  untracked  under the shim, the allocation created through a pointer that bypasses the shim
             (glibc's dlsym through dlvsym), so every call carries a driver handle or an
             untracked range (the N tracked background mappings still exist)

and prints per-call ns (the fastest round: the machine's noise only ever adds time) and the
ratio against base. A retain/release of a tracked mapping collapses onto the virtual handle the
shim holds and does not reach the driver, so its ratio may be below 1. No thresholds: this prints, it does not judge.

    .venv/bin/python bench/intercept.py [--n 10,100,1000,10000] [--calls 20000]
                                        [--shim LABEL=PATH ...] [--granularity 65536]
                                        [--driver fake|real]

--shim may be repeated to compare builds in one run (e.g. before=/tmp/old.so after=<installed>).

Then the IPC adapter (docs/shim.md section 10, "IPC adapter"): a second C program times loops of
cuMemAlloc_v2 and cuMemFree_v2 (K buffers of S bytes per round, K = min(--alloc-count,
256 MiB / S)) in three configurations, measured in the same run:

  base       no preload (the driver's cuMemAlloc)
  vmm        no preload, the program itself making the driver calls the adapter makes (POSIX
             cuMemCreate of the size rounded up to the granularity, reserve, map, access;
             unmap, free the range, release): the adapter's floor on this driver
  adapter    under the shim with CUINTERPOSE_IPC_ADAPTER unset (default: every cuMemAlloc is
             backed by a POSIX-exportable cuMemCreate + reservation + mapping + access)
  off        under the shim with CUINTERPOSE_IPC_ADAPTER=off (cuMemAlloc passes through)

and prints per-call ns (fastest round) and the ratios adapter/base, adapter/vmm, off/base.

    .venv/bin/python bench/intercept.py --n 10 --alloc-sizes 4096,1048576,33554432 [--alloc-count 64]

--alloc-sizes "" skips it; --n "" skips the VMM table.

Then IPC events (docs/shim.md "IPC events"): a third C program forks (before cuInit) a creator
and an opener. Per round the creator creates K events with PyTorch's flags (INTERPROCESS |
DISABLE_TIMING | BLOCKING_SYNC), records each on a stream, takes each one's IPC handle and sends
the K handles over a pipe; the opener opens each, makes its stream wait on it and destroys it;
the creator then destroys its K. Per event: ns of each step (fastest round), without the shim
(base) and under it (the events virtual, each handle fetched from the creator's control socket
on open), and the ratio.

    .venv/bin/python bench/intercept.py --n "" --alloc-sizes "" --events 256

--events 0 skips it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

from cuda_include_dir import cuda_include_dir  # noqa: E402

from cuinterpose.agent import paths  # noqa: E402

OPS = ("map", "access", "retain", "release", "unmap")

DRIVER_C = r"""
#define _GNU_SOURCE
#include <cuda.h>
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define CU(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { \
    fprintf(stderr, "%s = %d\n", #x, (int)r_); exit(1); } } while (0)
static unsigned long long now(void) {
  struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t);
  return (unsigned long long)t.tv_sec * 1000000000ull + (unsigned long long)t.tv_nsec;
}
typedef CUresult (*create_fn)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);

int main(int argc, char **argv) {
  size_t n = strtoull(argv[1], NULL, 0), rounds = strtoull(argv[2], NULL, 0);
  int untracked = argc > 3 && !strcmp(argv[3], "untracked");
  CUdevice dev; CUcontext ctx;
  CU(cuInit(0)); CU(cuDeviceGet(&dev, 0)); CU(cuDevicePrimaryCtxRetain(&ctx, dev)); CU(cuCtxSetCurrent(ctx));
  CUmemAllocationProp p; memset(&p, 0, sizeof p);
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED; p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  size_t g; CU(cuMemGetAllocationGranularity(&g, &p, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  create_fn create = cuMemCreate;
  if (untracked) {   /* glibc's own dlsym (dlvsym is a documented bypass of the shim's dlsym) */
    typedef void *(*dlsym_fn)(void *, const char *);
    dlsym_fn libc_dlsym = (dlsym_fn)dlvsym(RTLD_DEFAULT, "dlsym", "GLIBC_2.34");
    if (!libc_dlsym) libc_dlsym = (dlsym_fn)dlvsym(RTLD_DEFAULT, "dlsym", "GLIBC_2.2.5");
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    create = lib && libc_dlsym ? (create_fn)libc_dlsym(lib, "cuMemCreate") : NULL;
    if (!create) { fprintf(stderr, "no bypass for cuMemCreate\n"); return 1; }
  }
  CUmemAccessDesc d; memset(&d, 0, sizeof d);
  d.location = p.location; d.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  /* background: N more mappings of another allocation, always through the normal path */
  CUmemGenericAllocationHandle bg;
  CUdeviceptr bgva;
  CU(cuMemCreate(&bg, g, &p, 0));
  CU(cuMemAddressReserve(&bgva, n * g, 0, 0, 0));
  for (size_t i = 0; i < n; i++) {
    CU(cuMemMap(bgva + i * g, g, 0, bg, 0));
    CU(cuMemSetAccess(bgva + i * g, g, &d, 1));
  }
  CUmemGenericAllocationHandle h;
  CU(create(&h, g, &p, 0));
  CUdeviceptr base;
  CU(cuMemAddressReserve(&base, n * g, 0, 0, 0));
  CUmemGenericAllocationHandle *held = malloc(n * sizeof *held);
  for (size_t r = 0; r < rounds; r++) {
    unsigned long long t[6];
    t[0] = now();
    for (size_t i = 0; i < n; i++) CU(cuMemMap(base + i * g, g, 0, h, 0));
    t[1] = now();
    for (size_t i = 0; i < n; i++) CU(cuMemSetAccess(base + i * g, g, &d, 1));
    t[2] = now();
    for (size_t i = 0; i < n; i++) CU(cuMemRetainAllocationHandle(&held[i], (void *)(base + i * g + g / 2)));
    t[3] = now();
    for (size_t i = 0; i < n; i++) CU(cuMemRelease(held[i]));
    t[4] = now();
    for (size_t i = 0; i < n; i++) CU(cuMemUnmap(base + i * g, g));
    t[5] = now();
    printf("%llu %llu %llu %llu %llu\n", t[1] - t[0], t[2] - t[1], t[3] - t[2], t[4] - t[3], t[5] - t[4]);
  }
  CU(cuMemRelease(h));
  CU(cuMemAddressFree(base, n * g));
  for (size_t i = 0; i < n; i++) CU(cuMemUnmap(bgva + i * g, g));
  CU(cuMemRelease(bg));
  CU(cuMemAddressFree(bgva, n * g));
  free(held);
  return 0;
}
"""


ALLOC_C = r"""
#define _GNU_SOURCE
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define CU(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { \
    fprintf(stderr, "%s = %d\n", #x, (int)r_); exit(1); } } while (0)
static unsigned long long now(void) {
  struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t);
  return (unsigned long long)t.tv_sec * 1000000000ull + (unsigned long long)t.tv_nsec;
}

/* argv[4] "vmm": instead of cuMemAlloc/cuMemFree, the driver calls the adapter makes (a POSIX
 * cuMemCreate of the size rounded up to the granularity, reserve, map, access on device 0;
 * unmap, free the range, release), called directly: the adapter's floor. */
int main(int argc, char **argv) {
  size_t k = strtoull(argv[1], NULL, 0), rounds = strtoull(argv[2], NULL, 0);
  size_t size = strtoull(argv[3], NULL, 0);
  int vmm = argc > 4 && argv[4][0] == 'v';
  CUdevice dev; CUcontext ctx;
  CU(cuInit(0)); CU(cuDeviceGet(&dev, 0)); CU(cuDevicePrimaryCtxRetain(&ctx, dev)); CU(cuCtxSetCurrent(ctx));
  CUmemAllocationProp prop; memset(&prop, 0, sizeof prop);
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED; prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  size_t g; CU(cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  size_t rs = (size + g - 1) / g * g;
  CUmemAccessDesc d; memset(&d, 0, sizeof d);
  d.location = prop.location; d.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CUdeviceptr *p = calloc(k, sizeof *p);
  CUmemGenericAllocationHandle *h = calloc(k, sizeof *h);
  for (size_t r = 0; r < rounds; r++) {
    unsigned long long t0 = now();
    for (size_t i = 0; i < k; i++) {
      if (!vmm) { CU(cuMemAlloc(&p[i], size)); continue; }
      CU(cuMemCreate(&h[i], rs, &prop, 0)); CU(cuMemAddressReserve(&p[i], rs, 0, 0, 0));
      CU(cuMemMap(p[i], rs, 0, h[i], 0)); CU(cuMemSetAccess(p[i], rs, &d, 1));
    }
    unsigned long long t1 = now();
    for (size_t i = 0; i < k; i++) {
      if (!vmm) { CU(cuMemFree(p[i])); continue; }
      CU(cuMemUnmap(p[i], rs)); CU(cuMemAddressFree(p[i], rs)); CU(cuMemRelease(h[i]));
    }
    unsigned long long t2 = now();
    printf("%llu %llu\n", t1 - t0, t2 - t1);
  }
  free(h);
  free(p);
  return 0;
}
"""


def build_program(driver: str, name: str, source: str) -> pathlib.Path:
    out_dir = REPO / "build" / "bench"
    out_dir.mkdir(parents=True, exist_ok=True)
    exe = out_dir / f"{name}-{driver}"
    src = out_dir / f"{name}.c"
    link = [f"-L{paths.fakecuda_dir()}"] if driver == "fake" else []
    cmd = [
        "cc",
        "-std=gnu11",
        "-O2",
        f"-I{cuda_include_dir()}",
        "-o",
        str(exe),
        str(src),
        *link,
        "-l:libcuda.so.1",
        "-ldl",
    ]
    key = hashlib.sha256((source + " ".join(cmd)).encode()).hexdigest()
    stamp = out_dir / f"{name}-{driver}.sha256"
    if exe.exists() and stamp.exists() and stamp.read_text() == key:
        return exe
    src.write_text(source)
    subprocess.run(cmd, check=True)
    stamp.write_text(key)
    return exe


EVENT_OPS = ("create", "record", "get", "open", "wait", "odestroy", "destroy")

EVENTS_C = r"""
#define _GNU_SOURCE
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/wait.h>

#define CU(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { \
    fprintf(stderr, "%s = %d\n", #x, (int)r_); exit(1); } } while (0)
static unsigned long long now(void) {
  struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t);
  return (unsigned long long)t.tv_sec * 1000000000ull + (unsigned long long)t.tv_nsec;
}
static void io(int fd, void *p, size_t n, int wr) {
  char *c = p;
  while (n) {
    ssize_t k = wr ? write(fd, c, n) : read(fd, c, n);
    if (k <= 0) { perror("pipe"); exit(1); }
    c += k; n -= (size_t)k;
  }
}
static CUstream init(void) {
  CUdevice d; CUcontext c; CUstream s;
  CU(cuInit(0)); CU(cuDeviceGet(&d, 0)); CU(cuDevicePrimaryCtxRetain(&c, d)); CU(cuCtxSetCurrent(c));
  CU(cuStreamCreate(&s, 0));
  return s;
}
int main(int argc, char **argv) {
  int k = atoi(argv[1]), rounds = atoi(argv[2]);
  int to_opener[2], to_creator[2];
  if (pipe(to_opener) || pipe(to_creator)) return 1;
  CUipcEventHandle *h = calloc((size_t)k, sizeof *h);
  CUevent *ev = calloc((size_t)k, sizeof *ev);
  pid_t child = fork();
  CUstream s = init();
  for (int r = 0; r < rounds; r++) {
    unsigned long long t[7] = {0}, t0;
    if (child == 0) {                       /* the opener */
      io(to_opener[0], h, (size_t)k * sizeof *h, 0);
      t0 = now(); for (int i = 0; i < k; i++) CU(cuIpcOpenEventHandle(&ev[i], h[i])); t[3] = now() - t0;
      t0 = now(); for (int i = 0; i < k; i++) CU(cuStreamWaitEvent(s, ev[i], 0)); t[4] = now() - t0;
      CU(cuStreamSynchronize(s));
      t0 = now(); for (int i = 0; i < k; i++) CU(cuEventDestroy(ev[i])); t[5] = now() - t0;
      io(to_creator[1], t, sizeof t, 1);
      continue;
    }
    unsigned flags = CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING | CU_EVENT_BLOCKING_SYNC;
    t0 = now(); for (int i = 0; i < k; i++) CU(cuEventCreate(&ev[i], flags)); t[0] = now() - t0;
    t0 = now(); for (int i = 0; i < k; i++) CU(cuEventRecord(ev[i], s)); t[1] = now() - t0;
    t0 = now(); for (int i = 0; i < k; i++) CU(cuIpcGetEventHandle(&h[i], ev[i])); t[2] = now() - t0;
    io(to_opener[1], h, (size_t)k * sizeof *h, 1);
    unsigned long long o[7];
    io(to_creator[0], o, sizeof o, 0);
    CU(cuStreamSynchronize(s));
    t0 = now(); for (int i = 0; i < k; i++) CU(cuEventDestroy(ev[i])); t[6] = now() - t0;
    printf("%llu %llu %llu %llu %llu %llu %llu\n", t[0], t[1], t[2], o[3], o[4], o[5], t[6]);
  }
  if (child > 0) { int st; waitpid(child, &st, 0); if (!WIFEXITED(st) || WEXITSTATUS(st)) return 1; }
  return 0;
}
"""


def run_events(exe, k: int, rounds: int, shim: str | None, ctl: str, driver: str) -> dict:
    """Per-event ns of each step of EVENT_OPS (fastest round)."""
    env = {k_: v for k_, v in os.environ.items() if k_ not in ("LD_PRELOAD", "FAKECUDA_LOG")}
    if driver == "fake":
        env["LD_LIBRARY_PATH"] = str(paths.fakecuda_dir())
    env["CUINTERPOSE_CONTROL_DIR"] = ctl
    if shim:
        env["LD_PRELOAD"] = shim
    res = subprocess.run(
        [str(exe), str(k), str(rounds)], env=env, capture_output=True, text=True, timeout=600
    )
    if res.returncode != 0:
        raise SystemExit(f"events driver failed (shim={shim}): {res.stderr.strip()}")
    cols = list(zip(*[[int(x) for x in ln.split()] for ln in res.stdout.splitlines()]))
    return {op: min(c) / k for op, c in zip(EVENT_OPS, cols)}


def events_table(args, shim: str, ctl: str) -> None:
    exe = build_program(args.driver, "intercept-events", EVENTS_C)
    rounds = max(5, args.calls // (10 * args.events))
    base = run_events(exe, args.events, rounds, None, ctl, args.driver)
    got = run_events(exe, args.events, rounds, shim, ctl, args.driver)
    print(f"\nIPC events, {args.events} per round, shim {shim}; per-event ns, fastest round")
    if not args.json:
        print(f"{'step':>9} {'base':>10} {'shim':>10} {'ratio':>6}")
    for op in (*EVENT_OPS, "record+get+open"):
        b = sum(base[x] for x in ("record", "get", "open")) if op == "record+get+open" else base[op]
        g = sum(got[x] for x in ("record", "get", "open")) if op == "record+get+open" else got[op]
        if args.json:
            print(json.dumps({"events_step": op, "base_ns": b, "shim_ns": g, "ratio": g / b}))
        else:
            print(f"{op:>9} {b:>10.0f} {g:>10.0f} {g / b:>6.2f}")


ALLOC_CONFIGS = ("base", "vmm", "adapter", "off")


def run_alloc(exe, k, rounds, size, config, shim, granularity, ctl, driver) -> dict:
    """Per-call ns of cuMemAlloc and cuMemFree (fastest round) in one configuration."""
    env = {
        k_: v
        for k_, v in os.environ.items()
        if k_ not in ("LD_PRELOAD", "FAKECUDA_LOG", "CUINTERPOSE_IPC_ADAPTER")
    }
    if driver == "fake":
        env["LD_LIBRARY_PATH"] = str(paths.fakecuda_dir())
        env["FAKECUDA_GRANULARITY"] = str(granularity)
    env["CUINTERPOSE_CONTROL_DIR"] = ctl
    if config in ("adapter", "off"):
        env["LD_PRELOAD"] = shim
    if config == "off":
        env["CUINTERPOSE_IPC_ADAPTER"] = "off"
    res = subprocess.run(
        [str(exe), str(k), str(rounds), str(size), config],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if res.returncode != 0:
        raise SystemExit(f"alloc driver failed (size {size}, {config}): {res.stderr.strip()}")
    cols = list(zip(*[[int(x) for x in ln.split()] for ln in res.stdout.splitlines()]))
    return {"alloc": min(cols[0]) / k, "free": min(cols[1]) / k}


def alloc_table(args, shim: str, ctl: str) -> None:
    exe = build_program(args.driver, "intercept-alloc", ALLOC_C)
    print(f"\ncuMemAlloc_v2 / cuMemFree_v2, shim {shim}; per-call ns, fastest round")
    if not args.json:
        print(
            f"{'bytes':>10} {'K':>5} {'op':>6} {'base':>10} {'vmm':>10} {'adapter':>10}"
            f" {'off':>10} {'adapter/base':>12} {'adapter/vmm':>11} {'off/base':>9}"
        )
    for size in (int(x) for x in args.alloc_sizes.split(",") if x):
        k = max(1, min(args.alloc_count, (256 << 20) // size))
        rounds = max(5, args.calls // (10 * k))
        got = {
            c: run_alloc(exe, k, rounds, size, c, shim, args.granularity, ctl, args.driver)
            for c in ALLOC_CONFIGS
        }
        for op in ("alloc", "free"):
            b, v, a, o = (got[c][op] for c in ALLOC_CONFIGS)
            if args.json:
                row = {"bytes": size, "k": k, "op": op}
                row.update({f"{c}_ns": got[c][op] for c in ALLOC_CONFIGS})
                row.update(adapter_ratio=a / b, adapter_over_vmm=a / v, off_ratio=o / b)
                print(json.dumps(row))
                continue
            print(
                f"{size:>10} {k:>5} {op:>6} {b:>10.0f} {v:>10.0f} {a:>10.0f} {o:>10.0f}"
                f" {a / b:>12.2f} {a / v:>11.2f} {o / b:>9.2f}"
            )


def build_driver(driver: str) -> pathlib.Path:
    return build_program(driver, "intercept-driver", DRIVER_C)


def run(
    exe, n: int, rounds: int, mode: str, shim: str | None, granularity: int, ctl: str, driver: str
) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "FAKECUDA_LOG")}
    if driver == "fake":
        env["LD_LIBRARY_PATH"] = str(paths.fakecuda_dir())
        env["FAKECUDA_GRANULARITY"] = str(granularity)
    env["CUINTERPOSE_CONTROL_DIR"] = ctl
    if shim:
        env["LD_PRELOAD"] = shim
    res = subprocess.run(
        [str(exe), str(n), str(rounds), mode], env=env, capture_output=True, text=True, timeout=600
    )
    if res.returncode != 0:
        raise SystemExit(f"driver failed (N={n}, {mode}, shim={shim}): {res.stderr.strip()}")
    per_op = list(zip(*[[int(x) for x in ln.split()] for ln in res.stdout.splitlines()]))
    return {op: min(v) / n for op, v in zip(OPS, per_op)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", default="10,100,1000,10000", help="mapping counts, comma separated")
    ap.add_argument(
        "--calls",
        type=int,
        default=20000,
        help="calls per op and configuration (rounds = max(5, calls / N))",
    )
    ap.add_argument(
        "--granularity", type=int, default=64 << 10, help="FAKECUDA_GRANULARITY (fakecuda only)"
    )
    ap.add_argument(
        "--driver",
        choices=("fake", "real"),
        default="fake",
        help="fakecuda, or the libcuda.so.1 the loader finds (a GPU node)",
    )
    ap.add_argument(
        "--shim",
        action="append",
        default=[],
        help="LABEL=PATH of a shim build to measure (repeatable); default: the installed one",
    )
    ap.add_argument(
        "--alloc-sizes",
        default="4096,1048576,33554432",
        help="cuMemAlloc sizes in bytes for the IPC adapter table, comma separated ('' skips)",
    )
    ap.add_argument(
        "--alloc-count", type=int, default=64, help="buffers allocated per round (at most 256 MiB)"
    )
    ap.add_argument(
        "--events",
        type=int,
        default=256,
        help="IPC events per round for the events table (0 skips)",
    )
    ap.add_argument(
        "--json", action="store_true", help="print one JSON object per row instead of a table"
    )
    args = ap.parse_args(argv)
    shims = [tuple(s.split("=", 1)) for s in args.shim] or [("shim", str(paths.shim_path()))]
    exe = build_driver(args.driver)
    where = (
        f"fakecuda {paths.fakecuda_dir()}, granularity {args.granularity}"
        if args.driver == "fake"
        else "the real libcuda.so.1"
    )
    print(f"{where}; per-call ns, fastest round; ratio = configuration / base")
    if not args.json and args.n:
        cols = "".join(
            f" {lab + ' ' + m:>22} {'ratio':>6}"
            for lab, _ in shims
            for m in ("tracked", "untracked")
        )
        print(f"{'N':>6} {'op':>8} {'base':>10}{cols}")
    with tempfile.TemporaryDirectory(prefix="cui-bench-") as ctl:
        for n in (int(x) for x in args.n.split(",") if x):
            rounds = max(5, args.calls // n)
            base = run(exe, n, rounds, "tracked", None, args.granularity, ctl, args.driver)
            got = {
                (lab, m): run(exe, n, rounds, m, path, args.granularity, ctl, args.driver)
                for lab, path in shims
                for m in ("tracked", "untracked")
            }
            for op in OPS:
                if args.json:
                    row = {"n": n, "op": op, "base_ns": base[op]}
                    for (lab, m), v in got.items():
                        row[f"{lab}_{m}_ns"] = v[op]
                        row[f"{lab}_{m}_ratio"] = v[op] / base[op]
                    print(json.dumps(row))
                    continue
                cells = "".join(
                    f" {got[(lab, m)][op]:>22.0f} {got[(lab, m)][op] / base[op]:>6.2f}"
                    for lab, _ in shims
                    for m in ("tracked", "untracked")
                )
                print(f"{n:>6} {op:>8} {base[op]:>10.0f}{cells}")
        if args.alloc_sizes:
            alloc_table(args, shims[-1][1], ctl)
        if args.events:
            events_table(args, shims[-1][1], ctl)
    return 0


if __name__ == "__main__":
    sys.exit(main())
