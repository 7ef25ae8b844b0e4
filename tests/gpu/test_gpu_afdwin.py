"""afdwin on the real GPU under the shim, checkpointed mid-stream with the driver's native
checkpoint API and CRIU, killed, restored and finished (the fakecuda e2e test, on hardware).

Needs: a GPU, a driver with cuCheckpointProcess* (R570+), and CRIU 4.x usable here
(`make criu`; on a machine without network carry `.cache/criu`). Skips, printing why, otherwise.
"""

from __future__ import annotations

import signal

import pytest

from cuinterpose.workloads.afdwin import demo

STEPS = 200
HOLD = 20


@pytest.fixture
def real_afdwin(tmp_path, real_gpu, subreaper):
    from cuinterpose.agent.mech import criu

    ok, out = criu.check()
    if not ok:
        why = f"CRIU is not usable on this GPU machine: {out.strip()}"
        print(f"tests/gpu skipped: {why}")
        pytest.skip(why)
    if real_gpu.get("checkpoint_api") != 0:
        why = (
            f"the driver ({real_gpu.get('driver_version')}) has no usable "
            f"cuCheckpointProcessGetState (CUresult {real_gpu.get('checkpoint_api')})"
        )
        print(f"tests/gpu skipped: {why}")
        pytest.skip(why)
    runs = []

    def _start(**kw):
        a = demo.Afdwin(tmp_path / f"run{len(runs)}", driver="real", **kw).start()
        runs.append(a)
        return a

    yield _start
    for a in runs:
        a.kill()


@pytest.mark.parametrize("profile", ["ci", "gpu"])
def test_real_gpu_checkpoint_kill_restore_finish(real_afdwin, tmp_path, profile):
    # The attention ranks hold after step HOLD until the checkpoint's quiesce: the cut lands
    # there however fast the GPU runs (the first H200 run finished all steps before the agent
    # started, docs/gpu-validation.md).
    a = real_afdwin(
        steps=STEPS, step_delay_ms=2, hold_at=(HOLD,), extra_args=("--profile", profile)
    )
    a.wait_hold(1, 300)
    snap = tmp_path / "snap"
    rc, cp = demo.run_agent(
        *a.checkpoint_args(snap),
        timeout_s=600,
    )
    assert rc == 0 and cp["ok"], cp
    assert a.wait_dumped() == -signal.SIGKILL
    before = {
        e["rank"]: (e["base_va"], e["peer_va"])
        for e in a.events()
        if demo.kind(e) == "window" and not e.get("after_restore")
    }
    rc, rs = demo.run_agent("restore", "--images-dir", str(snap), "--driver", "real", timeout_s=600)
    assert rc == 0 and rs["ok"], rs
    assert a.wait_restored_exit(600) in (0, None)
    evs = a.events()
    assert demo.check_run(evs, STEPS) == []
    after = {
        e["rank"]: (e["base_va"], e["peer_va"])
        for e in evs
        if demo.kind(e) == "window" and e.get("after_restore")
    }
    assert after == before
    s = [e for e in evs if demo.kind(e) == "summary"][-1]
    assert (s["ok"], s["lost"], s["duplicated"], s["torn"]) == (True, 0, 0, 0)
