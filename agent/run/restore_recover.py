"""A restore's record of itself and finishing a restore whose agent died (issue 23, decisions
D49): a restore records itself in ``quiesce-ROOT.lock`` before CRIU restore (:func:`record`,
:func:`mark`, :func:`end`, called by agent/run/restore.py): the request id the restored workload
waits on, ``restore`` {images dir, snapshot id, claim token, device map, driver, timeouts} and
the ``steps`` it finished. ``cuinterpose-agent release --pid ROOT`` (and the daemon at start)
finds such a lock of a dead agent and:

- every tree back from CRIU ("criu restore ROOT done" for each root) and alive: finishes the
  restore: native restore (with the recorded device map, custom storage streams too) and unlock
  of every CUDA process still CHECKPOINTED or LOCKED, the coordinator's rollback of the shims
  from whatever phase each is in (PREPARED -> LOAD_ALLOCATIONS -> RESTORE_UNICAST, the
  multicast rebuild; INSPECT equal to the capture under the device map), then ``.resume`` with
  ``restored: true``: the job runs on exactly as after a restore;
- a tree CRIU did not finish (the agent, and CRIU with it, died inside CRIU restore): the trees
  it restored are killed, and the report says to run ``restore`` again (the snapshot only read);
- the restored trees gone: nothing to resume, the same;

then the lock and the claim files go. A step that fails leaves the tree parked (the lock stays)
and says what to do: release again once the cause is fixed, or kill the tree and restore again.
"""

from __future__ import annotations

import os
import secrets
import signal
from typing import Optional

from cuinterpose.agent.errors import AgentError, QuiesceRefused, SnapshotError
from cuinterpose.agent.mech import census as census_mod
from cuinterpose.agent.mech import devicemap, native, quiesce
from cuinterpose.agent.options import RunOptions
from cuinterpose.agent.run import carriers, gpustore_step
from cuinterpose.agent.snapshot import manifest as manifest_mod
from cuinterpose.agent.snapshot.snapdir import SnapshotDir
from cuinterpose.coordinator.contract import quiesce_path, read_json

__all__ = [
    "claim_dir",
    "release_dir",
    "record",
    "mark",
    "take_claim",
    "end",
    "restore_lock",
    "parked_hint",
    "find",
    "RestoreRecovery",
    "render",
]


# -- what a restore records (agent/run/restore.py calls these) ---------------------------------
def claim_dir(rs) -> None:
    """The restore ``rs`` locks its snapshot dir (``SnapshotDir.lock``, agent/snapshot/dirclaim.py
    ``SnapshotLock``: a flock of the directory, nothing written) until :func:`release_dir`: a
    ``delete`` or another restore of it is refused meanwhile, naming this agent's pid
    (decisions D72). Raises ``SnapshotError`` (phase "manifest", nothing changed) naming the
    pid that holds it. A missing directory is not locked (the manifest read refuses it)."""
    snap = SnapshotDir(rs.images_dir)
    if getattr(rs, "dir_claim", None) is None and snap.is_dir():
        rs.dir_claim = snap.lock(phase="manifest", kind="restore")


def release_dir(rs, keep_pin: bool = False) -> None:
    """The restore ``rs`` ended: its claim on the snapshot dir goes. Idempotent."""
    claim = getattr(rs, "dir_claim", None)
    if claim is not None:
        claim.release()
        rs.dir_claim = None


def record(rs) -> None:
    """Before CRIU restore (the end of ``stale sockets``): ``quiesce-ROOT.lock`` of every root of
    the restore ``rs`` says a restore of this snapshot is in progress in this agent (its pid and
    start time; ``restore``: images dir, snapshot id, claim token, device map, driver, timeouts;
    ``steps``, then marked by :func:`mark`). A record that cannot be written refuses the restore
    (``SnapshotError``, nothing was started)."""
    rs.claim_token = secrets.token_bytes(16)
    rs.recording = True  # from here on end() removes what was written
    try:
        quiesce.write_lock(
            rs.m["control_dir"],
            rs.m["roots"],
            rs.m["quiesce"]["id"],
            record={
                "restore": {
                    "images_dir": str(rs.images_dir),
                    "snapshot_id": rs.m["snapshot_id"],
                    "claim": rs.claim_token.hex(),
                    "device_map": dict(rs.gpu_map),
                    "driver": rs.driver_kind,
                    "phase_timeout_s": rs.options.phase_timeout_s,
                    "carrier_timeout_s": rs.options.carrier_timeout_s,
                },
                "steps": [],
            },
        )
    except OSError as e:
        end(rs)
        raise SnapshotError(
            "stale sockets",
            f"cannot record the restore in {rs.m['control_dir']}: {e}; restore refused, "
            "nothing was changed, the snapshot is untouched",
        ) from e


def mark(rs, step: str) -> None:
    """Append ``step`` to the restore's ``.lock`` (best effort: a note when it fails)."""
    if not getattr(rs, "recording", False):
        return
    try:
        quiesce.mark_step(rs.m["control_dir"], rs.m["roots"], rs.m["quiesce"]["id"], step)
    except OSError as e:
        rs.r.note(f"warning: could not record step {step!r} in the .lock: {e}")


def take_claim(rs, coord) -> None:
    """The restore's claim on the restored shims (protocol.h "Claims"), with the token the
    ``.lock`` recorded; ``AgentError`` phase "restore shared" when it cannot be taken."""
    from cuinterpose.coordinator.claim import Claim, ClaimError

    try:
        rs.claim = coord.claim = Claim.take(
            rs.m["control_dir"],
            [p.pid for p in coord.participants],
            kind="restore",
            token=getattr(rs, "claim_token", None),
        )
    except ClaimError as e:
        raise AgentError("restore shared", str(e), pid=e.pid) from e


def end(rs) -> None:
    """The restore ended (resumed, or its trees killed): its ``.lock`` and claim go."""
    if getattr(rs, "recording", False):
        quiesce.unlock(rs.m["control_dir"], rs.m["roots"], rs.m["quiesce"]["id"])
        rs.recording = False
    claim = getattr(rs, "claim", None)
    if claim is not None:
        claim.drop()


# -- what release finds ------------------------------------------------------------------------
def restore_lock(control_dir, root: int) -> Optional[dict]:
    """The ``.lock`` of ``root`` when it records a restore (its ``restore`` field), else None."""
    lk = read_json(quiesce_path(control_dir, root, "lock"))
    return lk if isinstance(lk, dict) and isinstance(lk.get("restore"), dict) else None


def _holder(lk: dict) -> str:
    steps = ", ".join(map(str, lk.get("steps") or [])) or "nothing"
    return f"agent pid {lk.get('pid')}, which died after: {steps}"


def parked_hint(m: dict) -> str:
    """For a restore refused because the snapshot's pids are in use: "; ..." naming the restore
    of this snapshot that holds them (alive: in progress; dead: the ``release`` that finishes
    it), or "" when none does."""
    cd = m.get("control_dir")
    for root in m.get("roots") or []:
        lk = restore_lock(cd, root)
        if lk is None or lk.get("id") != (m.get("quiesce") or {}).get("id"):
            continue
        if quiesce.lock_owner(cd, root) is not None:
            return f"; a restore of this snapshot is in progress in agent pid {lk.get('pid')}"
        return (
            f"; they are the trees of a restore of this snapshot by {_holder(lk)}: "
            f"`cuinterpose-agent release --pid {root} --control-dir {cd}` finishes it (or, if it "
            "cannot, says what to do)"
        )
    return ""


def find(control_dir, root: int) -> Optional["RestoreRecovery"]:
    """The :class:`RestoreRecovery` of ``root``'s restore lock whose agent is dead; None when
    ``root`` has no restore lock. Refused (``QuiesceRefused``, phase "release") while the agent
    that restores it is alive."""
    lk = restore_lock(control_dir, root)
    if lk is None:
        return None
    if quiesce.lock_owner(control_dir, root) is not None and lk.get("pid") != os.getpid():
        raise QuiesceRefused(
            "release",
            f"a restore of this tree is in progress in agent pid {lk.get('pid')} "
            f"({quiesce_path(control_dir, root, 'lock')}); release refused",
            pid=root,
        )
    return RestoreRecovery(control_dir, root, lk)


class RestoreRecovery:
    """Finish (or undo) the restore of a dead agent recorded in ``lock`` of ``root``.
    :meth:`run` returns the report (:func:`render`); raises ``AgentError`` (phase "release",
    outcome ``restore_failed``) when a step fails: the tree stays parked, the lock stays."""

    def __init__(self, control_dir, root: int, lock: dict):
        self.cdir = str(control_dir)
        self.root = int(root)
        self.lk = lock
        self.rec = lock["restore"]
        self.rid = str(lock.get("id"))
        self.steps = [str(s) for s in lock.get("steps") or []]
        self.found: dict = {}
        self.claim = None

    def fail(self, what: str, e: BaseException, pid=None) -> AgentError:
        reason = getattr(e, "reason", None) or str(e)
        err = AgentError(
            "release",
            f"{what}: {reason}; the restored tree stays parked (no .resume written) and "
            f"{quiesce_path(self.cdir, self.root, 'lock')} is kept: fix the cause and run "
            f"`cuinterpose-agent release --pid {self.root}` again, or end the restored tree "
            f"(`kill -KILL` its processes) and run `{self.again()}` (the snapshot is untouched)",
            pid=pid if pid is not None else getattr(e, "pid", None),
            outcome="restore_failed",
        )
        err.hint = "the restored tree stays parked"
        return err

    def again(self) -> str:
        return f"cuinterpose-agent restore --images-dir {self.rec.get('images_dir')}"

    def run(self) -> dict:
        try:
            m = manifest_mod.load(self.rec["images_dir"])
        except (AgentError, KeyError) as e:
            raise self.fail("the snapshot of the restore", e) from e
        roots = [int(r) for r in m["roots"]]
        # this process holds the lock from here (a release that dies is released again)
        quiesce.write_lock(self.cdir, roots, self.rid, record={"restore": self.rec})
        alive = [r for r in roots if census_mod.pid_alive(r)]
        back = [r for r in roots if f"criu restore {r} done" in self.steps]
        if not alive or len(back) < len(roots):
            return self.undo(m, roots, alive)
        self.found["native"] = self.native(m)
        self.found["shims"] = self.shims(m)
        quiesce.resume(self.cdir, roots, self.rid, restored=True)
        self.claim.drop()
        return self.report(roots, "restored", str(quiesce_path(self.cdir, self.root, "resume")))

    def undo(self, m: dict, roots: list[int], alive: list[int]) -> dict:
        """Kill what CRIU restored of an unfinished restore (or nothing: the trees are gone),
        remove the lock and the claim files; the report says to restore again."""
        killed = []
        try:
            procs = census_mod.walk_tree(alive) if alive else []
        except AgentError:
            procs = []
        for pid, _, _ in procs:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
        self.found["killed"] = killed
        quiesce.unlock(self.cdir, roots, self.rid)
        self._claim(m).drop()
        back = all(f"criu restore {r} done" in self.steps for r in roots)
        return self.report(roots, "workload_gone" if back and not alive else "restore_undone", None)

    def native(self, m: dict) -> dict:
        """Native restore (with the recorded device map; the snapshot's custom storage streams)
        of every CUDA process still CHECKPOINTED, then unlock of every one LOCKED. Returns
        {pid: state found}."""
        pids = [int(p) for p in m["cuda_pids"]]
        gpu_map = dict(self.rec.get("device_map") or {})
        try:
            native.load(self.rec.get("driver") or m["driver"]["kind"])
            found = {pid: native.get_state(pid) for pid in pids}
            todo = [p for p in pids if found[p] == "CHECKPOINTED"]
            if todo:
                gpustore_step.prepare_restore(m, self.rec["images_dir"])
                by_pid = {p["pid"]: p for p in m["participants"]}
                devicemap.native_restore(
                    todo, {p: devicemap.pairs_for(by_pid.get(p, {}), gpu_map) for p in todo}
                )
            native.unlock_all([p for p in pids if found[p] in ("CHECKPOINTED", "LOCKED")])
        except AgentError as e:
            raise self.fail("native restore + unlock", e) from e
        return found

    def _claim(self, m: dict):
        from cuinterpose.coordinator.claim import Claim

        pids = [int(p["pid"]) for p in m["participants"]]
        return Claim(self.cdir, pids, bytes.fromhex(self.rec.get("claim") or "00" * 16))

    def shims(self, m: dict) -> dict:
        """The restore's shim phases from wherever each shim is (the coordinator's rollback:
        it INSPECTs first and never resends an op blindly), compared with the capture under the
        recorded device map. Returns {pid: phase found}."""
        from cuinterpose.agent.snapshot import trust
        from cuinterpose.coordinator import phases
        from cuinterpose.coordinator.claim import Claim, ClaimError

        cd = m["control_dir"]
        parts = [
            phases.Participant(p["pid"], trust.socket_path(cd, p["pid"])) for p in m["participants"]
        ]
        coord = phases.Coordinator(
            parts,
            # the dead agent's options, else (an older agent's record) the defaults
            timeout_s=float(self.rec.get("phase_timeout_s") or RunOptions().phase_timeout_s),
            carrier_timeout_s=float(
                self.rec.get("carrier_timeout_s") or RunOptions().carrier_timeout_s
            ),
        )
        coord.carriers = carriers.restore_files(self.rec["images_dir"], m)
        try:
            try:
                self.claim = coord.claim = Claim.take(
                    cd, coord.pids, kind="release", token=self.rec.get("claim") or None
                )
            except (ClaimError, ValueError) as e:
                raise self.fail("the claim on the shims", e, pid=getattr(e, "pid", None)) from e
            capture = phases.Capture.from_dict(m["capture"])
            try:
                res = coord.rollback(capture, device_map=dict(self.rec.get("device_map") or {}))
            except Exception as e:
                raise self.fail("the shims' restore phases", e) from e
        finally:
            carriers.release(coord.carriers)
        return dict(res.found or {})

    def report(self, roots: list[int], outcome: str, resume: Optional[str]) -> dict:
        return {
            "pid": self.root,
            "request_id": self.rid,
            "resume": resume,
            "removed_lock": True,
            "recovered": True,
            "kind": "restore",
            "agent_pid": self.lk.get("pid"),
            "steps": self.steps,
            "roots": roots,
            "found": self.found,
            "snapshot": {"images_dir": self.rec.get("images_dir"), "kept": True},
            "restore": None if outcome == "restored" else self.again(),
            "outcome": outcome,
        }


def render(rep: dict) -> str:
    """A :class:`RestoreRecovery` report in words."""
    f = rep.get("found", {})
    lines = [
        f"released pid {rep['pid']}: the agent (pid {rep.get('agent_pid')}) that was restoring "
        f"{rep['snapshot']['images_dir']} died after: {', '.join(rep.get('steps') or []) or 'nothing'}"
    ]
    if rep["outcome"] == "restored":
        nat = f.get("native", {})
        lines.append(
            "  native: "
            + (", ".join(f"pid {p} {s}" for p, s in sorted(nat.items())) + " -> RUNNING")
        )
        lines.append(
            "  shims: "
            + ", ".join(f"pid {p} {ph}" for p, ph in sorted((f.get("shims") or {}).items()))
            + " -> ACTIVE, topology equal to the capture"
        )
        lines.append(f"  resumed: wrote {rep['resume']} (restored=true): the restore is complete")
    else:
        started = "criu restore" in (rep.get("steps") or [])
        why = (
            "the restored trees are gone"
            if rep["outcome"] == "workload_gone"
            else "CRIU had not restored every tree"
            if started
            else "CRIU restore had not started"
        )
        killed = f.get("killed") or []
        lines.append(
            f"  {why}: "
            + ("killed " + ", ".join(f"pid {p}" for p in killed) if killed else "nothing to resume")
        )
        lines.append(f"  the snapshot is untouched: run `{rep['restore']}` again")
    return "\n".join(lines)
