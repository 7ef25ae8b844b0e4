"""SIGINT/SIGTERM/SIGHUP during a checkpoint or restore: stop at the next step boundary.

While a :class:`Guard` is active a signal is only recorded (a note goes to stderr; repeats are
ignored) and the running step finishes; the step runner (agent/run/steps.py) asks the guard
after each step and stops with :class:`Interrupted` there, handled like any other failure of
that step. :func:`shielded` keeps the signals from a helper (CRIU). A :class:`Cancel` stops a
run from another thread the same way (the daemon: its gRPC call was cancelled by the client).
:func:`hold` keeps a one-shot ``checkpoint``/``restore`` command's signals recorded from its
start until the process exits (D73): before the run a signal refuses it (:func:`refuse_if_held`),
a run's own :class:`Guard` takes over a signal that came just before it, and after the result
a signal is ignored with a note, so the exit code always says what happened. Why, and what
each stop leaves behind: docs/agent.md "Interrupting the agent".
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from typing import Callable, Optional

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


class Cancel:
    """A request to stop a run from another thread, asked like a signal at the next step
    boundary (:meth:`Guard.pending`): the daemon sets it when the client cancels its gRPC
    call. ``why`` (None until set) is what the run's error names, as a signal's name."""

    def __init__(self):
        self.why: Optional[str] = None

    def set(self, why: str) -> None:
        if self.why is None:
            self.why = why


class Guard:
    """Context manager: records SIGINT/SIGTERM/SIGHUP instead of dying. ``signame`` is the
    first signal's name (None if none). A no-op outside the main thread. ``cancel``: a
    :class:`Cancel` that stops the run too (the daemon's runs, outside the main thread).
    Entered while another guard's handler is installed (:func:`hold`), it takes over that
    guard's recorded signal."""

    def __init__(self, what: str = "checkpoint", cancel: Optional[Cancel] = None):
        self.what = what
        self.cancel = cancel
        self.signame: Optional[str] = None
        #: the run is over and its result stands: a signal is only noted (:func:`hold`)
        self.ended = False
        #: called with the first signal's name (:func:`on_signal`: ``--agent`` cancels its call)
        self.on_first: Optional[Callable[[str], None]] = None
        self._old: dict = {}

    def _handler(self, signum, frame):
        name = signal.Signals(signum).name
        if self.ended:
            self.signame = self.signame or name
            msg = (
                f"cuinterpose-agent: {name} ignored: the {self.what} has ended; its result "
                "(above) stands"
            )
        elif self.signame is None and self.on_first is not None:
            self.signame = name
            msg = (
                f"cuinterpose-agent: {name} received: cancelling the request; the agent "
                "daemon stops it at the end of its current phase"
            )
            self.on_first(name)
        elif self.signame is None:
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
                    cur = signal.getsignal(s)
                    if cur is signal.SIG_IGN:
                        continue  # nohup, or a background job of a shell: keep ignoring it
                    outer = getattr(cur, "__self__", None)
                    if isinstance(outer, Guard) and self.signame is None:
                        self.signame = outer.signame  # came before this run's guard
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
        sig = self.pending()
        if sig is not None:
            raise Interrupted(phase, sig)

    def pending(self) -> Optional[str]:
        """The first signal's name, else the :class:`Cancel`'s ``why``, else None."""
        if self.signame is not None:
            return self.signame
        return self.cancel.why if self.cancel is not None else None


#: the guard :func:`hold` installed for this process (None: none)
_held: Optional[Guard] = None


def hold(what: str) -> Guard:
    """Record SIGINT/SIGTERM/SIGHUP from now until this process exits (a one-shot
    ``checkpoint``/``restore``: so that click never turns a Ctrl-C into ``Aborted!``, exit 1).
    Pair with :func:`release_at_exit`. Returns the guard (a no-op outside the main thread)."""
    global _held
    _held = Guard(what).__enter__()
    return _held


def refuse_if_stopped(what: str, effect: str, cancel: Optional[Cancel] = None) -> None:
    """Raise ``AgentError`` (phase "request", refused) when :func:`hold`'s guard recorded a
    signal, or ``cancel`` is set: the ``what`` run has not started, nothing was changed
    (``effect`` says so in the command's words)."""
    sig = _held.signame if _held is not None else None
    sig = sig or (cancel.why if cancel is not None else None)
    if sig is not None:
        raise AgentError(
            "request",
            f"interrupted by {sig} before the {what} started; {what} cancelled, " + effect,
            outcome="refused",
        )


def on_signal(fn: Optional[Callable[[str], None]]) -> None:
    """Call ``fn(signal name)`` on the first signal :func:`hold`'s guard records (at once when
    one came already); None: no longer. ``fn`` runs in the signal handler: it must not block
    or take a lock (``--agent``: it starts a thread that cancels the gRPC call)."""
    if _held is None:
        return
    _held.on_first = fn
    if fn is not None and _held.signame is not None and not _held.ended:
        fn(_held.signame)


def settle() -> None:
    """The run is over (its result is what the command prints): a later signal is noted as
    ignored."""
    if _held is not None:
        _held.ended = True


def release_at_exit(exiting: bool = True) -> None:
    """The command is over. ``exiting`` (the process exits next: the console script or
    ``python -m``): ignore the signals :func:`hold` recorded (SIG_IGN survives the
    interpreter's shutdown, where a Python handler would be reset to the default and a late
    Ctrl-C would kill the process after its result was printed). Not ``exiting`` (the command
    was called in-process, e.g. by click's CliRunner or a library caller): give back the
    handlers :func:`hold` found, so the caller, and every child it starts later, is not left
    ignoring Ctrl-C (a SIG_IGN is inherited across exec)."""
    global _held
    if _held is None:
        return
    if not exiting:
        _held.__exit__(None, None, None)
        _held = None
        return
    for s in list(_held._old):
        try:
            signal.signal(s, signal.SIG_IGN)
        except (ValueError, OSError):
            pass
    _held = None
