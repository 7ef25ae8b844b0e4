"""Chaos kind 4: SIGSTOP of a rank during a checkpoint (the kind of shared/cases/001).

The FFN rank is stopped when the checkpoint reaches a point, seen by the files it writes: the
quiesce request (``quiesce-ROOT.request``), the job's ready answer (``.ready``: capture comes
next), CRIU's images directory (``criu dump`` has begun). The agent runs with short deadlines
(2 s: these must fire, they are not timing assertions), so it must end within its deadline
with an error that names the phase, or with a complete snapshot; it never hangs
(``kit.DEADLINE_S``). Then the rank gets SIGCONT (``release`` if the agent left the job
parked) and the job must finish with exact evidence.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading

import kit
import pytest
import tally

from cuinterpose.coordinator.contract import quiesce_path

SHORT = ("--quiesce-timeout-ms", "2000", "--lock-timeout-ms", "2000", "--phase-timeout-s", "2")
ENV = {"CUINTERPOSE_DRIVER_CALL_TIMEOUT_S": "2", "FAKECUDA_CONTROLLER_TIMEOUT_MS": "2000"}


@pytest.fixture(autouse=True)
def _private_tmp(private_tmp):
    return private_tmp


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


POINTS = {
    "request": lambda a, snap: quiesce_path(a.ctl, a.pid, "request").exists(),
    "ready": lambda a, snap: quiesce_path(a.ctl, a.pid, "ready").exists(),
    "criu dump": lambda a, snap: (snap / "criu" / str(a.pid)).exists(),
}


@pytest.mark.parametrize("point", list(POINTS))
def test_sigstop_of_a_rank_during_a_checkpoint(afdwin, tmp_path, point):
    a = kit.job(afdwin)
    rank = kit.rank_pids(a)[1]
    snap = tmp_path / "snap"
    result: dict = {}
    sent = False

    def run():
        try:
            result["r"] = kit.checkpoint(a, snap, *SHORT, env=ENV)
        except kit.Hang as e:
            result["r"] = e

    t = threading.Thread(target=run)
    t.start()
    try:
        stopped = kit.wait_until(lambda: POINTS[point](a, snap) or "r" in result, point)
        if stopped is True and "r" not in result:
            os.kill(rank, signal.SIGSTOP)
            sent = True
        t.join(kit.DEADLINE_S)
        assert not t.is_alive(), f"checkpoint still running {kit.DEADLINE_S:g} s after SIGSTOP"
    finally:
        if sent or _state(rank) in ("T", "t"):  # a stop sent may not show T yet
            with contextlib.suppress(ProcessLookupError):
                os.kill(rank, signal.SIGCONT)
    if isinstance(result["r"], kit.Hang):
        tally.record(f"SIGSTOP rank at {point}", "hang")
        raise result["r"]
    rc, out, _ = result["r"]
    if rc != 0 and kit.stuck_shims(a) == [] and quiesce_path(a.ctl, a.pid, "request").exists():
        kit.agent("release", "--pid", str(a.pid), "--control-dir", str(a.ctl))
    # a rank stopped once the job is quiesced makes the quiescence check's lock time out; the
    # lock request the rank finds when it continues is not applied (fakecuda drops a request
    # its controller abandoned, and undoes a lock taken while the controller left)
    kit.judge(f"SIGSTOP rank at {point}", a, snap, rc, out)
