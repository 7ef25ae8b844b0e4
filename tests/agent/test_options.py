"""Issue 23: every option and environment variable a checkpoint reads later is checked before
its first step that changes anything. A bad one is refused (exit 3, phase "request", naming the
variable and the value) before the images dir is created, the workload is asked anything or a
shim is touched: ``CUINTERPOSE_GPU_STORAGE=bogus checkpoint --leave-running`` used to quiesce,
tear the shared memory down and only then fail (exit 4)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cuinterpose.workloads.afdwin import demo

BAD = [
    ("CUINTERPOSE_GPU_STORAGE", "bogus", "gpu storage: --gpu-storage 'bogus': expected one of"),
    ("CUINTERPOSE_NATIVE_BACKEND", "nope", "unknown native backend 'nope'"),
    ("CUINTERPOSE_DRIVER_CALL_TIMEOUT_S", "soon", "$CUINTERPOSE_DRIVER_CALL_TIMEOUT_S='soon'"),
    ("CUINTERPOSE_CRIU_TIMEOUT_S", "-1", "CUINTERPOSE_CRIU_TIMEOUT_S='-1'"),
    # the CLI reads these for its own usage check (exit 2) already; the daemon's requests too
    ("CUINTERPOSE_CHUNK_BYTES", "8MB", "CUINTERPOSE_CHUNK_BYTES='8MB'"),
    ("CUINTERPOSE_STAGING_BYTES", "1KiB", "CUINTERPOSE_STAGING_BYTES"),
    ("CUINTERPOSE_CHUNK_CHECKSUM", "md5", "CUINTERPOSE_CHUNK_CHECKSUM"),
    ("CUINTERPOSE_INCREMENTAL", "yes", "$CUINTERPOSE_INCREMENTAL='yes': must be 1, 0 or unset"),
    ("CUINTERPOSE_MANIFEST_KEY_FILE", "/nonexistent/key", "node key file /nonexistent/key"),
    ("CUINTERPOSE_TEST_DROP_REPLY", "NO_SUCH_OP", "'NO_SUCH_OP' is not OP[@PID][:N]"),
]


def _agent(*args, env):
    e = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    e.update(env)
    p = subprocess.run(
        [sys.executable, "-m", "cuinterpose.agent.cli", *args, "--json"],
        capture_output=True,
        text=True,
        env=e,
        timeout=300,
    )
    return p.returncode, json.loads(p.stdout)


@pytest.mark.parametrize("name,value,says", BAD, ids=[b[0] for b in BAD])
def test_a_bad_variable_is_refused_before_anything_changes(tmp_path, name, value, says):
    ctl = tmp_path / "ctl"
    ctl.mkdir(mode=0o700)
    snap = tmp_path / "snap"
    with subprocess.Popen(["sleep", "600"], start_new_session=True) as job:
        try:
            rc, out = _agent(
                "checkpoint",
                *("--pid", str(job.pid), "--images-dir", str(snap), "--leave-running"),
                *("--control-dir", str(ctl), "--driver", "fake"),
                env={name: value},
            )
        finally:
            job.kill()
    err = out["error"]
    if rc == 2:  # a usage error of the CLI: read before anything too
        assert err["phase"] == "usage" and says in err["message"], out
    else:
        assert (rc, err["phase"], err["outcome"]) == (3, "request", "refused"), out
        assert (
            says in err["message"]
            and "checkpoint refused before anything was changed" in (err["message"])
        ), err["message"]
    assert not snap.exists() and list(ctl.iterdir()) == []  # no images dir, no request


def test_bogus_gpu_storage_leaves_a_running_job_untouched(afdwin, tmp_path):
    """The issue's run: a held afdwin, ``CUINTERPOSE_GPU_STORAGE=bogus checkpoint
    --leave-running``: refused (exit 3), the job never saw a quiesce request and finishes
    exactly once its hold is released."""
    a = afdwin(steps=60, step_delay_ms=0, ranks=2, attention=1, hold_at=(20,))
    a.wait_hold(1)
    rc, out = _agent(
        *a.checkpoint_args(tmp_path / "snap"),
        "--leave-running",
        env={"CUINTERPOSE_GPU_STORAGE": "bogus"},
    )
    assert (rc, out["error"]["phase"]) == (3, "request"), out
    assert not any(demo.kind(e) == "quiesce_requested" for e in a.events())
    assert not (tmp_path / "snap").exists()
    a.release_hold()
    a.wait_ok(300)
    assert demo.check_run(a.events(), 60, expect_restore=False) == []
