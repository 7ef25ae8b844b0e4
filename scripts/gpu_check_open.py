"""The experiments of scripts/gpu_check_probe.py ``semantics`` for what NVIDIA's documents leave
open about checkpoint controllers and the ``cuda-checkpoint`` utility (issue 25; tests/conformance
checks what they do say). Each returns {key: what the driver did}; gpu_check.py compares the real
driver's answers with fakecuda's (``info_`` keys are reported, not compared).

- :func:`x_controller`: a controller that never called cuInit (NVIDIA's r570 sample, cuda.core)
  asks the state of a CUDA process and of its restore thread's id, locks and checkpoints it, and
  restores it ("requires persistence mode to be enabled or cuInit to have been called": the
  machine's persistence mode is reported); gpuPairs on one GPU naming an unknown new GPU, an
  unknown old GPU, and the identity (each result with the state it left).
- :func:`x_cli`: the utility's exit status and texts for a missing process (``--get-state``,
  ``--get-restore-tid``), for no arguments, for a checkpoint of a running process (the line's
  prefix); with ``--launch-job`` (r590+) the form of CUDA_CHECKPOINT_JOB_FILE, and two processes
  of one job sharing a cuMemAlloc buffer by CUDA IPC toggled by the utility (r610+ carries it).
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

from cuda.bindings import driver as cu


def call(fn, *args):
    out = fn(*args)
    if out[0] != cu.CUresult.CUDA_SUCCESS:
        raise SystemExit(f"gpu_check_open: {fn.__name__} failed: {out[0].name}")
    return out[1] if len(out) == 2 else out[1:]


def mapped_libcuda() -> str:
    from gpu_check_probe import mapped_libcuda as mapped

    return mapped()


TARGET = r"""
import ctypes, sys
from cuda.bindings import driver as cu
cu.cuInit(0)
err, dev = cu.cuDeviceGet(0)
err, ctx = cu.cuDevicePrimaryCtxRetain(dev)
cu.cuCtxSetCurrent(ctx)
err, buf = cu.cuMemAlloc(1 << 20)
print("up", flush=True)
for line in sys.stdin:
    w = line.split()
    if w[0] == "ipcget":
        err, h = cu.cuIpcGetMemHandle(buf)
        print(err.name, ctypes.string_at(h.getPtr(), 64).hex() if err == 0 else "", flush=True)
    elif w[0] == "ipcopen":
        h = cu.CUipcMemHandle()
        ctypes.memmove(h.getPtr(), bytes.fromhex(w[1]), 64)
        err, p = cu.cuIpcOpenMemHandle(h, cu.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
        print(err.name, flush=True)
"""
CONTROLLER = r"""
import json, sys
from cuda.bindings import driver as cu
out = []
for op in sys.argv[1:]:
    kind, pid = op.split(":")
    pid = int(pid)
    if kind == "state":
        err, st = cu.cuCheckpointProcessGetState(pid)
        out.append(f"{err.name}/{int(st) if err == 0 else -1}")
    elif kind == "tid":
        err, tid = cu.cuCheckpointProcessGetRestoreThreadId(pid)
        out.append(err.name if err else int(tid))
    else:
        fn = {"lock": cu.cuCheckpointProcessLock, "checkpoint": cu.cuCheckpointProcessCheckpoint,
              "restore": cu.cuCheckpointProcessRestore, "unlock": cu.cuCheckpointProcessUnlock}[kind]
        out.append(fn(pid, None)[0].name)
print(json.dumps(out))
"""


def start_target(env=None, argv=()):
    p = subprocess.Popen(
        [*argv, sys.executable, "-c", TARGET],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert p.stdout.readline().split() == ["up"]
    return p


def ask(p, line: str) -> list[str]:
    p.stdin.write(line + "\n")
    p.stdin.flush()
    return p.stdout.readline().split()


def uninit_controller(*ops: str) -> list:
    """``ops`` from a fresh process that never calls cuInit (NVIDIA's r570 sample, cuda.core)."""
    res = subprocess.run(
        [sys.executable, "-c", CONTROLLER, *ops], capture_output=True, text=True, timeout=120
    )
    return json.loads(res.stdout) if res.returncode == 0 else [f"exit {res.returncode}"]


def cli_path() -> str:
    import shutil

    from cuinterpose.agent.mech import native_cli

    fake = "fakecuda" in mapped_libcuda()
    return (native_cli.fake_cli() if fake else shutil.which("cuda-checkpoint")) or ""


def cli(*args, env=None) -> dict:
    res = subprocess.run(
        [cli_path(), *map(str, args)], capture_output=True, text=True, env=env, timeout=120
    )
    return {"status": res.returncode, "info_out": res.stdout[-200:], "info_err": res.stderr[-300:]}


def x_controller() -> dict:
    """A controller that never called cuInit; a thread id for its process; gpuPairs on one GPU."""
    out = {}
    t = start_target()
    try:
        p = t.pid
        tid = uninit_controller(f"tid:{p}")[0]
        out["uninit_state_tid_lock_checkpoint"] = uninit_controller(
            f"state:{p}", f"state:{tid}", f"lock:{p}", f"checkpoint:{p}", f"state:{p}"
        )
        # "restore requires persistence mode to be enabled or cuInit to have been called"
        out["uninit_restore_then_unlock"] = uninit_controller(
            f"restore:{p}", f"state:{p}", f"unlock:{p}"
        )
        out["info_persistence_mode"] = (
            subprocess.run(
                ["nvidia-smi", "--query-gpu=persistence_mode", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=15,
            ).stdout.strip()
            if cli_path() and "fakecuda" not in mapped_libcuda()
            else "fakecuda"
        )
        if cu.cuCheckpointProcessGetState(p)[1] != cu.CUprocessState.CU_PROCESS_STATE_RUNNING:
            cu.cuCheckpointProcessRestore(p, None)
            cu.cuCheckpointProcessUnlock(p, None)
        # gpuPairs: the identity of every GPU, then with an unknown new or old GPU in place of
        # GPU 0's, then (two GPUs or more) GPU 0 alone: a map missing GPUs of the node
        own = [
            bytes(call(cu.cuDeviceGetUuid, call(cu.cuDeviceGet, i)).bytes)
            for i in range(call(cu.cuDeviceGetCount))
        ]
        bogus = own[0][:-1] + bytes([own[0][-1] ^ 0xFF])
        cu.cuCheckpointProcessLock(p, None)
        cu.cuCheckpointProcessCheckpoint(p, None)
        maps = {
            "new_unknown": [(own[0], bogus)] + [(u, u) for u in own[1:]],
            "old_unknown": [(bogus, own[0])] + [(u, u) for u in own[1:]],
        }
        if len(own) > 1:
            maps["partial"] = [(own[0], own[0])]
        maps["identity"] = [(u, u) for u in own]
        for label, pairs in maps.items():
            arr = []
            for old, new in pairs:
                pair = cu.CUcheckpointGpuPair()
                ctypes.memmove(pair.getPtr(), old + new, 32)
                arr.append(pair)
            args = cu.CUcheckpointRestoreArgs()
            args.gpuPairs = arr
            args.gpuPairsCount = len(arr)
            out[f"pairs_{label}"] = [
                cu.cuCheckpointProcessRestore(p, args)[0].name,
                cu.CUprocessState(cu.cuCheckpointProcessGetState(p)[1]).name,
            ]
        cu.cuCheckpointProcessUnlock(p, None)
    finally:
        t.kill()
        t.wait()
    return out


def x_cli() -> dict:
    """The utility's texts and statuses the documents do not give (only compared where both have
    the utility and the flag)."""
    if not cli_path():
        return {"cli_absent": True}
    out = {}
    helptext = (
        cli("--help")["info_out"]
        + subprocess.run([cli_path(), "--help"], capture_output=True, text=True, timeout=60).stdout
    )
    out["info_cli_flags"] = [f for f in ("-d", "--launch-job", "-j") if f in helptext]
    none = int(open("/proc/sys/kernel/pid_max").read()) + 1
    out["cli_get_state_no_process"] = cli("--get-state", "--pid", none)
    out["cli_get_tid_no_process"] = cli("--get-restore-tid", "--pid", none)
    out["cli_no_arguments"] = cli()
    t = start_target()
    try:
        r = cli("--action", "checkpoint", "--pid", t.pid)
        r["prefix"] = r["info_err"].split(":")[0].replace(str(t.pid), "PID")
        out["cli_checkpoint_running"] = r
    finally:
        t.kill()
        t.wait()
    if "--launch-job" in helptext:  # r590+: the job file's form, and CUDA IPC in a job (r610+)
        j = cli(
            "--launch-job",
            "sh",
            "-c",
            'echo "$$ $CUDA_CHECKPOINT_JOB_FILE"; readlink "$CUDA_CHECKPOINT_JOB_FILE"',
        )
        words = j["info_out"].split()
        out["job_file"] = {
            "proc_fd_of_program": len(words) >= 3 and words[1].startswith(f"/proc/{words[0]}/fd/"),
            "memfd": len(words) >= 3 and words[2].startswith("/memfd:"),
            "info_seen": j["info_out"],
        }
        out.update(x_job_ipc())
    return out


def x_job_ipc() -> dict:
    a = start_target(argv=(cli_path(), "--launch-job"))
    jf = [
        v
        for v in open(f"/proc/{a.pid}/environ", "rb").read().split(b"\0")
        if v.startswith(b"CUDA_CHECKPOINT_JOB_FILE=")
    ]
    env = (
        dict(os.environ, CUDA_CHECKPOINT_JOB_FILE=jf[0].split(b"=", 1)[1].decode()) if jf else None
    )
    b = start_target(env=env)
    try:
        h = ask(a, "ipcget")
        opened = ask(b, f"ipcopen {h[1]}") if len(h) == 2 else h
        steps = [cli("--toggle", "--pid", x.pid)["status"] for x in (a, b)]
        steps += [cli("--get-state", "--pid", x.pid)["info_out"].strip() for x in (a, b)]
        steps += [cli("--toggle", "--pid", x.pid)["status"] for x in (a, b)]
        return {"job_ipc_open": opened[:1], "job_ipc_toggle_state_toggle": steps}
    finally:
        for x in (a, b):
            x.kill()
            x.wait()
