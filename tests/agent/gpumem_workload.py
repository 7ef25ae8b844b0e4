"""A one-process CUDA job for the GPU-storage tests: ``gpumem_workload.py CTL OUT MIB``.

Under the shim on fakecuda it allocates MIB MiB with ``cuMemAlloc`` (private GPU memory), fills
the first half with a pattern (bytes ``(i * 7 + i // 4096) & 0xFF``) and leaves the second half
zero, writes ``OUT.up`` ({"pid", "bytes", "blake2b"}), then follows the workload contract
(docs/workload-contract.md): on ``quiesce-<pid>.request`` it writes ``.ready``; on ``.resume``
it removes the three files, reads its memory back and writes ``OUT.after`` ({"restored",
"blake2b"}), then waits for the next request. Files are written atomically; stdout/stderr are
the caller's (a log opened for appending)."""

from __future__ import annotations

import hashlib
import os
import sys
import time

from cuda.bindings import driver as cu

from cuinterpose.coordinator import contract


def ok(res):
    err = res[0] if isinstance(res, tuple) else res
    assert int(err) == 0, res
    return res[1] if isinstance(res, tuple) and len(res) > 1 else None


def pattern(n: int) -> bytes:
    half = n // 2
    body = bytes((i * 7 + i // 4096) & 0xFF for i in range(65536))
    return (body * (half // len(body) + 1))[:half] + bytes(n - half)


def main(ctl: str, out: str, mib: int) -> None:
    n = mib << 20
    ok(cu.cuInit(0))
    ctx = ok(cu.cuDevicePrimaryCtxRetain(ok(cu.cuDeviceGet(0))))
    ok(cu.cuCtxSetCurrent(ctx))
    dptr = ok(cu.cuMemAlloc(n))
    data = pattern(n)
    ok(cu.cuMemcpyHtoD(dptr, data, n))
    want = hashlib.blake2b(data, digest_size=32).hexdigest()
    del data
    pid = os.getpid()
    contract.write_atomic(out + ".up", {"pid": pid, "bytes": n, "blake2b": want})
    req = contract.quiesce_path(ctl, pid, "request")
    ready = contract.quiesce_path(ctl, pid, "ready")
    resume = contract.quiesce_path(ctl, pid, "resume")
    while True:
        q = contract.read_json(req)
        if not q:
            time.sleep(0.02)  # the contract's poll (every <= 50 ms)
            continue
        contract.write_atomic(ready, {"id": q["id"], "ranks": [{"pid": pid}]})
        while not (r := contract.read_json(resume)) or r.get("id") != q["id"]:
            time.sleep(0.02)
        for p in (ready, resume, req):  # its own files, .request last (the contract)
            contract.remove_if_id(p, q["id"])
        buf = bytearray(n)
        ok(cu.cuMemcpyDtoH(buf, dptr, n))
        got = hashlib.blake2b(buf, digest_size=32).hexdigest()
        del buf  # the next checkpoint's page images hold only what the job keeps
        contract.write_atomic(out + ".after", {"restored": bool(r.get("restored")), "blake2b": got})


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
