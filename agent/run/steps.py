"""The step runner shared by :class:`~cuinterpose.agent.run.checkpoint.Checkpoint` and
:class:`~cuinterpose.agent.run.restore.Restore`: a :class:`Step` table declared once per
sequence, iterated by the one-shot run (a *stage* at a time) and by the group phases (a named
slice at a time); the interrupt check between steps and the wrapping of unexpected exceptions
live here (docs/agent.md "Steps").
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

from cuinterpose.agent.errors import AgentError


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
    (its ``interrupt.Guard``), :meth:`interrupted` and :meth:`phase_state`."""

    KIND = ""
    STEPS: tuple[Step, ...] = ()
    GROUP_PHASES: tuple[str, ...] = ()
    UNDO: dict[str, str] = {}
    GROUP_UNDO: tuple[str, ...] = ()

    def stage(self, stage: str) -> list[Step]:
        """The steps of one stage of the one-shot run, in order."""
        return [s for s in self.STEPS if s.stage == stage]

    def run_steps(self, steps) -> None:
        """Run ``steps`` in order, asking the interrupt guard after each that says so. (A
        group member runs without an active guard: the check never fires there.)"""
        for s in steps:
            getattr(self, s.method)()
            if s.check:
                sig = self.guard.pending()
                if sig:
                    raise self.interrupted(s, sig)

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
        try:
            if steps:
                self.run_steps(steps)
            else:
                getattr(self, self.UNDO[name])()
        except AgentError:
            raise
        except Exception as e:
            raise unexpected(self.r, e, name) from e
        return self.phase_state()
