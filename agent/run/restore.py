"""``cuinterpose-agent restore``: :class:`Restore`, its step table and the steps, and the
reasons of a CRIU restore refused for a file whose size changed (:func:`~cuinterpose.agent.mech.criu_bad_size.reason`).

The one-shot :meth:`Restore.run` and the group phases (:meth:`Restore.run_phase`, a named
slice of the table) both run :data:`Restore.STEPS` through the step runner (agent/run/steps.py).
Ordering, placements, failures: docs/agent.md "Restore ordering", "Restoring into a placement".
"""

from __future__ import annotations

import os
import pathlib
import signal
import stat as stat_mod
import time
from typing import Optional

from cuinterpose.agent import paths
from cuinterpose.agent.errors import AgentError, PlacementError, RestoreFailed, SnapshotError
from cuinterpose.agent.mech import census as census_mod
from cuinterpose.agent.mech import criu_bad_size, ctldir, devicemap, inherit, native, quiesce
from cuinterpose.agent.mech.census import pid_alive
from cuinterpose.agent.mech.placement import Placement
from cuinterpose.agent.options import RestoreOptions
from cuinterpose.agent.run import (
    carriers,
    download,
    durable,
    gpustore_step,
    interrupt,
    placing,
    restore_recover,
)
from cuinterpose.agent.run.report import Reporter
from cuinterpose.agent.run.steps import (
    RESTORE_STEPS,
    Step,
    StepRunner,
    as_agent_error,
    coordinator_events,
    group_phases,
    strip_preload_env,
)
from cuinterpose.agent.snapshot import manifest as manifest_mod
from cuinterpose.agent.snapshot import trust
from cuinterpose.agent.snapshot.snapdir import SnapshotDir


class Restore(StepRunner):
    """State of one restore run; :meth:`run` drives the steps and returns a result dict."""

    KIND = "restore"
    #: The restore, once: the table and every step property are agent/run/steps.py's.
    STEPS = RESTORE_STEPS
    GROUP_PHASES = group_phases(STEPS)
    #: after a failure from ``criu restore`` on, the leader runs ``abort`` on every member
    #: (restored trees killed, snapshots untouched)
    UNDO = {"abort": "kill_restored"}
    GROUP_UNDO = tuple(UNDO)

    def __init__(
        self,
        images_dir,
        options: Optional[RestoreOptions] = None,
        *,
        reporter: Optional[Reporter] = None,
        shim_path=None,
        placement: "Placement | int | None" = None,
        device_map: Optional[str] = None,
        remote=None,
        cancel: Optional[interrupt.Cancel] = None,
        **changes,
    ):
        #: every option of this run (agent/options.py); ``changes`` (option names) are set on
        #: ``options`` (default: the defaults), checked
        self.options = (options or RestoreOptions()).replace(**changes)
        self.images_dir = pathlib.Path(paths.canonical(images_dir))
        self.remote = remote  # run/remote.py Remote: an s3:// images dir (images_dir its copy)
        #: ``--device-map OLD=NEW[,...]`` as given (None: automatic); resolved in "driver" into
        #: ``gpu_map`` {old UUID: new UUID} ({}: every process goes back onto its own GPUs)
        self.device_map = device_map
        self.gpu_map: dict[str, str] = {}
        #: what was asked: a Placement, a pid (read in the "placement" phase) or None
        self.placement_arg = placement
        self.placement: Optional[Placement] = None
        #: root -> its CRIU options (inherit.RestoreOptions; fds closed after the restore)
        self.opts: dict[int, inherit.RestoreOptions] = {}
        #: {"root", "pid", "fd", "inode", "direction", "placement_fd"} handed over
        self.inherited: list[dict] = []
        #: external files handed over: manifest records + {"handed", "placement_fd"}
        self.files: list[dict] = []
        #: restored fds set O_APPEND after CRIU (inherit.RestoreOptions.after_restore)
        self.fixed: list[dict] = []
        #: the driver kind restored with: the manifest's (``options.driver``, when given, must
        #: be the same), resolved by "manifest"
        self.driver_kind: Optional[str] = None
        self.r = reporter or Reporter()
        self.shim_path = shim_path
        self.m: Optional[dict] = None
        self.restored_roots: list[int] = []
        #: directories "stale sockets" created (the control dir and missing parents, top first)
        self.created_dirs: list[str] = []
        #: signals (one-shot) or ``cancel`` (the daemon: a cancelled gRPC call) stop the run
        self.guard = interrupt.Guard("restore", cancel)
        self.t0_ns = time.monotonic_ns()

    def read_manifest(self):
        with self.r.phase("manifest") as ph:
            m = manifest_mod.load(self.images_dir)
            shim = census_mod.ShimFile.of(self.shim_path or paths.shim_path())
            manifest_mod.check_shim(m, shim.path, shim.sha256)
            orig = m["shim"]["path"]
            if orig != shim.path:
                try:
                    same = census_mod.sha256_file(orig) == shim.sha256
                except OSError:
                    same = False
                if not same:
                    raise SnapshotError(
                        "manifest",
                        f"the snapshot's processes map the shim at {orig}, "
                        f"which is missing or differs from the installed {shim.path}; "
                        "CRIU reopens mapped files by path",
                    )
            want = m["driver"]["kind"]
            kind = native.driver_kind(self.options.driver or want)
            if kind != want:
                raise SnapshotError(
                    "manifest", f"snapshot was taken on the {want} driver, restore asked for {kind}"
                )
            self.driver_kind = kind
            self.check_copies(m)
            for p in sorted(
                {
                    *m["roots"],
                    *(q["pid"] for q in m["participants"]),
                    *(q["pid"] for q in m.get("processes", [])),
                }
            ):
                if pid_alive(p):
                    comm = census_mod.read_stat(p)[1]
                    raise SnapshotError(
                        "manifest",
                        f"({comm}) is running with a pid the snapshot "
                        "needs (CRIU restores the original pids); restore refused, "
                        "snapshot untouched" + restore_recover.parked_hint(m),
                        pid=p,
                    )
            ph.detail = f"{m['snapshot_id']} taken {m['created_at']}"
            self.m = m

    verify_images = durable.verify_snapshot  # each image's SHA-256, in parallel, own phase
    # an s3:// images dir: downloaded first, and its local copy gone once the run is over
    download_snapshot = download.download_step

    def check_copies(self, m: dict):
        """Every copy of a checksum agrees, and the control dir is the one the images' shim
        sockets are bound in (a manifest is untrusted input: agent/snapshot/trust.py)."""
        from cuinterpose.coordinator import phases, topology

        cap = phases.Capture.from_dict(m["capture"]) if m["capture"] else None
        derived = topology.carriers(cap.records) if cap is not None else []
        trust.check_carriers(self.images_dir, m, derived)
        trust.check_chunks(self.images_dir, m, derived)
        trust.check_control_dir(self.images_dir, m)
        trust.check_gpu_storage(self.images_dir, m)  # before CRIU runs (issue 12)

    def load_driver(self):
        with self.r.phase("driver") as ph:
            self.driver = native.load(self.driver_kind)
            ph.detail = f"{self.driver.kind} {self.driver.version}"
            moved = self.map_devices()
            if moved:
                ph.detail += "; GPUs " + ", ".join(f"{o}={n}" for o, n in moved.items())

    def map_devices(self) -> dict[str, str]:
        """Part of "driver" (read-only): the GPUs the agent sees (with a placement: those the
        placement process sees, :func:`devicemap.placement_gpus`), and ``--device-map`` or the
        automatic mapping (agent/mech/devicemap.py) checked against the snapshot's GPU records;
        returns the moved GPUs {old UUID: new UUID}. Raises ``DeviceMapError`` (phase "device
        map") naming both GPUs, nothing touched."""
        self.node_gpus = devicemap.node_gpus()
        into = getattr(self.placement_arg, "pid", self.placement_arg)
        if into:  # the placeholder's GPUs: what the restored trees will see (NEW ordinals too)
            self.node_gpus = devicemap.placement_gpus(int(into), self.node_gpus)
        self.gpu_map = devicemap.resolve(self.m, self.node_gpus, self.device_map)
        return {o: n for o, n in self.gpu_map.items() if o != n}

    def place(self):
        """Phase "placement" (read-only): resolve the placement, check it is still the same
        process, that a child can join its cgroups (a probe process joins them and exits) and
        that it has stdio for every external pipe; prepare (open) what CRIU gets for each
        tree. Without a placement only an external network namespace of the images needs one:
        the agent's own. Raises ``PlacementError`` (refused, nothing changed)."""
        want = self.placement_arg
        ext_net = [
            r
            for r in self.m["roots"]
            if manifest_mod.tree_namespaces(self.m, r).get("external_net")
        ]
        ext_files = self.m.get("external_files", [])
        if want is None:
            for note in placing.unplaced_notes(self.m):
                self.r.note(note)
            if not ext_net and not ext_files:
                return
        with self.r.phase("placement") as ph:
            try:
                self._place(want)
            except BaseException:
                self.close_fds()
                raise
            pl = self.placement
            ph.detail = (
                pl.describe()
                if pl
                else (
                    "none: "
                    + "; ".join(
                        w
                        for w, on in (
                            ("external network namespaces go into the agent's", ext_net),
                            (
                                "external files are reopened in the agent's mount namespace",
                                ext_files,
                            ),
                        )
                        if on
                    )
                )
            )
        for note in placing.placed_notes(self.m, pl, self.files, self.fixups_planned()):
            self.r.note(note)

    def _place(self, want):
        pl = want
        if pl is not None and not isinstance(pl, Placement):
            pl = Placement.of_pid(int(pl))
        if pl is not None:
            pl.verify()
            pl.probe_cgroups()
        self.placement = pl
        for root in self.m["roots"]:
            opts = inherit.restore_options(
                pl,
                manifest_mod.external_pipes(self.m, root),
                manifest_mod.tree_namespaces(self.m, root).get("external_net", ""),
                root=root,
                external_files=manifest_mod.external_files(self.m, root),
            )
            self.opts[root] = opts
            self.inherited += [{"root": root, **p} for p in opts.inherited]
            self.files += [{"root": root, **f} for f in opts.files]

    def fixups_planned(self) -> list[dict]:
        return [{"root": r, **fx} for r, o in self.opts.items() for fx in o.fixups]

    def close_fds(self):
        for opts in self.opts.values():
            opts.close()

    def remove_stale(self):
        """Phase "stale sockets": make sure the recorded control dir is there and trusted,
        then unlink each participant's old control socket, at the path derived from the
        checked control dir, only if it is a socket (lstat); anything else there refuses.

        A missing control dir (a new node, a cleaned /tmp) is created as the checkpoint's
        census does (``ctldir.ensure``: mode 0700, missing parents too; CRIU re-binds the
        shim sockets in it); one that is there must pass ``ctldir.check`` (owned by root or
        the agent's uid, not writable by group or other, no symlink of another uid): a
        planted or unsafe one refuses, nothing changed. What this restore created is removed
        again when the restore fails (:meth:`remove_created_dirs`). The recorded path itself
        was checked against the CRIU images (``trust.check_control_dir``, phase manifest)."""
        with self.r.phase("stale sockets") as ph:
            cd = self.m["control_dir"]
            missing = paths.missing_dirs(cd)
            try:
                ctldir.ensure(
                    cd,
                    phase="stale sockets",
                    retry="(the restored shims bind their sockets in it) and run restore again",
                )
            except AgentError as e:
                raise SnapshotError(e.phase, f"{e.reason}; the snapshot is untouched") from None
            self.created_dirs = missing
            if missing:
                self.r.note(f"created control dir {cd} (mode 0700): the snapshot's was missing")
            stale = []
            for p in self.m["participants"]:
                sp = trust.socket_path(cd, p["pid"])
                try:
                    mode = os.lstat(sp).st_mode
                except FileNotFoundError:
                    continue
                if not stat_mod.S_ISSOCK(mode):
                    raise SnapshotError(
                        "stale sockets",
                        f"{sp} is not a socket; restore refuses to remove it (CRIU binds "
                        f"participant {p['pid']}'s control socket there): move it away and "
                        "run restore again; nothing was changed",
                        pid=p["pid"],
                    )
                stale.append(sp)
            for sp in stale:
                os.unlink(sp)
            for root in self.m["roots"]:
                rp = quiesce.quiesce_path(cd, root, "resume")
                try:
                    if not stat_mod.S_ISDIR(os.lstat(rp).st_mode):
                        os.unlink(rp)
                except FileNotFoundError:
                    pass
            ph.detail = f"removed {len(stale)}"
        restore_recover.record(self)

    # -- the restore in progress (decisions D49; agent/run/restore_recover.py keeps the record)
    def step_started(self, step: Step) -> None:
        if step.stage == "restore":
            restore_recover.mark(self, step.name)

    def step_done(self, step: Step) -> None:
        if step.stage == "restore":
            restore_recover.mark(self, f"{step.name} done")

    def criu_restore(self):
        from cuinterpose.agent.mech import criu

        strip_preload_env()
        for root in self.m["roots"]:
            with self.r.phase("criu restore") as ph:
                d = SnapshotDir(self.images_dir).criu_dir(root)
                opts = self.opts.get(root)
                kw = opts.kwargs() if opts else {}
                into = f" into placement pid {self.placement.pid}" if self.placement else ""
                try:
                    with interrupt.shielded():
                        pid = criu.restore(d, timeout_s=self.options.criu_timeout_s, **kw)
                except Exception as e:
                    gone = self.placement_gone()
                    if gone:
                        raise AgentError(
                            "criu restore",
                            f"tree {root} from {d}{into}: the placement process "
                            f"{gone} since the placement phase, so CRIU could not restore "
                            f"into it (CRIU: {_first_line(e)})",
                            pid=self.placement.pid,
                        ) from e
                    bad = getattr(e, "bad_size", None)
                    if bad:
                        raise AgentError(
                            "criu restore",
                            criu_bad_size.reason(
                                root, d, bad, e, files=criu_bad_size.handed_files(opts)
                            ),
                            pid=root,
                        ) from e
                    raise AgentError(
                        "criu restore", f"tree {root} from {d}{into}: {e}", pid=root
                    ) from e
                self.restored_roots.append(root)
                restore_recover.mark(self, f"criu restore {root} done")
                if int(pid) != int(root):
                    raise AgentError(
                        "criu restore", f"tree {root} came back as pid {pid}", pid=root
                    )
                if opts is not None and opts.fixups:
                    try:
                        self.fixed += [
                            {"root": root, **fx} for fx in opts.after_restore(criu.image_pids(d))
                        ]
                    except (PlacementError, criu.CriuError) as e:
                        raise AgentError("criu restore", f"tree {root}{into}: {e}", pid=root) from e
                if self.placement is not None:
                    self.check_placed(root)
                ph.detail = f"tree {root}{into}"
        self.close_fds()

    def placement_gone(self) -> str:
        """Why the placement is no longer usable (the process gone or its pid reused, a
        namespace left), "" when it still is (or there is none)."""
        if self.placement is None:
            return ""
        if not self.placement.alive():
            return f"{self.placement.pid} is gone (exited, or its pid was reused)"
        try:
            self.placement.verify()
        except PlacementError as e:
            return f"{self.placement.pid} {e.reason}"
        return ""

    def check_placed(self, root: int):
        """Every restored process of tree ``root`` is in the placement's namespaces and
        cgroups; raises ``AgentError`` (phase "criu restore") naming the first that is not."""
        try:
            procs = census_mod.walk_tree([root])
        except AgentError as e:
            raise AgentError(
                "criu restore",
                f"tree {root} is gone right after its restore "
                f"into placement pid {self.placement.pid}: {e.reason}",
                pid=root,
            ) from e
        for pid, _, _ in procs:
            bad = self.placement.mismatches(pid)
            if bad:
                raise AgentError(
                    "criu restore",
                    f"restored into placement pid "
                    f"{self.placement.pid} but it is not placed: " + "; ".join(bad),
                    pid=pid,
                )

    def native_restore(self):
        pids = self.m["cuda_pids"]
        with self.r.phase("native restore") as ph:
            for pid in pids:
                st = native.get_state(pid)
                if st != "CHECKPOINTED":
                    raise AgentError(
                        "native restore",
                        f"is {st} after CRIU restore, expected CHECKPOINTED",
                        pid=pid,
                    )
            by_pid = {p["pid"]: p for p in self.m["participants"]}
            pairs = {
                p: devicemap.pairs_for(by_pid.get(p, {}), self.gpu_map, self.node_gpus)
                for p in pids
            }
            # streams in custom storage (issue 12)
            gpustore_step.prepare_restore(self.m, self.images_dir, self.options.staging_bytes)
            devicemap.native_restore(pids, pairs)
            ph.detail = f"pids {', '.join(map(str, pids))} by {native.backend().name}"
            if self.gpu_map:
                ph.detail += f" onto {len({n for n in self.gpu_map.values()})} mapped GPUs"
        with self.r.phase("native unlock") as ph:
            native.unlock_all(pids)
            ph.detail = f"pids {', '.join(map(str, pids))}"

    def restore_shared(self):
        from cuinterpose.coordinator import phases

        cd = self.m["control_dir"]
        parts = [
            phases.Participant(p["pid"], trust.socket_path(cd, p["pid"]))
            for p in self.m["participants"]
        ]
        coord = phases.Coordinator(
            parts,
            timeout_s=self.options.phase_timeout_s,
            carrier_timeout_s=self.options.carrier_timeout_s,
            on_event=coordinator_events(self.r.coordinator_event),
        )
        coord.carriers = carriers.restore_files(self.images_dir, self.m)
        try:
            restore_recover.take_claim(self, coord)
            capture = phases.Capture.from_dict(self.m["capture"])
            self.restore_result = coord.restore(capture, device_map=self.gpu_map)
        except Exception as e:
            err = as_agent_error(e, "restore shared")
            # a damaged chunk: its file and byte range, for the operator
            raise carriers.name_bad_chunk(err, coord.carriers, self.m) from e
        finally:
            carriers.release(coord.carriers)  # the chunk store's shared lock, if any

    def resume(self):
        with self.r.phase("resume"):
            quiesce.resume(
                self.m["control_dir"], self.m["roots"], self.m["quiesce"]["id"], restored=True
            )
        restore_recover.end(self)

    def remove_created_dirs(self):
        """Remove the control dir (and parents) this restore created, where still empty (a
        failed restore leaves the node as it found it); a non-empty one stays."""
        for d in reversed(self.created_dirs):
            try:
                os.rmdir(d)
            except OSError:
                break
        self.created_dirs = []

    def kill_restored(self):
        """SIGKILL every process of the restored trees (leaves first is unnecessary: KILL);
        then :meth:`remove_created_dirs`."""
        try:
            procs = census_mod.walk_tree([r for r in self.restored_roots if pid_alive(r)])
        except AgentError:
            procs = []
        for pid, _, _ in procs:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        restore_recover.end(self)
        self.remove_created_dirs()

    def phase_state(self) -> dict:
        """{"restored": [roots]}."""
        return {"restored": list(self.restored_roots)}

    def result(self) -> dict:
        """{"snapshot_id", "roots", "cuda_pids", "phases", "totals", "notes"} of a finished
        restore, with ``external_files`` (what each file opened outside a tree's mount
        namespace was handed) and ``placement`` (its pid, namespaces, cgroups and the stdio
        handed to external pipes, ``append`` where a regular file was set O_APPEND)."""
        out = {
            "snapshot_id": self.m["snapshot_id"],
            "roots": self.m["roots"],
            "cuda_pids": self.m["cuda_pids"],
            "phases": self.r.to_list(),
            "totals": {"wall_ms": round(self.r.wall_ns() / 1e6, 3)},
            "notes": list(self.r.notes),
        }
        used = manifest_mod.native_record()  # the backend this restore's native steps used
        if used is not None:
            out["native"] = {**used, "snapshot": self.m.get("native")}
        if self.gpu_map:
            out["gpus"] = {
                str(p["pid"]): devicemap.mapped_gpus(p, self.gpu_map, self.node_gpus)
                for p in self.m["participants"]
            }
        if self.files:
            out["external_files"] = [
                {
                    k: f[k]
                    for k in (
                        "root",
                        "pid",
                        "fd",
                        "path",
                        "mnt_id",
                        "inode",
                        "handed",
                        "placement_fd",
                    )
                }
                for f in self.files
            ]
        if self.placement is not None:
            pl = self.placement
            appended = {(f["pid"], f["fd"]) for f in self.fixed}
            out["placement"] = {
                "pid": pl.pid,
                "namespaces": {n.kind: n.inode for n in pl.namespaces},
                "cgroups": [c.line() for c in pl.cgroups],
                "stdio": [
                    {
                        **{
                            k: p[k]
                            for k in ("root", "pid", "fd", "inode", "direction", "placement_fd")
                        },
                        **({"append": True} if (p["pid"], p["fd"]) in appended else {}),
                    }
                    for p in self.inherited
                ],
            }
        return out

    def run(self) -> dict:
        """Returns {"snapshot_id", "roots", "cuda_pids", "phases"}. Raises ``SnapshotError`` /
        ``AgentError`` (refused, nothing changed) or ``RestoreFailed`` (restored trees killed).

        SIGINT/SIGTERM/SIGHUP are deferred to the next step boundary (``interrupt.Guard``):
        before CRIU restore the restore is cancelled (refused); after it the restored trees
        are killed (``RestoreFailed``); the snapshot is never touched."""
        self.t0_ns = self.r.begin()
        with self.guard, native.using(self.options):
            try:
                return self._run()
            finally:
                self.release_store()

    def release_store(self, keep_pin: bool = False) -> None:
        """The run is over (the one-shot run's end, a group job's last phase): the lock on the
        snapshot dir goes, then an ``s3://`` run's downloaded copy (whose delete takes that
        lock itself). Idempotent."""
        restore_recover.release_dir(self, keep_pin)
        download.end(self, keep_pin)

    def _run(self) -> dict:
        try:
            self.run_steps(self.stage("refusal"))
        except BaseException:
            self.close_fds()
            self.remove_created_dirs()
            raise
        try:
            self.run_steps(self.stage("restore"))
            self.r.total(self.r.wall_ns())
        except BaseException as e:
            self.close_fds()
            self.kill_restored()
            if isinstance(e, AgentError):
                raise RestoreFailed(
                    e.phase,
                    e.reason + "; the restored tree was killed, the snapshot is untouched",
                    pid=e.pid,
                ) from e
            raise RestoreFailed("restore", f"{e}; the restored tree was killed") from e
        return self.result()

    def interrupted(self, step: Step, sig: str) -> AgentError:
        if step.stage == "refusal":
            return SnapshotError(
                step.name,
                f"interrupted by {sig} after {step.name}; restore "
                "cancelled, nothing was changed, the snapshot is untouched",
            )
        return interrupt.Interrupted(step.name, sig)

    def read_manifest_checked(self):
        """:meth:`read_manifest` once this run claimed the snapshot dir (a ``delete`` or another
        restore of it is refused meanwhile), a malformed manifest refused as ``SnapshotError``."""
        restore_recover.claim_dir(self)
        try:
            self.read_manifest()
        except AgentError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, OSError) as e:
            raise SnapshotError(
                "manifest",
                f"{self.images_dir}: malformed or unreadable "
                f"snapshot ({type(e).__name__}: {e}); restore refused, "
                "snapshot untouched",
            ) from e


def _first_line(e: BaseException) -> str:
    lines = str(e).splitlines()
    return lines[0] if lines else type(e).__name__
