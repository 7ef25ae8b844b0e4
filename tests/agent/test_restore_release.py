"""Issue 23 (decisions D49): the record a restore keeps in ``quiesce-ROOT.lock`` and what
``release`` (and the daemon at start) do with it when the restoring agent died, on a snapshot
whose trees are gone: undone (nothing to resume), the lock and the claim files removed, the
report naming the restore to run again; a live agent's restore is never touched; a restore
refused for pids in use names the release (the parts with real processes: the restore kill
points of tests/chaos/test_agent_kill.py)."""

from __future__ import annotations

import os
import subprocess

import pytest
from agent_world import dead_pid

from cuinterpose.agent.errors import QuiesceRefused
from cuinterpose.agent.mech import procfs
from cuinterpose.agent.run import recover, restore_recover
from cuinterpose.agent.snapshot import manifest
from cuinterpose.agent.snapshot.snapdir import SnapshotDir
from cuinterpose.coordinator.claim import Claim
from cuinterpose.coordinator.contract import quiesce_path, write_atomic
from cuinterpose.coordinator.protocol import claim_path


def snapshot(tmp_path, ctl) -> dict:
    """A written snapshot of one tree (root and rank: pids of processes that exited)."""
    root, rank = dead_pid(), dead_pid()
    snap = tmp_path / "snap"
    img = SnapshotDir(snap).criu_dir(root)
    img.mkdir(parents=True)
    (img / f"core-{root}.img").write_bytes(b"core" * 100)
    (img / "files.img").write_bytes(f"\x00unixsk{ctl}/cuinterpose-{rank}.sock\x00".encode())
    m = {
        "format": manifest.FORMAT,
        "format_version": manifest.FORMAT_VERSION,
        "snapshot_id": "s1",
        "created_at": manifest.utc_now(),
        "shim": {"path": "/x/libcuinterpose.so", "sha256": "ab" * 32, "size": 1},
        "driver": {"kind": "fake", "version": 13000, "library": "/x/libcuda.so.1"},
        "criu": {"version": "4.1", "trees": {str(root): f"criu/{root}"}},
        "roots": [root],
        "control_dir": str(ctl),
        "cuda_pids": [rank],
        "participants": [{"pid": rank, "socket_path": f"{ctl}/cuinterpose-{rank}.sock"}],
        "capture": {},
        "carriers": [],
        "phases": [],
        "quiesce": {"id": "q1"},
        "totals": {"carrier_bytes": 0, "image_bytes": 0},
    }
    m["criu"]["files"] = manifest.image_files(snap)
    manifest.write(snap, m)
    return {**m, "images_dir": str(snap)}


def restore_lock(ctl, m, *, pid, starttime, steps) -> dict:
    token = "cd" * 16
    lk = {
        "id": m["quiesce"]["id"],
        "pid": pid,
        "starttime": starttime,
        "torn_down": False,
        "restore": {"images_dir": m["images_dir"], "snapshot_id": "s1", "claim": token},
        "steps": steps,
    }
    write_atomic(quiesce_path(ctl, m["roots"][0], "lock"), lk)
    return lk


@pytest.fixture
def ctl(tmp_path):
    d = tmp_path / "ctl"
    d.mkdir(mode=0o700)
    return d


@pytest.mark.parametrize(
    "steps,outcome",
    [
        ([], "restore_undone"),  # killed before CRIU restore started
        (["criu restore"], "restore_undone"),  # inside CRIU: a partial tree
        (["criu restore", "criu restore {root} done", "criu restore done"], "workload_gone"),
    ],
)
def test_release_of_a_dead_agents_restore_whose_trees_are_gone(tmp_path, ctl, steps, outcome):
    m = snapshot(tmp_path, ctl)
    root = m["roots"][0]
    restore_lock(ctl, m, pid=dead_pid(), starttime=1, steps=[s.format(root=root) for s in steps])
    rank = m["participants"][0]["pid"]
    Claim.take(ctl, [rank], kind="restore", token="cd" * 16)  # the dead agent's claim
    rep = recover.release(ctl, root)
    assert (rep["kind"], rep["outcome"], rep["resume"]) == ("restore", outcome, None)
    assert rep["restore"] == f"cuinterpose-agent restore --images-dir {m['images_dir']}"
    assert not quiesce_path(ctl, root, "lock").exists()
    assert not os.path.exists(claim_path(ctl, rank))
    text = recover.render(rep)
    assert text.endswith(f"run `{rep['restore']}` again"), text
    assert ("CRIU restore had not started" in text) == (steps == [])


def test_the_daemon_at_start_releases_a_dead_agents_restore(tmp_path, ctl):
    m = snapshot(tmp_path, ctl)
    restore_lock(ctl, m, pid=dead_pid(), starttime=1, steps=[])
    lines = []
    (rep,) = recover.recover_dead(ctl, log=lines.append)
    assert (rep["kind"], rep["outcome"]) == ("restore", "restore_undone")
    assert lines and lines[0].startswith(f"cuinterpose-agent serve: released pid {m['roots'][0]}")


def test_a_live_agents_restore_is_left_alone_and_a_second_restore_names_it(tmp_path, ctl):
    m = snapshot(tmp_path, ctl)
    root = m["roots"][0]
    with subprocess.Popen(["sleep", "600"]) as agent:
        try:
            lk = restore_lock(
                ctl, m, pid=agent.pid, starttime=procfs.starttime(agent.pid), steps=["criu restore"]
            )
            with pytest.raises(QuiesceRefused, match=f"in progress in agent pid {agent.pid}"):
                recover.release(ctl, root)
            assert restore_recover.parked_hint(m) == (
                f"; a restore of this snapshot is in progress in agent pid {agent.pid}"
            )
        finally:
            agent.kill()
    agent.wait()
    assert restore_recover.parked_hint(m).endswith(
        f"`cuinterpose-agent release --pid {root} --control-dir {ctl}` finishes it (or, if it "
        "cannot, says what to do)"
    )
    assert quiesce_path(ctl, root, "lock").read_text()  # untouched by the refusal
    assert lk["pid"] == agent.pid
