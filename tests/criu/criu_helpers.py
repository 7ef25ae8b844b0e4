"""Helpers shared by the CRIU tests (imported by conftest.py and test_criu.py)."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import time

import pytest

from cuinterpose.agent.mech import criu

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent.parent
WORKLOAD = HERE / "criu_workload.py"


def wait_until(pred, what: str, timeout: float = 60.0, interval: float = 0.02):
    """Poll ``pred()`` until it returns a truthy value; fail the test naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        val = pred()
        if val:
            return val
        if time.monotonic() >= deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(interval)


def alive(pid: int) -> bool:
    """True when ``pid`` exists and is neither a zombie nor dead."""
    try:
        for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("State:"):
                return line.split()[1] not in ("Z", "X")
    except OSError:
        return False
    return False


def kill_tree(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in pids:
        criu.wait_exit(pid, timeout=30)


class Tree:
    """A running workload tree: ``run_dir``, ``launcher`` pid, ``children`` pids."""

    def __init__(self, run_dir: pathlib.Path, popen: subprocess.Popen):
        self.run_dir = run_dir
        self.popen = popen
        self.launcher = popen.pid
        self.meta = {}

    def load(self) -> None:
        self.meta = {
            name: json.loads((self.run_dir / f"{name}.json").read_text())
            for name in ("launcher", "child-0", "child-1")
        }

    @property
    def children(self) -> list[int]:
        return list(self.meta["launcher"]["children"])

    @property
    def pids(self) -> list[int]:
        return [self.launcher, *self.children]

    def counter(self, idx: int) -> list[str]:
        return (self.run_dir / f"counter-{idx}.log").read_text().split("\n")[:-1]


def stop_job(job: subprocess.Popen, restored: int | None) -> None:
    """Kill a test job: its restored tree (its own process group, not our child) if any, and
    the original ``job`` (reaped)."""
    if restored and alive(restored):
        os.killpg(restored, signal.SIGKILL)
        kill_tree([restored])
    if job.poll() is None:
        job.kill()
    job.wait()
