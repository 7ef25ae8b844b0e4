"""A restore claims the snapshot it restores (agent/snapshot/dirclaim.py, kind "restore";
decisions D72): while it runs, a ``delete`` of that snapshot and a second restore of it are
refused (exit 3) naming the restore's agent pid, before either changes anything; the snapshot
stays byte for byte, the restore finishes (exit 0) and the job ends exactly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from cuinterpose.agent.mech.census import sha256_file
from cuinterpose.agent.snapshot import dirclaim
from cuinterpose.workloads.afdwin import demo

STEPS = 200
HOLD = 20


def _digest(snap) -> dict:
    return {
        str(p.relative_to(snap)): sha256_file(p)
        for p in sorted(snap.rglob("*"))
        if p.is_file() and p.name != dirclaim.CLAIM_NAME
    }


def test_delete_and_a_second_restore_are_refused_while_a_restore_runs(afdwin, tmp_path):
    a = afdwin(steps=STEPS, step_delay_ms=5, hold_at=(HOLD,))
    a.wait_hold()
    snap = tmp_path / "snap"
    rc, cp = a.checkpoint(snap)
    assert rc == 0 and cp["ok"], cp
    assert a.wait_dumped() == -signal.SIGKILL
    digest = _digest(snap)
    offset = a.log.stat().st_size
    first = subprocess.Popen(
        [sys.executable, "-m", "cuinterpose.agent.cli", "restore", "--images-dir", str(snap)]
        + ["--driver", "fake", "--json"],
        env={
            **{k: v for k, v in os.environ.items() if k != "LD_PRELOAD"},
            "CUINTERPOSE_TEST_SIGNAL_AT": "after:verify=SIGSTOP",
        },
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        demo.wait_stopped(first.pid, lambda: first.poll() is None)
        held = dirclaim.holder(snap)
        assert (held["pid"], held["kind"]) == (first.pid, "restore")

        rc, out = demo.run_agent("delete", str(snap))
        assert rc == 3, out
        e = out["error"]
        assert (e["phase"], e["outcome"]) == ("delete", "refused")
        assert e["reason"].startswith(
            f"{snap} is being restored by a restore: agent pid {first.pid} on "
        ), e
        assert e["reason"].endswith("; nothing removed"), e
        assert _digest(snap) == digest

        rc, out = demo.run_agent("restore", "--images-dir", str(snap), "--driver", "fake")
        assert rc == 3, out
        e = out["error"]
        assert (e["phase"], e["outcome"]) == ("manifest", "refused")
        assert e["reason"].startswith(
            f"{snap} is being restored by another restore: agent pid {first.pid} on "
        ), e
        assert e["reason"].endswith(dirclaim.REFUSED["restore"]), e
        assert out["phases"] == [], out["phases"]
        assert _digest(snap) == digest
    finally:
        os.kill(first.pid, signal.SIGCONT)
    stdout, _ = first.communicate(timeout=300)
    assert first.returncode == 0, stdout
    assert json.loads(stdout)["ok"] is True
    assert a.wait_restored_exit(300) in (0, None)
    s = [e for e in a.events(offset) if demo.kind(e) == "summary"]
    assert [(x["ok"], x["lost"], x["duplicated"], x["torn"]) for x in s] == [(True, 0, 0, 0)]
    demo.reap_zombies()
    # the claim went with the restore: the snapshot is exactly what the checkpoint wrote
    assert not (snap / dirclaim.CLAIM_NAME).exists()
    assert _digest(snap) == digest
    rc, out = demo.run_agent("delete", str(snap))
    assert rc == 0 and out["deleted"] == str(snap), out
    assert not snap.exists()
