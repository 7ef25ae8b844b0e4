"""cuda.bindings (cuda-python 13.1) on fakecuda: the resolver path real Python clients take."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
from fakecuda_helpers import read_log

HERE = pathlib.Path(__file__).resolve().parent


@pytest.mark.parametrize("ptds", [False, True])
def test_bindings_smoke(fake_env, ptds):
    env = dict(fake_env, FAKECUDA_DEVICE_COUNT="2")
    env.pop("FAKECUDA_GRANULARITY", None)
    if ptds:
        env["CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM"] = "1"
    res = subprocess.run(
        [sys.executable, str(HERE / "bindings_smoke.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0 and "bindings smoke ok" in res.stdout, res.stdout + res.stderr
    lines = [l.split(" ", 2)[2] for l in read_log(env)]
    lookups = [l for l in lines if l.startswith("lookup ")]
    # everything goes through cuGetProcAddress_v2; unknown names come back NULL, cleanly
    assert len(lookups) > 400
    assert all(l.startswith("lookup cuGetProcAddress_v2 ") for l in lookups)
    assert "lookup cuGetProcAddress_v2 cuMemcpyPeer 4000 0 -> NULL" in lines or ptds
    # cuda-bindings 13.5 passes CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM (2) on every
    # lookup when PTDS is on (13.1 passed it only for the stream-ordered names)
    fl = 2 if ptds else 0
    for lookup in [
        "cuMemCreate 10020 {} -> cuMemCreate",
        "cuIpcGetMemHandle 4010 {} -> cuIpcGetMemHandle",
        "cuIpcOpenMemHandle 11000 {} -> cuIpcOpenMemHandle_v2",
        "cuIpcCloseMemHandle 4010 {} -> cuIpcCloseMemHandle",
        "cuPointerGetAttribute 4000 {} -> cuPointerGetAttribute",
        "cuPointerGetAttributes 7000 {} -> cuPointerGetAttributes",
        "cuGetProcAddress 12000 {} -> cuGetProcAddress_v2",
        "cuCheckpointProcessGetState 12080 {} -> cuCheckpointProcessGetState",
    ]:
        assert f"lookup cuGetProcAddress_v2 {lookup.format(fl)}" in lines, lookup
    if ptds:
        assert (
            "lookup cuGetProcAddress_v2 cuStreamWaitValue32 11070 2 -> cuStreamWaitValue32_v2_ptsz"
            in lines
        )
        assert any(l.startswith("cuMemcpyHtoD_v2_ptds(") for l in lines)
        assert any(l.startswith("cuStreamWaitValue32_v2_ptsz(") for l in lines)
    else:
        assert (
            "lookup cuGetProcAddress_v2 cuStreamWaitValue32 11070 0 -> cuStreamWaitValue32_v2"
            in lines
        )
        assert any(l.startswith("cuMemcpyHtoD_v2(") for l in lines)
        assert any(l.startswith("cuStreamWaitValue32_v2(") for l in lines)
