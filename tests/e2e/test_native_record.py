"""The native backend in the manifest (issue 13): a checkpoint records which backend took the
snapshot and the driver's version (``native``); a restore with the other backend works and its
report says which one it used (the result's ``native`` and the ``native restore`` step)."""

from __future__ import annotations

import json
import signal

import pytest

from cuinterpose.agent.mech import native_cli
from cuinterpose.agent.snapshot import pb
from cuinterpose.workloads.afdwin import demo

STEPS = 120
HOLD = 20


@pytest.mark.parametrize(
    "backend,restore_with",
    [("driver-api", "cuda-checkpoint"), ("cuda-checkpoint", "driver-api")],
    ids=["api-then-cli", "cli-then-api"],
)
def test_manifest_names_the_backend_and_restore_reports_its_own(
    afdwin, tmp_path, monkeypatch, backend, restore_with
):
    monkeypatch.delenv(native_cli.CLI_ENV, raising=False)  # fakecuda's own utility
    a = afdwin(steps=STEPS, step_delay_ms=5, hold_at=(HOLD,))
    a.wait_hold()
    snap = tmp_path / "snap"
    rc, cp = a.checkpoint(snap, "--native-backend", backend)
    assert rc == 0 and cp["ok"], cp
    assert a.wait_dumped() == -signal.SIGKILL
    m = json.loads((snap / "manifest.json").read_text())
    drv = m["driver"]
    detail = {
        "driver-api": f"{drv['kind']} driver {drv['version']} at {drv['library']}",
        "cuda-checkpoint": native_cli.fake_cli(),
    }
    assert m["native"] == {
        "backend": backend,
        "driver_version": m["driver"]["version"],
        "detail": detail[backend],
    }
    assert m["driver"]["version"] > 0
    # the protobuf schema carries it (manifest_to_proto refuses unknown fields)
    assert pb.manifest_from_proto(pb.manifest_to_proto(m)) == m

    rc, rs = demo.run_agent(
        "restore", "--images-dir", str(snap), "--driver", "fake", "--native-backend", restore_with
    )
    assert rc == 0 and rs["ok"], rs
    assert rs["native"] == {
        "backend": restore_with,
        "driver_version": m["driver"]["version"],
        "detail": detail[restore_with],
        "snapshot": m["native"],
    }
    step = [p for p in rs["phases"] if p["name"] == "native restore"][0]
    pids = ", ".join(map(str, m["cuda_pids"]))
    assert step["detail"] == f"pids {pids} by {restore_with}", step
    assert a.wait_restored_exit(300) in (0, None)
    assert demo.check_run(a.events(), STEPS, attention=1, ffn=1) == []
