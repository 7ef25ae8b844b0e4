"""Case 017 (shared/cases/017-back-to-back-checkpoints-park-job): gRPC ``Checkpoint(
leave_running)`` in a loop with no pause parked the job forever: the next request removed the
previous request's ``.resume`` before the workload had read it.

Kind: one request removes another's protocol files. The agent serializes one job's requests
(the control dir's flock), a new request waits until the workload took the previous answer,
neither side removes a file of another id, each id is answered once
(agent/mech/quiesce.py, docs/workload-contract.md). Here: one afdwin job held at every step
from 1 to ``HOLDS`` until a quiesce lets it pass (so it cannot end before the loops, and its
progress is counted in quiesces, not in time), ``DAEMON_CALLS`` back-to-back
``Checkpoint(leave_running)`` through ``cuinterpose-agent serve`` on a Unix socket, then
``CLI_ROUNDS`` rounds of two CLI checkpoints started together. Every call is answered (ok, or
refused naming the other agent), each workload resume matches one snapshot, the job reaches
the hold after its last quiesce (it moved on after every one). A last daemon call stops
the job; that snapshot is restored and the run's final evidence is exact (restores_seen 1).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from cuinterpose.agent.rpc import client
from cuinterpose.agent.snapshot import pb
from cuinterpose.workloads.afdwin import demo

DAEMON_CALLS = 100
CLI_ROUNDS = 10
#: one hold per step up to here: each quiesce lets the job issue exactly one more step
HOLDS = DAEMON_CALLS + 2 * CLI_ROUNDS + 1
STEPS = HOLDS + 9


@pytest.fixture
def serve(tmp_path):
    """``cuinterpose-agent serve`` on a Unix socket (a short private dir), snapshot dir
    ``tmp_path/sd``; yields its address; terminated at teardown."""
    d = tempfile.mkdtemp(prefix="cui-017-")
    sd = tmp_path / "sd"
    err = open(os.path.join(d, "stderr"), "wb")
    p = subprocess.Popen(
        [sys.executable, "-m", "cuinterpose.agent.cli", "serve", "--listen",
         f"unix:{d}/agent.sock", "--node", "n017", "--driver", "fake", "--snapshot-dir",
         str(sd), "--json"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err, text=True,
        env={k: v for k, v in os.environ.items() if k != "LD_PRELOAD"},
    )  # fmt: skip
    line = p.stdout.readline()
    assert line, open(os.path.join(d, "stderr")).read()
    yield json.loads(line)["listen"], sd
    p.terminate()
    p.wait(timeout=60)
    shutil.rmtree(d, ignore_errors=True)


def _resumed_ids(job) -> list[str]:
    return [e["id"] for e in job.events() if demo.kind(e) == "resumed"]


def test_back_to_back_checkpoints_through_the_daemon_and_two_clis_keep_the_job_running(
    afdwin, serve, tmp_path
):
    addr, sd = serve
    a = afdwin(steps=STEPS, step_delay_ms=1, hold_at=tuple(range(1, HOLDS + 1)))
    a.wait_hold()
    apb, _, _ = pb.modules()
    ids = []
    for i in range(DAEMON_CALLS):
        snap = sd / f"s{i}"
        req = apb.CheckpointRequest(
            roots=[a.pid],
            images_dir=str(snap),
            options=apb.CheckpointOptions(
                leave_running=True, driver="fake", control_dir=str(a.ctl)
            ),
        )
        res = client.call(addr, "Checkpoint", req)
        assert res.ok, f"call {i}: {res.error}"
        ids.append(json.loads(res.json)["snapshot_id"])
        shutil.rmtree(snap)  # 100 snapshots would fill the disk
    assert len(set(ids)) == DAEMON_CALLS
    # the job took every answer and moved on after each: it reaches the next hold
    a.wait_hold(DAEMON_CALLS + 1)
    assert _resumed_ids(a) == ids

    outcomes = {"ok": 0}
    for r in range(CLI_ROUNDS):
        dirs = [tmp_path / f"c{r}-{k}" for k in range(2)]
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "cuinterpose.agent.cli",
                    *a.checkpoint_args(d),
                    "--leave-running",
                    "--json",
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env={k: v for k, v in os.environ.items() if k != "LD_PRELOAD"},
            )  # fmt: skip
            for d in dirs
        ]  # started together
        res = []
        for p in procs:
            out, err = p.communicate(timeout=300)
            res.append((p.returncode, json.loads(out) if out.startswith("{") else err))
        for (rc, out), p in zip(res, procs):
            if rc == 0:
                outcomes["ok"] += 1
                ids.append(out["snapshot_id"])
                continue
            # refused, nothing changed: at the census (the other run holds the processes
            # natively locked, or CRIU's dump has them stopped) or at the request it finds
            e, other = out["error"], procs[1 - procs.index(p)].pid
            assert rc == 3 and e["outcome"] == "refused", res
            if e["phase"] == "census":
                # the other run named from its .lock (gone if it ended as the census looked)
                assert (
                    f"a checkpoint of root {a.pid} is in progress in agent pid {other} "
                    in e["reason"]
                    or "another checkpoint in progress?" in e["reason"]
                    or "it is stopped" in e["reason"]
                ), res
            else:
                assert e["phase"] == "quiesce", res
                assert f"in progress in agent pid {other}" in e["reason"], res
            outcomes[f"refused at {e['phase']}"] = outcomes.get(f"refused at {e['phase']}", 0) + 1
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
    print(f"case 017: {DAEMON_CALLS} daemon calls ok; CLI pairs x{CLI_ROUNDS}: {outcomes}")
    assert outcomes["ok"] >= CLI_ROUNDS  # at least one of each pair
    a.wait_hold(len(ids) + 1)
    assert _resumed_ids(a) == ids  # every request answered once, in order, and taken
    # one more back-to-back call, without leave_running: the job stops, and the snapshot the
    # daemon wrote after the 100 + CLI checkpoints above restores to an exact run
    final = sd / "final"
    req = apb.CheckpointRequest(
        roots=[a.pid],
        images_dir=str(final),
        options=apb.CheckpointOptions(driver="fake", control_dir=str(a.ctl)),
    )
    res = client.call(addr, "Checkpoint", req)
    assert res.ok, res.error
    a.wait_dumped()
    rc, rs = demo.run_agent("restore", "--images-dir", str(final), "--driver", "fake")
    assert rc == 0 and rs["snapshot_id"] == json.loads(res.json)["snapshot_id"], rs
    for k in range(len(ids) + 2, HOLDS + 1):  # the holds no quiesce ended
        a.wait_hold(k)
        a.release_hold()
    evs = a.wait_for(lambda ev: any(demo.kind(e) == "summary" for e in ev), 300, "summary")
    assert demo.check_run(evs, STEPS) == [], a.explain()  # restores_seen 1, VA tables equal
