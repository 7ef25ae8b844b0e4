"""A native-checkpoint controller on cuda.bindings, as cuda-checkpoint would drive it.

usage: controller.py OP... where OP is lock:PID[:TIMEOUT_MS] | checkpoint:PID | restore:PID |
unlock:PID | state:PID | tid:PID. Prints a JSON list, one entry per OP: the CUresult name, and
for state/tid "NAME/<value>". Runs on whatever libcuda.so.1 the loader finds (fakecuda in tests).
"""

import json
import sys

from cuda.bindings import driver


def name(err) -> str:
    return driver.CUresult(err).name


def main(argv):
    (err,) = driver.cuInit(0)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise SystemExit(f"cuInit: {name(err)}")
    out = []
    for op in argv:
        kind, pid, *rest = op.split(":")
        pid = int(pid)
        if kind == "lock":
            args = driver.CUcheckpointLockArgs()
            args.timeoutMs = int(rest[0]) if rest else 0
            out.append(name(driver.cuCheckpointProcessLock(pid, args)[0]))
        elif kind == "checkpoint":
            out.append(name(driver.cuCheckpointProcessCheckpoint(pid, None)[0]))
        elif kind == "restore":
            out.append(name(driver.cuCheckpointProcessRestore(pid, None)[0]))
        elif kind == "unlock":
            out.append(name(driver.cuCheckpointProcessUnlock(pid, None)[0]))
        elif kind == "state":
            err, st = driver.cuCheckpointProcessGetState(pid)
            out.append(f"{name(err)}/{int(st) if st is not None else -1}")
        elif kind == "tid":
            err, tid = driver.cuCheckpointProcessGetRestoreThreadId(pid)
            out.append(f"{name(err)}/{tid if tid is not None else -1}")
        else:
            raise SystemExit(f"unknown op {op}")
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
