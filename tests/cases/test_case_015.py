"""Case 015 (shared/cases/015-two-checkpoints-one-dir): two checkpoints into one images dir
both exited 0, both jobs were lost, and a rollback removed the other run's files.

Kind: two runs claim one directory. A checkpoint claims its images dir for its whole life
(agent/snapshot/dirclaim.py: a linked, flocked ``.cuinterpose-claim``, checked again before each
step that writes there); a second one is refused up front (exit 3, naming the other run's
agent pid and request id) and its job keeps running; a rollback removes only what its own run
wrote; a group leader refuses two members naming one directory. The race itself: two afdwin
jobs, two CLI checkpoints into one directory started together, ``ROUNDS`` times; each round
exactly one exits 0, the other is refused and its job untouched, and every exit-0 snapshot is
restored: each job ends with every message exactly once.
"""

# ruff: noqa: F811 (the `world` fixture, imported, is the argument of the tests)
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "agent"))

from agent_world import ROOT, answer_quiesce, world  # noqa: E402, F401

from cuinterpose.agent.errors import AgentError, CheckpointFailed, SnapshotError  # noqa: E402
from cuinterpose.agent.mech import quiesce  # noqa: E402
from cuinterpose.agent.rpc import group  # noqa: E402
from cuinterpose.agent.run import checkpoint as cp_mod  # noqa: E402
from cuinterpose.agent.run.report import Reporter  # noqa: E402
from cuinterpose.agent.snapshot import pb, snapdir  # noqa: E402
from cuinterpose.workloads.afdwin import demo  # noqa: E402

ROUNDS = 10
STEPS = 300
#: ROUNDS + 1 holds at the end: a job sees at most one quiesce per round, so neither can end
#: before the races do, however fast it runs (case 014); released one by one afterwards
HOLDS = tuple(range(STEPS - ROUNDS, STEPS + 1))


def _cli(args):
    return subprocess.Popen(
        [sys.executable, "-m", "cuinterpose.agent.cli", *args, "--json"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "LD_PRELOAD"},
    )


def _result(p) -> tuple[int, dict]:
    out, err = p.communicate(timeout=300)
    try:
        return p.returncode, json.loads(out)
    except ValueError:
        return p.returncode, {"raw": out + err}


def _tree_of(job) -> list[int]:
    return [job.pid] + sorted(
        {e["pid"] for e in job.events() if demo.kind(e) == "window" and "pid" in e}
    )


def _wait_gone(pids) -> None:
    """Until no pid of a killed tree is left (zombies re-parented to this subreaper reaped),
    so that CRIU can restore them; the deadline only catches a hang."""
    deadline = time.monotonic() + demo.HANG_S
    while any(os.path.exists(f"/proc/{p}") for p in pids):
        assert time.monotonic() < deadline, f"pids {pids} still present"
        demo.reap_zombies()
        time.sleep(0.02)


def _quiesces(job) -> int:
    return sum(1 for e in job.events() if demo.kind(e) == "quiesce_requested")


def test_racing_checkpoints_into_one_dir_one_wins_the_other_job_runs_on(afdwin, tmp_path):
    jobs = [afdwin(steps=STEPS, step_delay_ms=2, hold_at=HOLDS) for _ in range(2)]
    for j in jobs:
        j.wait_hold()  # both ranks called cuInit and the job runs (held until a quiesce)
    wins = [0, 0]
    outcomes = []
    for r in range(ROUNDS):
        snap = tmp_path / f"snap{r}"
        seen = [_quiesces(j) for j in jobs]
        trees = [_tree_of(j) for j in jobs]
        procs = [_cli(j.checkpoint_args(snap)) for j in jobs]  # started together
        res = [_result(p) for p in procs]
        rcs = [rc for rc, _ in res]
        assert sorted(rcs) == [0, 3], res
        w = rcs.index(0)
        lose = 1 - w
        sid = res[w][1]["snapshot_id"]
        err = res[lose][1]["error"]
        assert (err["phase"], err["outcome"]) == ("images dir", "refused"), err
        busy = (
            f"{snap} is being written by another checkpoint: agent pid " in err["reason"]
            and f"(request id {sid}, started at " in err["reason"]
            and err["reason"].endswith(
                "one run at a time writes a snapshot directory: checkpoint refused, nothing "
                "was changed; choose another --images-dir"
            )
        )
        done = err["reason"] == (
            f"{snap} already holds a snapshot (manifest.json); choose a new --images-dir"
        )  # the loser started after the winner had finished
        assert busy or done, err
        outcomes.append("refused while claimed" if busy else "refused: a snapshot")
        # the loser's job was not asked anything and still runs; the winner's tree is gone
        assert _quiesces(jobs[lose]) == seen[lose]
        assert demo.pid_alive(jobs[lose].pid)
        assert sorted(p.name for p in snap.iterdir()) == ["chunks", "criu", "manifest.json"]
        _wait_gone(trees[w])
        rc, rs = demo.run_agent("restore", "--images-dir", str(snap), "--driver", "fake")
        assert rc == 0 and rs["snapshot_id"] == sid, rs
        wins[w] += 1
    print(f"case 015: {ROUNDS} races, wins per job {wins}, losers: {outcomes}")
    for j, won in zip(jobs, wins):
        for k in range(won + 1, len(HOLDS) + 1):  # the holds no quiesce ended
            j.wait_hold(k)
            j.release_hold()
        evs = j.wait_for(lambda ev: any(demo.kind(e) == "summary" for e in ev), 300, "summary")
        assert demo.check_run(evs, STEPS, expect_restore=False) == [], j.explain()
        s = [e for e in evs if demo.kind(e) == "summary"][-1]
        assert (s["restores_seen"], s["va_tables_identical"]) == (won, True)


# -- the claim, without workloads ------------------------------------------------------------


def test_a_claimed_dir_is_refused_by_any_path_to_it_naming_the_run(tmp_path):
    d = tmp_path / "x"
    (tmp_path / "y").mkdir()
    os.symlink(d, tmp_path / "link")
    s1 = snapdir.prepare(d, run_id="r1", group="g1")
    c1 = s1.claim
    assert (s1.path, s1.created, s1.notes) == (d, [d], [])
    for other in (tmp_path / "link", tmp_path / "y" / ".." / "x"):
        with pytest.raises(SnapshotError) as ei:
            snapdir.prepare(other, run_id="r2")
        assert ei.value.phase == "images dir"
        assert ei.value.reason.startswith(
            f"{d} is being written by another checkpoint: agent pid {os.getpid()} on "
        )
        assert "(request id r1, group request g1, started at " in ei.value.reason
    assert os.listdir(d) == [snapdir.CLAIM]
    c1.release()
    assert os.listdir(d) == []
    s2 = snapdir.prepare(tmp_path / "y" / ".." / "link", run_id="r3")
    assert (s2.path, s2.created) == (d, [])  # the canonical path, and nothing created this time
    s2.claim.release()


def test_a_stale_claim_is_taken_over_alone_and_refused_beside_a_dead_runs_files(tmp_path):
    d = tmp_path / "x"
    d.mkdir()
    pid = os.fork()
    if pid == 0:  # a run that claims and dies without releasing (SIGKILL-like: no cleanup)
        snapdir.SnapshotDir(d).take_claim("dead")
        os._exit(0)
    os.waitpid(pid, 0)
    assert snapdir.SnapshotDir(d).claim_holder() is None  # its flock died with it
    (d / "criu").mkdir()
    with pytest.raises(SnapshotError) as ei:
        snapdir.prepare(d, run_id="new")
    assert ei.value.reason.startswith(f"{d} holds what a checkpoint left when its agent died")
    assert sorted(os.listdir(d)) == [snapdir.CLAIM, "criu"]
    (d / "criu").rmdir()
    c = snapdir.prepare(d, run_id="new").claim
    assert json.loads((d / snapdir.CLAIM).read_text())["run_id"] == "new"
    assert snapdir.SnapshotDir(d).claim_holder()["run_id"] == "new"
    c.release()


def test_an_open_dir_is_made_private_and_said_so(tmp_path):
    d = tmp_path / "open"
    d.mkdir()
    os.chmod(d, 0o755)
    s = snapdir.prepare(d)
    s.claim.release()
    notes = s.notes
    assert os.stat(d).st_mode & 0o777 == 0o700
    assert notes == [
        f"images dir {d} had mode 0755: made 0700 (a snapshot holds the memory of the "
        "processes: it is private to the agent's user)"
    ]


def test_a_rollback_whose_claim_was_taken_removes_nothing(world, tmp_path, monkeypatch):
    """The run's criu dump fails after another run replaced its claim (and wrote there): the
    rollback rebuilds the workload but leaves every file in the directory alone."""
    monkeypatch.setattr(quiesce, "request", answer_quiesce(world))
    snap = tmp_path / "snap"
    fake = sys.modules["cuinterpose.agent.mech.criu"]

    def dump(root, d, **kw):
        (snap / snapdir.CLAIM).unlink()  # another run's claim and its images now
        (snap / snapdir.CLAIM).write_text('{"run_id": "other"}')
        (d / "core-other.img").write_bytes(b"other run")
        raise RuntimeError("criu dump failed")

    monkeypatch.setattr(fake, "dump", dump)
    c = cp_mod.Checkpoint([ROOT], snap, control_dir=world.ctl)
    with pytest.raises(CheckpointFailed) as ei:
        c.run()
    assert ei.value.outcome == "rolled_back"
    assert (snap / "criu" / str(ROOT) / "core-other.img").read_bytes() == b"other run"
    assert json.loads((snap / snapdir.CLAIM).read_text()) == {"run_id": "other"}
    assert any("nothing in" in n and "is removed" in n for n in c.r.notes), c.r.notes


def test_a_group_leader_refuses_two_members_naming_one_dir(tmp_path):
    (tmp_path / "x").mkdir()
    os.symlink(tmp_path / "x", tmp_path / "l")
    apb, _, _ = pb.modules()
    calls = []
    for other in (tmp_path / "x", tmp_path / "l" / ".." / "x", tmp_path / "l"):
        req = apb.CheckpointRequest(
            members=[
                apb.Member(node="a", address="unix:/a", roots=[10], images_dir=str(tmp_path / "x")),
                apb.Member(node="b", address="10.0.0.2:7443", roots=[20], images_dir=str(other)),
            ]
        )
        with pytest.raises(AgentError) as ei:
            group.lead("checkpoint", req, Reporter(), calls.append, call=lambda *a: calls.append(a))
        e = ei.value
        assert (e.phase, e.outcome) == ("group", "refused")
        assert e.reason == (
            f"members a (unix:/a) and b (10.0.0.2:7443) name the same images dir {tmp_path / 'x'}: "
            "one run at a time writes a snapshot directory; give each member its own "
            "images_dir; nothing was done"
        )
    assert calls == []  # no member was asked anything
