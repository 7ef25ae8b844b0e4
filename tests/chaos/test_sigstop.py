"""Chaos kind 4: SIGSTOP of a rank during a checkpoint (the kind of shared/cases/001).

The FFN rank is stopped when the checkpoint reaches a point, seen by the files it writes: the
quiesce request (``quiesce-ROOT.request``), the job's ready answer (``.ready``: capture comes
next), the shared chunk files (SAVE_ALLOCATIONS has begun), CRIU's images directory (``criu
dump`` has begun). The agent runs with short deadlines
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
    # SAVE_ALLOCATIONS has begun: the agent opened its chunk files (the carrier deadline is
    # an hour; a stopped rank must end it after the phase timeout)
    "save": lambda a, snap: any((snap / "chunks").glob("shared-*")),
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
    parked = rc != 0 and quiesce_path(a.ctl, a.pid, "request").exists()
    if parked and out.get("error", {}).get("outcome") == "rollback_failed":
        # the rank stopped after the quiescence check locked it (LeftLocked): the agent said
        # to continue it (done above) and release; that must unlock it and resume the job
        rrc, rel, _ = kit.agent("release", "--pid", str(a.pid), "--control-dir", str(a.ctl))
        assert (rrc, rel.get("outcome")) == (0, "rolled_back"), (out, rel)
    elif parked and kit.stuck_shims(a) == []:
        kit.agent("release", "--pid", str(a.pid), "--control-dir", str(a.ctl))
    # a rank stopped once the job is quiesced makes the quiescence check's lock time out; the
    # lock request the rank finds when it continues is not applied (fakecuda drops a request
    # its controller abandoned, and undoes a lock taken while the controller left)
    kit.judge(f"SIGSTOP rank at {point}", a, snap, rc, out)


def test_rank_stopped_while_locked_stays_parked_until_release(afdwin, tmp_path):
    """The first CUDA pid is stopped right after the quiescence check locked it: its unlock
    gets no answer, so the driver keeps it LOCKED. The refusal must say so (outcome
    rollback_failed, the pid, the way out), leave the workload parked with the .lock that
    `release` unlocks it from, and after SIGCONT + `release` the job finishes exactly."""
    from cuinterpose.agent.mech import signal_at
    from cuinterpose.agent.mech.quiesce import read_json

    a = kit.job(afdwin)
    victim = min(kit.rank_pids(a))  # the census locks cuda_pids in pid order
    snap = tmp_path / "snap"
    env = {
        **ENV,
        signal_at.ENV: "during:quiescence check=SIGHUP",
        "CHAOS_KILL_PID": str(victim),
        "CHAOS_SIGNAL": "SIGSTOP",
    }
    try:
        rc, out, err = kit.checkpoint(a, snap, *SHORT, env=env, hook=True)
    finally:
        os.kill(victim, signal.SIGCONT)
    assert f"agent_hook: sent SIGSTOP to pid {victim}" in err
    e = out["error"]
    assert (rc, e["phase"], e["pid"], e["outcome"]) == (
        5,
        "quiescence check",
        victim,
        "rollback_failed",
    ), out
    assert "cuCheckpointProcessUnlock: CUDA_ERROR_TIMEOUT" in e["reason"], e
    assert f"still holds pid(s) {victim} LOCKED" in e["reason"], e
    assert f"`cuinterpose-agent release --pid {a.pid}`" in e["reason"], e
    assert not (snap / "manifest.json").exists()
    # parked: the request stands unanswered, the lock has no owner and names what to unlock
    assert quiesce_path(a.ctl, a.pid, "request").exists()
    assert not quiesce_path(a.ctl, a.pid, "resume").exists()
    lk = read_json(quiesce_path(a.ctl, a.pid, "lock"))
    assert (lk["pid"], lk["torn_down"], lk["rollback_failed"]) == (None, False, True), lk
    assert lk["cuda_pids"] == sorted(kit.rank_pids(a)), lk

    rc, rel, _ = kit.agent("release", "--pid", str(a.pid), "--control-dir", str(a.ctl))
    assert (rc, rel.get("outcome")) == (0, "rolled_back"), rel
    other = max(kit.rank_pids(a))
    assert rel["found"]["native"] == {str(victim): "LOCKED", str(other): "RUNNING"}, rel
    assert not quiesce_path(a.ctl, a.pid, "lock").exists()
    assert kit.finish(a) == []
    tally.record("SIGSTOP rank while locked", "rolled_back", kit.lost_bytes(a))
