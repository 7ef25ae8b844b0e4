"""Test only: ``CUINTERPOSE_TEST_SIGNAL_AT``, the agent signalling itself at a step boundary or
inside a step's blocking call, so that a test kills (or interrupts) the agent at an exact point
without sleeping (docs/agent.md "Test trigger").

The variable is a comma-separated list of ``WHEN:STEP[=SIGNAL]``:

- ``WHEN``: ``before`` / ``after`` (the step runner, agent/run/steps.py, calls
  :func:`signal_point` around each step) or ``during`` (the step's blocking call, once started:
  the quiesce wait once the ``.request`` is written, the first pid's native lock / checkpoint /
  restore / unlock once it returned, CRIU once its child has exec'd, the coordinator's first
  reply of a phase other than INSPECT);
- ``STEP``: a step name of ``Checkpoint.STEPS`` or ``Restore.STEPS`` ("capture", "native lock",
  "criu dump", ...): agent/run/steps.py registers its tables with :func:`register_steps`;
- ``SIGNAL``: ``SIGKILL`` (the default), ``SIGINT``, ``SIGTERM``, ``SIGHUP`` or ``SIGSTOP``
  (the agent stops there until the test has changed what it wants and sends ``SIGCONT``).

``during`` is accepted only for the steps of :data:`DURING` (the ones with such a call: their
step table's ``during`` column), so an entry that could never fire is refused instead of
passing vacuously.

Each entry fires at most once per process: ``os.kill(os.getpid(), SIGNAL)``. An entry naming
an unknown step, an unknown ``WHEN`` or signal raises ``AgentError`` naming the variable and the
known names (so a typo never makes a test pass vacuously).
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Iterable, Optional

from cuinterpose.agent.errors import AgentError

ENV = "CUINTERPOSE_TEST_SIGNAL_AT"
WHENS = ("before", "after", "during")
SIGNALS = ("SIGKILL", "SIGINT", "SIGTERM", "SIGHUP", "SIGSTOP")

#: the steps with a ``during`` point, and where it is (their step table's ``during`` column,
#: registered with :func:`register_steps`)
DURING: dict[str, str] = {}

#: the one-shot ``checkpoint``/``restore`` command's own points around its run (agent/cli):
#: ``before:request`` (the run has not started), ``after:result`` (the result is printed)
CLI_POINTS = ("request", "result")
#: every step name a step table registered (agent/run/steps.py: each StepRunner subclass),
#: and :data:`CLI_POINTS`
_known: dict[str, None] = dict.fromkeys(CLI_POINTS)
#: the step the step runner is running now (None between steps and during an undo)
_current: Optional[str] = None
#: (the variable's value, its parsed entries); entries that fired are removed
_parsed: tuple[Optional[str], list[tuple[str, str, int]]] = (None, [])
_lock = threading.Lock()


def register_steps(names: Iterable[str], during: Optional[dict] = None) -> None:
    """Add step names (a step table's) to the names the variable may use, and ``during``
    {step: where its during point is} to :data:`DURING`."""
    for n in names:
        _known[str(n)] = None
    DURING.update(during or {})


def known_steps() -> list[str]:
    """The step names the variable may use, in registration order."""
    return list(_known)


def set_current(step: Optional[str]) -> None:
    """The step runner: ``step`` starts (a name), or the running step ended (None)."""
    global _current
    _current = step


def current() -> Optional[str]:
    return _current


def parse(value: str) -> list[tuple[str, str, int]]:
    """``value`` as [(when, step, signal number)]. Raises ``AgentError`` (phase ``ENV``) for a
    malformed entry, an unknown ``WHEN``, step or signal."""
    out = []
    for raw in value.split(","):
        entry = raw.strip()
        if not entry:
            continue
        when, sep, rest = entry.partition(":")
        step, _, sig = rest.partition("=")
        when, step, sig = when.strip(), step.strip(), (sig.strip() or "SIGKILL")
        if not sep or when not in WHENS:
            raise AgentError(
                ENV,
                f"entry {entry!r} is not WHEN:STEP[=SIGNAL] with WHEN one of "
                f"{', '.join(WHENS)} (test only: unset it for a real run)",
            )
        if step not in _known:
            raise AgentError(
                ENV,
                f"entry {entry!r} names unknown step {step!r}; the known steps are "
                + ", ".join(repr(n) for n in _known),
            )
        if when == "during" and step not in DURING:
            raise AgentError(
                ENV,
                f"entry {entry!r}: step {step!r} has no during point; the steps with one are "
                + ", ".join(repr(n) for n in DURING),
            )
        if sig not in SIGNALS:
            raise AgentError(
                ENV, f"entry {entry!r} names signal {sig!r}; use one of {', '.join(SIGNALS)}"
            )
        out.append((when, step, int(getattr(signal, sig))))
    return out


def _entries() -> list[tuple[str, str, int]]:
    global _parsed
    value = os.environ.get(ENV)
    if value != _parsed[0]:
        _parsed = (value, parse(value) if value else [])
    return _parsed[1]


def signal_point(when: str, step: Optional[str] = None, *, after_exec: bool = False) -> None:
    """Send the signal of the first unfired entry ``when:step`` (``step`` defaults to the
    running step; nothing happens outside a step) to this process. ``after_exec``: the caller
    is about to start a helper (CRIU): the signal is sent from a thread once a child of this
    process has exec'd (its ``/proc/PID/exe`` is no longer this process's) and traces a
    process (CRIU has seized the tree it dumps or restores), or has exited. Raises
    ``AgentError`` for a malformed variable (see :func:`parse`); a no-op when it is unset."""
    if not os.environ.get(ENV):
        return
    step = step if step is not None else _current
    if step is None:
        return
    with _lock:
        entries = _entries()
        hit = next((e for e in entries if e[0] == when and e[1] == step), None)
        if hit is None:
            return
        entries.remove(hit)
    if after_exec:
        threading.Thread(target=_kill_after_exec, args=(hit[2], step), daemon=True).start()
    else:
        os.kill(os.getpid(), hit[2])


def _children() -> list[int]:
    out = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                out += [int(p) for p in f.read().split()]
        except OSError:
            pass
    return out


def _tracees(tracer: int) -> list[int]:
    """Every process whose ``TracerPid`` is ``tracer``."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                for line in f:
                    if line.startswith("TracerPid:"):
                        if int(line.split()[1]) == tracer:
                            out.append(int(name))
                        break
        except (OSError, ValueError):
            pass
    return out


def _kill_after_exec(sig: int, step: str) -> None:
    """Poll this process's children until one runs another program and then either traces a
    process (CRIU has seized the tree it dumps: the middle of its work) or is gone, then signal
    ourselves; give up once ``step`` is no longer the running step (the helper never started:
    the step failed or ended)."""
    import time

    me = os.readlink("/proc/self/exe")
    helper = None
    while _current == step:
        if helper is None:
            for child in _children():
                try:
                    if os.readlink(f"/proc/{child}/exe") != me:
                        helper = child
                        break
                except OSError:
                    pass
        if helper is not None and (helper not in _children() or _tracees(helper)):
            os.kill(os.getpid(), sig)
            return
        time.sleep(0.002)
