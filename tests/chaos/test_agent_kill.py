"""Chaos kind 1: SIGKILL of the agent at every step boundary of a checkpoint and of a restore.

``CUINTERPOSE_TEST_SIGNAL_AT=WHEN:STEP`` (agent/mech/signal_at.py) makes the agent SIGKILL
itself before and after every step of ``Checkpoint.STEPS`` and inside each step's blocking call
(``DURING``). Then ``cuinterpose-agent release --pid ROOT --json`` finishes what the dead agent
left, and the run must end in one of the two outcomes (tests/chaos/kit.py): the job completes
with exact evidence, or a complete snapshot exists (the tree is gone). For a restore killed at
each point of ``Restore.STEPS``: whatever it started is killed, the snapshot must still be
intact (manifest and image checksums); ``release`` finishes a restore whose trees CRIU had
brought back (the job finishes exactly), else a restore of it again succeeds and finishes
exactly (issue 23).
"""

from __future__ import annotations

import os
import signal

import kit
import pytest
import tally

from cuinterpose.agent.mech import signal_at
from cuinterpose.agent.run.checkpoint import Checkpoint
from cuinterpose.agent.run.restore import Restore
from cuinterpose.workloads.afdwin import demo


def _points(steps) -> list[str]:
    out = []
    for s in steps:
        out.append(f"before:{s.name}")
        if s.name in signal_at.DURING:
            out.append(f"during:{s.name}")
        out.append(f"after:{s.name}")
    return out


#: the points after the finish step, which kills the dumped tree (no --leave-running)
TREE_KILLED = ("after:finish", "before:resume", "after:resume")
#: killed between the quiescence check's native lock and unlock, or before the capture:
#: `release` must unlock every CUDA process (docs/testing.md "Found")
PARKED_AT = ("during:quiescence check", "after:quiescence check", "before:capture")
CHECKPOINT_POINTS = _points(Checkpoint.STEPS)
RESTORE_POINTS = _points(Restore.STEPS)


@pytest.fixture(autouse=True)
def _private_tmp(private_tmp):
    return private_tmp


@pytest.mark.parametrize("point", CHECKPOINT_POINTS)
def test_agent_sigkill_during_checkpoint(afdwin, tmp_path, point):
    kind = f"agent-SIGKILL checkpoint {point}"
    a = kit.job(afdwin)
    snap = tmp_path / "snap"
    rc, out, _ = kit.checkpoint(a, snap, env={signal_at.ENV: point})
    if rc == 0:
        # the step came after the agent's last signal point (nothing to kill): a snapshot
        assert kit.judge(kind, a, snap, rc, out) == "snapshot"
        return
    assert rc == -signal.SIGKILL, f"{point}: exit {rc}: {out}"
    if point in TREE_KILLED:
        # the finish step killed the dumped tree: the snapshot must be complete
        try:
            a.wait_dumped(kit.DEADLINE_S)
        except Exception:
            tally.record(kind, "hang")
            raise
        problem = kit.snapshot_problem(snap)
        tally.record(kind, "false_success" if problem else "snapshot")
        assert problem == "", f"{point}: the tree is gone and the snapshot is not complete"
        rrc, rel, _ = kit.agent("release", "--pid", str(a.pid), "--control-dir", str(a.ctl))
        assert rrc != 0 and "no pending quiesce request" in rel["error"]["message"], rel
        return
    rrc, rel, _ = kit.agent("release", "--pid", str(a.pid), "--control-dir", str(a.ctl))
    if rrc != 0 and kit.stuck_shims(a) == []:
        # nothing to release (killed before any quiesce request): the job goes on as it was
        assert "error" in rel, rel
    elif rrc != 0:
        tally.record(kind, "hang")
        pytest.fail(f"{point}: release exit {rrc}: {rel.get('error', rel)}")
    if rel.get("snapshot", {}).get("complete"):
        assert kit.snapshot_problem(snap) == "", rel
    if point in PARKED_AT:  # the native lock was (or may have been) taken: release undid it
        assert rrc == 0 and rel.get("outcome") == "rolled_back", rel
        assert set(rel["found"]["native"].values()) <= {"LOCKED", "RUNNING"}, rel
    try:
        problems = kit.finish(a)
    except kit.Hang:
        tally.record(kind, "hang")
        raise
    tally.record(kind, "lost" if problems else "rolled_back", kit.lost_bytes(a))
    assert problems == [], f"{point}: after release {rel}: {problems}"


@pytest.fixture
def snapshot(afdwin, tmp_path):
    """(job, a complete snapshot of it): the job's tree is gone."""
    a = kit.job(afdwin)
    snap = tmp_path / "snap"
    rc, out, _ = kit.checkpoint(a, snap)
    assert kit.judge("agent-SIGKILL restore: the snapshot", a, snap, rc, out) == "snapshot"
    return a, snap


def _kill_restored(a, ranks) -> None:
    for pid in [a.pid, *ranks]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    kit.wait_until(
        lambda: (
            (demo.reap_zombies() or True)
            and not any(os.path.exists(f"/proc/{p}") for p in [a.pid, *ranks])
        ),
        "the restored tree to be gone",
    )


#: restore points after which every tree is back from CRIU: release finishes the restore
RESTORED_AT = [
    p
    for p in RESTORE_POINTS
    if p in ("after:criu restore", "before:resume")
    or p.split(":", 1)[1] in ("native restore", "restore shared")
]


def test_agent_sigkill_during_restore(snapshot, subreaper):
    """Issue 23: the agent SIGKILLed at each point of a restore. ``release --pid ROOT`` then
    finishes the restore when CRIU had brought every tree back (native restore + unlock, the
    shims' restore phases from wherever they are, ``.resume`` restored: the job finishes
    exactly, restores_seen 1), or kills what CRIU restored and says to restore again (the
    snapshot untouched: that restore finishes exactly); before CRIU restore and after the
    resume there is nothing to release."""
    a, snap = snapshot
    ranks = kit.rank_pids(a)
    for point in RESTORE_POINTS:
        kind = f"agent-SIGKILL restore {point}"
        rc, out, _ = kit.agent(
            "restore", "--images-dir", str(snap), "--driver", "fake", env={signal_at.ENV: point}
        )
        if rc == 0:  # after the last point: the restored job runs
            assert kit.finish(a, restored=True) == [], point
            tally.record(kind, "snapshot")
            continue
        assert rc == -signal.SIGKILL, f"{point}: exit {rc}: {out}"
        if point == RESTORED_AT[0]:  # a restore again is refused, naming the way out
            rc, out, _ = kit.agent("restore", "--images-dir", str(snap), "--driver", "fake")
            msg = out["error"]["message"]
            assert rc == 3 and f"`cuinterpose-agent release --pid {a.pid} --control-dir" in msg, out
        rrc, rel, _ = kit.agent("release", "--pid", str(a.pid), "--control-dir", str(a.ctl))
        if point in RESTORED_AT or point == "after:resume":
            if point in RESTORED_AT:
                assert (rrc, rel.get("outcome")) == (0, "restored"), f"{point}: {rel}"
                assert set(rel["found"]["native"].values()) <= {
                    "CHECKPOINTED",
                    "LOCKED",
                    "RUNNING",
                }, rel
            else:  # the restore had finished: nothing left to release
                assert rrc == 3 and "nothing to release" in rel["error"]["message"], rel
            problems = kit.finish(a, restored=True)
            tally.record(kind, "lost" if problems else "snapshot", kit.lost_bytes(a))
            assert problems == [], f"{point}: after release {rel}: {problems}"
            assert not list(a.ctl.glob("*.claim")) and not list(a.ctl.glob("*.lock")), point
            continue
        if rrc == 0:  # CRIU had not brought every tree back: undone, restore again
            assert rel["outcome"] == "restore_undone", f"{point}: {rel}"
            assert rel["restore"] == f"cuinterpose-agent restore --images-dir {snap}", rel
        else:  # before the restore recorded itself: nothing to release
            assert "nothing to release" in rel["error"]["message"], f"{point}: {rel}"
        _kill_restored(a, ranks)
        problem = kit.snapshot_problem(snap)
        if problem:
            tally.record(kind, "lost")
            pytest.fail(f"restore killed {point}: the snapshot is no longer intact: {problem}")
        rc, out, _ = kit.agent("restore", "--images-dir", str(snap), "--driver", "fake")
        assert (rc, out.get("ok")) == (0, True), f"restore again after {point}: {out}"
        problems = kit.finish(a, restored=True)
        tally.record(kind, "lost" if problems else "snapshot", kit.lost_bytes(a))
        assert problems == [], f"restore again after {point}: {problems}"
