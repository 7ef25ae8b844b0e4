"""Case 002 (shared/cases/002-thread-id): `checkpoint --pid T` / `inspect --pid T` with T a
thread of process P gave a false reason ("no such process", "no control socket").

Kind: a pid the agent takes that is not a process id. Fixed: every pid taken (checkpoint and
group roots through the census, inspect) is checked against ``Tgid`` in /proc/T/status, and
the refusal is "T is a thread of process P (name); pass a process id (the job's root)".
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from cuinterpose.agent.errors import CensusError
from cuinterpose.agent.mech import census_checks
from cuinterpose.workloads.afdwin import demo

PROG = (
    "import threading, time\n"
    "threading.Thread(target=time.sleep, args=(300,), daemon=True).start()\n"
    "print('up', flush=True)\n"
    "time.sleep(300)\n"
)


@pytest.fixture
def thread_of(tmp_path):
    """(process id, one of its other threads' ids, its name)."""
    p = subprocess.Popen(
        [sys.executable, "-c", PROG],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert p.stdout.readline().strip() == "up"
        tids = sorted(int(t) for t in os.listdir(f"/proc/{p.pid}/task") if int(t) != p.pid)
        name = open(f"/proc/{p.pid}/comm").read().strip()
        yield p.pid, tids[0], name
    finally:
        p.kill()
        p.wait()


def want(pid, tid, name):
    return f"is a thread of process {pid} ({name}); pass a process id (the job's root)"


def test_checkpoint_of_a_thread_names_its_process(thread_of, tmp_path):
    pid, tid, name = thread_of
    ctl = tmp_path / "ctl"
    ctl.mkdir(mode=0o700)
    rc, out = demo.run_agent(
        "checkpoint",
        "--pid",
        str(tid),
        "--images-dir",
        str(tmp_path / "snap"),
        "--driver",
        "fake",
        "--control-dir",
        str(ctl),
    )
    assert rc == 3, out
    e = out["error"]
    assert (e["phase"], e["pid"], e["reason"], e["outcome"]) == (
        "census",
        tid,
        want(pid, tid, name),
        "refused",
    )
    assert not (tmp_path / "snap").exists()


def test_inspect_of_a_thread_names_its_process(thread_of, tmp_path):
    pid, tid, name = thread_of
    rc, out = demo.run_agent("inspect", "--pid", str(tid), "--control-dir", str(tmp_path))
    assert rc == 3, out
    assert (out["error"]["phase"], out["error"]["reason"]) == ("INSPECT", want(pid, tid, name))


def test_the_check_passes_a_process_and_a_missing_pid(thread_of):
    pid, tid, name = thread_of
    census_checks.check_process_id(pid, "x")
    census_checks.check_process_id(2**22 + 3, "x")
    with pytest.raises(CensusError) as ei:
        census_checks.check_process_id(tid, "restore target")
    assert str(ei.value) == f"restore target: pid {tid} {want(pid, tid, name)}"


def test_restore_into_a_thread_names_its_process(thread_of, tmp_path):
    pid, tid, name = thread_of
    rc, out = demo.run_agent(
        "restore",
        "--images-dir",
        str(tmp_path / "snap"),
        "--into-pid",
        str(tid),
        "--driver",
        "fake",
    )
    assert rc == 3, out
    e = out["error"]
    assert (e["phase"], e["pid"], e["reason"]) == ("placement", tid, want(pid, tid, name))
