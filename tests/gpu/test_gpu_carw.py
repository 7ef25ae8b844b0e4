"""carw on a real GPU: the same workload, unchanged, on the real ``libcuda.so.1``.

Without the shim every share must be exact (what fakecuda models is what the driver does);
under the shim, ``ipc`` with 2 ranks is checkpointed at a hold with the driver's native
checkpoint and CRIU, killed, restored and finished exact. Without a usable GPU (or, for the
cut, CRIU and the checkpoint API) each test is skipped and the reason printed.
"""

from __future__ import annotations

import pathlib
import signal
import sys

import pytest

from cuinterpose.workloads.afdwin import demo

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "carw"))  # carw_kit
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # tests/: carw, gpu
from carw.conftest import carw  # noqa: E402,F401 (the fixture)
from carw_kit import check_finished  # noqa: E402

from gpu.conftest import _probe  # noqa: E402


@pytest.fixture(scope="module")
def gpu_info():
    ok, why, info = _probe()
    if not ok:
        print(f"tests/gpu carw tests skipped: {why}")
        pytest.skip(why)
    return info


@pytest.mark.parametrize("share", ["ipc", "pidfd", "host"])
def test_real_gpu_all_reduce_exact(carw, gpu_info, share):  # noqa: F811
    run = carw(ranks=2, steps=40, shim=False, share=share, driver="real")
    assert run.wait_exit() == 0, run.stderr_tail()
    check_finished(run, restores=0)


def test_real_gpu_ipc_checkpoint_kill_restore_finish(carw, gpu_info, criu_ok, tmp_path):  # noqa: F811
    if gpu_info.get("checkpoint_api") != 0:
        why = f"the driver ({gpu_info.get('driver_version')}) has no usable cuCheckpointProcess*"
        print(f"tests/gpu carw tests skipped: {why}")
        pytest.skip(why)
    run = carw(ranks=2, steps=40, hold_at=(12,), driver="real")
    run.wait_hold(12)
    pids = run.rank_pids()
    rc, cp = run.checkpoint(tmp_path / "snap")
    assert rc == 0 and cp["ok"], cp
    assert run.wait_dumped() == -signal.SIGKILL
    rc, rs = demo.run_agent("restore", "--images-dir", str(tmp_path / "snap"), "--driver", "real")
    assert rc == 0 and rs["ok"], rs
    assert rs["cuda_pids"] == pids
    assert run.wait_exit() in (0, None), run.stderr_tail()
    check_finished(run, restores=1)
