"""SIGINT/SIGTERM/SIGHUP during a checkpoint or restore: stop at the next step boundary.

While a :class:`Guard` is active a signal is only recorded (a note goes to stderr; repeats are
ignored) and the running step finishes; the step runner (agent/run/steps.py) asks the guard
after each step and stops with :class:`Interrupted` there, handled like any other failure of
that step. :func:`shielded` keeps the signals from a helper (CRIU). Why, and what each stop
leaves behind: docs/agent.md "Interrupting the agent".
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from typing import Optional

from cuinterpose.agent.errors import AgentError

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(AgentError):
    """The operator (or a supervisor) signalled the agent; raised at a phase boundary."""

    def __init__(self, phase: str, signame: str, reason: Optional[str] = None):
        self.signame = signame
        super().__init__(phase, reason or f"interrupted by {signame} after {phase}")


@contextlib.contextmanager
def shielded():
    """Block SIGINT/SIGTERM/SIGHUP in this thread while a helper runs (CRIU): the helper
    inherits the blocked mask, so a terminal's Ctrl-C, which goes to the whole foreground
    process group, does not kill CRIU half-way through a dump (its parasite inside the
    workload). The signals stay pending and reach the :class:`Guard` when this block ends."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class Guard:
    """Context manager: records SIGINT/SIGTERM/SIGHUP instead of dying. ``signame`` is the
    first signal's name (None if none). A no-op outside the main thread."""

    def __init__(self, what: str = "checkpoint"):
        self.what = what
        self.signame: Optional[str] = None
        self._old: dict = {}

    def _handler(self, signum, frame):
        name = signal.Signals(signum).name
        if self.signame is None:
            self.signame = name
            msg = (
                f"cuinterpose-agent: {name} received: the {self.what} stops at the end of "
                "the current phase and what it changed is undone (a checkpoint whose "
                "snapshot is already written finishes instead)"
            )
        else:
            msg = (
                f"cuinterpose-agent: {name} ignored: already stopping after {self.signame}; "
                "the current phase ends at the latest at its deadline (--phase-timeout-s, "
                "--carrier-timeout-s, --lock-timeout-ms); SIGKILL abandons the workload "
                "in whatever state it is"
            )
        try:
            sys.stderr.write(msg + "\n")
            sys.stderr.flush()
        except Exception:
            pass

    def __enter__(self) -> "Guard":
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                try:
                    if signal.getsignal(s) is signal.SIG_IGN:
                        continue  # nohup, or a background job of a shell: keep ignoring it
                    self._old[s] = signal.signal(s, self._handler)
                except (ValueError, OSError):
                    pass
        return self

    def __exit__(self, *exc) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old = {}

    def check(self, phase: str) -> None:
        """Raise :class:`Interrupted` (naming ``phase``, the one that just finished) if a
        signal arrived."""
        if self.signame is not None:
            raise Interrupted(phase, self.signame)

    def pending(self) -> Optional[str]:
        return self.signame
