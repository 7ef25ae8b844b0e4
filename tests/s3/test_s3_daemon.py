"""The agent daemon with an object-store snapshot root (``serve --snapshot-dir
s3://BUCKET/PREFIX --staging-dir DIR``, the endpoint and keys from the standard AWS variables
read at start) against a real ``rclone serve s3``; fakecuda, real CRIU.

- one daemon: ``checkpoint``/``snapshots``/``restore``/``delete --agent`` with ``s3://``
  locations under its root; a location outside it is refused before anything happens; the
  local copies under the staging dir are gone once each request ends.
- two daemons leading one group cut into the bucket and restoring it from there: each
  member's snapshot is a prefix of its own, uploaded before any tree was killed.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import tempfile
import time

import pytest
from s3_kit import aws_env, bucket_files

from cuinterpose.agent.rpc import client
from cuinterpose.agent.snapshot import pb
from cuinterpose.agent.snapshot.backends import s3gc
from cuinterpose.workloads.afdwin import demo

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="CRIU needs root")

STEPS, HOLD = 200, 20


def test_checkpoint_list_restore_delete_through_a_daemon_whose_root_is_a_bucket(
    afdwin, daemon, tmp_path, bucket, rclone
):
    env = aws_env(rclone.endpoint, tmp_path)
    root = f"s3://{bucket}/cluster"
    staging = tmp_path / "staging"
    a = afdwin(steps=STEPS, step_delay_ms=5, hold_at=(HOLD,))
    d = daemon(
        "n1", "--driver", "fake", "--snapshot-dir", root, "--staging-dir", str(staging), env=env
    )
    assert d["snapshot_dirs"] == [root]
    a.wait_hold()
    # a location outside the root: refused before anything is asked of the job
    rc, out = demo.run_agent(
        "checkpoint", "--agent", d["listen"], "--pid", str(a.pid), "--control-dir", str(a.ctl),
        "--images-dir", f"s3://{bucket}/elsewhere/s1", "--driver", "fake",
    )  # fmt: skip
    assert rc == 3 and out["error"]["outcome"] == "refused", out
    assert f"outside the agent's snapshot prefix(es) {root}" in out["error"]["reason"]
    # a local copy outside the daemon's staging dir: refused too
    rc, out = demo.run_agent(
        "checkpoint", "--agent", d["listen"], "--pid", str(a.pid), "--control-dir", str(a.ctl),
        "--images-dir", f"{root}/ns/s0", "--driver", "fake", "--local-dir", str(tmp_path / "x"),
    )  # fmt: skip
    assert rc == 3 and out["error"]["outcome"] == "refused", out
    assert f"local dir {tmp_path / 'x'} resolves to" in out["error"]["reason"]
    assert not (tmp_path / "x").exists()
    loc = f"{root}/ns/s1"
    rc, cp = demo.run_agent(
        "checkpoint", "--agent", d["listen"], "--pid", str(a.pid), "--control-dir", str(a.ctl),
        "--images-dir", loc, "--driver", "fake",
    )  # fmt: skip
    assert rc == 0 and cp["ok"], cp
    assert (cp["images_dir"], cp["local_dir"], cp["local_kept"]) == (
        loc,
        str(staging / "checkpoint" / bucket / "cluster" / "ns" / "s1"),
        False,
    )
    assert cp["upload"]["chunks_uploaded"] == cp["upload"]["chunks"] > 0
    assert a.wait_dumped() == -signal.SIGKILL
    objs = bucket_files(rclone.root, bucket)
    m = json.loads(objs["cluster/ns/s1/manifest.json"])
    assert m["snapshot_id"] == cp["snapshot_id"]
    assert not [k for k in objs if k.startswith(s3gc.PINS)]

    rc, ls = demo.run_agent("snapshots", "--agent", d["listen"])  # the daemon's root
    assert rc == 0, ls
    assert ls["snapshots"] == []  # ns/ is no snapshot; its children are listed one level down
    rc, ls = demo.run_agent("snapshots", "--agent", d["listen"], f"{root}/ns")
    assert [(r["images_dir"], r["snapshot_id"]) for r in ls["snapshots"]] == [
        (loc, cp["snapshot_id"])
    ]

    rc, rs = demo.run_agent("restore", "--agent", d["listen"], "--images-dir", loc)
    assert rc == 0 and rs["ok"], rs
    assert rs["images_dir"] == loc and rs["roots"] == [a.pid]
    assert rs["download"]["chunk_bytes"] == cp["upload"]["chunk_bytes_uploaded"]
    assert a.wait_restored_exit(300) in (0, None)
    assert demo.check_run(a.events(), STEPS) == []
    # nothing left under the staging dir but the empty sub-trees' roots
    assert [p for p in staging.rglob("*") if p.is_file()] == []

    rc, gone = demo.run_agent("delete", "--agent", d["listen"], loc)
    assert rc == 0, gone
    assert (gone["deleted"], gone["chunks_removed"]) == (loc, cp["upload"]["chunks"])
    assert bucket_files(rclone.root, bucket) == {}


def test_a_group_cut_goes_into_the_bucket_and_comes_back_from_it(
    afdwin, daemon, tmp_path, bucket, rclone
):
    env = aws_env(rclone.endpoint, tmp_path)
    apb, _, _ = pb.modules()
    jobs = [afdwin(steps=STEPS, step_delay_ms=5, hold_at=(HOLD,)) for _ in range(2)]
    stages = [pathlib.Path(tempfile.mkdtemp(prefix=f"cui-stage-{n}-", dir=tmp_path)) for n in "ab"]
    opts = ("--driver", "fake", "--snapshot-dir", f"s3://{bucket}/cluster")
    agents = [
        daemon(f"node-{n}", *opts, "--control-dir", str(j.ctl), "--staging-dir", str(st), env=env)
        for n, j, st in zip("ab", jobs, stages)
    ]
    for j in jobs:
        j.wait_hold()
    locs = {n: f"s3://{bucket}/cluster/cut/{n}" for n in ("node-a", "node-b")}
    members = [
        apb.Member(node=n, address=ag["listen"], roots=[j.pid], images_dir=locs[n])
        for n, ag, j in zip(locs, agents, jobs)
    ]
    rows = []
    res = client.call(
        agents[0]["listen"],
        "Checkpoint",
        apb.CheckpointRequest(members=members),
        on_progress=rows.append,
    )
    assert res.ok, res.error
    out = json.loads(res.json)
    assert "group upload" in [p["name"] for p in out["phases"]]
    # every member's manifest is in the bucket before any tree is killed
    ups = [i for i, r in enumerate(rows) if r["event"] == "end" and r["phase"] == "upload"]
    kills = [i for i, r in enumerate(rows) if r["event"] == "start" and r["phase"] == "kill dumped"]
    assert len(ups) == len(kills) == 2 and max(ups) < min(kills)
    assert {rows[i]["node"] for i in ups} == set(locs)
    assert [j.proc.wait(timeout=300) for j in jobs] == [-signal.SIGKILL] * 2
    # each member wrote its snapshot under its own staging dir and removed it after the cut
    assert [[p for p in st.rglob("*") if p.is_file()] for st in stages] == [[], []]
    objs = bucket_files(rclone.root, bucket)
    for n, j in zip(locs, jobs):
        m = json.loads(objs[f"cluster/cut/{n}/manifest.json"])
        assert m["roots"] == [j.pid] and m["group"]["request_id"] == out["request_id"]
        pids = [p["pid"] for p in m["processes"]]
        deadline = time.monotonic() + demo.HANG_S
        while any(os.path.exists(f"/proc/{p}") for p in pids):
            assert time.monotonic() < deadline
            demo.reap_zombies()
            time.sleep(0.01)

    res = client.call(agents[0]["listen"], "Restore", apb.RestoreRequest(members=members))
    assert res.ok, res.error
    assert [[p for p in st.rglob("*") if p.is_file()] for st in stages] == [[], []]
    assert bucket_files(rclone.root, bucket) == objs
    for j in jobs:
        assert j.wait_restored_exit(300) in (0, None)
        assert demo.check_run(j.events(), STEPS) == []
