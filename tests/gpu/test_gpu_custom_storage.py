"""Native checkpoint to custom storage on the real driver (cuda.h 13.4+: customStorageInfo_out,
cuCheckpointOperationComplete): a process holding 64 MiB of cuMemAlloc memory (half a pattern,
half zero) is locked, checkpointed through agent/mech/native_storage.py into
chunks/gpu-<pid>-<ordinal>.bin, restored from those files and unlocked; its bytes compare equal
(BLAKE2b of the whole buffer) and the stream's checksums equal hashlib's over the file. Skipped,
with the reason printed, without a GPU or on a driver older than 13040."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest

from gpu.conftest import real_driver_env

N = 64 << 20

TARGET = r"""
import hashlib, sys
from cuda.bindings import driver as cu
assert int(cu.cuInit(0)[0]) == 0
err, ctx = cu.cuDevicePrimaryCtxRetain(cu.cuDeviceGet(0)[1])
assert int(err) == 0 and int(cu.cuCtxSetCurrent(ctx)[0]) == 0
n = int(sys.argv[1])
body = bytes((i * 7 + i // 4096) & 0xFF for i in range(65536))
data = (body * (n // 2 // 65536 + 1))[: n // 2] + bytes(n - n // 2)
err, dptr = cu.cuMemAlloc(n)
assert int(err) == 0 and int(cu.cuMemcpyHtoD(dptr, data, n)[0]) == 0
print("up", hashlib.blake2b(data, digest_size=32).hexdigest(), flush=True)
sys.stdin.readline()
buf = bytearray(n)
assert int(cu.cuMemcpyDtoH(buf, dptr, n)[0]) == 0
print(hashlib.blake2b(buf, digest_size=32).hexdigest(), flush=True)
"""

CONTROLLER = r"""
import json, sys
from cuinterpose.agent.mech import gpustore, native, native_storage
from cuinterpose.agent.snapshot.snapdir import SnapshotDir
info = native.load("real")
pid, d = int(sys.argv[1]), sys.argv[2]
out = {"version": info.version}
out["probe"] = native_storage.probe(native.backend().name, info.library, info.version)
native.lock_all([pid], 10000)
native_storage.begin_checkpoint(SnapshotDir(d), gpustore.Options())
native.checkpoint_all([pid])
out["streams"] = native_storage.end_checkpoint()
out["checkpointed"] = native.get_state(pid)
native.restore_all([pid])
out["restored"] = native.get_state(pid)
native.unlock_all([pid])
print(json.dumps(out))
"""


def test_custom_storage_round_trip_on_the_real_driver(real_gpu, tmp_path):
    if real_gpu.get("driver_version", 0) < 13040:
        why = f"driver {real_gpu.get('driver_version')} has no custom storage (needs 13040)"
        print(f"tests/gpu skipped: {why}")
        pytest.skip(why)
    env = real_driver_env()
    t = subprocess.Popen(
        [sys.executable, "-c", TARGET, str(N)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        word, want = t.stdout.readline().split()
        assert word == "up"
        res = subprocess.run(
            [sys.executable, "-c", CONTROLLER, str(t.pid), str(tmp_path)],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert res.returncode == 0, res.stderr
        out = json.loads(res.stdout)
        assert out["probe"][0] is True, out
        assert (out["checkpointed"], out["restored"]) == ("CHECKPOINTED", "LOCKED")
        assert out["streams"], out
        total = 0
        for s in out["streams"]:
            data = (tmp_path / s["file"]).read_bytes()
            assert len(data) == s["bytes"]
            total += s["bytes"]
            cb = 8 << 20
            for i, c in enumerate(s["checksums"]):
                chunk = data[i * cb : (i + 1) * cb]
                assert c == (
                    None if not any(chunk) else hashlib.blake2b(chunk, digest_size=32).hexdigest()
                )
        assert total >= N
        t.stdin.write("\n")
        t.stdin.flush()
        assert t.stdout.readline().strip() == want
    finally:
        t.kill()
        t.wait()
