"""``cuinterpose-agent checkpoint``: :class:`Checkpoint`, its step table and the steps.

The one-shot :meth:`Checkpoint.run` and the group phases (:meth:`Checkpoint.run_phase`, a
named slice of the table) both run :data:`Checkpoint.STEPS` through the step runner
(agent/run/steps.py); the undo half is agent/run/rollback.py, the images directory and the
manifest's contents agent/run/images.py. The ordering, and what each failure leaves behind:
docs/agent.md "Checkpoint ordering".
"""

from __future__ import annotations

import os
import pathlib
import secrets
import signal
import threading
import time
from typing import Iterable, Optional

from cuinterpose.agent import paths
from cuinterpose.agent.errors import AgentError, CheckpointFailed, LeftLocked, QuiesceRefused
from cuinterpose.agent.mech import census as census_mod
from cuinterpose.agent.mech import census_checks, fds, native, quiesce
from cuinterpose.agent.mech.inherit import external_file_key
from cuinterpose.agent.options import CheckpointOptions
from cuinterpose.agent.run import (
    carriers,
    gpustore_step,
    images,
    interrupt,
    placing,
    recover,
    upload,
)
from cuinterpose.agent.run.report import Reporter
from cuinterpose.agent.run.rollback import Rollback
from cuinterpose.agent.run.steps import (
    CHECKPOINT_STEPS,
    Step,
    StepRunner,
    as_agent_error,
    coordinator_events,
    group_phases,
    helper_env,
    strip_preload_env,
    unexpected,
)
from cuinterpose.agent.snapshot import manifest as manifest_mod
from cuinterpose.agent.snapshot import snapdir
from cuinterpose.coordinator.contract import remove_if_id

__all__ = ["Checkpoint", "checkpoint", "as_agent_error", "strip_preload_env", "helper_env"]


def _coordinator_module():
    from cuinterpose.coordinator import phases

    return phases


class Checkpoint(Rollback, StepRunner):
    """State of one checkpoint run; :meth:`run` drives the steps. Attributes filled along the
    way: ``census``, ``qid``, ``ready``, ``capture``, ``manifest``."""

    KIND = "checkpoint"
    #: The checkpoint, once: the table and every step property are agent/run/steps.py's.
    STEPS = CHECKPOINT_STEPS
    GROUP_PHASES = group_phases(STEPS)
    #: Run on every member after a failed phase: first ``rollback`` (rebuild what was torn
    #: down, no ``.resume`` yet), then ``release`` on the members whose rollback succeeded.
    UNDO = {"rollback": "group_rollback", "release": "group_release"}
    GROUP_UNDO = tuple(UNDO)

    def __init__(
        self,
        roots: Iterable[int],
        images_dir,
        options: Optional[CheckpointOptions] = None,
        *,
        reporter: Optional[Reporter] = None,
        shim_path=None,
        remote=None,
        cancel: Optional[interrupt.Cancel] = None,
        **changes,
    ):
        #: every option of this run (agent/options.py); ``changes`` (option names) are set on
        #: ``options`` (default: the defaults), checked
        self.options = (options or CheckpointOptions()).replace(**changes)
        self.roots = list(dict.fromkeys(int(r) for r in roots))
        self.images_dir, self.snap = images_dir, snapdir.SnapshotDir(images_dir)
        self.remote = remote  # run/remote.py Remote: an s3:// images dir (images_dir its copy)
        self.control_dir = paths.canonical(self.options.control_dir)
        self.r = reporter or Reporter()
        self.shim_path = shim_path
        self.census = None
        #: this run's id: its claim on the images dir, its quiesce request, the snapshot id
        self.run_id = quiesce.new_id()
        #: the claim on the images dir (agent/snapshot/dirclaim.py), held until the run ends
        #: (not the capture's claim on the shims, protocol.h "Claims")
        self.dir_claim = None
        self.qid: Optional[str] = None
        self.ready: dict = {}
        self.coordinator = None
        self.capture = None
        self.manifest: Optional[dict] = None
        self.started_at = manifest_mod.utc_now()
        self.torn_down = False
        #: roots whose tree CRIU dumped and left stopped (SIGSTOP), in dump order
        self.stopped_roots: list[int] = []
        #: root -> pids of its tree, read right before its dump (the tree is frozen from then on)
        self.tree_pids: dict[int, list[int]] = {}
        #: directories prepare_dir created (removed again when the checkpoint does not succeed)
        self.created_dirs: list[pathlib.Path] = []
        #: signals (one-shot) or ``cancel`` (the daemon: a cancelled gRPC call) stop the run
        self.guard = interrupt.Guard("checkpoint", cancel)
        #: {"request_id", "node", "members": [{"node", "address", "images_dir"}]} when this
        #: checkpoint is one member of a group cut (recorded in the manifest), else None
        self.group: Optional[dict] = None
        #: group: the finish phase started (dumped trees killed or resumed)
        self.finishing = False
        #: the quiesce refusal already withdrew the request (group undo must not repeat it)
        self.quiesce_cancelled = False
        #: pids the quiescence check locked and could not unlock (``LeftLocked``)
        self.left_locked: list[int] = []
        #: open-file warnings (see :func:`census.open_file_warnings`), in the manifest too
        self.warnings: list[dict] = []
        #: pipe fds of the dumped trees whose other end is outside them (manifest
        #: ``external_pipes``, see :func:`fds.external_pipes`), read right before each dump
        self.external_pipes: list[dict] = []
        #: fds of the dumped trees on mounts outside their mount namespace (manifest
        #: ``external_files``, see :func:`fds.external_files`), read right before each dump
        self.external_files: list[dict] = []
        #: root -> warnings about its external pipes and files (manifest ``warnings``)
        self.external_warnings: dict[int, list[dict]] = {}
        #: root -> namespaces of its tree as CRIU dumped them (manifest ``namespaces``)
        self.tree_ns: dict[int, dict] = {}
        #: monotonic ns: start, the workload's ready (paused from here), trees killed/resumed
        self.t0_ns = time.monotonic_ns()
        self.t_ready_ns: Optional[int] = None
        self.t_end_ns: Optional[int] = None

    # -- steps ---------------------------------------------------------------------------
    def prepare_images_dir(self):
        images.preflight()  # the node's key and test hooks, before anything changes
        upload.prepare(self)  # an s3:// images dir: the store answers, no snapshot there yet
        group = (self.group or {}).get("request_id", "")
        snap = self.snap = snapdir.prepare(self.images_dir, run_id=self.run_id, group=group)
        self.images_dir, self.created_dirs, self.dir_claim = snap.path, snap.created, snap.claim
        for n in snap.notes:  # also in the manifest's and the --json output's warnings
            self.r.note(n)
            self.warnings.append({"path": str(self.images_dir), "message": n})

    def load_driver(self):
        with self.r.phase("driver") as ph:
            self.driver = native.load(self.options.driver)
            ph.detail = f"{self.driver.kind} {self.driver.version} {self.driver.library}"

    def take_census(self):
        with self.r.phase("census") as ph:
            self.census = census_mod.take_census(
                self.roots, control_dir=self.control_dir, shim_path=self.shim_path
            )
            parts = self.census.participants
            self.check_mounts()
            ph.detail = (
                f"{len(self.census.processes)} processes, participants "
                f"{', '.join(str(p.pid) for p in parts)}"
            )
        found = census_mod.open_file_warnings(self.census)
        self.warnings += found
        for w in found:
            self.r.note(f"warning: {w['message']}")

    def check_mounts(self):
        """Case: a tree reaching a mount outside its namespace is refused at the census
        (:func:`~cuinterpose.agent.mech.census_checks.check_mounts`)."""
        census_checks.check_mounts(self.census, self.roots, _tree_pids)
        census_checks.check_tcp(self.census, self.roots, _tree_pids)

    def make_coordinator(self):
        ph = _coordinator_module()
        parts = [ph.Participant(p.pid, p.socket_path) for p in self.census.participants]
        self.coordinator = ph.Coordinator(
            parts,
            timeout_s=self.options.phase_timeout_s,
            carrier_timeout_s=self.options.carrier_timeout_s,
            on_event=coordinator_events(self.r.coordinator_event),
        )
        # the token of this checkpoint's claim on the shims (protocol.h "Claims"): in the .lock
        # record before the claim files are written (capture), so a release finds it again
        self.claim_token = secrets.token_bytes(16)
        o = self.options
        files = self.coordinator.carriers = carriers.checkpoint_files(
            self.images_dir, incremental=o.incremental, **o.chunk_settings()
        )
        if files.store is not None:  # each SAVE reply's refs go to the .lock at once
            lock = threading.Lock()

            def record():
                with lock:
                    self.mark("chunk store refs", store=carriers.store_record(files))

            files.on_saved = record

    def quiesce(self):
        try:
            self.request_quiesce()
        except QuiesceRefused:
            # refused requests withdraw themselves (or were never written): nothing to cancel
            self.quiesce_cancelled = True
            raise
        self.check_parked()

    def request_quiesce(self):
        with self.r.phase("quiesce") as ph:
            self.qid = self.run_id
            quiesce.request(self.control_dir, self.roots, self.qid, self.options.quiesce_timeout_ms)
            try:
                self.ready = quiesce.wait_ready(
                    self.control_dir,
                    self.roots,
                    self.qid,
                    self.options.quiesce_timeout_ms,
                    stop=self.guard.pending,
                )
            except QuiesceRefused as e:
                hint = (
                    census_mod.job_root_hint(e.pid, self.census.shim) if e.pid is not None else None
                )
                if hint:
                    # a rank never reads its .request: no .resume left behind for it
                    remove_if_id(quiesce.quiesce_path(self.control_dir, e.pid, "resume"), self.qid)
                    raise QuiesceRefused("quiesce", f"{e.reason}; {hint}", pid=e.pid) from e
                raise
            self.t_ready_ns = time.monotonic_ns()
            ranks = sum(len(v.get("ranks", [])) for v in self.ready.values())
            ph.detail = f"{ranks} ranks parked"

    def quiescence_check(self):
        """Prove the workload quiescent before anything is torn down: lock every CUDA process
        (the native lock waits for all submitted stream work, up to ``lock_timeout_ms``) and
        unlock it again. A parked workload submits no new work, so streams that drained under
        the lock stay drained through the capture. A lock that times out means a stream still
        waits on something (a peer's reply the workload did not drain): tearing the shared
        memory down under it would fault that stream and snapshot a dead context, so the
        checkpoint is refused here, with nothing torn down. Raises ``AgentError`` (phase
        "quiescence check") naming the pid and the driver's answer, or ``LeftLocked`` when a
        process it locked could not be unlocked again (it stopped meanwhile)."""
        with self.r.phase("quiescence check") as ph:
            try:
                native.lock_all(self.census.cuda_pids, self.options.lock_timeout_ms)
            except native.NativeError as e:
                left = [p for p in e.left_locked or () if _alive(p)]
                if left:  # (a process that died meanwhile holds no lock)
                    self.left_locked = left
                    raise LeftLocked("quiescence check", e, left, self.roots[0]) from e
                raise AgentError("quiescence check", e.reason, pid=e.pid) from e
            unlocked = native.unlock_each(self.census.cuda_pids)
            dead = sorted(p for p in unlocked if not _alive(p))
            failed = {p: e for p, e in unlocked.items() if p not in dead}
            if dead and not failed:  # it died during the check: no lock is left there
                raise AgentError(
                    "quiescence check",
                    f"exited during the check ({unlocked[dead[0]].reason}); checkpoint "
                    "refused, nothing was torn down",
                    pid=dead[0],
                )
            if failed:
                self.left_locked = sorted(failed)
                first = failed[min(failed)]
                raise LeftLocked("quiescence check", first, failed, self.roots[0]) from first
            ph.detail = (
                f"{len(self.census.cuda_pids)} processes locked and unlocked: every stream drained"
            )

    @staticmethod
    def alive(pid: int) -> bool:
        """``pid`` exists and is not a zombie (the rollback's question about the job)."""
        return _alive(pid)

    def check_parked(self):
        """Every participant is among the ranks the workload reported parked
        (:func:`~cuinterpose.agent.mech.census_checks.check_parked`)."""
        census_checks.check_parked(self.census, self.ready)

    def capture_shared(self):
        """Coordinator capture: INSPECT, validate, SAVE_ALLOCATIONS, PREPARE_UNICAST, INSPECT.
        A refusal or validation error before SAVE_ALLOCATIONS changed nothing (refused);
        from SAVE_ALLOCATIONS on, a failure means teardown started (rolled back)."""
        # the .lock turned torn_down with its record before this (Rollback.step_started)
        self.check_dir_claim("capture")  # SAVE_ALLOCATIONS writes the chunk files
        self.take_claim()
        try:
            self.capture = self.coordinator.capture()
        except Exception as e:
            changed = getattr(e, "changed", None)
            partial = getattr(e, "capture", None)
            # the coordinator attaches the partial capture to whatever left capture() once a
            # mutating phase may have gone out; without it (and not changed) nothing was sent
            if (
                changed is False
                or type(e).__name__ == "TopologyError"
                or (partial is None and changed is not True)
            ):
                raise as_agent_error(e, "INSPECT") from e
            self.torn_down = True
            self.capture = partial
            raise as_agent_error(e, "capture") from e
        self.torn_down = True

    def native_lock(self):
        with self.r.phase("native lock") as ph:
            native.lock_all(self.census.cuda_pids, self.options.lock_timeout_ms)
            ph.detail = f"pids {', '.join(map(str, self.census.cuda_pids))}"

    def native_checkpoint(self):
        self.check_dir_claim("native checkpoint")
        gpustore_step.native_checkpoint(self)  # custom storage or host staging (issue 12)

    def criu_dump(self):
        """Dump every tree with ``--leave-stopped``: CRIU writes the images and leaves the
        tree stopped (SIGSTOP) instead of killing it, so a later failure (another tree's
        dump, the manifest) can still resume it. A failed dump resumes its own tree (CRIU's
        default on a dump error). Native CUDA state stays CHECKPOINTED either way."""
        from cuinterpose.agent.mech import criu

        strip_preload_env()
        for i, root in enumerate(self.roots):
            if i:
                self.guard.check("criu dump")  # between trees, never inside CRIU
            with self.r.phase("criu dump") as ph:
                self.check_dir_claim("criu dump")
                d = self.snap.make_criu_dir(root)  # private, as the whole snapshot (case 016)
                self.tree_pids[root] = _tree_pids(root)
                self.mark(
                    f"criu dump {root}", tree_pids={str(k): v for k, v in self.tree_pids.items()}
                )
                self.external_pipes = [p for p in self.external_pipes if p["root"] != root]
                self.external_pipes += fds.external_pipes(root, self.tree_pids[root])
                self.external_files = [p for p in self.external_files if p["root"] != root]
                files = fds.external_files(root, self.tree_pids[root])
                self.external_files += files
                self.note_external(root)
                try:
                    with interrupt.shielded():
                        ns = criu.dump(
                            root,
                            d,
                            extra_args=("--leave-stopped",),
                            deleted_files=fds.unlinked_files(self.tree_pids[root]),
                            timeout_s=self.options.criu_timeout_s,
                            **(
                                {
                                    "external_files": list(
                                        dict.fromkeys(external_file_key(f) for f in files)
                                    )
                                }
                                if files
                                else {}
                            ),
                        )
                except Exception as e:
                    raise AgentError("criu dump", f"tree {root}: {e}", pid=root) from e
                if isinstance(ns, dict):
                    self.tree_ns[root] = ns
                self.stopped_roots.append(root)
                self.check_dumped(root, d)
                ph.bytes = self.snap.tree_bytes(root)
                ph.detail = f"tree {root} (left stopped)"

    def check_dumped(self, root: int, d) -> None:
        """Case 010: :func:`images.check_dumped` of tree ``root`` dumped into ``d``."""
        images.check_dumped(self.census, self.tree_pids, root, d, _alive)

    def note_external(self, root: int) -> None:
        """Warnings (manifest ``warnings``, and notes) for the external pipes and files of
        tree ``root``: what a restore does with them, with and without a placement."""
        comms = {p.pid: p.comm for p in self.census.processes} if self.census else {}
        out = placing.external_warnings(root, self.external_pipes, self.external_files, comms)
        self.external_warnings[root] = out
        for w in out:
            self.r.note(f"warning: {w['message']}")

    def signal_trees(self, roots, sig, phase: str):
        """Send ``sig`` to every process of each dumped tree in ``roots`` (the pids recorded
        before its dump, plus whatever is under the root now). A process that is gone is
        skipped. Returns {root: pids signalled}."""
        out = {}
        with self.r.phase(phase) as ph:
            for root in roots:
                pids = list(dict.fromkeys(self.tree_pids.get(root, []) + _tree_pids(root)))
                done = []
                for pid in pids:
                    try:
                        _kill(pid, sig)
                        done.append(pid)
                    except ProcessLookupError:
                        pass
                out[root] = done
            ph.detail = "; ".join(f"tree {r}: {len(p)} processes" for r, p in out.items())
        return out

    def kill_dumped(self):
        """The snapshot is complete: SIGKILL every dumped tree (what CRIU would have done)."""
        self.signal_trees(self.stopped_roots, signal.SIGKILL, "kill dumped")
        self.stopped_roots = []

    sync_snapshot = upload.sync_step  # run/durable.py's; an upload's chunks go meanwhile
    upload_snapshot = upload.upload_step

    def write_manifest(self):
        """``DIR/manifest.json``, written last and atomically; any failure is the
        ``manifest`` step's (rolled back)."""
        try:
            with self.r.phase("manifest") as ph:
                self.check_dir_claim("manifest")
                m = images.build_manifest(self)
                gpustore_step.annotate(self, m)
                path = manifest_mod.write(self.images_dir, m)
                self.manifest = m
                ph.detail = str(path)
        except AgentError:
            raise
        except BaseException as e:
            raise AgentError("manifest", f"{self.images_dir}: {type(e).__name__}: {e}") from e

    def finish(self):
        """The snapshot is complete: kill the dumped trees (what CRIU would have done) and
        remove their requests, or with ``--leave-running`` rebuild the workload (its
        ``.resume`` is the next step). From here on a group cannot be rolled back."""
        self.finishing = True
        if self.options.leave_running:
            self.rebuild_state("native restore", after_dump=True)
        else:
            self.kill_dumped()
            quiesce.clear(self.control_dir, self.roots)

    def resume(self):
        """``--leave-running``: ``.resume`` with ``restored=false`` (after a group's every
        member is rebuilt)."""
        if self.options.leave_running:
            with self.r.phase("resume"):
                quiesce.resume(self.control_dir, self.roots, self.qid, restored=False)

    def release_store(self, keep_pin: bool = False) -> None:
        """The run is over: the claim on the images dir goes (a failed rollback's leftovers
        keep the directory non-empty), and so does the chunk store (incremental): its pin and
        shared lock (the pin stays with ``keep_pin``: a later release needs the packs), and the
        claim on the shims (kept with ``keep_pin`` too: the workload stays parked for a release,
        which takes it over). Idempotent."""
        self.release_dir_claim()
        carriers.release(getattr(self.coordinator, "carriers", None), keep_pin=keep_pin)
        if not keep_pin:
            self.drop_claim()
        upload.end(self, keep_pin)  # an upload that did not commit undone; the local copy

    # -- the one-shot run -----------------------------------------------------------------
    def run(self) -> dict:
        """Run every step; returns the manifest. Raises ``AgentError`` (refused, nothing torn
        down) or ``CheckpointFailed`` (``outcome`` rolled_back / rollback_failed).

        SIGINT/SIGTERM/SIGHUP are deferred to the next step boundary (``interrupt.Guard``)
        and then handled like a failure there: cancelled before teardown, rolled back after;
        once the manifest is written the checkpoint simply finishes."""
        self.t0_ns = self.r.begin()
        with self.guard, native.using(self.options):
            try:
                self.run_steps(self.stage("images"))
                out = self._run()
                self.release_store()  # the manifest refers to the packs now
                return out
            except CheckpointFailed as e:
                # a failed rollback leaves the workload parked on the packs: the pin stays
                # until a release has rebuilt it
                self.release_store(keep_pin=e.outcome == "rollback_failed")
                if self.manifest is None:
                    gpustore_step.discard(self)
                    self.snap.remove_created()
                if self.qid is not None:
                    if e.lost:  # a process of the job died: wait for the rest to end or resume
                        self.settle_lost()
                    gone = [r for r in self.roots if not _alive(r)]
                    if gone:  # case 010: no later process may take these files for its own
                        quiesce.clear(self.control_dir, gone)
                    left = [r for r in self.roots if r not in gone]
                    if e.outcome == "rollback_failed":
                        quiesce.abandon_lock(
                            self.control_dir,
                            left,
                            self.qid,
                            by="checkpoint",
                            why=e.rollback_error or str(e),
                            last_txn_id=recover.last_txn_id(getattr(self, "coordinator", None)),
                        )
                    else:
                        quiesce.unlock(self.control_dir, left, self.qid)
                raise
            except BaseException as e:
                self.release_store()
                if self.manifest is None:
                    gpustore_step.discard(self)
                    self.snap.remove_created()
                if self.qid is not None and not isinstance(e, LeftLocked):  # its .lock stays
                    quiesce.unlock(self.control_dir, self.roots, self.qid)
                raise

    def _run(self) -> dict:
        try:
            self.run_steps(self.stage("refusal"))
        except BaseException as e:  # nothing was torn down yet: a refusal
            if isinstance(e, LeftLocked):
                # the workload stays parked on the native lock: no .resume; the .lock (its
                # cuda_pids, driver, steps) is what `release` unlocks it from
                quiesce.abandon_lock(
                    self.control_dir, self.roots, self.qid, why=str(e), torn_down=False
                )
                raise
            # wait_ready cancels its own refusals; everything after the request is cancelled here
            if self.qid is not None and not isinstance(e, QuiesceRefused):
                quiesce.cancel(self.control_dir, self.roots, self.qid)
            if isinstance(e, AgentError) or not isinstance(e, Exception):
                raise
            raise unexpected(self.r, e, "checkpoint") from e
        try:
            self.run_steps(self.stage("teardown"))
        except BaseException as e:
            if not self.torn_down:
                quiesce.cancel(self.control_dir, self.roots, self.qid)
                raise
            raise self.roll_back(e) from e
        # the snapshot is on disk: only now may the dumped trees go
        try:
            self.run_steps(self.stage("finish"))
        except BaseException as rb:
            if not self.options.leave_running or isinstance(rb, CheckpointFailed):  # (upload)
                raise
            raise CheckpointFailed(rb, "rollback_failed", rollback_error=str(rb)) from rb
        self.t_end_ns = self.r.cursor_ns  # the rows tile the run: its wall is their sum
        self.finish_totals()
        t = self.totals_times()
        self.r.total(
            self.t_end_ns - self.t0_ns,
            f"workload paused {t['paused_ms']:.1f} ms (ready -> "
            + ("resumed)" if self.options.leave_running else "killed)"),
        )
        return self.manifest

    def interrupted(self, step: Step, sig: str) -> AgentError:
        if step.stage == "refusal":
            return interrupt.Interrupted(
                step.name,
                sig,
                f"interrupted by {sig} after "
                f"{step.name}; checkpoint cancelled, nothing was torn "
                "down, the workload keeps running",
            )
        return interrupt.Interrupted(step.name, sig)

    def phase_state(self) -> dict:
        """{"torn_down", "snapshot_id" (the quiesce id or None), "images_dir",
        "manifest_written"}."""
        return {
            "torn_down": self.torn_down,
            "snapshot_id": self.qid,
            "images_dir": str(self.images_dir),
            "manifest_written": self.manifest is not None,
        }

    def totals_times(self) -> dict:
        """{"wall_ms": start of the checkpoint -> now (or the end), "paused_ms": the workload's
        ready -> its trees killed or resumed (now, while that has not happened yet)}."""
        end = self.t_end_ns or time.monotonic_ns()
        paused = (end - self.t_ready_ns) if self.t_ready_ns is not None else 0
        return {"wall_ms": round((end - self.t0_ns) / 1e6, 3), "paused_ms": round(paused / 1e6, 3)}

    def finish_totals(self) -> None:
        """Once the trees are killed or resumed: the final ``wall_ms``/``paused_ms`` go into
        the manifest (rewritten atomically; the first one stays valid if this fails)."""
        if self.manifest is None:
            return
        self.manifest["totals"].update(self.totals_times())
        self.manifest["phases"] = self.r.to_list()
        try:
            manifest_mod.write(self.images_dir, self.manifest)
        except (OSError, AgentError) as e:
            self.r.note(f"warning: could not record the final totals in the manifest: {e}")


def _kill(pid: int, sig: int) -> None:
    os.kill(pid, sig)


def _alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


def _tree_pids(root: int) -> list[int]:
    """Pids of the tree under ``root`` (root first); [] when the root is gone."""
    try:
        return [p for p, _, _ in census_mod.walk_tree([root])]
    except AgentError:
        return []


def checkpoint(roots: Iterable[int], images_dir, **kw) -> dict:
    """Convenience: ``Checkpoint(roots, images_dir, **kw).run()``."""
    return Checkpoint(roots, images_dir, **kw).run()
