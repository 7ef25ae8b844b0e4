"""``cuinterpose-agent checkpoint``: the capture ordering, as one function with one step per phase.

Order (DESIGN §3, prior-art §9 lesson 8)::

    census -> quiesce (request/ready) -> capture (coordinator: INSPECT, validate,
    SAVE_ALLOCATIONS, PREPARE_UNICAST) -> native lock (every pid) -> native checkpoint (each pid)
    -> CRIU dump (kills the tree) -> manifest (written last)

What a failure leaves behind:

- census, quiesce, INSPECT/validate: *refused*; nothing was torn down (``.resume`` cancelled
  is written once the request was sent); the workload keeps running.
- after teardown started, before the dump completed: *rolled back*: native processes are
  brought back to RUNNING (restore first if checkpointed), the coordinator's restore phases
  rebuild the shared memory from the host carriers, the topology is compared with the capture,
  and ``.resume`` with ``restored=false`` lets the workload continue with its memory intact.
- after the dump (the tree is gone) the manifest is written; if that fails, the directory is
  left without a manifest (not a snapshot) and the error says so.

``--leave-running`` dumps with CRIU's leave-running and then rebuilds exactly like a rollback:
the snapshot is written and the workload continues.
"""
from __future__ import annotations

import os
import pathlib
import shutil
from typing import Iterable, Optional

from . import census as census_mod
from . import manifest as manifest_mod
from . import native, paths, quiesce
from .errors import AgentError, CheckpointFailed, SnapshotError
from .report import Reporter


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


def prepare_dir(images_dir: os.PathLike | str) -> pathlib.Path:
    """Create the snapshot directory. Refuses (``SnapshotError``) a directory that already holds a
    snapshot (a ``manifest.json``) or CRIU images; an empty or missing directory is fine."""
    d = pathlib.Path(images_dir).resolve()
    if (d / manifest_mod.MANIFEST_NAME).exists():
        raise SnapshotError("checkpoint", f"{d} already holds a snapshot ({manifest_mod.MANIFEST_NAME}); "
                            "choose a new --images-dir")
    crit = d / manifest_mod.CRIU_DIR
    if crit.exists() and any(crit.iterdir()):
        raise SnapshotError("checkpoint", f"{crit} is not empty (left by an interrupted checkpoint?); "
                            "remove it or choose a new --images-dir")
    d.mkdir(parents=True, exist_ok=True)
    return d


class Checkpoint:
    """State of one checkpoint run; :meth:`run` drives the phases. Attributes filled along the
    way: ``census``, ``qid``, ``ready``, ``capture``, ``manifest``."""

    def __init__(self, roots: Iterable[int], images_dir, *, control_dir=None,
                 quiesce_timeout_ms: int = 10_000, lock_timeout_ms: int = 10_000,
                 phase_timeout_s: float = 60.0, driver: Optional[str] = None,
                 leave_running: bool = False, reporter: Optional[Reporter] = None,
                 shim_path=None):
        self.roots = list(dict.fromkeys(int(r) for r in roots))
        self.images_dir = images_dir
        self.control_dir = str(pathlib.Path(control_dir or paths.control_dir()).resolve())
        self.quiesce_timeout_ms = int(quiesce_timeout_ms)
        self.lock_timeout_ms = int(lock_timeout_ms)
        self.phase_timeout_s = float(phase_timeout_s)
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
            ph.detail = (f"{len(self.census.processes)} processes, participants "
                         f"{', '.join(str(p.pid) for p in parts)}")

    def make_coordinator(self):
        ph = _coordinator_module()
        parts = [ph.Participant(p.pid, p.socket_path) for p in self.census.participants]
        self.coordinator = ph.Coordinator(parts, timeout_s=self.phase_timeout_s,
                                          on_event=self.r.coordinator_event)

    def quiesce(self):
        with self.r.phase("quiesce") as ph:
            self.qid = quiesce.new_id()
            quiesce.request(self.control_dir, self.roots, self.qid, self.quiesce_timeout_ms)
            self.ready = quiesce.wait_ready(self.control_dir, self.roots, self.qid,
                                            self.quiesce_timeout_ms)
            ranks = sum(len(v.get("ranks", [])) for v in self.ready.values())
            ph.detail = f"{ranks} ranks parked"
        try:
            self.check_parked()
        except AgentError:
            quiesce.cancel(self.control_dir, self.roots, self.qid)
            raise

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
        try:
            self.capture = self.coordinator.capture()
        except Exception as e:
            changed = getattr(e, "changed", None)
            if changed is False or type(e).__name__ == "TopologyError":
                raise self._as_agent_error(e, "INSPECT") from e
            self.torn_down = True
            self.capture = getattr(e, "capture", None)
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
        from . import criu
        strip_preload_env()
        for root in self.roots:
            with self.r.phase("criu dump") as ph:
                d = manifest_mod.criu_dir(self.images_dir, root)
                d.mkdir(parents=True, exist_ok=True)
                try:
                    criu.dump(root, d, leave_running=self.leave_running)
                except Exception as e:
                    raise AgentError("criu dump", f"tree {root}: {e}", pid=root) from e
                ph.bytes = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
                ph.detail = f"tree {root}" + (" (left running)" if self.leave_running else " (killed)")

    def write_manifest(self):
        m = self.build_manifest()
        with self.r.phase("manifest") as ph:
            path = manifest_mod.write(self.images_dir, m)
            self.manifest = m
            ph.detail = str(path)

    # -- rollback ---------------------------------------------------------------------------
    def rebuild(self, restored: bool = False):
        """Undo the teardown in a live tree: native back to RUNNING (restore first where
        checkpointed), then the coordinator's restore phases from the host carriers (topology
        equality included), then ``.resume``. Shims still ACTIVE everywhere (the failure came
        before any teardown) need no restore phases. Raises on failure (no ``.resume``: the
        workload stays parked rather than run on torn-down memory)."""
        with self.r.phase("rollback native") as ph:
            found = native.rollback_all(self.census.cuda_pids)
            ph.detail = ", ".join(f"{p}:{s}" for p, s in found.items())
        state = self.shim_phases()
        if state == "PREPARED":
            if self.capture is None:
                raise AgentError("rollback", "no capture to restore the shims from")
            self.coordinator.restore(self.capture)
        elif state != "ACTIVE":
            raise AgentError("rollback", state)
        quiesce.resume(self.control_dir, self.roots, self.qid, restored=restored)

    def shim_phases(self) -> str:
        """"PREPARED" when every shim is PREPARED, "ACTIVE" when every shim is ACTIVE (teardown
        never started), else a description of the mix (INSPECT needs the expected phase)."""
        from cuinterpose.coordinator.protocol import Phase
        errors = []
        for ph in (Phase.PREPARED, Phase.ACTIVE):
            try:
                self.coordinator.inspect(expected_phase=ph, check_phase=True)
                return ph.name
            except Exception as e:
                errors.append(str(e))
        return "shims are in mixed phases, cannot rebuild: " + " / ".join(errors)

    # -- driver ---------------------------------------------------------------------------
    def run(self) -> dict:
        """Run every phase; returns the manifest. Raises ``AgentError`` (refused, nothing torn
        down) or ``CheckpointFailed`` (``outcome`` rolled_back / rollback_failed /
        snapshot_incomplete)."""
        self.images_dir = prepare_dir(self.images_dir)
        try:
            self.load_driver()
            self.take_census()
            self.make_coordinator()
            self.quiesce()
        except AgentError:
            raise
        except Exception as e:  # nothing was torn down yet: a refusal
            if self.qid is not None:
                quiesce.cancel(self.control_dir, self.roots, self.qid)
            phase = self.r.phases[-1].name if self.r.phases else "checkpoint"
            raise AgentError(phase, f"{type(e).__name__}: {e}") from e
        try:
            self.capture_shared()
            self.native_lock()
            self.native_checkpoint()
            self.criu_dump()
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
        if self.leave_running:
            try:
                self.rebuild(restored=False)
            except BaseException as rb:
                raise CheckpointFailed(rb, "rollback_failed", rollback_error=str(rb)) from rb
        try:
            self.write_manifest()
        except BaseException as e:
            raise CheckpointFailed(AgentError("manifest", f"{self.images_dir}: {e}"),
                                   "snapshot_incomplete") from e
        return self.manifest

    def _cleanup_images(self):
        d = pathlib.Path(self.images_dir) / manifest_mod.CRIU_DIR
        shutil.rmtree(d, ignore_errors=True)

    def _as_agent_error(self, e: BaseException, phase: str) -> AgentError:
        return as_agent_error(e, phase)

    # -- manifest -----------------------------------------------------------------------------
    def build_manifest(self) -> dict:
        cap = self.capture.to_dict() if hasattr(self.capture, "to_dict") else self.capture
        records = _records_by_pid_from_capture(self.capture)
        criu_version = None
        try:
            from . import criu
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
                                          manifest_mod.image_files(self.images_dir).values())},
        }


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
