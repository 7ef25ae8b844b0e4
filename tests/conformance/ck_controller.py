"""The controller of the conformance suite: one process that drives another's checkpoint the way
the documented clients do, on whatever ``libcuda.so.1`` the loader finds.

usage: ck_controller.py MODE OP... with MODE ``bindings`` (cuda.bindings, as cuda.core's
``checkpoint.Process`` does: it never calls cuInit) or ``dlsym`` (``dlopen("libcuda.so.1")`` and
the ELF names, as CRIU's driver-API cuda plugin does: cuInit only before a restore). OP:

    init                      cuInit(0) now
    devices                   (bindings; after init) -> [[UUID, name], ...] by ordinal
    state:PID                 cuCheckpointProcessGetState -> "NAME/<state>" ("NAME/-1" on error)
    tid:PID                   cuCheckpointProcessGetRestoreThreadId -> "NAME/<tid>"
    lock:PID[:TIMEOUT_MS]     cuCheckpointProcessLock (timeoutMs, default 0)
    checkpoint:PID | unlock:PID
    restore:PID[:OLD=NEW,...] cuCheckpointProcessRestore, the pairs as gpuPairs (UUIDs GPU-...)

Prints one JSON list: the CUresult name of each OP (with "/value" where it has one).
"""

from __future__ import annotations

import ctypes
import json
import sys


def uuid16(text: str) -> bytes:
    h = text.strip()
    h = (h[4:] if h.upper().startswith("GPU-") else h).replace("-", "")
    return bytes.fromhex(h)


class Bindings:
    """cuda.bindings.driver (cuda-python)."""

    def __init__(self):
        from cuda.bindings import driver

        self.d = driver

    def name(self, err) -> str:
        return self.d.CUresult(err).name

    def run(self, kind: str, pid: int, rest: list[str]) -> str:
        d = self.d
        if kind == "state":
            err, st = d.cuCheckpointProcessGetState(pid)
            return f"{self.name(err)}/{int(st) if err == 0 else -1}"
        if kind == "tid":
            err, tid = d.cuCheckpointProcessGetRestoreThreadId(pid)
            return f"{self.name(err)}/{int(tid) if err == 0 else -1}"
        if kind == "lock":
            args = d.CUcheckpointLockArgs()
            args.timeoutMs = int(rest[0]) if rest else 0
            return self.name(d.cuCheckpointProcessLock(pid, args)[0])
        if kind == "checkpoint":
            return self.name(d.cuCheckpointProcessCheckpoint(pid, None)[0])
        if kind == "unlock":
            return self.name(d.cuCheckpointProcessUnlock(pid, None)[0])
        if kind == "restore":
            args = None
            if rest and rest[0]:
                pairs = []
                for entry in rest[0].split(","):
                    old, new = entry.split("=")
                    p = d.CUcheckpointGpuPair()
                    # CUuuid.bytes is read-only in the bindings: the struct's 32 bytes
                    ctypes.memmove(p.getPtr(), uuid16(old) + uuid16(new), 32)
                    pairs.append(p)
                args = d.CUcheckpointRestoreArgs()
                args.gpuPairs = pairs
                args.gpuPairsCount = len(pairs)
            return self.name(d.cuCheckpointProcessRestore(pid, args)[0])
        raise SystemExit(f"unknown op {kind}")

    def init(self) -> str:
        return self.name(self.d.cuInit(0)[0])

    def devices(self) -> list:
        d, out = self.d, []
        for i in range(d.cuDeviceGetCount()[1]):
            dev = d.cuDeviceGet(i)[1]
            h = bytes(d.cuDeviceGetUuid(dev)[1].bytes).hex()
            name = bytes(d.cuDeviceGetName(256, dev)[1]).split(b"\0")[0].decode()
            out.append([f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}", name])
        return out


class Dlsym:
    """dlopen("libcuda.so.1") and its ELF names through ctypes (CRIU's driver-API plugin)."""

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1", mode=ctypes.RTLD_LOCAL)

    def name(self, r: int) -> str:
        s = ctypes.c_char_p()
        if self.lib.cuGetErrorName(r, ctypes.byref(s)) != 0 or not s.value:
            return f"CUresult {r}"
        return s.value.decode()

    def run(self, kind: str, pid: int, rest: list[str]) -> str:
        lib = self.lib
        if kind in ("state", "tid"):
            v = ctypes.c_int(-1)
            fn = (
                lib.cuCheckpointProcessGetState
                if kind == "state"
                else lib.cuCheckpointProcessGetRestoreThreadId
            )
            r = fn(pid, ctypes.byref(v))
            return f"{self.name(r)}/{v.value if r == 0 else -1}"
        args = (ctypes.c_uint64 * 8)()  # every *Args struct is 64 bytes, zeroed (criu: "= { 0 }")
        if kind == "lock":
            ctypes.c_uint32.from_buffer(args).value = int(rest[0]) if rest else 0
            return self.name(lib.cuCheckpointProcessLock(pid, args))
        fn = {
            "checkpoint": lib.cuCheckpointProcessCheckpoint,
            "restore": lib.cuCheckpointProcessRestore,
            "unlock": lib.cuCheckpointProcessUnlock,
        }.get(kind)
        if fn is None or (kind == "restore" and rest and rest[0]):
            raise SystemExit(f"op {kind} {rest} is not a dlsym op")
        return self.name(fn(pid, args))

    def init(self) -> str:
        return self.name(self.lib.cuInit(0))


def main(argv: list[str]) -> None:
    api = Bindings() if argv[0] == "bindings" else Dlsym()
    out = []
    for op in argv[1:]:
        if op in ("init", "devices"):
            out.append(api.init() if op == "init" else api.devices())
            continue
        kind, pid, *rest = op.split(":", 2)
        out.append(api.run(kind, int(pid), rest))
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
