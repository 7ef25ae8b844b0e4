"""A line-driven process on cuda.bindings for tests/fakecuda/test_devices.py (target or controller).

Reads one command per stdin line, writes one JSON line per command to stdout:
  devices                      -> [{"ordinal", "name", "uuid", "mem"}, ...] (cuDeviceGet*)
  alloc ORD SIZE BYTE          -> {"va"}: primary context of ORD, cuMemAlloc(SIZE), every byte BYTE
  read VA SIZE                 -> {"hex"}: cuMemcpyDtoH of SIZE bytes
  ctxdev                       -> {"dev"}: cuCtxGetDevice of the current context
  restore PID [OLD=NEW ...]    -> {"result"}: cuCheckpointProcessRestore with gpuPairs (UUID
                                  strings "GPU-..."), or NULL args without pairs
  lock PID | checkpoint PID | unlock PID | state PID -> {"result"[, "state"]}
cuInit failing prints {"init": NAME} and exits 0. Runs on whatever libcuda.so.1 the loader finds.
"""

import ctypes
import json
import sys

from cuda.bindings import driver


def name(err) -> str:
    return driver.CUresult(err).name


def uuid_str(b: bytes) -> str:
    h = b.hex()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def uuid_bytes(s: str) -> bytes:
    return bytes.fromhex(s.removeprefix("GPU-").replace("-", ""))


def ok(res):
    if int(res[0]) != 0:
        raise RuntimeError(name(res[0]))
    return res[1] if len(res) == 2 else res[1:]


def devices():
    out = []
    for i in range(ok(driver.cuDeviceGetCount())):
        dev = ok(driver.cuDeviceGet(i))
        nm = ok(driver.cuDeviceGetName(64, dev)).split(b"\0")[0].decode()
        uuid = ok(driver.cuDeviceGetUuid(dev))
        mem = ok(driver.cuDeviceTotalMem(dev))
        out.append({"ordinal": i, "name": nm, "uuid": uuid_str(bytes(uuid.bytes)), "mem": mem})
    return out


def restore(pid: int, pairs: list[str]):
    if not pairs:
        return name(driver.cuCheckpointProcessRestore(pid, None)[0])
    gp = []
    for p in pairs:
        old, new = p.split("=")
        g = driver.CUcheckpointGpuPair()  # CUuuid.bytes is read-only in the bindings
        ctypes.memmove(g.getPtr(), uuid_bytes(old) + uuid_bytes(new), 32)
        gp.append(g)
    args = driver.CUcheckpointRestoreArgs()
    args.gpuPairs = gp
    args.gpuPairsCount = len(gp)
    return name(driver.cuCheckpointProcessRestore(pid, args)[0])


def main():
    (err,) = driver.cuInit(0)
    if int(err) != 0:
        print(json.dumps({"init": name(err)}), flush=True)
        return
    print(json.dumps({"init": "CUDA_SUCCESS"}), flush=True)
    for line in sys.stdin:
        w = line.split()
        if not w:
            continue
        try:
            if w[0] == "devices":
                r = devices()
            elif w[0] == "alloc":
                dev = ok(driver.cuDeviceGet(int(w[1])))
                ctx = ok(driver.cuDevicePrimaryCtxRetain(dev))
                ok((driver.cuCtxSetCurrent(ctx)[0], None))
                va = ok(driver.cuMemAlloc(int(w[2])))
                ok((driver.cuMemsetD8(va, int(w[3]), int(w[2]))[0], None))
                r = {"va": int(va)}
            elif w[0] == "read":
                buf = bytearray(int(w[2]))
                ok((driver.cuMemcpyDtoH(buf, int(w[1]), len(buf))[0], None))
                r = {"hex": buf.hex()}
            elif w[0] == "ctxdev":
                r = {"dev": int(ok(driver.cuCtxGetDevice()))}
            elif w[0] == "restore":
                r = {"result": restore(int(w[1]), w[2:])}
            elif w[0] == "lock":
                r = {"result": name(driver.cuCheckpointProcessLock(int(w[1]), None)[0])}
            elif w[0] == "checkpoint":
                r = {"result": name(driver.cuCheckpointProcessCheckpoint(int(w[1]), None)[0])}
            elif w[0] == "unlock":
                r = {"result": name(driver.cuCheckpointProcessUnlock(int(w[1]), None)[0])}
            elif w[0] == "state":
                err, st = driver.cuCheckpointProcessGetState(int(w[1]))
                r = {"result": name(err), "state": int(st) if st is not None else -1}
            else:
                r = {"error": f"unknown command {w[0]}"}
        except RuntimeError as e:
            r = {"error": str(e)}
        print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
