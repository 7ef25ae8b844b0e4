"""Two agents on loopback (Unix sockets), each owning one afdwin job on fakecuda with real CRIU,
checkpointed as one group by a leader and restored as one group. The leader's merged event
log proves that every member was quiesced before any member locked and that every member
restored its shared memory before any member resumed; a failure injected on the second agent
(a tree CRIU cannot dump) rolls both members back and both jobs finish intact."""

from __future__ import annotations

import json
import os
import signal
import time

from group_kit import STEPS, agents, idx, reap_tree, start_jobs, wait_running

from cuinterpose.agent.mech import signal_at
from cuinterpose.agent.rpc import client
from cuinterpose.agent.snapshot import pb
from cuinterpose.workloads.afdwin import demo


def test_group_checkpoint_and_restore_one_consistent_cut(afdwin, daemon, tmp_path):
    apb, _, _ = pb.modules()
    ja, jb = start_jobs(afdwin)
    A, B = agents(daemon, (ja, jb))
    wait_running((ja, jb))
    snaps = {"node-a": tmp_path / "snap-a", "node-b": tmp_path / "snap-b"}
    members = [
        apb.Member(
            node="node-a", address=A["listen"], roots=[ja.pid], images_dir=str(snaps["node-a"])
        ),
        apb.Member(
            node="node-b", address=B["listen"], roots=[jb.pid], images_dir=str(snaps["node-b"])
        ),
    ]
    rows = []
    res = client.call(
        A["listen"], "Checkpoint", apb.CheckpointRequest(members=members), on_progress=rows.append
    )
    assert res.ok, res.error
    nodes = {"node-a", "node-b"}
    # every member's rows are in the leader's log; every quiesce before every lock; every
    # manifest written before any tree is killed
    q_end = idx(rows, "end", lambda r: r["phase"] == "quiescence check" and r["status"] == "ok")
    lock = idx(rows, "start", lambda r: r["phase"] == "native lock")
    mf_end = idx(rows, "end", lambda r: r["phase"] == "manifest" and r["node"])
    kill = idx(rows, "start", lambda r: r["phase"] == "kill dumped")
    assert {rows[i]["node"] for i in q_end} == {rows[i]["node"] for i in lock} == nodes
    assert len(q_end) == len(lock) == len(mf_end) == len(kill) == 2
    assert max(q_end) < min(lock)
    assert max(mf_end) < min(kill)
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
    # both roots are our children: wait for each before reaping (wait_dumped reaps every
    # zombie, which would hide the second one's status)
    assert [j.proc.wait(timeout=300) for j in (ja, jb)] == [-signal.SIGKILL] * 2
    for node, j in (("node-a", ja), ("node-b", jb)):
        m = json.loads((snaps[node] / "manifest.json").read_text())
        assert m["roots"] == [j.pid]
        assert (m["group"]["request_id"], m["group"]["node"]) == (out["request_id"], node)
        assert [x["node"] for x in m["group"]["members"]] == ["node-a", "node-b"]
        # the manifest is the cuinterpose.v1.Manifest schema, both ways
        assert pb.manifest_from_proto(pb.manifest_to_proto(m)) == m
        reap_tree(m)

    rows = []
    res = client.call(
        A["listen"], "Restore", apb.RestoreRequest(members=members), on_progress=rows.append
    )
    assert res.ok, res.error
    shared_end = idx(rows, "end", lambda r: r["group_phase"] == "restore shared")
    resume = idx(rows, "start", lambda r: r["phase"] == "resume")
    assert {rows[i]["node"] for i in shared_end} == {rows[i]["node"] for i in resume} == nodes
    assert [rows[i]["phase"] for i in shared_end if rows[i]["node"] == "node-b"] == [
        "INSPECT",
        "check carriers",  # the coordinator's own work between its barriers: rows of their own
        "LOAD_ALLOCATIONS",
        "RESTORE_UNICAST",
        "INSPECT",
        "compare",
    ]
    assert max(shared_end) < min(resume)
    for j in (ja, jb):
        assert j.wait_restored_exit(300) in (0, None)
        evs = j.events()
        assert demo.check_run(evs, STEPS) == []
        assert [(e["restored"], e["cancelled"]) for e in evs if demo.kind(e) == "resumed"] == [
            (True, False)
        ]


def _wait_ext_ready(p, log):
    deadline = time.monotonic() + demo.HANG_S
    while '"ready"' not in log.read_text():
        assert p.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)


def test_failure_on_the_second_agent_rolls_back_both_and_both_jobs_finish(
    afdwin, ext_socket, daemon, tmp_path
):
    ja, jb = start_jobs(afdwin, steps=2 * STEPS)
    xp, xlog, conn = ext_socket(jb.ctl)  # a second tree on node b that CRIU cannot dump
    A, B = agents(daemon, (ja, jb))
    _wait_ext_ready(xp, xlog)
    wait_running((ja, jb))
    spec = tmp_path / "group.json"
    spec.write_text(
        json.dumps(
            {
                "members": [
                    {
                        "node": "node-a",
                        "address": A["listen"],
                        "roots": [ja.pid],
                        "images_dir": str(tmp_path / "snap-a"),
                    },
                    {
                        "node": "node-b",
                        "address": B["listen"],
                        "roots": [jb.pid, xp.pid],
                        "images_dir": str(tmp_path / "snap-b"),
                    },
                ]
            }
        )
    )
    rc, out = demo.run_agent("checkpoint", "--agent", A["listen"], "--group", str(spec))
    assert rc == 4 and not out["ok"], out
    err = out["error"]
    assert (err["node"], err["phase"], err["pid"], err["outcome"]) == (
        "node-b",
        "criu dump",
        xp.pid,
        "rolled_back",
    )
    assert err["message"].startswith(f"node node-b: criu dump: pid {xp.pid} tree {xp.pid}: ")
    assert err["reason"].endswith(
        "(rolled back: every member's workload continues with its memory intact)"
    )
    assert [(p["name"], p["status"]) for p in out["phases"]] == [
        ("group prepare", "ok"),
        ("group quiesce", "ok"),
        ("group capture", "ok"),
        ("group native lock", "ok"),
        ("group native checkpoint", "ok"),
        ("group criu dump", "failed"),
        ("group rollback", "ok"),
        ("group release", "ok"),
    ]
    for d in ("snap-a", "snap-b"):
        assert not (tmp_path / d / "manifest.json").exists()
        assert not (tmp_path / d / "criu").exists()
    assert xp.wait(timeout=300) == 0
    assert conn.recv(64) == b"still here\n"
    for j in (ja, jb):
        j.release_hold()  # a job whose quiesce never came
        j.wait_ok(300)  # never killed: ran to the end
        evs = j.events()
        assert demo.check_run(evs, 2 * STEPS, expect_restore=False) == []
        assert [(e["restored"], e["cancelled"]) for e in evs if demo.kind(e) == "resumed"] == [
            (False, False)
        ]


def test_manifest_failure_on_one_member_removes_the_others_snapshot_and_rebuilds_both(
    afdwin, daemon, tmp_path
):
    """Member b's manifest cannot be written (its temp path is made a directory while b's
    daemon is stopped just before its manifest step) after member a wrote its own: a's
    snapshot alone is no consistent cut, so the group rollback removes it too and both jobs
    are rebuilt and finish."""
    import subprocess
    import sys

    ja, jb = start_jobs(afdwin, steps=2 * STEPS)
    A = agents(daemon, (ja,))[0]
    B = daemon(
        "node-b",
        "--driver",
        "fake",
        "--control-dir",
        str(jb.ctl),
        env={signal_at.ENV: "before:manifest=SIGSTOP"},
    )
    wait_running((ja, jb))
    snap_a, snap_b = tmp_path / "snap-a", tmp_path / "snap-b"
    spec = tmp_path / "group.json"
    spec.write_text(
        json.dumps(
            {
                "members": [
                    {
                        "node": "node-a",
                        "address": A["listen"],
                        "roots": [ja.pid],
                        "images_dir": str(snap_a),
                    },
                    {
                        "node": "node-b",
                        "address": B["listen"],
                        "roots": [jb.pid],
                        "images_dir": str(snap_b),
                    },
                ]
            }
        )
    )
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cuinterpose.agent.cli",
            "checkpoint",
            "--agent",
            A["listen"],
            "--group",
            str(spec),
            "--json",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    # an event, not a race with CRIU: b's daemon stops itself before its manifest step
    demo.wait_stopped(B["pid"], lambda: p.poll() is None)
    assert (snap_b / "criu" / str(jb.pid)).is_dir() and not (snap_b / "manifest.json").exists()
    (snap_b / "manifest.json.tmp").mkdir()
    os.kill(B["pid"], signal.SIGCONT)
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 4, out
    err = json.loads(out)["error"]
    assert (err["node"], err["phase"], err["pid"], err["outcome"]) == (
        "node-b",
        "manifest",
        None,
        "rolled_back",
    )
    assert [(x["name"], x["status"]) for x in json.loads(out)["phases"]][-3:] == [
        ("group manifest", "failed"),
        ("group rollback", "ok"),
        ("group release", "ok"),
    ]
    for d in (snap_a, snap_b):
        assert not (d / "manifest.json").exists() and not (d / "criu").exists()
    for j in (ja, jb):
        j.release_hold()  # a job whose quiesce never came
        j.wait_ok(300)
        evs = j.events()
        assert demo.check_run(evs, 2 * STEPS, expect_restore=False) == []
        assert [(e["restored"], e["cancelled"]) for e in evs if demo.kind(e) == "resumed"] == [
            (False, False)
        ]
