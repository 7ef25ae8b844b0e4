"""The member side of group requests: the state a member keeps between ``RunPhase`` calls,
and its leases.

A member keeps the state of a group request between ``RunPhase`` calls in
:attr:`GroupMember.jobs` (one :class:`Job` each), keyed by the leader's request id, for as long
as its lease lasts (``ServeOptions.group_lease_s``): every RunPhase and every ``Renew`` (which
takes no node lock) extends it; when it runs out with no phase running, the member undoes the
job itself (:meth:`GroupMember.expire_due`) and refuses every later RunPhase of the request
(docs/service.md "Leases"). The leader side is :mod:`cuinterpose.agent.rpc.group`; this module
does not import it.
"""

from __future__ import annotations

import collections
import logging
import sys
import threading
import time
from typing import Optional

from cuinterpose.agent.errors import AgentError
from cuinterpose.agent.run.report import Reporter
from cuinterpose.agent.snapshot import pb

log = logging.getLogger("cuinterpose.service")

#: seconds a member keeps a group request's job without a RunPhase or Renew from its leader
#: (``serve --group-lease-s``, config ``groupLeaseS``)
DEFAULT_GROUP_LEASE_S = 30.0
#: expired group requests a member remembers (to refuse their late RunPhase calls by name)
EXPIRED_KEPT = 256
#: the outcome of a member's refusal after its lease expired and it undid the job itself
LEASE_EXPIRED = "lease_expired"


class Job:
    """One group request on this member: the ``Checkpoint`` or ``Restore`` object whose
    phases the leader calls, the index of the next regular phase, a lock (one phase at a
    time) and the lease: ``deadline`` (``time.monotonic()`` seconds) is ``lease_s`` past the
    end of the last phase or the last ``Renew``, whichever is later."""

    def __init__(
        self,
        kind: str,
        obj,
        *,
        rid: str = "",
        lease_s: float = DEFAULT_GROUP_LEASE_S,
        leader: str = "",
    ):
        self.kind = kind
        self.obj = obj
        self.rid = rid
        self.next = 0
        self.undoing = False
        self.failed = False
        self.lock = threading.Lock()
        self.lease_s = float(lease_s)
        self.leader = leader or "(unnamed)"
        self.deadline = time.monotonic() + self.lease_s
        #: the phase running now ("" when none), the last phase run and whether it succeeded
        self.running = ""
        self.last = ""
        self.last_ok = True
        #: index in GROUP_PHASES of the furthest regular phase started (-1: none)
        self.reached = -1
        #: undo phases that succeeded
        self.undone: list = []
        #: the lease ran out and the member is undoing (or has undone) the job
        self.expiring = False
        self.expired = False

    def renew(self, now: Optional[float] = None) -> None:
        """Extend the lease to ``lease_s`` seconds from ``now`` (never shortens it)."""
        now = time.monotonic() if now is None else now
        self.deadline = max(self.deadline, now + self.lease_s)

    def reached_phase(self) -> str:
        """The last phase, in words for messages: ``'native lock'`` or ``'criu dump' (which failed)``."""
        if not self.last:
            return "none"
        return repr(self.last) + ("" if self.last_ok else " (which failed)")


def job_key(rid: str, member: str = "", own: str = "") -> str:
    """The key of a group job: the request id, and the member (the node name the leader gave
    this daemon in ``RunPhaseRequest.node``/``RenewRequest.node``) unless it is this daemon's
    own node name ``own`` (or empty), so that two members of one group that are the same
    daemon (two roots, two images dirs) are two jobs, not one whose second ``prepare`` is
    refused and whose undo phases then find nothing (issue 23)."""
    return f"{rid}@{member}" if member and member != own else rid


class GroupMember:
    """The member side of :class:`~cuinterpose.agent.rpc.service.AgentService`: its group
    jobs and their leases. The service calls :meth:`init_member` in its ``__init__`` and
    provides ``opts`` (``ServeOptions``), ``metrics``, ``active`` (the running work threads),
    ``exclusive()`` (the node lock), ``confine()``, ``remote_for()`` and ``request_options()``."""

    def init_member(self) -> None:
        self.jobs: dict[str, Job] = {}
        self.jobs_lock = threading.Lock()
        #: request id -> what happened when its lease expired ({"kind", "leader", "phase",
        #: "lease_s", "result", "undo"}), the last EXPIRED_KEPT of them
        self.expired: "collections.OrderedDict[str, dict]" = collections.OrderedDict()
        self._closing = threading.Event()
        self._reaper: Optional[threading.Thread] = None

    # leases
    def renew(self, rid: str, member: str = "") -> dict:
        """Extend the lease of group request ``rid`` (its member ``member``: the node name the
        leader gave this daemon, :func:`job_key`) to ``lease_s`` seconds from now. Takes no
        node lock (a long phase of this or another request does not delay it) and changes
        nothing else. Returns the ``RenewResponse`` fields: {"ok", "node", "lease_s", "phase",
        "running"} or, when this member holds no live job for ``rid``, ok false with
        ``expired`` and ``reason`` (naming the request and the node)."""
        node = self.opts.node
        key = job_key(rid, member, self.opts.node)
        with self.jobs_lock:
            job = self.jobs.get(key)
            if job is not None and not job.expired:
                job.renew()
                return {
                    "ok": True,
                    "node": node,
                    "lease_s": job.lease_s,
                    "phase": job.last,
                    "running": bool(job.running),
                }
            rec = self.expired.get(key)
        if rec is not None:
            reason = (
                f"request {rid}: its lease of {rec['lease_s']:g} s expired on node {node} "
                f"after phase {rec['phase']} with no Renew or RunPhase from leader "
                f"{rec['leader']}; this member {rec['undo']}"
            )
        else:
            reason = (
                f"request {rid}: no such group request on node {node} (it finished, or "
                "never started here)"
            )
        return {
            "ok": False,
            "node": node,
            "lease_s": float(self.opts.group_lease_s),
            "expired": rec is not None,
            "reason": reason,
        }

    def _start_reaper(self) -> None:
        """Start the thread that checks the group leases (once; stops at :meth:`close`)."""
        if self._reaper is not None and self._reaper.is_alive():
            return
        self._reaper = threading.Thread(target=self._reap, name="cui-group-lease", daemon=True)
        self._reaper.start()

    def _reap(self) -> None:
        tick = max(0.05, min(1.0, float(self.opts.group_lease_s) / 4))
        while not self._closing.wait(tick):
            try:
                self.expire_due()
            except Exception:  # never let the lease check die
                log.exception("group lease check failed")

    def close(self) -> None:
        """Stop the lease checks (the daemon is stopping)."""
        self._closing.set()

    def expire_due(self, now: Optional[float] = None) -> list:
        """Start undoing every group job whose lease ran out (``now`` past its deadline, in
        ``time.monotonic()`` seconds) while no phase of it runs: each in a thread of its own
        (:meth:`_expire`, counted in :attr:`active`). Returns the request ids."""
        now = time.monotonic() if now is None else now
        due = []
        with self.jobs_lock:
            for rid, job in self.jobs.items():
                if not job.expiring and not job.running and now >= job.deadline:
                    job.expiring = True
                    due.append((rid, job))
        for rid, job in due:
            t = threading.Thread(
                target=self._expire, args=(rid, job), daemon=True, name=f"cui-lease-{rid[:8]}"
            )
            self.active.add(t)
            t.start()
        return [rid for rid, _ in due]

    def _expire(self, rid: str, job: Job) -> None:
        try:
            self._expire_job(rid, job)
        except Exception:
            log.exception("group request %s: undoing it after its lease expired failed", rid)
        finally:
            self.active.discard(threading.current_thread())

    def _expire_job(self, rid: str, job: Job) -> None:
        """Undo ``job`` as its leader would have, under the node lock and the job's lock (so
        never while one of its phases runs), unless it was renewed or finished meanwhile."""
        m = self.metrics

        def sink(event, obj):
            if event == "end" and m is not None:
                m.phase_done(job.kind, obj.name, obj.elapsed_ns, obj.bytes)
            elif event == "note":
                log.warning("group %s request %s: %s", job.kind, rid, obj)

        rep = Reporter([sink])
        node = self.opts.node
        with self.exclusive(rep, f"undoing group {job.kind} {rid} (its lease expired)"):
            with job.lock:
                with self.jobs_lock:
                    if self.jobs.get(rid) is not job or time.monotonic() < job.deadline:
                        job.expiring = False  # finished, or renewed while we waited
                        return
                    job.expired = True
                    del self.jobs[rid]
                    rec = {
                        "kind": job.kind,
                        "leader": job.leader,
                        "phase": job.reached_phase(),
                        "lease_s": job.lease_s,
                        "result": "undoing",
                        "undo": "is undoing it now",
                    }
                    self.expired[rid] = rec
                    while len(self.expired) > EXPIRED_KEPT:
                        self.expired.popitem(last=False)
                log.warning(
                    "node %s: group %s request %s from leader %s: its lease of %g s "
                    "expired after phase %s with no Renew or RunPhase; undoing it as the "
                    "leader would have",
                    node,
                    job.kind,
                    rid,
                    job.leader,
                    job.lease_s,
                    rec["phase"],
                )
                result, undo = self._undo_expired(job, rep)
                _release_store(job.obj, keep_pin=result == "undo_failed")
                with self.jobs_lock:
                    rec.update(result=result, undo=undo)
        (log.warning if result != "undo_failed" else log.error)(
            "node %s: group %s request %s (lease expired after phase %s): this member %s",
            node,
            job.kind,
            rid,
            rec["phase"],
            undo,
        )
        if m is not None:
            m.lease_expired(job.kind, result)

    def _undo_expired(self, job: Job, rep: Reporter) -> tuple:
        """What the leader would have run for ``job``: checkpoint past ``finish`` (every
        member's snapshot complete): ``resume``; otherwise the undo phases not run yet
        (``rollback``, then ``release``); restore: ``abort`` once ``criu restore`` was
        started, else nothing. Returns (result, words): result ``undone``, ``completed``,
        ``dropped`` or ``undo_failed``."""
        from cuinterpose.agent.run.checkpoint import Checkpoint
        from cuinterpose.agent.run.restore import Restore

        obj = job.obj
        obj.r.sinks = list(rep.sinks)
        try:
            if job.kind == "checkpoint":
                phases = Checkpoint.GROUP_PHASES
                if job.next > phases.index("finish") and not job.failed:
                    obj.run_phase("resume")
                    return "completed", (
                        "ran 'resume': every member's snapshot was complete ('finish' had run here)"
                    )
                for name in Checkpoint.GROUP_UNDO:
                    if name not in job.undone:
                        obj.run_phase(name)
                        job.undone.append(name)
                if getattr(obj, "torn_down", False):
                    return "undone", (
                        "rolled it back and released it (the workload continues "
                        "with its memory intact)"
                    )
                return "undone", "released it (nothing had been torn down)"
            if job.reached >= Restore.GROUP_PHASES.index("criu restore"):
                obj.run_phase("abort")
                return "undone", (
                    "aborted it (its restored trees were killed; the snapshot is untouched)"
                )
            return "dropped", "dropped it (it had not reached 'criu restore': nothing to undo)"
        except AgentError as e:
            return "undo_failed", f"could not undo it: {e}"
        except Exception as e:
            return "undo_failed", f"could not undo it: unexpected {type(e).__name__}: {e}"
        finally:
            obj.r.sinks = []

    def _expired_refusal(self, rid: str, name: str, rec: dict) -> AgentError:
        ok = rec["result"] in ("undone", "completed", "dropped")
        outcome = (
            LEASE_EXPIRED
            if ok
            else "rollback_failed"
            if rec["kind"] == "checkpoint"
            else "restore_failed"
        )
        return AgentError(
            "group",
            f"request {rid}: phase {name!r} refused: the request's lease "
            f"of {rec['lease_s']:g} s expired on node {self.opts.node} after phase "
            f"{rec['phase']} with no Renew or RunPhase from leader "
            f"{rec['leader']}; this member {rec['undo']}; this call changed "
            "nothing",
            outcome=outcome,
        )

    # phases
    def run_phase(self, req, rep: Reporter, peer: str = "") -> tuple[dict, None]:
        """One group phase for request ``req.request_id``. The first regular phase creates
        the job from ``req.checkpoint``/``req.restore``; phases must come in the order of
        ``GROUP_PHASES`` (an out-of-order or repeated phase, or any regular phase after one
        failed, is refused and changes nothing: a mutating phase is never retried); undo
        phases may come at any time after the job exists. The job is dropped after the
        last phase, the last undo phase, or a failed undo phase. Every call renews the job's
        lease when the phase ends; a request whose lease expired is refused (outcome
        ``lease_expired``, or ``rollback_failed``/``restore_failed`` when this member's own
        undo failed). ``peer``: the caller's address, naming the leader when ``req.leader``
        is empty. Returns ({"ok", "node", "phase", "state", "lease_s"}, None)."""
        from cuinterpose.agent.run.checkpoint import Checkpoint
        from cuinterpose.agent.run.restore import Restore

        rid, name, kind = req.request_id, req.phase, req.kind
        if kind not in ("checkpoint", "restore") or not rid:
            raise AgentError("group", f"bad RunPhase: kind {kind!r}, request id {rid!r}")
        cls = Checkpoint if kind == "checkpoint" else Restore
        key = job_key(rid, req.node, self.opts.node)  # one job per member (two: one daemon)
        with self.jobs_lock:
            job = self.jobs.get(key)
            if job is None:
                rec = self.expired.get(key)
                if rec is not None:
                    raise self._expired_refusal(rid, name, rec)
                if name != cls.GROUP_PHASES[0]:
                    raise AgentError(
                        "group",
                        f"request {rid}: phase {name!r} for an unknown "
                        "request (nothing was changed)",
                    )
                try:
                    obj = self._make(kind, req)
                except AgentError as e:  # a confinement refusal: the leader's undo phases
                    obj = _Refused(kind, req, e)  # still find the job (and do nothing)
                job = Job(
                    kind,
                    obj,
                    rid=rid,
                    lease_s=self.opts.group_lease_s,
                    leader=req.leader or (f"at {peer}" if peer else ""),
                )
                self.jobs[key] = job
                self._start_reaper()
        with job.lock:
            if job.expired:  # expired while this call waited (the expiry holds the lock)
                with self.jobs_lock:
                    rec = dict(
                        self.expired.get(key)
                        or {
                            "kind": job.kind,
                            "leader": job.leader,
                            "phase": job.reached_phase(),
                            "lease_s": job.lease_s,
                            "result": "undoing",
                            "undo": "undid it",
                        }
                    )
                raise self._expired_refusal(rid, name, rec)
            if job.kind != kind:
                raise AgentError("group", f"request {rid} is a {job.kind}, not a {kind}")
            undo = name in cls.GROUP_UNDO
            if not undo:
                want = (
                    cls.GROUP_UNDO[0]
                    if job.failed or job.undoing
                    else cls.GROUP_PHASES[job.next]
                    if job.next < len(cls.GROUP_PHASES)
                    else None
                )
                if job.failed or job.undoing or name != want:
                    raise AgentError(
                        "group",
                        f"request {rid}: phase {name!r} out of order "
                        f"(expected {want!r}); refused, nothing was changed",
                    )
            else:
                job.undoing = True
            # the job keeps one Reporter (its phases go into the manifest); this call's
            # stream gets the rows of this phase
            job.obj.r.sinks = list(rep.sinks)
            before = len(job.obj.r.phases)
            done = False
            job.running, job.last, job.last_ok = name, name, False
            if not undo:
                job.reached = max(job.reached, cls.GROUP_PHASES.index(name))
            try:
                state = job.obj.run_phase(name)
                job.last_ok = True
                if not undo:
                    job.next += 1
                    done = job.next == len(cls.GROUP_PHASES)
                else:
                    job.undone.append(name)
                    done = name == cls.GROUP_UNDO[-1]
            except AgentError as e:
                e.node = self.opts.node
                done = undo
                job.failed = True  # a mutating phase is never retried: undo only
                raise
            finally:
                rep.phases.extend(job.obj.r.phases[before:])
                job.obj.r.sinks = []
                with self.jobs_lock:
                    job.running = ""
                    job.deadline = time.monotonic() + job.lease_s
                    if done:
                        self.jobs.pop(key, None)
                        # the job's last phase: a checkpoint into the chunk store lets go of
                        # it (its pin stays when that phase failed: a release needs the packs)
                        _release_store(job.obj, keep_pin=sys.exc_info()[0] is not None)
        return {
            "ok": True,
            "node": self.opts.node,
            "phase": name,
            "state": state,
            "lease_s": job.lease_s,
        }, None

    def _make(self, kind, req):
        """The member's Checkpoint/Restore for the first phase of a group request; its images
        dir confined to the snapshot roots (``AgentError`` when outside)."""
        from cuinterpose.agent.run.checkpoint import Checkpoint
        from cuinterpose.agent.run.restore import Restore

        if kind == "checkpoint":
            c = req.checkpoint
            images_dir = self.confine(c.images_dir)
            opts = self.request_options("checkpoint", options_of(c))
            where = self.remote_for(images_dir, "checkpoint", opts)
            local = where.local_dir if where is not None else images_dir
            obj = Checkpoint(list(c.roots), local, opts, reporter=Reporter(), remote=where)
            if req.HasField("group"):
                obj.group = pb.message_to_dict(req.group)
            return obj
        r = req.restore
        images_dir = self.confine(r.images_dir)
        opts = self.request_options("restore", options_of(r))
        where = self.remote_for(images_dir, "restore", opts)
        local = where.local_dir if where is not None else images_dir
        return Restore(local, opts, reporter=Reporter(), remote=where, **restore_targets(r))


class _Refused:
    """A group member's job whose request was refused before anything happened (its images
    dir is outside the snapshot roots): the first phase raises the refusal, the undo phases
    the leader then sends do nothing."""

    def __init__(self, kind: str, req, error: AgentError):
        self.kind = kind
        self.error = error
        self.r = Reporter()
        sub = req.checkpoint if kind == "checkpoint" else req.restore
        self.images_dir = sub.images_dir

    def run_phase(self, name: str) -> dict:
        from cuinterpose.agent.run.checkpoint import Checkpoint
        from cuinterpose.agent.run.restore import Restore

        cls = Checkpoint if self.kind == "checkpoint" else Restore
        if name not in cls.GROUP_UNDO:
            raise self.error
        if self.kind == "checkpoint":
            return {
                "torn_down": False,
                "snapshot_id": None,
                "images_dir": self.images_dir,
                "manifest_written": False,
            }
        return {}


def options_of(request):
    """The options message of a request (None when it carries none)."""
    return request.options if request.HasField("options") else None


def restore_targets(request) -> dict:
    """What a RestoreRequest restores into, as ``Restore`` takes it: ``placement`` (a pid,
    read and checked in the restore's "placement" phase) and ``device_map`` ("OLD=NEW[,...]",
    checked against the snapshot in "driver", agent/mech/devicemap.py)."""
    return {"placement": request.into_pid or None, "device_map": request.device_map or None}


def _release_store(obj, keep_pin: bool) -> None:
    """A finished group job's hold on the chunk store (a checkpoint's; nothing otherwise)."""
    release = getattr(obj, "release_store", None)
    if release is not None:
        release(keep_pin=keep_pin)
