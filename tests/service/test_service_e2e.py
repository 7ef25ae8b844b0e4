"""``checkpoint --agent`` / ``restore --agent``: an afdwin job on fakecuda with real CRIU,
checkpointed and restored through the daemon, with the in-process command's output shape."""

from __future__ import annotations

import json
import os
import signal
import time

from cuinterpose.workloads.afdwin import demo

STEPS = 300
HOLD = 20


def test_checkpoint_and_restore_through_the_daemon(afdwin, daemon, tmp_path):
    # held at HOLD until the checkpoint: the daemon may take long to start on a busy machine
    a = afdwin(steps=STEPS, step_delay_ms=5, hold_at=(HOLD,))
    d = daemon("n1", "--driver", "fake", "--metrics-port", "0")
    a.wait_hold()
    snap = tmp_path / "snap"
    rc, cp = demo.run_agent(
        "checkpoint",
        "--agent",
        d["listen"],
        "--pid",
        str(a.pid),
        "--images-dir",
        str(snap),
        "--driver",
        "fake",
        "--control-dir",
        str(a.ctl),
    )
    assert rc == 0 and cp["ok"], cp
    assert sorted(cp) == [
        "cuda_pids",
        "images_dir",
        "ok",
        "phases",
        "roots",
        "shim_sha256",
        "snapshot_id",
        "totals",
        "warnings",
    ]
    assert (cp["roots"], cp["images_dir"]) == ([a.pid], str(snap))
    m = json.loads((snap / "manifest.json").read_text())
    assert [p["name"] for p in m["phases"]] == [p["name"] for p in cp["phases"]][: len(m["phases"])]
    assert a.wait_dumped() == -signal.SIGKILL
    assert set(demo.cut_seqs(a.events()).values()) == {HOLD}
    # the ranks (re-parented to this subreaper) may die after the root: CRIU needs their pids
    deadline = time.monotonic() + demo.HANG_S
    while any(os.path.exists(f"/proc/{p['pid']}") for p in m["processes"]):
        assert time.monotonic() < deadline
        demo.reap_zombies()
        time.sleep(0.01)
    rc, rs = demo.run_agent("restore", "--agent", d["listen"], "--images-dir", str(snap))
    assert rc == 0 and rs["ok"], rs
    assert (rs["roots"], rs["snapshot_id"]) == ([a.pid], cp["snapshot_id"])
    assert a.wait_restored_exit(300) in (0, None)
    assert demo.check_run(a.events(), STEPS) == []
    from test_service import metrics

    got = metrics(d)
    assert got['cuinterpose_snapshots_total{kind="checkpoint",result="succeeded"}'] == 1.0
    assert got['cuinterpose_snapshots_total{kind="restore",result="succeeded"}'] == 1.0
    assert (
        got['cuinterpose_phase_bytes_total{kind="checkpoint",phase="SAVE_ALLOCATIONS"}']
        == m["totals"]["carrier_bytes"]
    )
    assert (
        got['cuinterpose_phase_bytes_total{kind="restore",phase="LOAD_ALLOCATIONS"}']
        == m["totals"]["carrier_bytes"]
    )
