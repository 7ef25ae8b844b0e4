"""A restore locks the snapshot it restores (agent/snapshot/dirclaim.py ``SnapshotLock``: a
flock of the directory, nothing written; decisions D72): while it runs, a ``delete`` of that
snapshot and a second restore of it are refused (exit 3) naming the restore's agent pid, before
either changes anything; the snapshot stays byte for byte (its directory's mtime too), the
restore finishes (exit 0) and the job ends exactly."""

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
    """Every file's SHA-256 and every directory's mtime (ns), by path under ``snap``."""
    out = {".": snap.stat().st_mtime_ns}
    for p in sorted(snap.rglob("*")):
        out[str(p.relative_to(snap))] = sha256_file(p) if p.is_file() else p.stat().st_mtime_ns
    return out


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
        assert dirclaim.lock_holders(snap) == [first.pid]

        rc, out = demo.run_agent("delete", str(snap))
        assert rc == 3, out
        e = out["error"]
        assert (e["phase"], e["outcome"]) == ("delete", "refused")
        assert e["reason"] == (
            f"{snap} is in use by a restore or delete of it: agent pid {first.pid}; nothing removed"
        ), e
        assert _digest(snap) == digest

        rc, out = demo.run_agent("restore", "--images-dir", str(snap), "--driver", "fake")
        assert rc == 3, out
        e = out["error"]
        assert (e["phase"], e["outcome"]) == ("manifest", "refused")
        assert e["reason"] == (
            f"{snap} is in use by a restore or delete of it: agent pid {first.pid}; restore "
            "refused, nothing was changed, the snapshot is untouched; restore it once that run "
            "has finished"
        ), e
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
    # the lock went with the restore; the snapshot is exactly what the checkpoint wrote
    assert dirclaim.lock_holders(snap) == []
    assert _digest(snap) == digest
    rc, out = demo.run_agent("delete", str(snap))
    assert rc == 0 and out["deleted"] == str(snap), out
    assert not snap.exists()
