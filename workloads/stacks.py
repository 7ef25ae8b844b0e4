"""Where a workload process waits, on request: :func:`on_signal` makes ``SIGUSR2`` print the
Python stack of every thread (``faulthandler``), and the process goes on. A test harness that
finds a run hung sends it to every process of the run before it gives up
(tests/carw/carw_kit.py), so the failure says which call each process is blocked in.

Where the stacks go: ``$CUI_STACKS_DIR/stacks-PID.txt`` (appended) when that variable is set,
one file per process so that the dumps of processes signalled together do not interleave;
else stderr."""

from __future__ import annotations

import faulthandler
import os
import signal
import sys

#: the signal that prints the stacks (SIGUSR1 ends an afdwin hold: workloads/afdwin/attention.py)
SIGNAL = signal.SIGUSR2
#: the directory of the per-process files, from the environment
DIR_VAR = "CUI_STACKS_DIR"
_files: list = []  # faulthandler writes to the file's descriptor: keep the object alive


def path_of(directory: str, pid: int) -> str:
    return os.path.join(directory, f"stacks-{pid}.txt")


def on_signal() -> None:
    """Register the stack dump for this process (all threads)."""
    d = os.environ.get(DIR_VAR)
    out = sys.stderr
    if d:
        os.makedirs(d, exist_ok=True)
        out = open(path_of(d, os.getpid()), "a")  # noqa: SIM115 (lives as long as the process)
        _files.append(out)
    faulthandler.register(SIGNAL, file=out, all_threads=True)
