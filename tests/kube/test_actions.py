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
