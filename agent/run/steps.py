"""The step runner shared by :class:`~cuinterpose.agent.run.checkpoint.Checkpoint` and
:class:`~cuinterpose.agent.run.restore.Restore`: a :class:`Step` table declared once per
sequence, iterated by the one-shot run (a *stage* at a time) and by the group phases (a named
slice at a time); the interrupt check between steps and the wrapping of unexpected exceptions
live here (docs/agent.md "Steps"), and so does the test trigger around each step
(:func:`signal_point`, ``CUINTERPOSE_TEST_SIGNAL_AT``: agent/mech/signal_at.py).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

from cuinterpose.agent.errors import AgentError
from cuinterpose.agent.mech import native_call, signal_at
from cuinterpose.agent.run import durable

#: the modules whose step tables CUINTERPOSE_TEST_SIGNAL_AT may name (each registers its table
#: when its class is defined; :func:`signal_point` loads them by name, at run time, so that a
#: checkpoint process also knows the restore's names: a typo is never mistaken for a step the
#: process merely has not loaded)
SEQUENCE_MODULES = ("cuinterpose.agent.run.checkpoint", "cuinterpose.agent.run.restore")


def signal_point(when: str, step: Optional[str] = None) -> None:
    """The test trigger (agent/mech/signal_at.py, docs/agent.md "Test trigger"): when
    ``CUINTERPOSE_TEST_SIGNAL_AT`` has an unfired entry ``when:step`` (``step``: the running
    step when None), the agent sends its signal to itself. Raises ``AgentError`` (phase
    ``CUINTERPOSE_TEST_SIGNAL_AT``) naming the known steps for an entry naming none of them."""
    if os.environ.get(signal_at.ENV):
        import importlib

        for m in SEQUENCE_MODULES:
            importlib.import_module(m)
    signal_at.signal_point(when, step)


@dataclasses.dataclass(frozen=True)
class Step:
    """One step of a sequence.

    ``name``: the step's one name: its progress row (and so its manifest timing and metrics
    label), the phase its errors and interrupt checks name. A step may record finer rows
    (one ``criu dump`` per tree, the coordinator's phases, ``native unlock``).
    ``method``: the method of the run object that performs it (looked up when it runs).
    ``group``: the group phase (a named slice of the table) it belongs to.
    ``stage``: the part of the one-shot run it belongs to; each stage has its own failure
    handling (refused, rolled back, ...: the sequence's ``run``).
    ``check``: the interrupt guard is asked right after it."""

    name: str
    method: str
    group: str
    stage: str
    check: bool = True


def group_phases(steps: tuple[Step, ...]) -> tuple[str, ...]:
    """The group phases of a step table: its slices' names, in table order."""
    return tuple(dict.fromkeys(s.group for s in steps))


def last_phase(rep, default: str) -> str:
    """The phase an unexpected exception is charged to: the last progress row (the running
    step's own, or a finer one it recorded), else ``default``."""
    return rep.phases[-1].name if rep.phases else default


def unexpected(
    rep,
    e: BaseException,
    default: str,
    *,
    prefix: str = "",
    tail: str = "",
    outcome: Optional[str] = None,
) -> AgentError:
    """An exception that is no ``AgentError`` (a bug, an OS error nobody expected) as the
    ``AgentError`` of the phase that was running (:func:`last_phase`)."""
    return AgentError(
        last_phase(rep, default), f"{prefix}{type(e).__name__}: {e}{tail}", outcome=outcome
    )


def as_agent_error(e: BaseException, phase: str) -> AgentError:
    """Wrap a coordinator/CRIU exception as ``AgentError`` keeping its phase and pid, without
    repeating the "PHASE: pid N" prefix its message may already carry."""
    if isinstance(e, AgentError):
        return e
    phase = getattr(e, "phase", None) or phase
    pid = getattr(e, "pid", None)
    reason = str(e)
    if reason.startswith(f"{phase}: "):
        reason = reason[len(phase) + 2 :]
    if pid is not None and reason.startswith(f"pid {pid} "):
        reason = reason[len(f"pid {pid} ") :]
    return AgentError(phase, reason, pid=pid)


def coordinator_events(on_event):
    """Wrap a coordinator ``on_event`` callback: the first reply of a phase other than INSPECT
    (a request of the running step went out and one shim answered it) is the running step's
    ``during`` point (:func:`signal_point`), then ``on_event`` gets the event."""

    def wrapped(ev) -> None:
        if getattr(ev, "kind", None) == "reply" and getattr(ev, "phase", "") != "INSPECT":
            signal_point("during")
        if on_event is not None:
            on_event(ev)

    return wrapped


def strip_preload_env() -> None:
    """Remove ``LD_PRELOAD`` from this process's environment so that every helper the agent
    runs (CRIU, ...) starts without the shim."""
    os.environ.pop("LD_PRELOAD", None)


def helper_env(extra: Optional[dict] = None) -> dict:
    """Environment for a helper process: ours without ``LD_PRELOAD``."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env.update(extra or {})
    return env


class StepRunner:
    """Base of a checkpoint or restore run. A subclass sets ``KIND``, ``STEPS`` (its
    :class:`Step` table), ``GROUP_PHASES = group_phases(STEPS)``, ``UNDO`` (undo phase ->
    method) and ``GROUP_UNDO = tuple(UNDO)``, and provides ``r`` (its Reporter), ``guard``
    (its ``interrupt.Guard``), ``options`` (its options, agent/options.py), :meth:`interrupted`
    and :meth:`phase_state`."""

    KIND = ""
    STEPS: tuple[Step, ...] = ()
    GROUP_PHASES: tuple[str, ...] = ()
    UNDO: dict[str, str] = {}
    GROUP_UNDO: tuple[str, ...] = ()

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        # the names CUINTERPOSE_TEST_SIGNAL_AT may use
        signal_at.register_steps(s.name for s in cls.STEPS)

    def stage(self, stage: str) -> list[Step]:
        """The steps of one stage of the one-shot run, in order."""
        return [s for s in self.STEPS if s.stage == stage]

    def run_steps(self, steps) -> None:
        """Run ``steps`` in order, asking the interrupt guard after each that says so. (A
        group member runs without an active guard: the check never fires there.) Around each
        step: the test trigger's ``before``/``after`` points (:func:`signal_point`; raises
        ``AgentError`` for a malformed ``CUINTERPOSE_TEST_SIGNAL_AT``)."""
        for s in steps:
            signal_point("before", s.name)
            self.step_started(s)
            signal_at.set_current(s.name)
            try:
                with durable.polled(self, s.name):  # chunk-file progress, where it applies
                    getattr(self, s.method)()
            finally:
                signal_at.set_current(None)
            self.step_done(s)
            signal_point("after", s.name)
            if s.check:
                sig = self.guard.pending()
                if sig:
                    raise self.interrupted(s, sig)

    def step_started(self, step: Step) -> None:
        """Called right before ``step`` runs (a checkpoint records it in its ``.lock``)."""

    def step_done(self, step: Step) -> None:
        """Called right after ``step`` returned (not when it raised)."""

    def interrupted(self, step: Step, sig: str) -> AgentError:
        """The error a signal that arrived during ``step`` stops the run with."""
        raise NotImplementedError

    def phase_state(self) -> dict:
        """What a group phase answers about this member."""
        raise NotImplementedError

    def run_phase(self, name: str) -> dict:
        """Run one group phase on this node (the slice ``name`` of the table, or an undo
        phase); returns :meth:`phase_state`. Raises ``AgentError`` (phase and pid named) when
        it fails; the leader then runs the undo phases."""
        steps = [s for s in self.STEPS if s.group == name]
        if not steps and name not in self.UNDO:
            raise AgentError("group", f"unknown {self.KIND} phase {name!r}")
        self.r.begin()  # the wait since the last group phase is the leader's, not a row's
        try:
            with native_call.using(self.options):  # the run's driver options (agent/options.py)
                if steps:
                    self.run_steps(steps)
                else:
                    getattr(self, self.UNDO[name])()
        except AgentError:
            raise
        except Exception as e:
            raise unexpected(self.r, e, name) from e
        return self.phase_state()
