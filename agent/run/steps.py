"""The step tables and the step runner shared by
:class:`~cuinterpose.agent.run.checkpoint.Checkpoint` and
:class:`~cuinterpose.agent.run.restore.Restore`: one :class:`Step` table per sequence
(:data:`CHECKPOINT_STEPS`, :data:`RESTORE_STEPS`), each row holding every property of its step
(its group phase and stage, the interrupt check, the chunk-file progress it reports, whether
it locks the workload before the capture, whether its group phase is the point of no return,
its ``during`` test point), iterated by the one-shot run (a *stage* at a time) and by the group
phases (a named slice at a time); the interrupt check between steps and the wrapping of
unexpected exceptions live here (docs/agent.md "Steps"), and so does the test trigger around
each step (:func:`signal_point`, ``CUINTERPOSE_TEST_SIGNAL_AT``: agent/mech/signal_at.py).
"""

from __future__ import annotations

import dataclasses
import os
from typing import NamedTuple, Optional

from cuinterpose.agent.errors import AgentError
from cuinterpose.agent.mech import native_call, signal_at
from cuinterpose.agent.run import durable


def signal_point(when: str, step: Optional[str] = None) -> None:
    """The test trigger (agent/mech/signal_at.py, docs/agent.md "Test trigger"): when
    ``CUINTERPOSE_TEST_SIGNAL_AT`` has an unfired entry ``when:step`` (``step``: the running
    step when None), the agent sends its signal to itself. Raises ``AgentError`` (phase
    ``CUINTERPOSE_TEST_SIGNAL_AT``) naming the known steps (both tables of this module, and
    any other :class:`StepRunner`'s) for an entry naming none of them."""
    signal_at.signal_point(when, step)


class ChunkPoll(NamedTuple):
    """A step that moves chunk bytes (the chunk format of issue 12): ``row``, the progress row
    its bytes go to; ``mode``, "write" or "read"; ``prefix``, the name prefix of its own
    stream files under ``chunks/`` (the shim carriers' "shared-", GPU storage's "gpu-"),
    agent/run/durable.py ``polled``."""

    row: str
    mode: str
    prefix: str


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
    ``check``: the interrupt guard is asked right after it.
    ``poll``: the chunk-file progress it reports while it runs (:class:`ChunkPoll`), None.
    ``locks``: it locks the CUDA processes before the capture (a checkpoint's ``.lock``
    records it and its end, so a release of a dead agent unlocks them).
    ``no_return``: its group phase is the first that cannot be undone (a group leader confirms
    every member's lease before it).
    ``during``: where its ``during`` test point is ("": it has none; agent/mech/signal_at.py)."""

    name: str
    method: str
    group: str
    stage: str
    check: bool = True
    poll: Optional[ChunkPoll] = None
    locks: bool = False
    no_return: bool = False
    during: str = ""


#: The checkpoint, once. ``stage`` says how the one-shot run handles a failure: ``images``
#: (before the signal guard), ``refusal`` (nothing torn down: refused, the quiesce request
#: cancelled), ``teardown`` (rolled back), ``finish`` (the snapshot is complete). ``group``
#: names the group phase each step belongs to (docs/service.md): a leader runs each on every
#: member and waits for all before the next, so no member locks before every member is
#: quiesced and none is killed or resumed before every manifest is written.
CHECKPOINT_STEPS = (
    Step("images dir", "prepare_images_dir", "prepare", "images", check=False),
    Step("driver", "load_driver", "prepare", "refusal"),
    Step("census", "take_census", "prepare", "refusal"),
    Step("coordinator", "make_coordinator", "prepare", "refusal", check=False),
    Step(
        "quiesce",
        "quiesce",
        "quiesce",
        "refusal",
        during="quiesce.wait_ready, once the .request is written",
    ),
    Step(
        "quiescence check",
        "quiescence_check",
        "quiesce",
        "refusal",
        locks=True,
        during="native lock_all/unlock_all, after the first pid's call",
    ),
    Step(
        "capture",
        "capture_shared",
        "capture",
        "teardown",
        poll=ChunkPoll("SAVE_ALLOCATIONS", "write", "shared-"),
        during="the coordinator's first reply of a phase other than INSPECT",
    ),
    Step(
        "native lock",
        "native_lock",
        "native lock",
        "teardown",
        during="native lock_all, after the first pid's call",
    ),
    Step(
        "native checkpoint",
        "native_checkpoint",
        "native checkpoint",
        "teardown",
        poll=ChunkPoll("native checkpoint", "write", "gpu-"),
        during="native checkpoint_all, after the first pid's call",
    ),
    Step(
        "criu dump",
        "criu_dump",
        "criu dump",
        "teardown",
        during="criu_run.run, once CRIU's child has exec'd",
    ),
    # every file under DIR and every directory on stable storage, images hashed (once)
    Step("sync", "sync_snapshot", "manifest", "teardown"),
    # the point of no return: once the manifest is on disk a signal no longer stops it
    Step("manifest", "write_manifest", "manifest", "teardown", check=False),
    # s3://: the local snapshot to the object store (run/upload.py), before anything is killed
    Step("upload", "upload_snapshot", "upload", "finish", check=False),
    # the group phase that kills or resumes the dumped trees: no undo after it
    Step("finish", "finish", "finish", "finish", check=False, no_return=True),
    Step("resume", "resume", "resume", "finish", check=False),
)

#: The restore, once. ``stage``: ``refusal`` (only reads: a refused snapshot is left untouched,
#: nothing changed) or ``restore`` (from CRIU restore on: a failure kills the restored trees,
#: ``RestoreFailed``). ``group`` names the group phase each step belongs to
#: (docs/service.md): no member resumes its workload before every member restored its shared
#: memory.
RESTORE_STEPS = (
    Step("download", "download_snapshot", "prepare", "refusal"),  # s3://: run/download.py
    Step("manifest", "read_manifest_checked", "prepare", "refusal"),
    Step("verify", "verify_images", "prepare", "refusal"),
    Step("driver", "load_driver", "prepare", "refusal"),
    Step("placement", "place", "prepare", "refusal"),
    Step("stale sockets", "remove_stale", "stale sockets", "refusal", check=False),
    Step(
        "criu restore",
        "criu_restore",
        "criu restore",
        "restore",
        during="criu_run.run, once CRIU's child has exec'd",
    ),
    Step(
        "native restore",
        "native_restore",
        "native restore",
        "restore",
        poll=ChunkPoll("native restore", "read", "gpu-"),
        during="native restore_all/unlock_all, after the first pid's call",
    ),
    Step(
        "restore shared",
        "restore_shared",
        "restore shared",
        "restore",
        poll=ChunkPoll("LOAD_ALLOCATIONS", "read", "shared-"),
        during="the coordinator's first reply of a phase other than INSPECT",
    ),
    # the restored trees run: no undo after it
    Step("resume", "resume", "resume", "restore", check=False, no_return=True),
)


def _register(steps) -> None:
    """The names (and ``during`` points) CUINTERPOSE_TEST_SIGNAL_AT may use."""
    signal_at.register_steps((s.name for s in steps), {s.name: s.during for s in steps if s.during})


# both tables from the start: a checkpoint process knows the restore's names too, so a typo
# is never mistaken for a step the process has not loaded
_register(CHECKPOINT_STEPS)
_register(RESTORE_STEPS)


def group_phases(steps: tuple[Step, ...]) -> tuple[str, ...]:
    """The group phases of a step table: its slices' names, in table order."""
    return tuple(dict.fromkeys(s.group for s in steps))


def point_of_no_return(steps: tuple[Step, ...]) -> Optional[str]:
    """The first group phase of a step table that cannot be undone (its ``no_return`` row)."""
    return next((s.group for s in steps if s.no_return), None)


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
        _register(cls.STEPS)  # a table of its own (the two above are registered already)

    @classmethod
    def point_of_no_return(cls) -> Optional[str]:
        """The first group phase of :attr:`STEPS` that cannot be undone."""
        return point_of_no_return(cls.STEPS)

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
                with durable.polled(self, s.poll):  # chunk-file progress, where it applies
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
