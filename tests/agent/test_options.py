"""Issue 23: every option and environment variable a checkpoint reads later is checked before
its first step that changes anything. A bad one is refused (exit 3, phase "request", naming the
variable and the value) before the images dir is created, the workload is asked anything or a
shim is touched: ``CUINTERPOSE_GPU_STORAGE=bogus checkpoint --leave-running`` used to quiesce,
tear the shared memory down and only then fail (exit 4). The options are read once, by the
command's options object (agent/options.py ``from_environ``); the node key and the test hook
by the checkpoint's first step (agent/run/images.py ``preflight``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cuinterpose.workloads.afdwin import demo

SECONDS = "must be a finite number of seconds above 0 and at most 86400"
BAD = [
    (
        "CUINTERPOSE_GPU_STORAGE",
        "bogus",
        "request: $CUINTERPOSE_GPU_STORAGE='bogus': must be one of auto, custom, host",
    ),
    (
        "CUINTERPOSE_NATIVE_BACKEND",
        "nope",
        "request: $CUINTERPOSE_NATIVE_BACKEND='nope': must be one of auto, driver-api, "
        "cuda-checkpoint",
    ),
    (
        "CUINTERPOSE_DRIVER_CALL_TIMEOUT_S",
        "soon",
        "request: $CUINTERPOSE_DRIVER_CALL_TIMEOUT_S='soon': must be a number of seconds",
    ),
    ("CUINTERPOSE_CRIU_TIMEOUT_S", "-1", f"request: $CUINTERPOSE_CRIU_TIMEOUT_S='-1': {SECONDS}"),
    (
        "CUINTERPOSE_CHUNK_BYTES",
        "8MB",
        "request: $CUINTERPOSE_CHUNK_BYTES='8MB': '8MB' is not a byte count: MB is ambiguous",
    ),
    (
        "CUINTERPOSE_STAGING_BYTES",
        "1KiB",
        "request: $CUINTERPOSE_STAGING_BYTES 1024 must be at least --chunk-bytes (the default)",
    ),
    (
        "CUINTERPOSE_CHUNK_CHECKSUM",
        "md5",
        "request: $CUINTERPOSE_CHUNK_CHECKSUM='md5': must be one of blake2b-256, sha256",
    ),
    (
        "CUINTERPOSE_INCREMENTAL",
        "yes",
        "request: $CUINTERPOSE_INCREMENTAL='yes': must be 1 or true, 0 or false",
    ),
    ("CUINTERPOSE_DRIVER", "cuda", "request: $CUINTERPOSE_DRIVER='cuda': must be one of"),
    ("CUINTERPOSE_CONTROL_DIR", "x" * 300, "request: $CUINTERPOSE_CONTROL_DIR="),
    # not options: read by the checkpoint's first step, before anything changes
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
    assert (rc, err["phase"], err["outcome"]) == (3, "request", "refused"), out
    if name.startswith("CUINTERPOSE_TEST") or name.endswith("KEY_FILE"):  # the first step's
        assert says in err["message"], err["message"]
        assert err["message"].endswith("checkpoint refused before anything was changed")
    else:  # the options': before the command did anything
        assert err["message"].startswith(says), err["message"]
    assert not snap.exists() and list(ctl.iterdir()) == []  # no images dir, no request


@pytest.mark.parametrize("name,value,says", BAD[:-2], ids=[b[0] for b in BAD[:-2]])
def test_a_bad_variable_keeps_the_daemon_from_starting(tmp_path, name, value, says):
    """The daemon reads its options once, at its start: a bad variable is refused there
    (exit 2, naming it), not at each request."""
    rc, out = _agent(
        "serve",
        "--listen",
        f"unix:{tmp_path}/a.sock",
        "--snapshot-dir",
        str(tmp_path / "s"),
        env={name: value},
    )
    assert (rc, out["error"]["phase"], out["error"]["outcome"]) == (2, "serve", "usage"), out
    assert out["error"]["message"].startswith("serve: " + says.removeprefix("request: ")), out


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
