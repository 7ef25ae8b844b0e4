"""CuPy's legacy CUDA IPC under the shim on a real GPU (issue 29, an experiment: recorded, not
asserted): a producer allocates a CuPy array (the runtime's ``cudaMalloc``, which the shim's
adapter turns into VMM memory), fills it with a known sequence and exports
``cupy.cuda.runtime.ipcGetMemHandle``; a consumer process opens the handle with
``ipcOpenMemHandle`` and reads the bytes back. Once without the shim, once under it; each
ends in a row (the bytes compared, or the error) in ``$CUI_TORCHMP_REPORT_DIR``; only the
plain run, the driver's own IPC, is asserted.
Skipped, with the reason printed, without a GPU or CuPy. Not yet run on hardware."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "torchmp"))  # report
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # tests/: gpu
from torchmp_kit import report  # noqa: E402

from gpu.conftest import _probe, real_driver_env  # noqa: E402

N = 1 << 20  # int32 elements: 4 MiB

PRODUCER = r"""
import json, subprocess, sys
import cupy as cp
a = cp.arange(%(n)d, dtype=cp.int32) * 7 + 3
cp.cuda.runtime.deviceSynchronize()
h = cp.cuda.runtime.ipcGetMemHandle(a.data.ptr)
cmd = [sys.executable, "-c", sys.argv[1], bytes(h).hex()]
out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
got = {"consumer_rc": out.returncode, "consumer": out.stdout.strip()[-400:]}
print(json.dumps({**got, "err": out.stderr.strip()[-400:]}))
"""
CONSUMER = r"""
import json, sys
import cupy as cp
h = bytes.fromhex(sys.argv[1])
ptr = cp.cuda.runtime.ipcOpenMemHandle(h)
mem = cp.cuda.UnownedMemory(ptr, %(n)d * 4, None)
b = cp.ndarray((%(n)d,), dtype=cp.int32, memptr=cp.cuda.MemoryPointer(mem, 0))
want = cp.arange(%(n)d, dtype=cp.int32) * 7 + 3
print(json.dumps({"equal": bool((b == want).all()), "first": int(b[1])}))
cp.cuda.runtime.ipcCloseMemHandle(ptr)
"""


@pytest.fixture(scope="module")
def cupy_gpu():
    ok, why, _ = _probe()
    if ok:
        res = subprocess.run([sys.executable, "-c", "import cupy"], capture_output=True, text=True)
        if res.returncode:
            ok, why = (
                False,
                f"CuPy is not importable: {(res.stderr.strip().splitlines() or ['?'])[-1]}",
            )
    if not ok:
        print(f"tests/gpu cupy tests skipped: {why}")
        pytest.skip(why)


@pytest.mark.parametrize("shim", [False, True], ids=["plain", "shim"])
def test_real_gpu_cupy_ipc_experiment(cupy_gpu, real_env, shim):
    env = real_env if shim else real_driver_env()
    res = subprocess.run(
        [sys.executable, "-c", PRODUCER % {"n": N}, CONSUMER % {"n": N}],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    row = {"shim": shim, "rc": res.returncode, "stderr": res.stderr.strip()[-400:]}
    try:
        row.update(json.loads(res.stdout.strip().splitlines()[-1]))
    except (IndexError, ValueError):
        row["stdout"] = res.stdout.strip()[-400:]
    try:
        row["equal"] = json.loads(row.get("consumer", ""))["equal"]
    except (ValueError, KeyError, TypeError):
        row["equal"] = False
    report(f"gpu-cupy-ipc-{'shim' if shim else 'plain'}", row)
    if not shim:  # the driver's own IPC: the baseline the shim's answer is read against
        assert (row["rc"], row.get("consumer_rc")) == (0, 0), row
        assert row["equal"] and json.loads(row["consumer"]) == {"equal": True, "first": 10}, row
