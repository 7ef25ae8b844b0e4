"""tmsh on a real GPU (docs/tmsh.md): torch.multiprocessing's CUDA sharing replayed, unchanged,
on the real ``libcuda.so.1``. Without the shim every variant must be exact (IPC memory and
events, expandable segments, a pickled event: what fakecuda models is what the driver does);
under the shim, ``ipc`` with 2 processes is cut mid-stream with the driver's native checkpoint
and CRIU, killed, restored and finished exact (the shim destroys every IPC event before the
native checkpoint). Without a usable GPU (or, for the cut, CRIU and the checkpoint API) each
test is skipped and the reason printed. Not yet run on hardware."""

from __future__ import annotations

import pathlib
import signal
import sys

import pytest

from cuinterpose.workloads.afdwin import demo

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tmsh"))  # tmsh_kit
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # tests/: tmsh, gpu
from tmsh.conftest import tmsh  # noqa: E402,F401 (the fixture)
from tmsh_kit import check_finished  # noqa: E402

from gpu.conftest import _probe  # noqa: E402


@pytest.fixture(scope="module")
def gpu_info():
    ok, why, info = _probe()
    if not ok:
        print(f"tests/gpu tmsh tests skipped: {why}")
        pytest.skip(why)
    return info


@pytest.mark.parametrize("variant", ["ipc", "expandable", "event"])
def test_real_gpu_tmsh_exact(tmsh, gpu_info, variant):  # noqa: F811
    run = tmsh(procs=2, variant=variant, steps=60, max_events=16, shim=False, driver="real")
    assert run.wait_exit() == 0, run.stderr_tail()
    check_finished(run, restores=0)


def test_real_gpu_tmsh_cut_mid_stream(tmsh, gpu_info, criu_ok, tmp_path):  # noqa: F811
    if gpu_info.get("checkpoint_api") != 0:
        why = f"the driver ({gpu_info.get('driver_version')}) has no usable cuCheckpointProcess*"
        print(f"tests/gpu tmsh tests skipped: {why}")
        pytest.skip(why)
    run = tmsh(procs=2, steps=40, hold_at=12, consumer_hold_at=3, driver="real")
    run.wait_hold()
    rc, cp = run.checkpoint(tmp_path / "snap")
    assert rc == 0 and cp["ok"], cp
    assert run.wait_dumped() == -signal.SIGKILL
    rc, rs = demo.run_agent("restore", "--images-dir", str(tmp_path / "snap"), "--driver", "real")
    assert rc == 0 and rs["ok"], rs
    assert run.wait_exit() in (0, None), run.stderr_tail()
    check_finished(run, restores=1)
