"""Fixtures for the CRIU tests.

- ``criu_ok`` (tests/conftest.py): a working CRIU, installed by scripts/install-criu.sh when
  none is found, else a skip with the reason printed (a machine where CRIU cannot run at all).
- ``spawn_tree``: starts tests/criu/criu_workload.py (launcher + 2 children) with setsid and stdio
  on files/``/dev/null``, waits until it is ready; every tree it started, and every restored
  tree registered with ``track``, is SIGKILLed at teardown.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from criu_helpers import WORKLOAD, Tree, kill_tree, wait_until


@pytest.fixture
def spawn_tree(tmp_path, criu_ok):
    started: list[Tree] = []
    extra: list[list[int]] = []

    def spawn(**extra_env: str) -> Tree:
        run_dir = tmp_path / f"run{len(started)}"
        run_dir.mkdir()
        env = {k: v for k, v in os.environ.items() if not k.startswith("LD_")}
        env["PYTHONUNBUFFERED"] = "1"
        env.update(extra_env)
        with open(run_dir / "launcher.out", "wb") as out:
            popen = subprocess.Popen(
                [sys.executable, str(WORKLOAD), str(run_dir)],
                start_new_session=True,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=run_dir,
            )
        tree = Tree(run_dir, popen)
        started.append(tree)

        def ready():
            if popen.poll() is not None:
                pytest.fail(
                    f"workload exited {popen.returncode}:\n{(run_dir / 'launcher.out').read_text()}"
                )
            names = (
                "launcher.json",
                "child-0.json",
                "child-1.json",
                "counter-0.log",
                "counter-1.log",
            )
            if not all((run_dir / n).exists() for n in names):
                return False
            return all(len(tree.counter(i)) > 20 for i in (0, 1))

        wait_until(ready, "the workload tree to start")
        tree.load()
        return tree

    spawn.track = extra.append
    yield spawn
    for tree in started:
        if tree.popen.returncode is None:
            # Not reaped yet, so its pid (the tree's process group) cannot have been reused:
            # kill the whole group, children included, even if the tree never got ready.
            try:
                os.killpg(tree.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        pids = tree.pids if tree.meta else [tree.launcher]
        kill_tree(pids)
        if tree.popen.poll() is None:
            tree.popen.kill()
        tree.popen.wait()
    for pids in extra:
        kill_tree(pids)


@pytest.fixture(autouse=True)
def _private_tmp(private_tmp):
    """Every test here: temporary files under pytest's tree (tests/conftest.py)."""
    return private_tmp
