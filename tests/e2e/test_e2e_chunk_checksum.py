"""The chunk checksum end to end (decisions D36; fakecuda, real CRIU, the creator + importer job
of test_e2e_chunk_store.py): a snapshot's own checksum wins over the node's and the
environment's at restore, at a release after a killed agent (the ``.lock`` records it) and at
the rollback of a failed checkpoint; an incremental checkpoint does not refer to chunks of a
snapshot of the other checksum in the same store (it writes every chunk, all with O_DIRECT).
Every case compares the job's bytes (SHA-256 of both processes' views) with the cut's."""

from __future__ import annotations

import glob
import json
import os
import pathlib

import pytest
import test_e2e_chunk_store as cs  # its job, waits and stream checks (tests/e2e is on sys.path)

from cuinterpose.agent.run.carriers import node_checksum
from cuinterpose.agent.snapshot import store
from cuinterpose.coordinator.contract import read_json
from cuinterpose.workloads.afdwin import demo

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="CRIU needs root")

OTHER = {"sha256": "blake2b-256", "blake2b-256": "sha256"}


def _base(job, ctl):
    return [
        "--pid",
        str(job.pid),
        "--driver",
        "fake",
        "--control-dir",
        str(ctl),
        "--chunk-bytes",
        str(cs.CB),
    ]


def _dirs(tmp_path):
    root, run = tmp_path / "snapshots", tmp_path / "run"
    root.mkdir()
    run.mkdir()
    return root, run


def test_mixed_checksum_store_and_restore_uses_the_snapshots(tmp_path):
    """s1 (other checksum) then s2 (node checksum) into one store: s2 refers to nothing of
    s1 and writes everything; s2 restores with the environment forcing the other checksum."""
    node = node_checksum()
    root, run = _dirs(tmp_path)
    packs = store.packs_dir(root)
    job, ctl = cs._start(run, cuts=2)
    try:
        cs._wait(run / "ready.json", "ready.json", job)
        env1 = {"CUINTERPOSE_INCREMENTAL": "1", "CUINTERPOSE_CHUNK_CHECKSUM": OTHER[node]}
        rc, cp1 = demo.run_agent(
            "checkpoint",
            "--images-dir",
            str(root / "s1"),
            *_base(job, ctl),
            "--leave-running",
            env=env1,
        )
        assert rc == 0 and cp1["ok"], cp1
        changed = cs._wait(run / "changed-1.json", "the change", job)
        env2 = {"CUINTERPOSE_INCREMENTAL": "1", "CUINTERPOSE_CHUNK_CHECKSUM": node}
        rc, cp2 = demo.run_agent(
            "checkpoint", "--images-dir", str(root / "s2"), *_base(job, ctl), env=env2
        )
        assert rc == 0 and cp2["ok"], cp2
        job.wait(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
    m1 = json.loads((root / "s1" / "manifest.json").read_text())
    m2 = json.loads((root / "s2" / "manifest.json").read_text())
    assert m1["chunks"]["checksum"] == OTHER[node] and m2["chunks"]["checksum"] == node
    assert m1["gpu_storage"]["checksum"] == OTHER[node] and m2["gpu_storage"]["checksum"] == node
    [s2] = m2["chunks"]["streams"]
    assert s2["refs"] == [] and m2["chunks"]["written_bytes"] == cs.SIZE
    assert m2["chunks"]["direct_bytes"] == cs.SIZE
    cs._check_streams(packs, m1)
    cs._check_streams(packs, m2)
    rc, rs = demo.run_agent(
        "restore",
        "--images-dir",
        str(root / "s2"),
        "--driver",
        "fake",
        env={"CUINTERPOSE_CHUNK_CHECKSUM": OTHER[node]},
    )
    assert rc == 0 and rs["ok"], rs
    res = cs._wait_file(run / "result.json")
    assert (res["restored"], res["verified"]) == (True, True)
    assert res["creator_sha256"] == res["importer_sha256"] == changed["sha256"]


def _after_a_first_cut(tmp_path):
    """The job, checkpointed once (``s0``, left running) and changed since: (root, run, job,
    ctl, node checksum)."""
    root, run = _dirs(tmp_path)
    job, ctl = cs._start(run, cuts=2)
    cs._wait(run / "ready.json", "ready.json", job)
    rc, cp0 = demo.run_agent(
        "checkpoint", "--images-dir", str(root / "s0"), *_base(job, ctl), "--leave-running"
    )
    assert rc == 0 and cp0["ok"], cp0
    cs._wait(run / "changed-1.json", "the change", job)
    return root, run, job, ctl, node_checksum()


def _rebuilt_with_the_change(run, res) -> None:
    """The job was rebuilt in place (not restored) and both processes see the changed bytes."""
    changed = read_json(run / "changed-1.json")
    assert (res["restored"], res["verified"]) == (False, True)
    assert res["creator_sha256"] == res["importer_sha256"] == changed["sha256"]


@pytest.mark.parametrize("incremental", [False, True], ids=["dir", "store"])
def test_release_after_a_killed_agent_uses_the_locks_checksum(tmp_path, incremental):
    job = None
    try:
        root, run, job, ctl, node = _after_a_first_cut(tmp_path)
        env = {
            "CUINTERPOSE_CHUNK_CHECKSUM": OTHER[node],
            "CUINTERPOSE_TEST_SIGNAL_AT": "after:criu dump",
        }
        if incremental:
            env["CUINTERPOSE_INCREMENTAL"] = "1"
        rc, _ = demo.run_agent(
            "checkpoint", "--images-dir", str(root / "s1"), *_base(job, ctl), env=env
        )
        assert rc == -9
        [lk] = glob.glob(str(ctl / "*.lock"))
        rec = json.loads(pathlib.Path(lk).read_text())
        assert rec["chunks"]["checksum"] == OTHER[node], rec
        rc, rel = demo.run_agent(
            "release",
            "--pid",
            str(job.pid),
            "--control-dir",
            str(ctl),
            env={"CUINTERPOSE_CHUNK_CHECKSUM": node},
        )
        assert rc == 0 and rel["ok"] and rel["outcome"] == "rolled_back", rel
        res = cs._wait(run / "result.json", "the released job's result", job)
    finally:
        if job is not None and job.poll() is None:
            job.kill()
    _rebuilt_with_the_change(run, res)


def test_rollback_of_a_failed_checkpoint_with_the_other_checksum(tmp_path):
    job = None
    try:
        root, run, job, ctl, node = _after_a_first_cut(tmp_path)
        env = {
            "CUINTERPOSE_CHUNK_CHECKSUM": OTHER[node],
            "CUINTERPOSE_TEST_SIGNAL_AT": "before:criu dump=SIGINT",
        }
        rc, cp = demo.run_agent(
            "checkpoint", "--images-dir", str(root / "s1"), *_base(job, ctl), env=env
        )
        assert rc != 0 and cp["error"]["outcome"] == "rolled_back", cp
        res = cs._wait(run / "result.json", "the rebuilt job's result", job)
    finally:
        if job is not None and job.poll() is None:
            job.kill()
    _rebuilt_with_the_change(run, res)
