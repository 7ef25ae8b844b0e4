"""Group checkpoint/restore: one consistent cut across several agents (DESIGN §8).

The agent that receives a request with ``members`` is the *leader* for it. It gives the
request an id and drives every member through the group phases of
:class:`~cuinterpose.agent.checkpoint.Checkpoint` (``GROUP_PHASES``: prepare, quiesce,
capture, lock, checkpoint, dump, manifest, finish, resume) or
:class:`~cuinterpose.agent.restore.Restore` (prepare, stale, criu restore, native restore,
restore shared, resume) by calling ``RunPhase`` on all members concurrently — itself
included, through the same RPC — and waits for every answer before the next phase (a
barrier). Hence no member locks before every member is quiesced, none is killed before every
manifest is written, and none resumes before every member restored.

A failure on any member stops the group at that phase. Checkpoint: every member then runs
``rollback`` (what was torn down is rebuilt; no ``.resume`` yet), and the members whose
rollback succeeded run ``release`` (``.resume``: restored=false, or cancelled when nothing was
torn down). Restore: a failure from ``criu restore`` on runs ``abort`` on every member (its
restored trees are killed; the snapshots stay untouched). The error names the member (node),
the phase and the pid; ``outcome`` is refused / rolled_back / rollback_failed (checkpoint) or
refused / restore_failed (restore), for the group as a whole.

Every member's progress rows are forwarded into the leader's stream with ``node`` and
``group_phase`` set: the leader's event log is the merged log of the group.
"""
from __future__ import annotations

import json
import uuid
from concurrent import futures
from typing import Callable

from . import pb
from .errors import AgentError
from .report import Reporter


class MemberFailed(Exception):
    """A group phase failed on at least one member (marks the leader's row failed)."""


def _members(request) -> list:
    seen = set()
    out = list(request.members)
    for m in out:
        if not m.node or not m.address:
            raise AgentError("group", "every member needs a node name and an address",
                             outcome="usage")
        if m.node in seen:
            raise AgentError("group", f"member {m.node!r} listed twice", outcome="usage")
        seen.add(m.node)
    return out


def lead(kind: str, request, rep: Reporter, emit: Callable[[dict], None], *,
         tls=None, call=None) -> tuple[dict, None]:
    """Lead a group ``kind`` ("checkpoint" | "restore") for ``request`` (a
    ``CheckpointRequest``/``RestoreRequest`` with ``members``). ``emit`` receives the members'
    progress rows; ``call(address, method, request, on_progress)`` defaults to
    :func:`cuinterpose.agent.service.call`. Returns ({"ok": true, "request_id", "members":
    [{"node", "address", "images_dir", "state"}], "phases"}, None); raises ``AgentError``
    with ``node`` set to the failing member."""
    from .checkpoint import Checkpoint
    from .restore import Restore
    from . import service
    apb, _, mpb = pb.modules()
    if call is None:
        def call(addr, method, req, on_progress):
            return service.call(addr, method, req, tls=tls, on_progress=on_progress)
    members = _members(request)
    cls = Checkpoint if kind == "checkpoint" else Restore
    rid = uuid.uuid4().hex
    ginfo = mpb.GroupInfo(request_id=rid, members=[
        mpb.GroupMember(node=m.node, address=m.address, images_dir=m.images_dir) for m in members])
    states: dict[str, dict] = {m.node: {} for m in members}

    def run_on(m, phase: str):
        req = apb.RunPhaseRequest(request_id=rid, kind=kind, phase=phase, node=m.node)
        if phase == cls.GROUP_PHASES[0]:
            if kind == "checkpoint":
                sub = apb.CheckpointRequest(roots=list(m.roots), images_dir=m.images_dir)
                sub.options.CopyFrom(request.options)
                req.checkpoint.CopyFrom(sub)
                g = mpb.GroupInfo()
                g.CopyFrom(ginfo)
                g.node = m.node
                req.group.CopyFrom(g)
            else:
                req.restore.CopyFrom(apb.RestoreRequest(
                    images_dir=m.images_dir, driver=request.driver,
                    phase_timeout_s=request.phase_timeout_s,
                    carrier_timeout_s=request.carrier_timeout_s))

        def fwd(row):
            row = dict(row)
            row["node"] = m.node
            row["group_phase"] = phase
            emit(row)
        res = call(m.address, "RunPhase", req, fwd)
        if not res.ok:
            e = res.error
            err = AgentError(e.phase or phase, e.reason, pid=e.pid if e.has_pid else None,
                             outcome=e.outcome or None)
            err.node = e.node or m.node
            raise err
        try:
            states[m.node] = json.loads(res.json).get("state", {}) or {}
        except ValueError:
            states[m.node] = {}

    def group_phase(phase: str, targets: list) -> list[tuple]:
        """Run ``phase`` on ``targets`` concurrently; wait for all. Returns [(member, error)]
        for the members that failed, in member order."""
        failed = []
        try:
            with rep.phase(f"group {phase}") as ph:
                _barrier(ph, phase, targets, failed)
        except MemberFailed:
            pass
        return failed

    def _barrier(ph, phase, targets, failed):
        with futures.ThreadPoolExecutor(max_workers=max(1, len(targets)),
                                        thread_name_prefix="cui-group") as ex:
            futs = [(m, ex.submit(run_on, m, phase)) for m in targets]
            for m, f in futs:
                try:
                    f.result()
                except AgentError as e:
                    if not getattr(e, "node", None):
                        e.node = m.node
                    failed.append((m, e))
                except Exception as e:
                    err = AgentError(phase, f"{type(e).__name__}: {e}", outcome="unreachable")
                    err.node = m.node
                    failed.append((m, err))
        ph.detail = (f"{len(targets)} members" if not failed else
                     "failed on " + ", ".join(m.node for m, _ in failed))
        if failed:
            raise MemberFailed()

    for i, phase in enumerate(cls.GROUP_PHASES):
        failed = group_phase(phase, members)
        if not failed:
            continue
        _, first = failed[0]
        if len(failed) > 1:      # the first member's error leads; the others are named too
            first.reason += "; also failed: " + "; ".join(
                f"node {m.node}: {e}" for m, e in failed[1:])
        if kind == "checkpoint":
            raise _undo_checkpoint(first, members, group_phase, states, rep)
        raise _undo_restore(first, i, members, group_phase, cls, rep)
    return ({"ok": True, "request_id": rid, "kind": kind,
             "members": [{"node": m.node, "address": m.address, "images_dir": m.images_dir,
                          "state": states[m.node]} for m in members],
             "phases": rep.to_list()}, None)


def _named(e: AgentError, reason: str, outcome: str) -> AgentError:
    err = AgentError(e.phase, reason, pid=e.pid, outcome=outcome)
    err.node = getattr(e, "node", "")
    err.args = (f"node {err.node}: {err}",)
    return err


def _undo_checkpoint(first: AgentError, members, group_phase, states, rep) -> AgentError:
    """Run ``rollback`` on every member, then ``release`` on those whose rollback worked.
    Returns the group's error."""
    rb_failed = group_phase("rollback", members)
    bad = {m.node for m, _ in rb_failed}
    torn = any(states.get(m.node, {}).get("torn_down") for m in members if m.node not in bad)
    ok_members = [m for m in members if m.node not in bad]
    rel_failed = group_phase("release", ok_members) if ok_members else []
    if rb_failed or rel_failed:
        why = "; ".join(f"node {m.node}: {e}" for m, e in rb_failed + rel_failed)
        rep.note(f"group rollback failed: {why}")
        return _named(first, f"{first.reason}; rollback failed too: {why}", "rollback_failed")
    if torn:
        return _named(first, first.reason + " (rolled back: every member's workload continues "
                      "with its memory intact)", "rolled_back")
    return _named(first, first.reason, first.outcome if first.outcome != "usage" else "refused")


def _undo_restore(first: AgentError, index: int, members, group_phase, cls, rep) -> AgentError:
    if index < cls.GROUP_PHASES.index("criu restore"):
        return _named(first, first.reason, "refused")
    ab_failed = group_phase("abort", members)
    extra = ("" if not ab_failed else "; abort failed on " +
             ", ".join(f"node {m.node}: {e}" for m, e in ab_failed))
    return _named(first, first.reason + "; every member's restored trees were killed, the "
                  "snapshots are untouched" + extra, "restore_failed")
