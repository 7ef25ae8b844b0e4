"""GPU tests: they run only where a real NVIDIA driver and GPU are present.

Everything else in the suite runs on fakecuda. These tests check what fakecuda cannot prove:
that the shim's lookup-path wrappers recognise the real driver's functions, and that the whole
checkpoint/restore path works on the real ``libcuda.so.1`` with its native checkpoint API
(driver >= 570, CUDA 12.8+). Without a GPU each test is skipped and the reason is printed.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cuinterpose.agent import paths

PROBE = r"""
import json, sys
from cuda.bindings import driver as d
out = {}
err, = d.cuInit(0)
out["cuInit"] = int(err)
if err == d.CUresult.CUDA_SUCCESS:
    err, n = d.cuDeviceGetCount(); out["devices"] = int(n) if err == 0 else 0
    err, v = d.cuDriverGetVersion(); out["driver_version"] = int(v) if err == 0 else 0
    err, st = d.cuCheckpointProcessGetState(__import__("os").getpid())
    out["checkpoint_api"] = int(err)
print(json.dumps(out))
"""


def real_driver_env() -> dict:
    """This process's environment for a child on the real driver (agent/paths.py)."""
    return paths.real_driver_env()


def _probe() -> tuple[bool, str, dict]:
    env = real_driver_env()
    try:
        res = subprocess.run(
            [sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=120
        )
    except subprocess.TimeoutExpired:
        return False, "probing the NVIDIA driver timed out after 120 s", {}
    if res.returncode != 0:
        tail = (res.stderr.strip().splitlines() or ["no output"])[-1]
        return False, f"no NVIDIA driver (libcuda.so.1) usable here: {tail}", {}
    info = json.loads(res.stdout.strip().splitlines()[-1])
    if info.get("cuInit") != 0:
        return False, f"cuInit failed on the real driver (CUresult {info.get('cuInit')})", info
    if not info.get("devices"):
        return False, "the NVIDIA driver reports no GPU", info
    return True, "", info


@pytest.fixture(scope="session")
def real_gpu():
    """Facts about the real driver ({"devices", "driver_version", "checkpoint_api"}); skips
    the test, printing why, when there is no usable GPU."""
    ok, why, info = _probe()
    if not ok:
        print(f"tests/gpu skipped: {why}")
        pytest.skip(why)
    return info


@pytest.fixture
def real_env(tmp_path, shim_path):
    """A child's environment on the real driver, under the shim, with a private control dir."""
    ctl = tmp_path / "ctl"
    ctl.mkdir()
    env = real_driver_env()
    env["LD_PRELOAD"] = str(shim_path)
    env["CUINTERPOSE_CONTROL_DIR"] = str(ctl)
    env["PYTHONUNBUFFERED"] = "1"
    return env
