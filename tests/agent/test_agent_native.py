"""agent.native against fakecuda, and the census refusal of a CUDA process without the shim.

The driver is loaded in child processes only (loading fakecuda into the pytest process would
change the driver every later in-process test sees)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from cuinterpose.agent import paths
from cuinterpose.workloads.afdwin import demo

TARGET = textwrap.dedent("""
    import sys, time
    from cuda.bindings import driver as cu
    assert cu.cuInit(0)[0] == cu.CUresult.CUDA_SUCCESS
    print("up", flush=True)
    time.sleep(120)
""")

CONTROLLER = textwrap.dedent("""
    import json, sys
    from cuinterpose.agent.mech import native
    from cuinterpose.agent.errors import NativeError
    out = {}
    info = native.load("fake")
    out["info"] = info.to_dict()
    pid, bogus = int(sys.argv[1]), int(sys.argv[2])
    out["s0"] = native.get_state(pid)
    native.lock_all([pid], 1000)
    out["s1"] = native.get_state(pid)
    native.checkpoint_all([pid])
    out["s2"] = native.get_state(pid)
    try:
        native.lock_all([pid], 1000)
    except NativeError as e:
        out["relock"] = str(e)
    out["rollback"] = native.rollback_all([pid])
    out["s3"] = native.get_state(pid)
    try:
        native.get_state(bogus)
    except NativeError as e:
        out["bogus"] = [e.pid, e.action, e.result, str(e)]
    try:
        native.load("real")
    except Exception as e:
        out["switch"] = str(e)
    print(json.dumps(out))
""")


@pytest.fixture
def target(tmp_path):
    env = demo.workload_env(tmp_path, shim=False)
    p = subprocess.Popen([sys.executable, "-c", TARGET], stdout=subprocess.PIPE, text=True, env=env)
    assert p.stdout.readline().strip() == "up"
    yield p
    p.kill()
    p.wait()


def test_native_cycle_on_fakecuda(target):
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "LD_LIBRARY_PATH")}
    res = subprocess.run(
        [sys.executable, "-c", CONTROLLER, str(target.pid), str(2**22 + 3)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    fake = str((paths.fakecuda_dir() / paths.FAKECUDA_NAME).resolve())
    assert out["info"]["kind"] == "fake" and out["info"]["library"] == fake
    assert (out["s0"], out["s1"], out["s2"], out["s3"]) == (
        "RUNNING",
        "LOCKED",
        "CHECKPOINTED",
        "RUNNING",
    )
    assert out["relock"] == (
        f"native lock: pid {target.pid} cuCheckpointProcessLock: CUDA_ERROR_ILLEGAL_STATE"
    )
    assert out["rollback"] == {str(target.pid): "CHECKPOINTED"}
    assert out["bogus"][:3] == [2**22 + 3, "get_state", "CUDA_ERROR_OPERATING_SYSTEM"]
    assert (
        f"pid {2**22 + 3} cuCheckpointProcessGetState: CUDA_ERROR_OPERATING_SYSTEM"
        in out["bogus"][3]
    )
    assert "(no such process: it has exited)" in out["bogus"][3]
    assert "cannot switch to 'real'" in out["switch"]


def test_real_driver_refuses_fakecuda_on_library_path(tmp_path):
    env = demo.workload_env(tmp_path, shim=False)  # LD_LIBRARY_PATH = fakecuda dir
    res = subprocess.run(
        [
            sys.executable,
            "-c",
            "from cuinterpose.agent.mech import native\n"
            "try:\n native.load('real')\nexcept Exception as e:\n print(e)",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert "real driver requested but fakecuda" in res.stdout, res.stdout + res.stderr


def test_cuda_process_without_shim_is_refused_by_checkpoint(target, tmp_path):
    snap = tmp_path / "snap"
    rc, out = demo.run_agent(
        "checkpoint",
        "--pid",
        str(target.pid),
        "--images-dir",
        str(snap),
        "--driver",
        "fake",
        "--control-dir",
        str(tmp_path),
    )
    assert rc == 3 and not out["ok"]
    e = out["error"]
    assert (e["phase"], e["pid"], e["outcome"]) == ("census", target.pid, "refused")
    assert "is a CUDA process (state RUNNING) without the shim" in e["reason"]
    assert not (tmp_path / f"quiesce-{target.pid}.request").exists()
    assert not (snap / "manifest.json").exists()
    assert target.poll() is None


def test_restore_of_a_non_snapshot_is_refused(tmp_path):
    (tmp_path / "criu").mkdir()
    rc, out = demo.run_agent("restore", "--images-dir", str(tmp_path), "--driver", "fake")
    assert rc == 3 and out["error"]["phase"] == "manifest"
    assert "not a snapshot: no manifest.json" in out["error"]["reason"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["criu"]


def test_shim_path_command():
    res = subprocess.run(
        [sys.executable, "-m", "cuinterpose.agent.cli", "shim-path"], capture_output=True, text=True
    )
    assert res.returncode == 0 and res.stdout.strip() == str(paths.shim_path())
