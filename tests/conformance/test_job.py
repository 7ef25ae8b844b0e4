"""Job mode (``cuda-checkpoint --launch-job``, r590+; CUDA IPC memory checkpointed from r610 only
under it: NVIDIA/cuda-checkpoint #56, the README's restriction "does not support ... IPC memory"
before): two processes of one job share a cuMemAlloc buffer by legacy CUDA IPC
(``cuIpcGetMemHandle`` / ``cuIpcOpenMemHandle``), and NVIDIA's own ``cuda-checkpoint --toggle``
checkpoints and restores both, with and without the shim: under the shim the IPC adapter is off
in a job (its cached export FD would make the driver refuse and leave the job locked). The real
driver's answer depends on its release (r610+), so on a real driver scripts/gpu_check_probe.py
records it (``job_*`` experiments) and this test runs on fakecuda only."""

from __future__ import annotations

import pathlib

import pytest
from conformance_driver import DRIVER


@pytest.mark.skipif(DRIVER == "real", reason="r610 job mode is recorded by gpu_check_probe.py")
def test_a_job_sharing_ipc_memory_is_checkpointed_by_cuda_checkpoint(
    target, cli, cli_path, shim_mode, tmp_path
):
    err = tmp_path / "exporter.err"
    with open(err, "w") as e:
        a = target(launcher=(cli_path, "--launch-job"), stderr=e)
    env = pathlib.Path(f"/proc/{a.pid}/environ").read_bytes().split(b"\0")
    job_file = next(v for v in env if v.startswith(b"CUDA_CHECKPOINT_JOB_FILE=")).decode()
    job_file = job_file.split("=", 1)[1]
    assert pathlib.Path(job_file).resolve().name.startswith("memfd:cuda-checkpoint-job")
    # a second process of the job (a child would inherit the variable and the memfd)
    b = target(CUDA_CHECKPOINT_JOB_FILE=job_file)
    handle = a.cmd("ipcget")[0]
    assert b.cmd(f"ipcopen {handle}") == ["1"]
    for t in (a, b):
        rc, out, errtext = cli("--toggle", "--pid", t.pid)
        assert (rc, out, errtext) == (0, "", "")
        assert cli("--get-state", "--pid", t.pid)[:2] == (0, "checkpointed\n")
    for t in (a, b):
        assert cli("--toggle", "--pid", t.pid)[:2] == (0, "")
        assert t.cmd("check") == ["1"]
    assert b.cmd("ipcclose") == []
    note = "runs under cuda-checkpoint --launch-job"
    assert (note in err.read_text()) == (shim_mode == "shim")
