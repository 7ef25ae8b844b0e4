"""``cuinterpose-agent checkpoint``: the capture ordering, as one function with one step per phase.

Order (DESIGN §3, prior-art §9 lesson 8)::

    census (a cwd, root or file mapping of a tree on a mount outside its mount namespace,
    which CRIU cannot dump, is refused here: :func:`~cuinterpose.agent.mech.fds.outside_mounts`)
    -> quiesce (request/ready) -> quiescence check (native lock + unlock of every pid:
    no stream work left) -> capture (coordinator: INSPECT, validate,
    SAVE_ALLOCATIONS, PREPARE_UNICAST) -> native lock (every pid) -> native checkpoint (each pid)
    -> CRIU dump of each tree with --leave-stopped (images written, tree left stopped; right
       before it, the tree's pipes to outside it are recorded, manifest ``external_pipes``,
       and its files opened outside its mount namespace, manifest ``external_files``, which
       CRIU dumps as external; CRIU reports the tree's namespaces, manifest ``namespaces``)
    -> manifest (written last) -> SIGKILL every dumped tree (--leave-running: resume it)

A refused or failed checkpoint leaves the workload running with its memory intact:

- census, quiesce, quiescence check, INSPECT/validate: *refused*; nothing was torn down (``.resume`` cancelled
  is written once the request was sent); the workload keeps running.
- from SAVE_ALLOCATIONS until the manifest is on disk: *rolled back*. No tree has been killed
  yet (CRIU leaves a dumped tree stopped; a failed dump resumes its tree), so the agent
  SIGCONTs the stopped trees, brings every CUDA process back to RUNNING (native restore where
  CHECKPOINTED, then unlock), runs the coordinator's rollback (SAVED shims CANCEL_CAPTURE,
  PREPARED ones LOAD_ALLOCATIONS + RESTORE_UNICAST, INSPECT equal to the capture), and writes
  ``.resume`` with ``restored=false``. The CRIU images are removed.
- only once the manifest is written are the dumped trees killed.

``--leave-running``: the same dump, manifest, then the rebuild above instead of the kill: the
snapshot is written and the workload continues.
"""
from __future__ import annotations

import os
import pathlib
import shutil
import signal
import tempfile
import time
from typing import Iterable, Optional

from cuinterpose.agent.mech import census as census_mod
from cuinterpose.agent.snapshot import manifest as manifest_mod
from cuinterpose.agent.run import interrupt
from cuinterpose.agent.mech import fds, native, quiesce
from cuinterpose.agent.errors import AgentError, CensusError, CheckpointFailed, QuiesceRefused, SnapshotError
from cuinterpose.agent.mech.placement import external_file_key
from cuinterpose.agent.run.report import Reporter
from cuinterpose.coordinator.protocol import default_control_dir


def _coordinator_module():
    from cuinterpose.coordinator import phases
    return phases


def strip_preload_env() -> None:
    """Remove ``LD_PRELOAD`` from this process's environment so that every helper the agent
    runs (CRIU, ...) starts without the shim."""
    os.environ.pop("LD_PRELOAD", None)


def helper_env(extra: Optional[dict] = None) -> dict:
    """Environment for a helper process: ours without ``LD_PRELOAD``."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env.update(extra or {})
    return env


def shim_version() -> dict:
    """{"package": cuinterpose version, "protocol": CUI_PROTO_VERSION}."""
    try:
        from importlib.metadata import version
        pkg = version("cuinterpose")
    except Exception:
        pkg = "unknown"
    try:
        from cuinterpose.coordinator.protocol import CUI_PROTO_VERSION
        proto = CUI_PROTO_VERSION
    except Exception:
        proto = None
    return {"package": pkg, "protocol": proto}


def prepare_dir(images_dir: os.PathLike | str) -> tuple[pathlib.Path, list[pathlib.Path]]:
    """Create the snapshot directory; returns (its absolute path, the directories this call
    created, outermost first, so that a refused checkpoint can remove them again).

    Only a missing or an empty, writable directory is accepted. Refused (``SnapshotError``,
    phase "images dir", before anything is asked of the workload): a directory that already
    holds a snapshot (``manifest.json``) or anything else (a checkpoint never writes among
    other files, and a rollback removes ``criu/``), a path that is not a directory, one that
    cannot be created or written."""
    d = pathlib.Path(os.path.abspath(images_dir))
    if d.exists() or d.is_symlink():
        if not d.is_dir():
            raise SnapshotError("images dir", f"{d} is not a directory")
        if (d / manifest_mod.MANIFEST_NAME).exists():
            raise SnapshotError("images dir", f"{d} already holds a snapshot "
                                f"({manifest_mod.MANIFEST_NAME}); choose a new --images-dir")
        try:
            names = sorted(p.name for p in d.iterdir())
        except OSError as e:
            raise SnapshotError("images dir", f"{d} cannot be read: {e.strerror}") from None
        if names:
            shown = ", ".join(names[:5]) + (f", … ({len(names)} entries)" if len(names) > 5 else "")
            raise SnapshotError("images dir", f"{d} is not empty ({shown}); a checkpoint writes "
                                "only into a new or empty directory: choose a new --images-dir")
        created = []
    else:
        created = []
        p = d
        while not (p.exists() or p.is_symlink()) and p != p.parent:
            created.insert(0, p)
            p = p.parent
        try:
            d.mkdir(parents=True)
        except OSError as e:
            _remove_empty(created)
            raise SnapshotError("images dir", f"{d} cannot be created: "
                                f"{e.strerror or e}") from None
    try:
        tempfile.TemporaryFile(dir=d).close()
    except OSError as e:
        _remove_empty(created)
        raise SnapshotError("images dir", f"{d} is not writable: {e.strerror or e}") from None
    return d, created


def _remove_empty(dirs: list[pathlib.Path]) -> None:
    """rmdir ``dirs`` innermost first, stopping at the first that is not empty."""
    for p in reversed(dirs):
        try:
            p.rmdir()
        except OSError:
            return


class Checkpoint:
    """State of one checkpoint run; :meth:`run` drives the phases. Attributes filled along the
    way: ``census``, ``qid``, ``ready``, ``capture``, ``manifest``."""

    def __init__(self, roots: Iterable[int], images_dir, *, control_dir=None,
                 quiesce_timeout_ms: int = 10_000, lock_timeout_ms: int = 10_000,
                 phase_timeout_s: float = 60.0, carrier_timeout_s: float = 3600.0,
                 driver: Optional[str] = None,
                 leave_running: bool = False, reporter: Optional[Reporter] = None,
                 shim_path=None):
        self.roots = list(dict.fromkeys(int(r) for r in roots))
        self.images_dir = images_dir
        self.control_dir = str(pathlib.Path(control_dir or default_control_dir()).resolve())
        self.quiesce_timeout_ms = int(quiesce_timeout_ms)
        self.lock_timeout_ms = int(lock_timeout_ms)
        self.phase_timeout_s = float(phase_timeout_s)
        self.carrier_timeout_s = float(carrier_timeout_s)
        self.driver_kind = driver
        self.leave_running = leave_running
        self.r = reporter or Reporter()
        self.shim_path = shim_path
        self.census = None
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
        self.guard = interrupt.Guard("checkpoint")
        #: {"request_id", "node", "members": [{"node", "address", "images_dir"}]} when this
        #: checkpoint is one member of a group cut (recorded in the manifest), else None
        self.group: Optional[dict] = None
        #: group: the finish phase started (dumped trees killed or resumed)
        self.finishing = False
        #: the quiesce refusal already withdrew the request (group undo must not repeat it)
        self.quiesce_cancelled = False
        #: open-file warnings (see :func:`census.open_file_warnings`), in the manifest too
        self.warnings: list[dict] = []
        #: pipe fds of the dumped trees whose other end is outside them (manifest
        #: ``external_pipes``, see :func:`external_pipes`), read right before each dump
        self.external_pipes: list[dict] = []
        #: fds of the dumped trees on mounts outside their mount namespace (manifest
        #: ``external_files``, see :func:`external_files`), read right before each dump
        self.external_files: list[dict] = []
        #: root -> warnings about its external pipes and files (manifest ``warnings``)
        self.external_warnings: dict[int, list[dict]] = {}
        #: root -> namespaces of its tree as CRIU dumped them (manifest ``namespaces``)
        self.tree_ns: dict[int, dict] = {}
        #: monotonic ns: start, the workload's ready (paused from here), trees killed/resumed
        self.t0_ns = time.monotonic_ns()
        self.t_ready_ns: Optional[int] = None
        self.t_end_ns: Optional[int] = None

    # -- phases ---------------------------------------------------------------------------
    def load_driver(self):
        with self.r.phase("driver") as ph:
            self.driver = native.load(self.driver_kind)
            ph.detail = f"{self.driver.kind} {self.driver.version} {self.driver.library}"

    def take_census(self):
        with self.r.phase("census") as ph:
            self.census = census_mod.take_census(self.roots, control_dir=self.control_dir,
                                                 shim_path=self.shim_path)
            parts = self.census.participants
            self.check_mounts()
            ph.detail = (f"{len(self.census.processes)} processes, participants "
                         f"{', '.join(str(p.pid) for p in parts)}")
        self.warnings = census_mod.open_file_warnings(self.census)
        for w in self.warnings:
            self.r.note(f"warning: {w['message']}")

    def check_mounts(self):
        """Refuse (``CensusError``, phase "census", nothing torn down) a tree with a working
        directory, root directory or file mapping on a mount outside its mount namespace
        (:func:`~cuinterpose.agent.mech.fds.outside_mounts`): CRIU fails such a dump ("Can't lookup mount=N for fd=-3"),
        and only open fds can be dumped as external files."""
        comms = {p.pid: p.comm for p in self.census.processes}
        for root in self.roots:
            found = fds.outside_mounts(root, _tree_pids(root))
            if not found:
                continue
            f0 = found[0]
            others = "".join(f"; also pid {f['pid']} ({comms.get(f['pid'], '?')}) {f['what']}"
                             for f in found[1:6])
            if len(found) > 6:
                others += f"; and {len(found) - 6} more"
            raise CensusError("census", (
                f"({comms.get(f0['pid'], '?')}) of tree {root} {f0['what']}, which is not a "
                "mount of the tree's mount namespace (reached from outside it, e.g. through an "
                "inherited fd or another process's /proc/PID/root): CRIU, run in that "
                f"namespace, cannot dump it (\"Can't lookup mount={f0['mnt_id']} for fd=-3\"), "
                "and only open fds can be recorded as external files"
                f"{others}; checkpoint refused, nothing was torn down, the workload keeps "
                "running"), pid=f0["pid"])

    def make_coordinator(self):
        ph = _coordinator_module()
        parts = [ph.Participant(p.pid, p.socket_path) for p in self.census.participants]
        self.coordinator = ph.Coordinator(parts, timeout_s=self.phase_timeout_s,
                                          carrier_timeout_s=self.carrier_timeout_s,
                                          on_event=self.r.coordinator_event)

    def quiesce(self):
        with self.r.phase("quiesce") as ph:
            self.qid = quiesce.new_id()
            quiesce.request(self.control_dir, self.roots, self.qid, self.quiesce_timeout_ms)
            quiesce.write_lock(self.control_dir, self.roots, self.qid)
            try:
                self.ready = quiesce.wait_ready(self.control_dir, self.roots, self.qid,
                                                self.quiesce_timeout_ms, stop=self.guard.pending)
            except QuiesceRefused as e:
                hint = (census_mod.job_root_hint(e.pid, self.census.shim)
                        if e.pid is not None else None)
                if hint:
                    # a rank never reads its .request: no .resume left behind for it
                    quiesce.quiesce_path(self.control_dir, e.pid, "resume").unlink(missing_ok=True)
                    raise QuiesceRefused("quiesce", f"{e.reason}; {hint}", pid=e.pid) from e
                raise
            self.t_ready_ns = time.monotonic_ns()
            ranks = sum(len(v.get("ranks", [])) for v in self.ready.values())
            ph.detail = f"{ranks} ranks parked"
        self.check_parked()

    def quiescence_check(self):
        """Prove the workload quiescent before anything is torn down: lock every CUDA process
        (the native lock waits for all submitted stream work, up to ``lock_timeout_ms``) and
        unlock it again. A parked workload submits no new work, so streams that drained under
        the lock stay drained through the capture. A lock that times out means a stream still
        waits on something (a peer's reply the workload did not drain): tearing the shared
        memory down under it would fault that stream and snapshot a dead context, so the
        checkpoint is refused here, with nothing torn down. Raises ``AgentError`` (phase
        "quiescence check") naming the pid and the driver's answer."""
        with self.r.phase("quiescence check") as ph:
            try:
                native.lock_all(self.census.cuda_pids, self.lock_timeout_ms)
            except native.NativeError as e:
                raise AgentError("quiescence check", e.reason, pid=e.pid) from e
            native.unlock_all(self.census.cuda_pids)
            ph.detail = (f"{len(self.census.cuda_pids)} processes locked and unlocked: "
                         "every stream drained")

    def check_parked(self):
        """Every participant must be among the ranks the workload reported parked (when it lists
        pids): a CUDA process that is still running cannot be torn down safely. Raises
        ``AgentError`` (phase "quiesce") naming the first unparked participant."""
        parked = set()
        for payload in self.ready.values():
            ranks = payload.get("ranks")
            if not isinstance(ranks, list) or not all(isinstance(r, dict) and "pid" in r for r in ranks):
                return  # the workload does not list pids: nothing to check against
            parked.update(int(r["pid"]) for r in ranks)
        for p in self.census.participants:
            if p.pid not in parked:
                raise AgentError("quiesce", f"({p.comm}) is a participant but the workload's ready "
                                 f"lists only pids {sorted(parked)} as parked; checkpoint refused, "
                                 "nothing was torn down", pid=p.pid)

    def capture_shared(self):
        """Coordinator capture: INSPECT, validate, SAVE_ALLOCATIONS, PREPARE_UNICAST, INSPECT.
        A refusal or validation error before SAVE_ALLOCATIONS changed nothing (refused);
        from SAVE_ALLOCATIONS on, a failure means teardown started (rolled back)."""
        # from here a dead agent may leave torn-down memory: `release` then wants --force
        quiesce.write_lock(self.control_dir, self.roots, self.qid, torn_down=True)
        try:
            self.capture = self.coordinator.capture()
        except Exception as e:
            changed = getattr(e, "changed", None)
            partial = getattr(e, "capture", None)
            # the coordinator attaches the partial capture to whatever left capture() once a
            # mutating phase may have gone out; without it (and not changed) nothing was sent
            if (changed is False or type(e).__name__ == "TopologyError"
                    or (partial is None and changed is not True)):
                raise self._as_agent_error(e, "INSPECT") from e
            self.torn_down = True
            self.capture = partial
            raise self._as_agent_error(e, "capture") from e
        self.torn_down = True

    def native_lock(self):
        with self.r.phase("native lock") as ph:
            native.lock_all(self.census.cuda_pids, self.lock_timeout_ms)
            ph.detail = f"pids {', '.join(map(str, self.census.cuda_pids))}"

    def native_checkpoint(self):
        with self.r.phase("native checkpoint") as ph:
            native.checkpoint_all(self.census.cuda_pids)
            ph.detail = f"pids {', '.join(map(str, self.census.cuda_pids))}"

    def criu_dump(self):
        """Dump every tree with ``--leave-stopped``: CRIU writes the images and leaves the
        tree stopped (SIGSTOP) instead of killing it, so a later failure (another tree's
        dump, the manifest) can still resume it. A failed dump resumes its own tree (CRIU's
        default on a dump error). Native CUDA state stays CHECKPOINTED either way."""
        from cuinterpose.agent.mech import criu
        strip_preload_env()
        for root in self.roots:
            with self.r.phase("criu dump") as ph:
                d = manifest_mod.criu_dir(self.images_dir, root)
                d.mkdir(parents=True, exist_ok=True)
                self.tree_pids[root] = _tree_pids(root)
                self.external_pipes = [p for p in self.external_pipes if p["root"] != root]
                self.external_pipes += fds.external_pipes(root, self.tree_pids[root])
                self.external_files = [p for p in self.external_files if p["root"] != root]
                files = fds.external_files(root, self.tree_pids[root])
                self.external_files += files
                self.note_external(root)
                try:
                    with interrupt.shielded():
                        ns = criu.dump(root, d, extra_args=("--leave-stopped",),
                                       **({"external_files": list(dict.fromkeys(
                                           external_file_key(f) for f in files))}
                                          if files else {}))
                except Exception as e:
                    raise AgentError("criu dump", f"tree {root}: {e}", pid=root) from e
                if isinstance(ns, dict):
                    self.tree_ns[root] = ns
                self.stopped_roots.append(root)
                ph.bytes = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
                ph.detail = f"tree {root} (left stopped)"
            self.guard.check("criu dump")   # between trees, never inside CRIU

    def note_external(self, root: int) -> None:
        """Warnings (manifest ``warnings``, and notes) for the external pipes and files of
        tree ``root``: what a restore does with them, with and without a placement."""
        comms = {p.pid: p.comm for p in self.census.processes} if self.census else {}
        out = []
        for p in self.external_pipes:
            if p["root"] != root:
                continue
            comm = comms.get(p["pid"], "?")
            out.append({"pid": p["pid"], "comm": comm, "fd": p["fd"],
                        "path": f"pipe:[{p['inode']}]", "message": (
                f"pid {p['pid']} ({comm}) fd {p['fd']} {p['direction']}s pipe:[{p['inode']}], "
                "whose other end is outside the checkpointed tree (a container's stdio, a "
                "pipe to a logger): a restore into a placement (--into-pid) hands it the "
                "placement's stdio; a restore without a placement brings it back with nothing "
                "at the other end (a writer gets EPIPE/SIGPIPE at its next write, a reader "
                "end-of-file)")})
        for f in self.external_files:
            if f["root"] != root:
                continue
            comm = comms.get(f["pid"], "?")
            out.append({"pid": f["pid"], "comm": comm, "fd": f["fd"], "path": f["path"],
                        "message": (
                f"pid {f['pid']} ({comm}) fd {f['fd']} holds {f['path']}, opened outside the "
                f"tree's mount namespace (mount {f['mnt_id']} is not in it): CRIU records it "
                "as external, and a restore hands it the placement's fd "
                f"{f['fd']} when that is the same kind of file, else reopens {f['path']} in "
                "the agent's mount namespace (a restore without a placement always does); it "
                "is refused when that path does not exist there")})
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

    def write_manifest(self):
        m = self.build_manifest()
        with self.r.phase("manifest") as ph:
            path = manifest_mod.write(self.images_dir, m)
            self.manifest = m
            ph.detail = str(path)

    # -- rollback ---------------------------------------------------------------------------
    def rebuild(self, restored: bool = False, native_phase: str = "rollback native"):
        """Undo the teardown in a live workload: SIGCONT the trees CRIU left stopped, native
        back to RUNNING (restore first where CHECKPOINTED), the coordinator's rollback (every
        shim back to ACTIVE whatever phase it reached, topology equal to the capture), then
        ``.resume``. Raises on failure (no ``.resume``: the workload stays parked rather than
        run on torn-down memory)."""
        self.rebuild_state(native_phase)
        quiesce.resume(self.control_dir, self.roots, self.qid, restored=restored)

    def rebuild_state(self, native_phase: str = "rollback native"):
        """:meth:`rebuild` without the final ``.resume`` (a group writes it only once every
        member is rebuilt). ``native_phase`` names the native step's row: "rollback native"
        after a failure, "native restore" after a successful ``--leave-running`` dump."""
        if self.stopped_roots:
            # first: a stopped process cannot answer the driver's checkpoint calls
            self.signal_trees(self.stopped_roots, signal.SIGCONT, "resume trees")
            self.stopped_roots = []
        with self.r.phase(native_phase) as ph:
            found = native.rollback_all(self.census.cuda_pids)
            ph.detail = ", ".join(f"{p}:{s}" for p, s in found.items())
        if self.capture is None:
            raise AgentError("rollback", "no capture to roll the shims back to (the capture "
                             "failed before its first INSPECT completed)")
        try:
            self.coordinator.rollback(self.capture)
        except Exception as e:
            raise as_agent_error(e, "rollback") from e

    # -- group phases -----------------------------------------------------------------------
    #: Group phases of a checkpoint, in order (docs/service.md). A group leader runs each on
    #: every member and waits for all before the next, so no member locks before every member
    #: is quiesced and none is killed or resumed before every manifest is written.
    GROUP_PHASES = ("prepare", "quiesce", "capture", "lock", "checkpoint", "dump", "manifest",
                    "finish", "resume")
    #: Run on every member after a failed phase: first ``rollback`` (rebuild what was torn
    #: down, no ``.resume`` yet), then ``release`` on the members whose rollback succeeded.
    GROUP_UNDO = ("rollback", "release")

    def run_phase(self, name: str) -> dict:
        """Run one group phase on this node; returns {"torn_down", "snapshot_id" (the quiesce
        id or None), "images_dir", "manifest_written"}. Raises
        ``AgentError`` (phase and pid named) when it fails; the leader then runs the undo
        phases. The steps are the ones :meth:`run` calls, grouped at the barriers."""
        fn = getattr(self, "group_" + name, None)
        if name not in self.GROUP_PHASES + self.GROUP_UNDO or fn is None:
            raise AgentError("group", f"unknown checkpoint phase {name!r}")
        try:
            fn()
        except AgentError:
            raise
        except Exception as e:
            phase = self.r.phases[-1].name if self.r.phases else name
            raise AgentError(phase, f"{type(e).__name__}: {e}") from e
        return {"torn_down": self.torn_down, "snapshot_id": self.qid,
                "images_dir": str(self.images_dir),
                "manifest_written": self.manifest is not None}

    def group_prepare(self):
        self.images_dir, self.created_dirs = prepare_dir(self.images_dir)
        self.load_driver()
        self.take_census()
        self.make_coordinator()

    def group_quiesce(self):
        try:
            self.quiesce()
        except QuiesceRefused:
            self.quiesce_cancelled = True   # wait_ready already wrote .resume cancelled
            raise
        self.quiescence_check()

    def group_capture(self):
        self.capture_shared()

    def group_lock(self):
        self.native_lock()

    def group_checkpoint(self):
        self.native_checkpoint()

    def group_dump(self):
        self.criu_dump()

    def group_manifest(self):
        try:
            self.write_manifest()
        except AgentError:
            raise
        except Exception as e:
            raise AgentError("manifest", f"{self.images_dir}: {type(e).__name__}: {e}") from e

    def group_finish(self):
        self.finishing = True      # from here on the group cannot be rolled back
        if self.leave_running:
            self.rebuild_state("native restore")
        else:
            self.kill_dumped()
            quiesce.clear(self.control_dir, self.roots)

    def group_resume(self):
        if self.leave_running:
            quiesce.resume(self.control_dir, self.roots, self.qid, restored=False)

    def group_rollback(self):
        """Undo this member's part of a failed group checkpoint: its own snapshot, even when
        complete, is not part of a consistent cut, so the manifest (written last, removed
        first) and the CRIU images go, then the workload is rebuilt (no ``.resume`` yet)."""
        if self.finishing:
            raise AgentError("rollback", "the group had reached finish (trees killed or "
                             "resumed): nothing to roll back")
        if self.torn_down:
            if self.manifest is not None:
                (pathlib.Path(self.images_dir) / manifest_mod.MANIFEST_NAME).unlink(missing_ok=True)
                self.manifest = None
            self._cleanup_images()
            self.rebuild_state()

    def group_release(self):
        """``.resume`` after a group rollback (restored=false; cancelled when nothing was torn
        down), and the directories this request created are removed when empty."""
        if self.torn_down:
            quiesce.resume(self.control_dir, self.roots, self.qid, restored=False)
        elif self.qid is not None and not self.quiesce_cancelled:
            quiesce.cancel(self.control_dir, self.roots, self.qid)
        _remove_empty(self.created_dirs)

    # -- driver ---------------------------------------------------------------------------
    def run(self) -> dict:
        """Run every phase; returns the manifest. Raises ``AgentError`` (refused, nothing torn
        down) or ``CheckpointFailed`` (``outcome`` rolled_back / rollback_failed).

        SIGINT/SIGTERM/SIGHUP are deferred to the next phase boundary (``interrupt.Guard``)
        and then handled like a failure there: cancelled before teardown, rolled back after;
        once the manifest is written the checkpoint simply finishes."""
        self.t0_ns = time.monotonic_ns()
        self.images_dir, self.created_dirs = prepare_dir(self.images_dir)
        with self.guard:
            try:
                return self._run()
            except CheckpointFailed as e:
                if self.manifest is None:
                    _remove_empty(self.created_dirs)
                if self.qid is not None:
                    if e.outcome == "rollback_failed":
                        quiesce.abandon_lock(self.control_dir, self.roots, self.qid)
                    else:
                        quiesce.unlock(self.control_dir, self.roots, self.qid)
                raise
            except BaseException:
                if self.manifest is None:
                    _remove_empty(self.created_dirs)
                if self.qid is not None:
                    quiesce.unlock(self.control_dir, self.roots, self.qid)
                raise

    def _refused_if_interrupted(self, phase: str) -> None:
        sig = self.guard.pending()
        if sig:
            raise interrupt.Interrupted(phase, sig, f"interrupted by {sig} after {phase}; "
                                        "checkpoint cancelled, nothing was torn down, the "
                                        "workload keeps running")

    def _run(self) -> dict:
        try:
            self.load_driver()
            self._refused_if_interrupted("driver")
            self.take_census()
            self._refused_if_interrupted("census")
            self.make_coordinator()
            self.quiesce()
            self._refused_if_interrupted("quiesce")
            self.quiescence_check()
            self._refused_if_interrupted("quiescence check")
        except BaseException as e:  # nothing was torn down yet: a refusal
            # wait_ready cancels its own refusals; everything after the request is cancelled here
            if self.qid is not None and not isinstance(e, QuiesceRefused):
                quiesce.cancel(self.control_dir, self.roots, self.qid)
            if isinstance(e, AgentError) or not isinstance(e, Exception):
                raise
            phase = self.r.phases[-1].name if self.r.phases else "checkpoint"
            raise AgentError(phase, f"{type(e).__name__}: {e}") from e
        try:
            self.capture_shared()
            self.guard.check("capture")
            self.native_lock()
            self.guard.check("native lock")
            self.native_checkpoint()
            self.guard.check("native checkpoint")
            self.criu_dump()
            try:
                self.write_manifest()
            except AgentError:
                raise
            except BaseException as e:
                raise AgentError("manifest", f"{self.images_dir}: {type(e).__name__}: {e}") from e
        except BaseException as e:
            if not self.torn_down:
                quiesce.cancel(self.control_dir, self.roots, self.qid)
                raise
            self._cleanup_images()
            try:
                self.rebuild(restored=False)
            except BaseException as rb:
                self.r.note(f"rollback failed: {rb}")
                raise CheckpointFailed(e, "rollback_failed", rollback_error=str(rb)) from e
            raise CheckpointFailed(e, "rolled_back") from e
        # the snapshot is on disk: only now may the dumped trees go
        if self.leave_running:
            try:
                self.rebuild(restored=False, native_phase="native restore")
            except BaseException as rb:
                raise CheckpointFailed(rb, "rollback_failed", rollback_error=str(rb)) from rb
        else:
            self.kill_dumped()
            quiesce.clear(self.control_dir, self.roots)
        self.t_end_ns = time.monotonic_ns()
        self.finish_totals()
        t = self.totals_times()
        self.r.total(self.t_end_ns - self.t0_ns,
                     f"workload paused {t['paused_ms']:.1f} ms (ready -> "
                     + ("resumed)" if self.leave_running else "killed)"))
        return self.manifest

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
        try:
            manifest_mod.write(self.images_dir, self.manifest)
        except (OSError, AgentError) as e:
            self.r.note(f"warning: could not record the final totals in the manifest: {e}")

    def _cleanup_images(self):
        d = pathlib.Path(self.images_dir) / manifest_mod.CRIU_DIR
        shutil.rmtree(d, ignore_errors=True)
        tmp = pathlib.Path(self.images_dir) / (manifest_mod.MANIFEST_NAME + ".tmp")
        try:
            if tmp.is_file():
                tmp.unlink()
        except OSError:
            pass

    def _as_agent_error(self, e: BaseException, phase: str) -> AgentError:
        return as_agent_error(e, phase)

    # -- manifest -----------------------------------------------------------------------------
    def build_manifest(self) -> dict:
        cap = self.capture.to_dict() if hasattr(self.capture, "to_dict") else self.capture
        records = _records_by_pid_from_capture(self.capture)
        criu_version = None
        try:
            from cuinterpose.agent.mech import criu
            criu_version = criu.version()
        except Exception as e:  # the dump worked, so this is cosmetic
            criu_version = f"unknown ({e})"
        return {
            "format": manifest_mod.FORMAT,
            "format_version": manifest_mod.FORMAT_VERSION,
            "snapshot_id": self.qid,
            "created_at": manifest_mod.utc_now(),
            "checkpoint_started_at": self.started_at,
            "shim": {"path": self.census.shim.path, "sha256": self.census.shim.sha256,
                     "size": self.census.shim.size, "version": shim_version()},
            "driver": self.driver.to_dict(),
            "criu": {"version": criu_version, "leave_running": self.leave_running,
                     "trees": {str(r): str(manifest_mod.criu_dir("", r)) for r in self.roots},
                     "files": manifest_mod.image_files(self.images_dir)},
            "roots": self.roots,
            "control_dir": self.control_dir,
            "cuda_pids": self.census.cuda_pids,
            "participants": [
                {"pid": p.pid, "comm": p.comm, "socket_path": p.socket_path,
                 "cuda_state": p.cuda_state,
                 "roles": manifest_mod.role_counts(records.get(p.pid, []))}
                for p in self.census.participants],
            "processes": [{"pid": p.pid, "ppid": p.ppid, "comm": p.comm}
                          for p in self.census.processes],
            "quiesce": {"id": self.qid, "timeout_ms": self.quiesce_timeout_ms,
                        "ready": {str(k): v for k, v in self.ready.items()}},
            "capture": cap,
            "carriers": list(getattr(self.capture, "carriers", None)
                             or manifest_mod.carriers_from_capture(cap)),
            "phases": self.r.to_list(),
            "totals": {"carrier_bytes": _capture_bytes(self.capture),
                       "image_bytes": sum(f["bytes"] for f in
                                          manifest_mod.image_files(self.images_dir).values()),
                       **self.totals_times()},
            "warnings": list(self.warnings) + [w for r in self.roots
                                               for w in self.external_warnings.get(r, [])],
            "external_pipes": list(self.external_pipes),
            "external_files": list(self.external_files),
            "namespaces": [{"root": r,
                            **{k: int(self.tree_ns[r][k]) for k in ("net", "uts", "ipc")},
                            "external_net": self.tree_ns[r].get("external_net", ""),
                            **({"mnt": int(self.tree_ns[r]["mnt"]),
                                "foreign_mnt": bool(self.tree_ns[r].get("foreign_mnt"))}
                               if "mnt" in self.tree_ns[r] else {})}
                           for r in self.roots if r in self.tree_ns],
            **({"group": self.group} if self.group else {}),
        }


def _kill(pid: int, sig: int) -> None:
    os.kill(pid, sig)


def _tree_pids(root: int) -> list[int]:
    """Pids of the tree under ``root`` (root first); [] when the root is gone."""
    try:
        return [p for p, _, _ in census_mod.walk_tree([root])]
    except AgentError:
        return []


def as_agent_error(e: BaseException, phase: str) -> AgentError:
    """Wrap a coordinator/CRIU exception as ``AgentError`` keeping its phase and pid, without
    repeating the "PHASE: pid N" prefix its message may already carry."""
    if isinstance(e, AgentError):
        return e
    phase = getattr(e, "phase", None) or phase
    pid = getattr(e, "pid", None)
    reason = str(e)
    if reason.startswith(f"{phase}: "):
        reason = reason[len(phase) + 2:]
    if pid is not None and reason.startswith(f"pid {pid} "):
        reason = reason[len(f"pid {pid} "):]
    return AgentError(phase, reason, pid=pid)


def _records_by_pid_from_capture(capture) -> dict[int, list]:
    if capture is None:
        return {}
    d = capture.to_dict() if hasattr(capture, "to_dict") else capture
    return {pid: recs for pid, recs in manifest_mod._records_by_pid(d)} if isinstance(d, dict) else {}


def _capture_bytes(capture) -> int:
    """Carrier bytes held by a capture (sum over creator carriers), 0 if unknown."""
    if capture is None:
        return 0
    for attr in ("carrier_bytes", "bytes"):
        v = getattr(capture, attr, None)
        if isinstance(v, int):
            return v
    d = capture.to_dict() if hasattr(capture, "to_dict") else capture
    return sum(c["bytes"] for c in manifest_mod.carriers_from_capture(d))


def checkpoint(roots: Iterable[int], images_dir, **kw) -> dict:
    """Convenience: ``Checkpoint(roots, images_dir, **kw).run()``."""
    return Checkpoint(roots, images_dir, **kw).run()
