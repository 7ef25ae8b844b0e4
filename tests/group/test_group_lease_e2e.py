"""Group leases end to end (docs/service.md "Leases"): two agents with 2 s leases, each owning
one afdwin job on fakecuda with real CRIU.

- A leader (its own process) killed right after the group ``lock`` phase leaves both jobs
  quiesced, torn down and locked; when the leases expire each member rolls back and releases
  its job by itself, both jobs finish with every message exactly once, the expiry is counted,
  and a late RunPhase of the request is refused naming it.
- A CRIU dump made to last 5 s (2.5 leases) on one member does not expire the other: the
  leader keeps renewing it and the group checkpoint succeeds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from group_kit import STEPS, agents, finished_intact, metrics, start_jobs, wait_running

from cuinterpose.agent.mech import criu
from cuinterpose.agent.rpc import client
from cuinterpose.agent.snapshot import pb

LEASE = "2"
EXPIRED_UNDONE = 'cuinterpose_group_leases_expired_total{kind="checkpoint",result="undone"}'

# the leader, in a process of its own: SIGKILLs itself when the group phase ``die_after`` ends
LEADER = r"""
import json, os, signal, sys
from cuinterpose.agent.rpc import group
from cuinterpose.agent.snapshot import pb
from cuinterpose.agent.run.report import Reporter
spec = json.loads(sys.argv[1])
apb, _, _ = pb.modules()
req = apb.CheckpointRequest(members=[apb.Member(**m) for m in spec["members"]])
def sink(event, ph):
    if event == "end" and getattr(ph, "name", "") == spec["die_after"] and ph.status == "ok":
        os.kill(os.getpid(), signal.SIGKILL)
group.lead("checkpoint", req, Reporter([sink]), lambda row: None, request_id=spec["rid"],
           leader="doomed-leader")
print("the leader was not killed")
"""


def test_a_leader_killed_after_lock_leaves_members_that_undo_the_job_when_the_lease_expires(
    afdwin, daemon, tmp_path
):
    ja, jb = start_jobs(afdwin, steps=2 * STEPS)
    A, B = agents(daemon, (ja, jb), "--group-lease-s", LEASE, "--metrics-port", "0")
    assert A["group_lease_s"] == B["group_lease_s"] == 2.0
    wait_running((ja, jb))
    snaps = {n: tmp_path / f"snap-{n}" for n in ("node-a", "node-b")}
    spec = {
        "rid": "lease-e2e",
        "die_after": "group native lock",
        "members": [
            {
                "node": "node-a",
                "address": A["listen"],
                "roots": [ja.pid],
                "images_dir": str(snaps["node-a"]),
            },
            {
                "node": "node-b",
                "address": B["listen"],
                "roots": [jb.pid],
                "images_dir": str(snaps["node-b"]),
            },
        ],
    }
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    leader = subprocess.run(
        [sys.executable, "-c", LEADER, json.dumps(spec)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert leader.returncode == -signal.SIGKILL, leader.stdout + leader.stderr
    # both members expire the request and undo it by themselves
    deadline = time.monotonic() + 120
    while not all(metrics(x).get(EXPIRED_UNDONE) == 1.0 for x in (A, B)):
        assert time.monotonic() < deadline, [open(x["stderr"]).read() for x in (A, B)]
        time.sleep(0.1)
    undo = "rolled it back and released it (the workload continues with its memory intact)"
    apb, _, _ = pb.modules()
    for info, node in ((A, "node-a"), (B, "node-b")):
        assert {k: v for k, v in metrics(info).items() if "leases_expired" in k} == {
            EXPIRED_UNDONE: 1.0
        }
        log = open(info["stderr"]).read()
        assert (
            f"node {node}: group checkpoint request lease-e2e from leader doomed-leader: its "
            "lease of 2 s expired after phase 'native lock' with no Renew or RunPhase; undoing it "
            "as the leader would have"
        ) in log
        assert (
            f"node {node}: group checkpoint request lease-e2e (lease expired after phase "
            f"'native lock'): this member {undo}"
        ) in log
        # a late phase of the request is refused, naming it, and changes nothing
        for phase in ("native checkpoint", "rollback"):
            res = client.call(
                info["listen"],
                "RunPhase",
                apb.RunPhaseRequest(
                    request_id="lease-e2e", kind="checkpoint", phase=phase, node=node
                ),
            )
            assert (res.ok, res.error.node, res.error.phase, res.error.outcome) == (
                False,
                node,
                "group",
                "lease_expired",
            )
            assert res.error.reason == (
                f"request lease-e2e: phase {phase!r} refused: the request's lease of 2 s expired "
                f"on node {node} after phase 'native lock' with no Renew or RunPhase from leader "
                f"doomed-leader; this member {undo}; this call changed nothing"
            )
        r = client.renew(info["listen"], apb.RenewRequest(request_id="lease-e2e", node=node))
        assert (r.ok, r.expired, r.node, r.lease_s) == (False, True, node, 2.0)
    for d in snaps.values():
        assert not d.exists()  # the directories the request made are gone
    finished_intact((ja, jb), 2 * STEPS)


def test_a_long_dump_on_one_member_does_not_expire_the_other(afdwin, daemon, tmp_path):
    """node-b's CRIU dump sleeps 5 s first (a wrapper around the real CRIU): node-a, done
    with its own dump, waits 2.5 leases at the barrier and is kept alive by the leader's
    Renew calls; the group checkpoint (--leave-running) succeeds and both jobs finish."""
    import shlex

    slow = tmp_path / "slow-criu"
    slow.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = dump ]; then sleep 5; fi\n'
        f'exec {shlex.join(criu.criu_command())} "$@"\n'
    )
    slow.chmod(0o755)
    ja, jb = start_jobs(afdwin, steps=2 * STEPS)
    A = daemon(
        "node-a",
        "--driver",
        "fake",
        "--control-dir",
        str(ja.ctl),
        "--group-lease-s",
        LEASE,
        "--metrics-port",
        "0",
    )
    B = daemon(
        "node-b",
        "--driver",
        "fake",
        "--control-dir",
        str(jb.ctl),
        "--group-lease-s",
        LEASE,
        "--metrics-port",
        "0",
        env={criu.ENV_CRIU: str(slow)},
    )
    wait_running((ja, jb))
    apb, _, _ = pb.modules()
    req = apb.CheckpointRequest(
        options=apb.CheckpointOptions(leave_running=True),
        members=[
            apb.Member(
                node="node-a",
                address=A["listen"],
                roots=[ja.pid],
                images_dir=str(tmp_path / "snap-a"),
            ),
            apb.Member(
                node="node-b",
                address=B["listen"],
                roots=[jb.pid],
                images_dir=str(tmp_path / "snap-b"),
            ),
        ],
    )
    rows = []
    res = client.call(A["listen"], "Checkpoint", req, on_progress=rows.append)
    assert res.ok, res.error
    out = json.loads(res.json)
    assert [p["name"] for p in out["phases"]] == [
        f"group {p}"
        for p in (
            "prepare",
            "quiesce",
            "capture",
            "native lock",
            "native checkpoint",
            "criu dump",
            "manifest",
            "upload",
            "confirm leases",
            "finish",
            "resume",
        )
    ]
    dumps = {
        r["node"]: r["elapsed_ns"]
        for r in rows
        if r["event"] == "end" and r["phase"] == "criu dump"
    }
    assert dumps["node-b"] >= 5e9  # the injected delay: 2.5 leases
    for info in (A, B):
        assert {k: v for k, v in metrics(info).items() if "leases_expired" in k} == {}
    for d in ("snap-a", "snap-b"):
        m = json.loads((tmp_path / d / "manifest.json").read_text())
        assert m["group"]["request_id"] == out["request_id"]
    finished_intact((ja, jb), 2 * STEPS)
