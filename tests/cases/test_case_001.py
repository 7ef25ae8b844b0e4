"""Case 001 (shared/cases/001-stopped-process-hang): a stopped process in the job made
`checkpoint` hang forever inside the driver's cuCheckpointProcessGetState.

Kind: a driver call or socket wait about another process without a deadline. Fixed: the census
(and ``inspect``) see state T/t in /proc/PID/stat before any driver call and refuse naming the
pid, the cause and what to do; every driver call the agent makes about another process has a
deadline (agent.mech.native.with_deadline), and fakecuda's controller waits on the target's
socket with one (CUDA_ERROR_TIMEOUT, as the real driver's lock does on its own timeout).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from cuinterpose.workloads.afdwin import demo

TARGET = textwrap.dedent("""
    import time
    from cuda.bindings import driver as cu
    assert cu.cuInit(0)[0] == cu.CUresult.CUDA_SUCCESS
    print("up", flush=True)
    time.sleep(300)
""")

CONTROLLER = textwrap.dedent("""
    import json, sys
    from cuinterpose.agent.mech import native
    from cuinterpose.agent.errors import NativeError
    from cuinterpose.agent.options import DriverOptions
    native.load("fake")
    # a front end: its options from the environment (the call deadline)
    with native.using(DriverOptions.from_environ()):
        try:
            print(json.dumps({"state": native.get_state(int(sys.argv[1]))}))
        except NativeError as e:
            print(json.dumps({"pid": e.pid, "action": e.action, "result": e.result}))
""")


@pytest.fixture
def stopped(tmp_path):
    """A shim'd fakecuda process (its own session, past cuInit), then SIGSTOPped; resumed and
    killed at teardown. Yields (pid, control dir)."""
    ctl = tmp_path / "ctl"
    ctl.mkdir(mode=0o700)
    p = subprocess.Popen(
        [sys.executable, "-c", TARGET],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=demo.workload_env(ctl),
        start_new_session=True,
    )
    try:
        assert p.stdout.readline().strip() == "up"
        assert (ctl / f"cuinterpose-{p.pid}.sock").exists()
        os.kill(p.pid, signal.SIGSTOP)
        # the stop is delivered asynchronously: wait for the state, not for a time
        while open(f"/proc/{p.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "T":
            os.sched_yield()
        yield p.pid, ctl
    finally:
        os.kill(p.pid, signal.SIGCONT)
        p.kill()
        p.wait()


def hint(pid):
    return (
        "is stopped (state T in /proc/{pid}/stat): it is stopped (SIGSTOP, a debugger, or an "
        "interrupted checkpoint that left the tree stopped): resume it with `kill -CONT {pid}`, "
        "or run `cuinterpose-agent release --pid <job root>` to finish an interrupted "
        "checkpoint, then retry"
    ).format(pid=pid)


def test_checkpoint_of_a_stopped_process_is_refused_before_any_driver_call(stopped, tmp_path):
    pid, ctl = stopped
    rc, out = demo.run_agent(
        "checkpoint",
        "--pid",
        str(pid),
        "--images-dir",
        str(tmp_path / "snap"),
        "--driver",
        "fake",
        "--control-dir",
        str(ctl),
    )
    assert rc == 3, out
    e = out["error"]
    assert (e["phase"], e["pid"], e["outcome"]) == ("census", pid, "refused")
    assert e["reason"] == f"(python3) {hint(pid)}" or e["reason"].endswith(hint(pid)), e
    assert not (tmp_path / "snap").exists()


def test_inspect_of_a_stopped_process_says_it_is_stopped(stopped):
    pid, ctl = stopped
    rc, out = demo.run_agent("inspect", "--pid", str(pid), "--control-dir", str(ctl))
    assert rc == 3, out
    e = out["error"]
    assert (e["phase"], e["pid"]) == ("INSPECT", pid)
    assert e["reason"].endswith(hint(pid)), e


def controller(pid, **env):
    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "LD_LIBRARY_PATH")}
    res = subprocess.run(
        [sys.executable, "-c", CONTROLLER, str(pid)],
        capture_output=True,
        text=True,
        env={**base, **env},
    )
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_fakecuda_controller_waits_on_the_target_with_a_deadline(stopped):
    """The agent's own deadline far away: fakecuda's controller gives up first."""
    pid, _ = stopped
    out = controller(
        pid, FAKECUDA_CONTROLLER_TIMEOUT_MS="200", CUINTERPOSE_DRIVER_CALL_TIMEOUT_S="3600"
    )
    assert out == {"pid": pid, "action": "get_state", "result": "CUDA_ERROR_TIMEOUT"}


def test_agent_gives_up_on_a_driver_call_past_its_deadline(stopped):
    """The driver's wait far away (the real driver's has none): the agent's deadline ends it."""
    pid, _ = stopped
    out = controller(
        pid, FAKECUDA_CONTROLLER_TIMEOUT_MS="3600000", CUINTERPOSE_DRIVER_CALL_TIMEOUT_S="0.2"
    )
    assert out == {
        "pid": pid,
        "action": "get_state",
        "result": "CUDA_ERROR_TIMEOUT (no answer from the driver within 0.2 s; the process is "
        "in state T; a stopped process: `kill -CONT` it, or `cuinterpose-agent release`)",
    }
