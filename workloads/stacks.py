"""Where a workload process waits, on request: :func:`on_signal` makes ``SIGUSR2`` print the
Python stack of every thread to stderr (``faulthandler``), and the process goes on. A test
harness that finds a run hung sends it to every process of the run before it gives up
(tests/carw/carw_kit.py), so the failure says which call each process is blocked in."""

from __future__ import annotations

import faulthandler
import signal
import sys

#: the signal that prints the stacks (SIGUSR1 ends an afdwin hold: workloads/afdwin/attention.py)
SIGNAL = signal.SIGUSR2


def on_signal() -> None:
    """Register the stack dump for this process (threads included; chained to no handler)."""
    faulthandler.register(SIGNAL, file=sys.stderr, all_threads=True)
