"""The rollback of a dead agent's checkpoint (case 009; case 006 from outside): what the
checkpoint records in its ``.lock`` (:func:`lock_record`, :func:`watch_first_inspect`, the
step marks of agent/run/rollback.py) and :class:`Recovery`, which ``cuinterpose-agent release``
(:func:`release`) and the daemon at start (:func:`recover_dead`) run to finish what the dead
agent would have done: kill a leftover CRIU, SIGCONT the stopped trees, native restore and
unlock, the coordinator's rollback from the recorded records (it INSPECTs every shim first and
undoes whatever phase it finds, never retrying a mutating op blindly), compare, ``.resume``
with ``restored=false``, then remove the lock and the partial images. A complete snapshot is
never removed. docs/agent.md "What each failure leaves behind".
"""

from __future__ import annotations

import os
import pathlib
import select
import signal
import sys
from typing import Callable, Optional

from cuinterpose.agent.errors import AgentError
from cuinterpose.agent.mech import census as census_mod
from cuinterpose.agent.mech import native, procfs, quiesce
from cuinterpose.agent.options import RunOptions
from cuinterpose.agent.run import carriers
from cuinterpose.agent.snapshot import manifest as manifest_mod
from cuinterpose.agent.snapshot import snapdir
from cuinterpose.agent.snapshot.snapdir import SnapshotDir
from cuinterpose.coordinator.contract import quiesce_path, remove_if_id

__all__ = [
    "lock_record",
    "encode_records",
    "decode_records",
    "watch_first_inspect",
    "Recovery",
    "release",
    "recover_dead",
    "render",
]

#: seconds a leftover CRIU gets to exit after SIGKILL (it is killed, so this only catches a
#: process stuck in the kernel)
CRIU_EXIT_S = 30.0
#: the snapshot ``why`` of a checkpoint that never wrote its manifest
NO_MANIFEST = "no manifest was written"


# -- what the checkpoint records ---------------------------------------------------------------
def last_txn_id(coordinator) -> int:
    """The highest txn id ``coordinator`` sent so far (0 before any; a stand-in without one)."""
    return int(getattr(coordinator, "last_txn_id", 0) or 0)


def driver_of(cp) -> Optional[str]:
    """The driver kind ``cp`` loaded ("fake", "real"), else the one it was asked for (None:
    the release's own ``driver`` option)."""
    return getattr(getattr(cp, "driver", None), "kind", None) or cp.options.driver or None


def lock_record(cp) -> dict:
    """The ``.lock`` fields the checkpoint ``cp`` writes when its capture starts (the lock
    turns ``torn_down``): whatever :class:`Recovery` needs that is known then."""
    return {
        "roots": list(cp.roots),
        "participants": [[p.pid, str(p.socket_path)] for p in cp.census.participants],
        "cuda_pids": list(cp.census.cuda_pids),
        "driver": driver_of(cp),
        "images_dir": str(cp.images_dir),
        "created_dirs": [str(d) for d in cp.created_dirs],
        "phase_timeout_s": cp.options.phase_timeout_s,
        "carrier_timeout_s": cp.options.carrier_timeout_s,
        "last_txn_id": last_txn_id(cp.coordinator),
        # the token of the checkpoint's claim on the shims (protocol.h "Claims"): a release
        # takes the claim over with it
        "claim": getattr(cp, "claim_token", b"").hex() or None,
        "chunks": chunk_settings(getattr(cp.coordinator, "carriers", None)),
        # the chunk store (incremental): its packs and, once each SAVE reply is in, the refs
        "store": carriers.store_record(getattr(cp.coordinator, "carriers", None)),
    }


def chunk_settings(files) -> dict:
    """{"chunk_bytes", "staging_bytes", "writers", "checksum"} of a capture's carrier chunk
    files (coordinator/carrierfiles.py ``CarrierFiles``; {} without): a release loads the shims
    back from the files with the chunk size and checksum they were written with (the shim
    refuses another size; another checksum would fail every chunk)."""
    return {} if files is None else files.settings.as_dict()


def encode_records(records) -> dict:
    """pid -> [Record] as {"proto": CUI_PROTO_VERSION, "by_pid": {"PID": hex of the packed
    ``struct cui_record``s (interposer/include/protocol.h), in order}}."""
    from cuinterpose.coordinator.protocol import CUI_PROTO_VERSION

    return {
        "proto": CUI_PROTO_VERSION,
        "by_pid": {str(p): b"".join(r.pack() for r in rs).hex() for p, rs in records.items()},
    }


def decode_records(field: dict, root: int) -> dict:
    """:func:`encode_records`' output back to pid -> [Record]. Raises ``AgentError`` (phase
    "release", pid ``root``) for another protocol version or a malformed entry."""
    from cuinterpose.coordinator.protocol import CUI_PROTO_VERSION, Record

    if not isinstance(field, dict) or field.get("proto") != CUI_PROTO_VERSION:
        got = field.get("proto") if isinstance(field, dict) else None
        raise AgentError(
            "release",
            f"the lock's records are protocol version {got!r}, this agent speaks "
            f"{CUI_PROTO_VERSION}: run the release with the agent version that checkpointed",
            pid=root,
        )
    out = {}
    try:
        for p, h in field["by_pid"].items():
            data = bytes.fromhex(h)
            out[int(p)] = Record.unpack_many(data, len(data) // Record.SIZE)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise AgentError("release", f"the lock's records cannot be read: {e}", pid=root) from e
    return out


def watch_first_inspect(cp) -> None:
    """Record the capture's first INSPECT in the ``.lock``: the coordinator's capture validates
    those records before SAVE_ALLOCATIONS goes out, so ``cp.coordinator.validate`` is wrapped
    to mark "first INSPECT" with ``records`` (:func:`encode_records`) and ``last_txn_id``
    first. A lock without records thus means no mutating op was sent."""
    coord = cp.coordinator
    orig = getattr(coord, "validate", None)
    if orig is None:
        return

    def validate(records_by_pid=None):
        out = orig(records_by_pid)
        quiesce.mark_step(
            cp.control_dir,
            cp.roots,
            cp.qid,
            "first INSPECT",
            records=encode_records(out),
            last_txn_id=last_txn_id(coord),
            # the chunk checksum the capture settled on (a shim from before D36: BLAKE2b-256)
            chunks=chunk_settings(getattr(coord, "carriers", None)),
        )
        return out

    coord.validate = validate


# -- the leftovers ----------------------------------------------------------------------------
def _cmdline(pid: int) -> list[str]:
    try:
        return (
            pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        )
    except OSError:
        return []


def _is_criu(pid: int) -> bool:
    return any(os.path.basename(a) == "criu" for a in _cmdline(pid))


def _wait_gone(pid: int, timeout_s: float) -> bool:
    """Wait (pidfd) until ``pid`` exited; True when it did within ``timeout_s``."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout_s)[0])
    finally:
        os.close(fd)


def _state(pid: int) -> Optional[str]:
    try:
        return census_mod.read_stat_state(pid)[2]
    except (OSError, ValueError, IndexError):
        return None


class Recovery:
    """Undo the checkpoint of the dead agent whose ``.lock`` ``lock`` (request ``rid``) holds
    ``root``. :meth:`run` returns the report (:func:`render` prints it); raises ``AgentError``
    (phase "release", the process named, outcome ``rollback_failed``) when a step fails: the
    workload then stays parked (no ``.resume``) and the lock says ``rollback_failed`` (a
    later ``release`` runs it again where the lock holds the records, :func:`needs_recovery`;
    ``release --force`` resumes it without rebuilding)."""

    def __init__(self, control_dir, root: int, rid: str, lock: dict):
        self.cdir = str(control_dir)
        self.root = int(root)
        self.rid = rid
        self.lk = lock
        roots = [int(r) for r in lock.get("roots") or []]
        self.roots = list(dict.fromkeys([*roots, self.root]))
        self.steps = [str(s) for s in lock.get("steps") or []]
        self.found: dict = {}
        self.coord = None  # the coordinator of the shims' rollback, once made

    def tree_pids(self) -> list[int]:
        """The recorded pids of every tree (read before each dump) and what is under each
        root now."""
        pids = [int(p) for ps in (self.lk.get("tree_pids") or {}).values() for p in ps]
        for r in self.roots:
            try:
                pids += [p for p, _, _ in census_mod.walk_tree([r])]
            except AgentError:
                pass
        return list(dict.fromkeys([*self.roots, *pids]))

    def fail(self, what: str, e: BaseException, pid=None) -> AgentError:
        reason = getattr(e, "reason", None) or str(e)
        files = getattr(getattr(self, "coord", None), "carriers", None)
        reason += carriers.bad_chunk_where(reason, files, getattr(e, "pid", None))
        err = AgentError(
            "release",
            f"{what}: {reason}; the workload stays parked (no .resume written) and "
            f"{quiesce_path(self.cdir, self.root, 'lock')} is kept with rollback_failed: "
            + (
                "fix the cause and `release` continues the rollback (`release --force` resumes "
                "it without rebuilding)"
                if needs_recovery({**self.lk, "rollback_failed": True})
                else "fix the cause and `release --force` resumes it without rebuilding"
            ),
            pid=pid if pid is not None else getattr(e, "pid", None),
            outcome="rollback_failed",
        )
        quiesce.abandon_lock(
            self.cdir,
            self.roots,
            self.rid,
            by="release",
            why=str(err),
            last_txn_id=last_txn_id(self.coord),
        )
        return err

    # -- the steps --------------------------------------------------------------------------
    def kill_criu(self) -> list[int]:
        """SIGKILL a CRIU still tracing one of the trees (it would finish a dump alone, or
        leave its parasite); waits for it to exit. Returns the CRIU pids killed."""
        killed = []
        for pid in self.tree_pids():
            try:
                tracer = int(procfs.status(pid).get("TracerPid", "0"))
            except (OSError, ValueError):
                continue
            if tracer and tracer not in killed and _is_criu(tracer):
                try:
                    os.kill(tracer, signal.SIGKILL)
                except ProcessLookupError:
                    continue
                if not _wait_gone(tracer, CRIU_EXIT_S):
                    raise self.fail(
                        f"CRIU pid {tracer} still runs {CRIU_EXIT_S:g} s after SIGKILL",
                        OSError("stuck in the kernel"),
                        pid=tracer,
                    )
                killed.append(tracer)
        return killed

    def snapshot(self) -> dict:
        """{"images_dir", "complete", "why"}: complete when the manifest was written and it and
        every image it lists check out (manifest.load, verify_images). A manifest that does not
        check out (e.g. signed with a node key this process does not have) is never removed:
        it is written last, so the dump had completed."""
        d = self.lk.get("images_dir")
        out = {"images_dir": d, "complete": False, "why": NO_MANIFEST}
        if d and SnapshotDir(d).has_manifest():
            try:
                m = manifest_mod.load(d)
                manifest_mod.verify_images(d, m)
                out.update(complete=True, why="")
            except AgentError as e:
                out["why"] = str(e)
        return out

    def continue_stopped(self) -> list[int]:
        """SIGCONT every process of the trees in state T (CRIU's ``--leave-stopped``), and
        every process of the trees once the lock shows a dump began: CRIU sends SIGSTOP just
        before it detaches, so a task not yet scheduled since shows R or S with the stop
        still pending, and would stop for good after a release that skipped it (SIGCONT
        discards a pending stop). A stopped process cannot answer the driver's checkpoint
        calls. Returns the pids signalled."""
        dumped = any(s.startswith("criu dump") for s in self.steps)
        done = []
        for pid in self.tree_pids():
            if dumped or _state(pid) in ("T", "t"):
                try:
                    os.kill(pid, signal.SIGCONT)
                    done.append(pid)
                except ProcessLookupError:
                    pass
        return done

    def native(self) -> dict:
        pids = [int(p) for p in self.lk.get("cuda_pids") or []]
        if not pids:
            return {}
        try:
            native.load(self.lk.get("driver"))
            return native.rollback_all(pids)
        except AgentError as e:
            raise self.fail("native restore + unlock", e) from e

    def shims(self) -> dict:
        """The coordinator's rollback from the recorded records: {pid: phase found}."""
        from cuinterpose.coordinator import phases

        parts = [phases.Participant(int(p), s) for p, s in self.lk.get("participants") or []]
        if not parts:
            return {}
        coord = self.coord = phases.Coordinator(
            parts,
            # the dead agent's options, else (an older agent's record) the defaults
            timeout_s=float(self.lk.get("phase_timeout_s") or RunOptions().phase_timeout_s),
            carrier_timeout_s=float(
                self.lk.get("carrier_timeout_s") or RunOptions().carrier_timeout_s
            ),
        )
        if self.lk.get("images_dir"):  # the carried bytes live in the snapshot's chunk files
            coord.carriers = carriers.release_files(self.lk["images_dir"], self.lk)
        # txn ids above every one the dead agent (and any failed rollback) sent (they are
        # wall-clock based as well)
        coord.txn_floor = max(coord.txn_floor, int(self.lk.get("last_txn_id") or 0))
        if "records" not in self.lk:
            # the lock gets the records before SAVE_ALLOCATIONS goes out: nothing was torn
            # down, every shim must still be ACTIVE (else: an older agent's lock)
            try:
                coord.inspect(check_phase=True)
            except Exception as e:
                raise self.fail(
                    "the lock holds no records of the capture to rebuild from", e
                ) from e
            return {p.pid: "ACTIVE" for p in parts}
        self.claim(coord)
        try:
            res = coord.rollback(decode_records(self.lk["records"], self.root))
        except AgentError:
            raise
        except Exception as e:
            raise self.fail("coordinator rollback", e) from e
        return dict(res.found or {})

    def claim(self, coord) -> None:
        """Take the dead agent's claim on the shims over (protocol.h "Claims"): its token from
        the lock (a lock without one, an older agent's: a new token), written again with this
        process as the holder, so the rollback's mutating requests are accepted."""
        from cuinterpose.coordinator.claim import Claim, ClaimError

        try:
            coord.claim = Claim.take(
                self.cdir, coord.pids, kind="release", token=self.lk.get("claim") or None
            )
        except (ClaimError, ValueError) as e:
            raise self.fail("the claim on the shims", e, pid=getattr(e, "pid", None)) from e

    def drop_claim(self) -> None:
        """Remove the claim files that hold the lock's token (or the one this release took)."""
        from cuinterpose.coordinator.claim import Claim

        claim = getattr(self.coord, "claim", None)
        if claim is None and self.lk.get("claim"):
            pids = [int(p) for p, _ in self.lk.get("participants") or []]
            claim = Claim(self.cdir, pids, bytes.fromhex(self.lk["claim"]))
        if claim is not None:
            claim.drop()

    def run(self) -> dict:
        snap = self.snapshot()
        self.found["criu"] = self.kill_criu()
        gone = [r for r in self.roots if not census_mod.pid_alive(r)]
        if gone and len(gone) < len(self.roots):
            left = ", ".join(str(r) for r in self.roots if r not in gone)
            todo = (
                f"the snapshot in {snap['images_dir']} is complete: end trees {left} and restore it"
                if snap["complete"]
                else f"trees {left} cannot be rebuilt without it"
            )
            raise self.fail(
                f"tree {gone[0]} of the checkpointed cut is gone but {left} still run",
                OSError(f"a cut of several trees cannot be resumed in part ({todo})"),
                pid=gone[0],
            )
        resume = None
        if gone:  # the workload is gone (killed after a complete dump, or it died)
            quiesce.clear(self.cdir, self.roots)
        else:
            self.found["stopped"] = self.continue_stopped()
            self.found["native"] = self.native()
            if self.lk.get("torn_down"):
                self.found["shims"] = self.shims()
            torn = bool(self.lk.get("torn_down"))
            quiesce.resume(self.cdir, self.roots, self.rid, restored=False, cancelled=not torn)
            for r in self.roots:  # withdrawn: the workload may never have read it
                remove_if_id(quiesce_path(self.cdir, r, "request"), self.rid)
            resume = str(quiesce_path(self.cdir, self.root, "resume"))
        partial = snap["images_dir"] and not snap["complete"]
        sd = SnapshotDir(snap["images_dir"] or ".")
        if snap["images_dir"]:  # the dead run's claim (its flock died with it)
            sd.remove_stale_claim(self.rid)
        if partial and not sd.exists(sd.MANIFEST):
            sd.remove_dump()
            files = getattr(getattr(self, "coord", None), "carriers", None)
            if files is None and self.lk.get("store"):  # this checkpoint's packs go too
                files = carriers.release_files(snap["images_dir"], self.lk)
            carriers.remove_chunks(snap["images_dir"], files)
            snapdir.remove_empty(self.lk.get("created_dirs") or [])
        carriers.unpin(self.lk)  # the packs are back on the device, gone, or in a manifest
        self.drop_claim()
        return {
            "pid": self.root,
            "request_id": self.rid,
            "resume": resume,
            "removed_lock": True,
            "recovered": True,
            "agent_pid": self.lk.get("pid"),
            "steps": self.steps,
            "roots": self.roots,
            "found": self.found,
            "snapshot": {
                **snap,
                "kept": snap["complete"],
                "restore": (
                    f"cuinterpose-agent restore --images-dir {snap['images_dir']}"
                    if snap["complete"]
                    else None
                ),
            },
            "outcome": "workload_gone" if gone else "rolled_back",
        }


def needs_recovery(lk: Optional[dict]) -> bool:
    """A dead agent's lock whose checkpoint left something to undo and that says how: the
    capture started (``torn_down``, with its record: ``participants``; a torn-down lock
    without one is an older agent's, which only ``release --force`` resumes) or a native lock
    was taken (``cuda_pids``: the quiescence check locks and unlocks every CUDA process). A
    lock whose rollback failed already (``rollback_failed``, by the checkpoint or an earlier
    release) is rolled back again when it holds what that needs: the capture's ``records``
    (the coordinator's rollback INSPECTs first and continues from whatever phase each shim is
    in), or, not torn down, its ``cuda_pids``."""
    if not isinstance(lk, dict):
        return False
    if lk.get("torn_down"):
        if lk.get("rollback_failed"):
            return "participants" in lk and "records" in lk
        return "participants" in lk
    return bool(lk.get("cuda_pids"))


def release(control_dir, root: int, *, force: bool = False) -> dict:
    """``cuinterpose-agent release``: the pending request of ``root`` whose agent is dead.
    When its lock says the checkpoint had started changing the workload (:func:`needs_recovery`,
    also after a failed rollback: it continues from where each shim is now) :class:`Recovery`
    undoes it; otherwise the request is answered as before (``quiesce.release``). ``force``:
    for a lock without records (an older agent's) or whose rollback failed, resume without
    rebuilding (``quiesce.release(force=True)``); any other lock with records is rolled back.
    Raises ``AgentError`` (phase "release", the pid named): refused (no pending request, a
    live agent owns it, a torn-down lock without records and without ``force``) or
    ``rollback_failed``."""
    from cuinterpose.agent.run import restore_recover

    parked = restore_recover.find(control_dir, root)  # a restore whose agent died (D49)
    if parked is not None:
        return parked.run()
    rid, lk = quiesce.release_check(control_dir, root)
    if force and lk is not None and ("records" not in lk or lk.get("rollback_failed")):
        return quiesce.release(control_dir, root, force=True)
    if lk is not None and needs_recovery(lk):
        return Recovery(control_dir, root, rid, lk).run()
    return quiesce.release(control_dir, root, force=force)


def recover_dead(control_dir, log: Optional[Callable[[str], None]] = None) -> list[dict]:
    """The daemon at start: :class:`Recovery` of every dead agent's lock in ``control_dir``
    that needs one (a live agent's lock is left alone). Returns one entry per lock: the report,
    or {"pid", "error": AgentError.to_dict()}; ``log`` (default: stderr) gets one line each."""
    from cuinterpose.agent.mech import ctldir
    from cuinterpose.agent.run import restore_recover

    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    out: list[dict] = []
    done: set[int] = set()
    try:
        control_dir = ctldir.check(control_dir, phase="release")
        names = sorted(os.listdir(control_dir))
    except AgentError as e:
        log(f"cuinterpose-agent serve: no dead checkpoint released: {e}")
        return out
    except OSError:
        return out
    for name in names:
        if not (name.startswith("quiesce-") and name.endswith(".lock")):
            continue
        try:
            root = int(name[len("quiesce-") : -len(".lock")])
        except ValueError:
            continue
        if root in done:
            continue
        try:
            parked = restore_recover.find(control_dir, root)  # a dead agent's restore (D49)
        except AgentError:
            continue  # a live agent's restore
        if parked is not None:
            _recover_one(parked, root, "finish a dead agent's restore", out, done, log)
            continue
        try:
            rid, lk = quiesce.release_check(control_dir, root)
        except AgentError:
            continue  # no pending request, or a live agent's: not ours to touch
        if needs_recovery(lk):
            rec = Recovery(control_dir, root, rid, lk)
            _recover_one(rec, root, "release a dead agent's checkpoint", out, done, log)
    return out


def _recover_one(rec, root: int, what: str, out: list, done: set, log) -> None:
    """Run ``rec`` (a :class:`Recovery` or a restore's) for the daemon: its report, or the
    error, appended to ``out`` and logged; the roots it covered added to ``done``."""
    try:
        rep = rec.run()
        done.update(rep["roots"])
        out.append(rep)
        log(f"cuinterpose-agent serve: {render(rep)}")
    except AgentError as e:
        out.append({"pid": root, "error": e.to_dict()})
        log(f"cuinterpose-agent serve: could not {what}: {e}")


def render(rep: dict) -> str:
    """The report of :class:`Recovery` in words (the CLI's text, the daemon's log line)."""
    if rep.get("kind") == "restore":  # a dead agent's restore finished or undone
        from cuinterpose.agent.run import restore_recover

        return restore_recover.render(rep)
    f = rep.get("found", {})
    lines = [
        f"released pid {rep['pid']}: the agent (pid {rep.get('agent_pid')}) that sent request "
        f"{rep['request_id']} died after: {', '.join(rep.get('steps') or []) or 'nothing'}"
    ]
    lines.append(
        "  criu: " + (", ".join(f"pid {p} killed" for p in f.get("criu", [])) or "none running")
    )
    if rep.get("outcome") == "workload_gone":
        lines.append("  workload: gone (nothing to resume)")
    else:
        lines.append(
            "  trees: "
            + (
                ", ".join(f"pid {p}" for p in f.get("stopped", [])) + " continued (SIGCONT)"
                if f.get("stopped")
                else "none stopped"
            )
        )
        nat = f.get("native", {})
        lines.append(
            "  native: "
            + (
                ", ".join(f"pid {p} {s}" for p, s in sorted(nat.items())) + " -> RUNNING"
                if nat
                else "no CUDA process"
            )
        )
        sh = f.get("shims")
        if sh == {}:
            lines.append("  shims: no participant")
        elif sh is not None:
            lines.append(
                "  shims: "
                + ", ".join(f"pid {p} {ph}" for p, ph in sorted(sh.items()))
                + " -> ACTIVE, topology equal to the capture"
            )
        lines.append(f"  resumed: wrote {rep['resume']} (restored=false)")
    s = rep.get("snapshot", {})
    if s.get("complete"):
        lines.append(
            f"  snapshot: complete in {s['images_dir']}, kept: `{s['restore']}` restores it"
            + (" once the workload is gone" if rep.get("outcome") != "workload_gone" else "")
        )
    elif s.get("images_dir") and s.get("why") == NO_MANIFEST:
        lines.append(
            f"  snapshot: none ({s['why']}); the partial images in {s['images_dir']} removed"
        )
    elif s.get("images_dir"):
        lines.append(
            f"  snapshot: {s['images_dir']} has a manifest that does not check out ({s['why']}); "
            "kept as it is: check it before you restore or remove it"
        )
    return "\n".join(lines)
