"""Undoing a checkpoint that did not complete: the rebuild of a torn-down workload (trees CRIU
left stopped continued, native state back to RUNNING, the coordinator's rollback, ``.resume``
with ``restored=false``) and the group undo phases ``rollback`` and ``release``; and what the
``.lock`` records step by step so that the same undo can be done from outside once this agent
is dead (agent/run/recover.py). Which failure is refused, rolled back or rollback_failed:
docs/agent.md "What each failure leaves behind".
"""

from __future__ import annotations

import dataclasses
import signal
import time

from cuinterpose.agent.errors import AgentError, CheckpointFailed, LeftLocked
from cuinterpose.agent.mech import native, quiesce
from cuinterpose.agent.run import carriers, recover, upload
from cuinterpose.agent.run.steps import Step, as_agent_error
from cuinterpose.agent.snapshot.snapdir import SnapshotDir
from cuinterpose.coordinator.contract import quiesce_path, read_json


class Rollback:
    """The undo half of :class:`~cuinterpose.agent.run.checkpoint.Checkpoint` (a mixin: it
    works on the checkpoint's state)."""

    # -- the .lock record (case 009) --------------------------------------------------------

    def mark(self, step: str, **extra) -> None:
        """Append ``step`` to the ``.lock``'s ``steps`` (and merge ``extra``): what a dead
        agent had done. Best effort (a note when the write fails, e.g. ENOSPC): what a release
        needs (participants, records) is written before the capture's first mutating request,
        and that write is not (Rollback.step_started, recover.watch_first_inspect); a later
        mark only tells a release what it will find anyway (driver states, shim phases, the
        manifest on disk), and failing a step over it could, after the manifest, leave a
        manifest without its images."""
        try:
            quiesce.mark_step(self.control_dir, self.roots, self.qid, step, **extra)
        except OSError as e:
            self.r.note(f"warning: could not record step {step!r} in the .lock: {e}")

    def step_started(self, step: Step) -> None:
        """From the quiescence check on (it locks every CUDA process), each step is in the
        lock before it runs; the capture writes the lock's record (``torn_down``)."""
        if self.qid is None:
            return
        if step.name == "capture":
            self.mark("capture")
            quiesce.write_lock(
                self.control_dir,
                self.roots,
                self.qid,
                torn_down=True,
                record=recover.lock_record(self),
            )
            recover.watch_first_inspect(self)
        elif step.locks:
            # the check locks and unlocks every CUDA process: a release of an agent killed in
            # between must unlock them, with the same driver
            self.mark(
                step.name, cuda_pids=list(self.census.cuda_pids), driver=recover.driver_of(self)
            )
        elif step.stage == "teardown":
            self.mark(step.name)

    def step_done(self, step: Step) -> None:
        """``STEP done`` in the lock (``manifest done``: the snapshot is complete on disk)."""
        if self.qid is not None and (step.stage == "teardown" or step.locks):
            self.mark(
                f"{step.name} done",
                last_txn_id=recover.last_txn_id(getattr(self, "coordinator", None)),
            )

    def roll_back(self, cause: BaseException) -> CheckpointFailed:
        """A teardown step failed (``cause``): remove the CRIU images and rebuild the
        workload. Returns the error to raise: outcome ``rolled_back``, or ``rollback_failed``
        when the rebuild failed too."""
        own = self.owns_images_dir()
        if own:
            self.cleanup_images()
        try:
            self.rebuild(restored=False)
        except BaseException as rb:
            lost = self.lost_text(rb)
            if lost:  # the job lost a process: no release could rebuild it either
                if own:
                    carriers.remove_chunks(
                        self.images_dir, getattr(self.coordinator, "carriers", None)
                    )
                return CheckpointFailed(cause, "rolled_back", lost=lost)
            self.r.note(f"rollback failed: {rb}")
            way_out = f"{rb}; the workload stays parked: once the cause is fixed, " + (
                f"`cuinterpose-agent release --pid {self.roots[0]}` continues the rollback "
                "from the .lock"
                if self.capture is not None  # the lock holds the first INSPECT's records
                else f"`cuinterpose-agent release --pid {self.roots[0]} --force` resumes it "
                "without rebuilding"
            )
            return CheckpointFailed(cause, "rollback_failed", rollback_error=way_out)
        # the bytes are back on the device
        if own:
            carriers.remove_chunks(self.images_dir, getattr(self.coordinator, "carriers", None))
        return CheckpointFailed(cause, "rolled_back", lost=self.lost_text())

    # -- a job that lost a process during the checkpoint (issue 23) ------------------------
    def settle_lost(self) -> None:
        """After a rollback of a job that lost a process: wait (up to the quiesce timeout)
        until each root took its ``.resume`` (the workload removes its ``.request``) or exited
        (a job whose rank died usually ends itself), then remove the quiesce files this request
        left for a root that is gone (``.request``, ``.ready``, ``.lock``, and its ``.resume``),
        so no later process with that pid takes them for its own."""
        deadline = time.monotonic() + self.options.quiesce_timeout_ms / 1000.0
        for r in self.roots:
            while self.alive(r) and quiesce_path(self.control_dir, r, "request").exists():
                if time.monotonic() >= deadline:
                    break
                time.sleep(quiesce.POLL_S)
        gone = [r for r in self.roots if not self.alive(r)]
        quiesce.clear(self.control_dir, gone)
        for r in gone:
            res = quiesce_path(self.control_dir, r, "resume")
            if (read_json(res) or {}).get("id") == self.qid:
                res.unlink(missing_ok=True)

    def lost_pids(self) -> list[int]:
        """The census processes that are gone or zombies now: they died during the
        checkpoint (the agent kills nothing before the manifest), e.g. a rank killed as CRIU
        dumped. Their peers are rolled back without them (:meth:`rebuild_state`)."""
        procs = getattr(getattr(self, "census", None), "processes", None) or []
        return [p.pid for p in procs if not self.alive(p.pid)]

    def lost_text(self, failed: BaseException | None = None) -> str:
        """'' when no process of the job died; else what the rollback left (the outcome
        stays ``rolled_back``: the loss is not the agent's, and a ``release`` could not bring a
        dead process back either). ``failed``: the survivors' rebuild failed with it: they were
        resumed as they are (``.resume``, so the workload sees its loss; the shim refuses their
        CUDA calls on torn-down memory with CUDA_ERROR_NOT_READY, it never runs on it)."""
        lost = self.lost_pids()
        if not lost:
            return ""
        comms = {p.pid: p.comm for p in self.census.processes}
        who = ", ".join(f"pid {p} ({comms.get(p, '?')})" for p in lost)
        text = f"{who} died during the checkpoint, not by the agent: the job cannot finish intact"
        left = [r for r in self.roots if self.alive(r)]
        if failed is not None and left and self.qid is not None:
            if getattr(self, "group", None) is None:  # a group member's release phase writes it
                quiesce.resume(self.control_dir, left, self.qid, restored=False)
            text += (
                f"; the rest could not be rebuilt without it ({failed}) and was resumed as it "
                "is: its CUDA calls on the torn-down memory get CUDA_ERROR_NOT_READY"
            )
        elif left:
            text += "; the rest was rebuilt and resumed"
        else:
            text += "; no process of it is left"
        self.r.note(f"rollback: {text}")
        return text

    def rebuild(self, restored: bool = False, native_phase: str = "rollback native"):
        """Undo the teardown in a live workload: SIGCONT the trees CRIU left stopped, native
        back to RUNNING (restore first where CHECKPOINTED), the coordinator's rollback (every
        shim back to ACTIVE whatever phase it reached, topology equal to the capture), then
        ``.resume``. Raises on failure (no ``.resume``: the workload stays parked rather than
        run on torn-down memory)."""
        self.rebuild_state(native_phase)
        quiesce.resume(self.control_dir, self.roots, self.qid, restored=restored)

    def rebuild_state(self, native_phase: str = "rollback native", after_dump: bool = False):
        """:meth:`rebuild` without the final ``.resume`` (a group writes it only once every
        member is rebuilt). ``native_phase`` names the native step's row: "rollback native"
        after a failure, "native restore" after a successful ``--leave-running`` dump
        (``after_dump``: every shim is PREPARED by plan, so only another phase is noted)."""
        if self.stopped_roots:
            # first: a stopped process cannot answer the driver's checkpoint calls
            self.signal_trees(self.stopped_roots, signal.SIGCONT, "resume trees")
            self.stopped_roots = []
        lost = set(self.lost_pids())  # died during the checkpoint: rolled back without them
        with self.r.phase(native_phase) as ph:
            found = native.rollback_all([p for p in self.census.cuda_pids if p not in lost])
            ph.detail = ", ".join(f"{p}:{s}" for p, s in found.items())
        if self.capture is None:
            raise AgentError(
                "rollback",
                "no capture to roll the shims back to (the capture "
                "failed before its first INSPECT completed)",
            )
        coord, capture = self.coordinator, self.capture
        if lost and lost & set(coord.pids):
            if not set(coord.pids) - lost:
                return  # no participant is left to roll back
            coord = coord.survivors(lost)
            capture = dataclasses.replace(
                capture,
                participants=[p for p in capture.participants if p.pid not in lost],
                records={p: rs for p, rs in capture.records.items() if p not in lost},
            )
        try:
            res = coord.rollback(capture)
        except Exception as e:
            err = as_agent_error(e, "rollback")  # a damaged chunk: its file and byte range
            raise carriers.name_bad_chunk(err, getattr(self.coordinator, "carriers", None)) from e
        found = getattr(res, "found", None) or {}
        if found and not (after_dump and set(found.values()) == {"PREPARED"}):
            # case 006: what state each process was in, and so what was undone
            self.r.note(
                ("rebuild after the dump" if after_dump else "rollback")
                + ": shims found in "
                + ", ".join(f"pid {p} {ph}" for p, ph in sorted(found.items()))
                + "; each brought back to ACTIVE, topology equal to the capture"
            )

    def cleanup_images(self):
        SnapshotDir(self.images_dir).remove_dump()

    def check_dir_claim(self, phase: str) -> None:
        """Before a step writes into the images dir: it is still this run's (case 015)."""
        if self.dir_claim is not None:
            self.dir_claim.check(phase)

    def release_dir_claim(self) -> None:
        if self.dir_claim is not None:
            self.dir_claim.release()

    def owns_images_dir(self) -> bool:
        """This run still holds its claim on the images dir (case 015): only then does its
        rollback remove what lies there (``criu/``, ``chunks/``), which is then its own."""
        claim = getattr(self, "dir_claim", None)
        if claim is None:
            return True  # no claim taken (a test's bare Checkpoint)
        try:
            claim.check()
        except AgentError as e:
            self.r.note(f"rollback: {e.reason}; nothing in {self.images_dir} is removed")
            return False
        return True

    # -- the claim on the shims (protocol.h "Claims", decisions D48) ----------------------
    def take_claim(self) -> None:
        """Before the capture's first request: write the claim file of every participant with
        this checkpoint's token (recorded in the ``.lock`` already) and hand it to the
        coordinator, whose mutating requests then carry it. A claim that cannot be taken (a
        live holder of another checkpoint, an unwritable control dir) refuses the capture:
        ``AgentError`` phase "capture", nothing torn down."""
        from cuinterpose.coordinator.claim import Claim, ClaimError

        try:
            self.coordinator.claim = Claim.take(
                self.control_dir,
                [p.pid for p in self.census.participants],
                kind="checkpoint",
                token=self.claim_token,
            )
        except ClaimError as e:
            raise AgentError(
                "capture", f"{e}; checkpoint refused, nothing was torn down", pid=e.pid
            ) from e

    def drop_claim(self) -> None:
        """Remove this checkpoint's claim files (idempotent; a no-op before the capture)."""
        claim = getattr(getattr(self, "coordinator", None), "claim", None)
        if claim is not None:
            claim.drop()

    # -- group undo phases ----------------------------------------------------------------
    def group_rollback(self):
        """Undo this member's part of a failed group checkpoint: its own snapshot, even when
        complete, is not part of a consistent cut, so the manifest (written last, removed
        first) and the CRIU images go, then the workload is rebuilt (no ``.resume`` yet)."""
        if self.finishing:
            raise AgentError(
                "rollback",
                "the group had reached finish (trees killed or resumed): nothing to roll back",
            )
        if self.left_locked:  # the quiescence check's unlock got no answer: try it again
            failed = native.unlock_each(self.left_locked)
            if failed:
                self.left_locked = sorted(failed)
                quiesce.abandon_lock(
                    self.control_dir, self.roots, self.qid, by="group rollback", torn_down=False
                )
                first = failed[min(failed)]
                raise LeftLocked("rollback", first, failed, self.roots[0]) from first
            self.left_locked = []
        if self.torn_down:
            upload.withdraw(self)  # a snapshot this member committed to the store goes again
            own = self.owns_images_dir()
            if self.manifest is not None and own:
                SnapshotDir(self.images_dir).remove_manifest()
                self.manifest = None
            if own:
                self.cleanup_images()
            try:
                self.rebuild_state()
            except BaseException as rb:
                if not self.lost_text(rb):  # a job that lost a process: resumed as it is
                    raise
            if own:
                carriers.remove_chunks(self.images_dir, getattr(self.coordinator, "carriers", None))

    def group_release(self):
        """``.resume`` after a group rollback (restored=false; cancelled when nothing was torn
        down), and the directories this request created are removed when empty."""
        if self.torn_down:
            quiesce.resume(self.control_dir, self.roots, self.qid, restored=False)
        elif self.qid is not None and not self.quiesce_cancelled:
            quiesce.cancel(self.control_dir, self.roots, self.qid)
        self.release_dir_claim()
        self.snap.remove_created()
