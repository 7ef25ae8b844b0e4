"""A chunk file write that fails (ENOSPC: the snapshot's filesystem is full) rolls the
checkpoint back: the agent reports SAVE_ALLOCATIONS naming pid, allocation, chunk and errno,
the workload keeps running with its memory intact (it runs to the end with every pair exact,
no restore), and ``DIR/chunks/`` is removed.

The full filesystem is a small tmpfs mounted in a private mount namespace of the agent only
(``unshare -m``) and filled before the checkpoint but for 16 KiB (the images dir's claim); the
shims write through the descriptors the agent passes, so they hit it too. Needs root (the
suite's e2e tests run as root)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from test_e2e_afdwin import HOLD, STEPS, assert_exact_pairs

from cuinterpose.workloads.afdwin import demo

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare(1)"
)


def test_chunk_write_enospc_rolls_back_and_removes_chunks(afdwin, tmp_path):
    a = afdwin(steps=STEPS, step_delay_ms=5, hold_at=(HOLD,))
    a.wait_hold()
    full = tmp_path / "full"
    full.mkdir()
    snap = full / "snap"
    out, rc, listing = tmp_path / "out.json", tmp_path / "rc", tmp_path / "listing"
    args = " ".join(
        [sys.executable, "-m", "cuinterpose.agent.cli", *a.checkpoint_args(snap), "--json"]
    )
    script = (
        f"set -e; mount -t tmpfs -o size=1m tmpfs {full}; "
        # 16 KiB left: the images dir and its claim fit (a checkpoint into a filesystem with
        # no room at all is refused before it asks the workload anything), the chunks do not
        f"dd if=/dev/zero of={full}/room bs=4096 count=4 2>/dev/null; "
        f"dd if=/dev/zero of={full}/filler bs=4096 2>/dev/null || true; rm {full}/room; set +e; "
        f"{args} > {out}; echo $? > {rc}; "
        f"(test -e {snap}/chunks && echo chunks; test -e {snap}/criu && echo criu; true) > {listing}"
    )
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        env=env,
        stdin=subprocess.DEVNULL,
        check=True,
        timeout=600,
    )
    cp = json.loads(out.read_text())
    assert int(rc.read_text()) == 4 and not cp["ok"], cp
    err = cp["error"]
    assert (err["phase"], err["outcome"]) == ("SAVE_ALLOCATIONS", "rolled_back"), err
    assert "SAVE_ALLOCATIONS: pid " in err["message"]
    assert "to its chunk file failed: No space left on device (errno 28)" in err["message"]
    assert listing.read_text() == ""  # chunks/ removed, no CRIU images
    # the workload was never torn down for good: it runs to the end, every pair exact
    assert a.proc.wait(timeout=300) == 0
    evs = a.events()
    s = assert_exact_pairs(evs, STEPS)
    assert (s["restores_seen"], s["quiesces"]) == (0, 1)
    resumed = [e for e in evs if demo.kind(e) == "resumed"]
    assert [(e["restored"], e["cancelled"]) for e in resumed] == [(False, False)]
    assert demo.check_run(evs, STEPS, attention=1, ffn=1, expect_restore=False) == []
