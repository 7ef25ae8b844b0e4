"""Chaos kind 2: SIGKILL of each rank at every step boundary of a checkpoint.

tests/chaos/agent_hook.py runs the agent with ``CUINTERPOSE_TEST_SIGNAL_AT=WHEN:STEP=SIGHUP``
turned into a SIGKILL of one rank (``CHAOS_KILL_PID``) when the agent reaches the point (after
each step of ``Checkpoint.STEPS``, that is before the next, and during each step of
``signal_at.DURING``); the agent goes on. Outcomes: exit 0 only with a complete snapshot that
holds every process (case 010): it is restored and must finish with exact evidence; or a named
error, the job ends (no hang) and its launcher names the killed rank, and no manifest is left.
"""

from __future__ import annotations

import kit
import pytest
import tally

from cuinterpose.agent.mech import signal_at
from cuinterpose.agent.run.checkpoint import Checkpoint
from cuinterpose.workloads.afdwin import demo

POINTS = [f"after:{s.name}" for s in Checkpoint.STEPS] + [
    f"during:{s.name}" for s in Checkpoint.STEPS if s.name in signal_at.DURING
]


@pytest.fixture(autouse=True)
def _private_tmp(private_tmp):
    return private_tmp


#: the FFN rank at every point; the attention rank inside each blocking call (bounded time)
RANK_POINTS = {1: POINTS, 0: [p for p in POINTS if p.startswith("during:")]}


@pytest.mark.parametrize("rank", (0, 1))
def test_rank_sigkill_at_every_step(afdwin, tmp_path, rank):
    for point in RANK_POINTS[rank]:
        kind = f"rank-SIGKILL rank{rank} {point}"
        a = kit.job(afdwin)
        victim = kit.rank_pids(a)[rank]
        snap = tmp_path / f"snap-{point.replace(':', '-').replace(' ', '-')}"
        env = {signal_at.ENV: f"{point}=SIGHUP", "CHAOS_KILL_PID": str(victim)}
        rc, out, err = kit.checkpoint(a, snap, env=env, hook=True)
        killed = f"agent_hook: sent SIGKILL to pid {victim}" in err
        if rc == 0:
            assert kit.judge(kind, a, snap, rc, out) == "snapshot"
            if killed and point != "after:resume":
                # the snapshot must hold every rank: restored, the job finishes exactly
                kit.restore_and_finish(kind, a, snap)
            continue
        assert killed, f"{point}: exit {rc} without the kill: {out}"
        assert out.get("error", {}).get("phase"), f"{point}: exit {rc}: {out}"
        # issue 23: refused before the teardown, rolled back after it; never rollback_failed
        # (no release could bring the dead rank back: nothing is left parked for one)
        assert (rc, out["error"]["outcome"]) in ((3, "refused"), (4, "rolled_back")), out
        assert not (snap / "manifest.json").exists(), f"{point}: {out}"
        try:
            code = a.proc.wait(timeout=kit.DEADLINE_S)
        except Exception:
            tally.record(kind, "hang")
            raise
        (s,) = [e for e in a.events() if demo.kind(e) == "summary"] or [{}]
        assert code != 0 and any(f"rank {rank}" in p for p in s.get("problems", [])), (code, s)
        # the job is gone: no claim, lock or pending request of it is left behind, and after a
        # rollback (case 010's kind) none of its quiesce files (a refusal's cancelling
        # .resume and the workload's .ready are the quiesce protocol's: docs/workload-contract.md)
        left = sorted(
            f.name
            for f in a.ctl.iterdir()
            if f.name.endswith((".claim", ".lock", ".request"))
            or (rc == 4 and f.name.startswith("quiesce-"))
        )
        assert left == [], f"{point}: exit {rc}: {left}"
        tally.record(kind, "rolled_back")
