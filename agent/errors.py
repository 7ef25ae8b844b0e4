"""Errors raised by the node agent.

Every error names the phase it happened in, the process (pid) when one is to blame, and the
reason, so that an operator can act on the message alone:
``"native checkpoint: pid 4121 cuCheckpointProcessCheckpoint: CUDA_ERROR_ILLEGAL_STATE"``.

``outcome`` says what the failure left behind (see docs/agent.md):

- ``"refused"``: nothing was torn down; the workload keeps running untouched.
- ``"rolled_back"``: teardown had started; the agent rebuilt everything and the workload
  continues with its memory intact (``.resume`` with ``restored=false`` was written).
- ``"rollback_failed"``: teardown had started and rebuilding failed too; the workload is
  parked or broken and needs an operator.
- ``"snapshot_incomplete"``: kept for callers; ``checkpoint`` no longer produces it: the dumped
  trees stay stopped until the manifest is on disk, so a manifest failure is rolled back.
- ``"restore_failed"``: CRIU restore, or a step after it, failed; the restored tree was killed
  and the snapshot directory is untouched. A retry succeeds only once the cause is gone: a
  workload file whose size changed since the dump (CRIU "has bad size") keeps failing until
  it is back to its dumped size.
"""

from __future__ import annotations

from typing import Optional


class AgentError(Exception):
    """Base class: ``phase`` (str), ``pid`` (int or None), ``reason`` (str), ``outcome`` (str)."""

    outcome = "refused"

    def __init__(
        self, phase: str, reason: str, pid: Optional[int] = None, outcome: Optional[str] = None
    ):
        self.phase = phase
        self.pid = pid
        self.reason = reason
        if outcome is not None:
            self.outcome = outcome
        who = f"pid {pid} " if pid is not None else ""
        super().__init__(f"{phase}: {who}{reason}")

    def to_dict(self) -> dict:
        return {
            "phase": self.phase,
            "pid": self.pid,
            "reason": self.reason,
            "outcome": self.outcome,
            "message": str(self),
        }


class CensusError(AgentError):
    """The process census refused the tree (nothing was touched)."""


class QuiesceRefused(AgentError):
    """The workload did not answer the quiesce request in time (nothing was torn down)."""


class NativeError(AgentError):
    """A ``cuCheckpointProcess*`` call failed. ``action`` is the driver function's short name
    (``lock``, ``checkpoint``, ``restore``, ``unlock``, ``get_state``), ``result`` the CUresult
    name (``CUDA_ERROR_...``) or its integer as text when outside the enum."""

    def __init__(self, action: str, pid: Optional[int], result: str, phase: str = "native"):
        self.action = action
        self.result = result
        fn = "cuCheckpointProcess" + {"get_state": "GetState"}.get(action, action.capitalize())
        hint = NATIVE_HINTS.get((action, result), "")
        super().__init__(phase, f"{fn}: {result}" + (f" ({hint})" if hint else ""), pid=pid)


NATIVE_HINTS = {
    (
        "checkpoint",
        "CUDA_ERROR_NOT_SUPPORTED",
    ): "the process holds sharing the driver cannot checkpoint: an exported FD still open "
    "outside the shim's knowledge, a multicast object, or a legacy CUDA IPC export or import "
    "(drivers before r610 refuse those; run under the shim with CUINTERPOSE_IPC_ADAPTER on)",
    (
        "lock",
        "CUDA_ERROR_NOT_READY",
    ): "work was still in flight when the lock timed out: the workload is not quiescent",
    # What R580 answers for a pid that is not a CUDA process (docs/gpu-validation.md)
    ("get_state", "CUDA_ERROR_NOT_INITIALIZED"): "not a CUDA process: it never called cuInit",
    ("lock", "CUDA_ERROR_NOT_INITIALIZED"): "not a CUDA process: it never called cuInit",
    ("get_state", "CUDA_ERROR_OPERATING_SYSTEM"): "no such process: it has exited",
}


class PlacementError(AgentError):
    """The placement process cannot be used (gone, unreadable, a cgroup or stdio that cannot be
    joined): phase "placement", ``pid`` the placement pid; nothing was changed."""

    def __init__(self, reason: str, pid: Optional[int] = None, phase: str = "placement"):
        super().__init__(phase, reason, pid=pid)


class SnapshotError(AgentError):
    """A snapshot directory is missing, malformed, or incompatible (it is left untouched)."""


class LeftLocked(AgentError):
    """A refusal before teardown that could not give the processes back: the quiescence check
    locked them and the unlock of ``left_locked`` (sorted pids) got no answer (a process
    stopped meanwhile cannot answer the driver). Nothing was torn down, but the driver holds
    those pids LOCKED, so their CUDA calls block: outcome ``rollback_failed``. The workload
    stays parked and the ``.lock`` is kept without an owner, so that ``cuinterpose-agent
    release`` (SIGCONT, native unlock, ``.resume``) finishes it (agent/run/recover.py)."""

    outcome = "rollback_failed"

    def __init__(self, phase: str, cause: "NativeError", left_locked, root: int):
        self.left_locked = sorted(int(p) for p in left_locked)
        pids = ", ".join(map(str, self.left_locked))
        super().__init__(
            phase,
            f"{cause.reason}; nothing was torn down, but the driver still holds pid(s) {pids} "
            "LOCKED (their CUDA calls block), so the workload stays parked: `kill -CONT` any "
            f"stopped one, then `cuinterpose-agent release --pid {root}` unlocks them and "
            "resumes the workload",
            pid=cause.pid,
        )


class CheckpointFailed(AgentError):
    """A checkpoint failed after teardown started. ``cause`` is the original error;
    ``outcome`` says whether the rollback succeeded; ``lost``: what a job that lost a process
    during the checkpoint was left with (a rolled_back that is not intact)."""

    def __init__(
        self,
        cause: BaseException,
        outcome: str,
        rollback_error: Optional[str] = None,
        lost: Optional[str] = None,
    ):
        self.cause = cause
        self.rollback_error = rollback_error
        self.lost = lost
        phase = getattr(cause, "phase", "checkpoint")
        pid = getattr(cause, "pid", None)
        reason = getattr(cause, "reason", None) or str(cause)
        if outcome == "rolled_back" and lost:
            # a process of the job died during the checkpoint (not by the agent): what is
            # left was rolled back as far as it could be, and resumed
            reason += f" (rolled back what is left of the workload: {lost})"
        elif outcome == "rolled_back":
            reason += " (rolled back: the workload continues with its memory intact)"
        elif rollback_error:
            reason += f"; rollback failed too: {rollback_error}"
        super().__init__(phase, reason, pid=pid, outcome=outcome)


class RestoreFailed(AgentError):
    """A restore failed after CRIU restored the tree (the restored tree was killed)."""

    outcome = "restore_failed"
