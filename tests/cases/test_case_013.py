"""Case 013 (shared/cases/013-bad-numbers-and-paths): out-of-range numbers and over-long paths
came back as internal errors (exit 5 "rollback_failed", raw Python text) and left a created
parent directory behind.

Kind: a request's fields used before they are checked. Fixed (agent/validate.py for the pids
and paths, agent/options.py for the options, both before anything happens): each field is
checked and a refusal is exit 3 "refused", phase "request", naming the field (the flag on the
command line) and the allowed range; nothing is created.
The manifest's part: when its final rewrite (the totals, after the trees are killed) hits
ENOSPC, no ``manifest.json.tmp`` is left, the first manifest stays complete, and ``--json``
carries the warning (agent/snapshot/manifest.py ``write``); asserted on a real checkpoint
(afdwin, CRIU) whose agent's second write to the temp file fails.
"""

from __future__ import annotations

import errno
import json
import os
import pathlib
import signal
import subprocess
import sys

import pytest

from cuinterpose.agent.errors import AgentError
from cuinterpose.agent.options import CheckpointOptions
from cuinterpose.workloads.afdwin import demo

SECONDS = "must be a finite number of seconds above 0 and at most 86400"
MS = "must be an integer from 0 to 86400000 (milliseconds); 0 = the driver-call deadline"


def checkpoint(tmp_path, images_dir, *extra):
    return demo.run_agent(
        "checkpoint", "--pid", "1", "--images-dir", images_dir, "--driver", "fake", *extra
    )


def test_an_images_dir_over_path_max_is_refused_and_nothing_is_created(tmp_path):
    d = str(tmp_path / "missing" / ("x" * 300))
    rc, out = checkpoint(tmp_path, d)
    assert rc == 3, out
    e = out["error"]
    assert (e["phase"], e["outcome"]) == ("request", "refused")
    assert e["reason"] == (
        f"images_dir has a component of 300 bytes ({'x' * 24}…): the limit is 255 (NAME_MAX)"
    )
    assert not (tmp_path / "missing").exists()
    d = str(tmp_path) + "/" + "/".join(["y" * 200] * 25)
    rc, out = checkpoint(tmp_path, d)
    assert rc == 3, out
    n = len(d.encode())
    assert (
        out["error"]["reason"]
        == f"images_dir is {n} bytes long (absolute): the limit is 4095 (PATH_MAX)"
    )


@pytest.mark.parametrize(
    "field,value,reason",
    [
        ("phase_timeout_s", float("nan"), f"phase_timeout_s=nan: {SECONDS}"),
        ("phase_timeout_s", float("inf"), f"phase_timeout_s=inf: {SECONDS}"),
        ("carrier_timeout_s", 1e300, f"carrier_timeout_s=1e+300: {SECONDS}"),
        ("lock_timeout_ms", -1, f"lock_timeout_ms=-1: {MS}"),
        ("lock_timeout_ms", 2**62, f"lock_timeout_ms={2**62}: {MS}"),
    ],
)
def test_out_of_range_numbers_name_the_field_and_range(field, value, reason):
    with pytest.raises(AgentError) as ei:
        CheckpointOptions(**{field: value})
    assert (ei.value.phase, ei.value.reason, ei.value.outcome) == ("request", reason, "refused")


def test_cli_nan_and_huge_numbers_are_refused_exit_3(tmp_path):
    snap = str(tmp_path / "snap")
    for extra, reason in (
        (("--phase-timeout-s", "nan"), f"--phase-timeout-s=nan: {SECONDS}"),
        (("--carrier-timeout-s", "inf"), f"--carrier-timeout-s=inf: {SECONDS}"),
        (("--lock-timeout-ms", str(2**62)), f"--lock-timeout-ms={2**62}: {MS}"),
    ):
        rc, out = checkpoint(tmp_path, snap, *extra)
        assert rc == 3, out
        e = out["error"]
        assert (e["phase"], e["outcome"], e["reason"]) == ("request", "refused", reason)
        assert not (tmp_path / "snap").exists()


# -- the manifest's final rewrite hits ENOSPC -----------------------------------------------
ENOSPC_AGENT = pathlib.Path(__file__).with_name("enospc_agent.py")
STEPS, HOLD = 80, 20


def _agent_enospc_at(n: int, *args: str) -> tuple[int, dict]:
    """``cuinterpose-agent ARGS --json`` whose n-th write to ``manifest.json.tmp`` fails with
    ENOSPC: (exit code, JSON)."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    res = subprocess.run(
        [sys.executable, str(ENOSPC_AGENT), str(n), *args, "--json"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        env=env,
        timeout=demo.HANG_S,
    )
    try:
        return res.returncode, json.loads(res.stdout)
    except ValueError:
        return res.returncode, {"raw": res.stdout + res.stderr}


def test_enospc_at_the_final_rewrite_leaves_no_tmp_and_warns_in_json(afdwin, tmp_path, private_tmp):
    a = afdwin(steps=STEPS, step_delay_ms=0, hold_at=(HOLD,))
    assert a.wait_hold(1) == HOLD
    snap = tmp_path / "snap"
    rc, cp = _agent_enospc_at(
        2, *a.checkpoint_args(snap), "--quiesce-timeout-ms", str(int(demo.HANG_S * 1000))
    )
    assert (rc, cp.get("ok")) == (0, True), cp
    assert a.wait_dumped(demo.HANG_S) == -signal.SIGKILL
    # the first manifest stays, complete; no temp file is left
    assert sorted(p.name for p in snap.iterdir()) == ["chunks", "criu", "manifest.json"]
    final = snap / "manifest.json"
    assert cp["warnings"] == [
        {
            "path": str(final),
            "message": (
                f"could not rewrite {final} (No space left on device): the snapshot is "
                "complete and restorable, but its manifest keeps the totals of its first "
                "write (wall_ms/paused_ms up to the manifest, not the final ones); nothing "
                "else is missing"
            ),
        }
    ]
    on_disk = json.loads(final.read_text())
    assert on_disk["snapshot_id"] == cp["snapshot_id"] and on_disk["warnings"] == []
    # ... and it restores: the run finishes with exact evidence
    rc, rs = demo.run_agent("restore", "--images-dir", str(snap), "--driver", "fake")
    assert (rc, rs.get("ok")) == (0, True), rs
    assert a.wait_restored_exit(demo.HANG_S) in (0, None)
    assert demo.check_run(a.events(), STEPS) == []
    assert sorted(p.name for p in snap.iterdir()) == ["chunks", "criu", "manifest.json"]


def test_a_failed_first_write_leaves_neither_file(tmp_path, monkeypatch):
    """The manifest writer itself: ENOSPC at its first write leaves no manifest.json and no
    manifest.json.tmp, and adds no warning (the checkpoint then fails at "manifest")."""
    from cuinterpose.agent.snapshot import manifest

    real = os.write

    def full(fd, data):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("/manifest.json.tmp"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data)

    m = {k: {} for k in manifest.REQUIRED}
    m["warnings"] = []
    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OSError) as ei:
        manifest.write(tmp_path, m)
    assert ei.value.errno == errno.ENOSPC
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    assert m["warnings"] == []
    # a rewrite over an existing manifest: that one stays byte for byte, the warning is added
    monkeypatch.setattr(os, "write", real)
    manifest.write(tmp_path, m)
    before = (tmp_path / "manifest.json").read_bytes()
    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OSError):
        manifest.write(tmp_path, m)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"]
    assert (tmp_path / "manifest.json").read_bytes() == before
    assert [w["path"] for w in m["warnings"]] == [str(tmp_path / "manifest.json")]


def test_a_failed_directory_fsync_after_the_first_rename_leaves_no_manifest(tmp_path, monkeypatch):
    """The rename happened and only the fsync of the snapshot directory failed (found by the
    chaos suite): a first manifest not known to be durable is removed again, so no
    manifest.json says the snapshot is complete of a checkpoint that then rolls back."""
    from cuinterpose.agent.snapshot import manifest

    real = os.fsync

    def eio_on_dirs(fd):
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd)

    m = {k: {} for k in manifest.REQUIRED}
    monkeypatch.setattr(os, "fsync", eio_on_dirs)
    with pytest.raises(OSError) as ei:
        manifest.write(tmp_path, m)
    assert ei.value.errno == errno.EIO
    assert sorted(p.name for p in tmp_path.iterdir()) == []
