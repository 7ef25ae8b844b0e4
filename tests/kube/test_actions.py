"""The default pod actions: a restore into a placeholder whose pid was reused is refused before
anything runs."""

from __future__ import annotations

import subprocess

import pytest

from cuinterpose.agent.config import parse_config
from cuinterpose.agent.kube.actions import AgentActions
from cuinterpose.agent.kube.resolver import CgroupResolver
from cuinterpose.agent.mech.placement import PlacementError


def test_restore_into_a_reused_placeholder_pid_is_refused(tmp_path):
    snap = tmp_path / "snap"
    snap.mkdir()
    (snap / "manifest.json").write_text("{}")
    proc = subprocess.Popen(["sleep", "600"])
    try:
        started = CgroupResolver().start_time(proc.pid)
        actions = AgentActions(parse_config({"driver": "fake"}))
        pod = {"metadata": {"namespace": "default", "name": "p1"}}
        with pytest.raises(PlacementError) as e:
            actions.restore(
                pod, "snap1", images_dir=str(snap), into_pid=proc.pid, into_start_time=started - 1
            )
        assert (e.value.phase, e.value.pid) == ("placement", proc.pid)
        assert str(e.value).endswith(
            f"is not the placeholder's process any more (started at tick {started}, the "
            f"placeholder's init at {started - 1}): its pid was reused; nothing was done"
        )
        assert (snap / "manifest.json").read_text() == "{}"
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_an_object_store_location_gets_its_local_copy_under_the_staging_dir(tmp_path):
    from cuinterpose.agent.errors import AgentError
    from cuinterpose.agent.snapshot.backends.api import StorageOptions
    from cuinterpose.agent.snapshot.backends.awsconf import S3Settings

    cfg = parse_config(
        {"snapshotDir": "s3://gpu-snapshots/cluster-a", "stagingDir": str(tmp_path / "stage")}
    )
    storage = StorageOptions(s3=S3Settings(endpoint="http://127.0.0.1:9"))
    loc = "s3://gpu-snapshots/cluster-a/default/snap1"
    from cuinterpose.agent.options import CheckpointOptions, RestoreOptions

    cp, rs = CheckpointOptions(), RestoreOptions(keep_local=True)
    r = AgentActions(cfg, storage=storage).remote_for(loc, "checkpoint", cp)
    assert (r.location, r.local_dir, r.keep_local) == (
        loc,
        str(
            tmp_path / "stage" / "checkpoint" / "gpu-snapshots" / "cluster-a" / "default" / "snap1"
        ),
        False,
    )
    assert r.storage is storage
    r = AgentActions(cfg, storage=storage).remote_for(loc, "restore", rs)
    base = str(tmp_path / "stage" / "restore" / "gpu-snapshots" / "cluster-a" / "default" / "snap1")
    assert r.local_dir.startswith(base + ".") and len(r.local_dir) == len(base) + 9
    assert r.keep_local
    assert AgentActions(cfg).remote_for(str(tmp_path / "local"), "checkpoint", cp) is None
    with pytest.raises(AgentError) as e:
        AgentActions(cfg).remote_for(loc, "checkpoint", cp)  # no settings to reach the store
    assert e.value.reason == f"{loc}: no storage settings to reach it"
