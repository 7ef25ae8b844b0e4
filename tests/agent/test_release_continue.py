"""``release`` (agent/run/recover.py Recovery.continue_stopped) after an agent died past
``criu dump``: CRIU sends each task SIGSTOP just before it detaches, and the stop takes effect
only when the task is next scheduled. Whatever /proc shows at release time (T, or R/S with the
stop still pending), every process of a dumped tree must end up running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from cuinterpose.agent.mech import census
from cuinterpose.agent.run import recover


def _state(pid: int) -> str:
    return census.read_stat_state(pid)[2]


def _until(pred, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() >= deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.01)


@pytest.fixture
def tree():
    """A root (python) with one child (sleep): {root: [root, child]}."""
    root = subprocess.Popen(
        [sys.executable, "-c", "import subprocess; subprocess.run(['sleep', '600'])"],
        start_new_session=True,
    )
    try:
        _until(lambda: len(census.walk_tree([root.pid])) == 2, "the child to start")
        pids = [p for p, _, _ in census.walk_tree([root.pid])]
        yield root.pid, pids
    finally:
        os.killpg(root.pid, signal.SIGKILL)
        root.wait()


def _recovery(root: int, pids: list[int], steps: list[str]) -> recover.Recovery:
    lock = {"roots": [root], "tree_pids": {str(root): pids}, "steps": steps}
    return recover.Recovery("/nonexistent", root, "rid", lock)


@pytest.mark.parametrize("stopped", [True, False], ids=["stopped", "not-yet-stopped"])
def test_every_process_of_a_dumped_tree_runs_after_release(tree, stopped):
    """``stopped``: the tree shows T (CRIU's SIGSTOP took effect); else it shows S, as a task
    does whose SIGSTOP is still pending: release must not go by the state it reads."""
    root, pids = tree
    if stopped:
        for p in pids:
            os.kill(p, signal.SIGSTOP)
        _until(lambda: all(_state(p) == "T" for p in pids), "the tree to stop")
    rec = _recovery(root, pids, ["criu dump", f"criu dump {root}"])
    assert sorted(rec.continue_stopped()) == sorted(pids)
    _until(lambda: all(_state(p) not in ("T", "t") for p in pids), "the tree to run")


def test_a_pending_stop_is_discarded_by_the_continue(tree):
    """SIGSTOP then at once release's SIGCONT, in whichever order the kernel acts on them: the
    tree is left running (SIGCONT discards a queued stop; signal(7))."""
    root, pids = tree
    for p in pids:
        os.kill(p, signal.SIGSTOP)
    rec = _recovery(root, pids, ["criu dump", f"criu dump {root}"])
    assert sorted(rec.continue_stopped()) == sorted(pids)
    _until(lambda: all(_state(p) not in ("T", "t") for p in pids), "the tree to run")
    time.sleep(0.05)  # a stop still queued would have taken effect by now
    assert [_state(p) in ("T", "t") for p in pids] == [False, False]


def test_without_a_dump_only_stopped_processes_are_continued(tree):
    root, pids = tree
    os.kill(pids[1], signal.SIGSTOP)
    _until(lambda: _state(pids[1]) == "T", "the child to stop")
    rec = _recovery(root, pids, ["capture", "native checkpoint"])
    assert rec.continue_stopped() == [pids[1]]
    _until(lambda: _state(pids[1]) != "T", "the child to run")
