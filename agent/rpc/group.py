"""Group checkpoint/restore, the leader side: one consistent cut across several agents.

The agent that receives a request with ``members`` (or the CLI with ``--group`` and no
``--agent``) leads it (:func:`lead`): it calls ``RunPhase`` for each group phase of
``Checkpoint.GROUP_PHASES`` / ``Restore.GROUP_PHASES`` on every member concurrently, itself
included, and waits for all (a barrier); on a failure it runs the undo phases (``rollback``
and ``release``, or ``abort``) and names the failing member. Every member's rows are forwarded
into the leader's stream with ``node`` and ``group_phase`` set. :class:`Renewer` keeps the
members' leases alive while the group runs; the member side is
:mod:`cuinterpose.agent.rpc.member`. The protocol, the failure outcomes and the leases:
docs/service.md "Groups" and "Leases", docs/decisions.md D11 and D12.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from concurrent import futures
from typing import Callable, Optional

from cuinterpose.agent import paths
from cuinterpose.agent.errors import AgentError
from cuinterpose.agent.rpc import client
from cuinterpose.agent.rpc.member import DEFAULT_GROUP_LEASE_S, LEASE_EXPIRED
from cuinterpose.agent.run.report import Reporter
from cuinterpose.agent.snapshot import pb

#: a leader renews every member's lease after this fraction of the shortest lease
RENEW_FRACTION = 1 / 3
# the first group phase that cannot be undone (the step table's ``no_return`` row,
# ``StepRunner.point_of_no_return``): the leader confirms every member's lease (a synchronous
# Renew) right before it (checkpoint: ``finish`` kills the dumped trees; restore: ``resume``
# lets the restored trees run)


class Renewer:
    """Keeps the leases of group request ``rid`` alive on every member while the group runs.

    A thread of its own calls ``renew(address, RenewRequest, timeout_s)`` on every member
    concurrently every ``RENEW_FRACTION`` of the shortest lease (seconds) learned so far:
    :meth:`learn` takes a member's ``lease_s`` (from its RunPhase answers and Renew responses);
    until one is known the leader assumes ``default_lease_s``. A member whose renewal is still
    in flight is skipped, so one hung member does not delay the others; a failed renewal is
    noted once per member on ``rep`` (the next RunPhase on that member then says what
    happened). ``renewed[node]`` counts successful renewals."""

    def __init__(
        self,
        rid: str,
        members: list,
        leader: str,
        renew: Callable,
        rep: Reporter,
        default_lease_s: float,
    ):
        self.rid = rid
        self.members = members
        self.leader = leader
        self.renew = renew
        self.rep = rep
        self.default_lease_s = float(default_lease_s)
        self.leases: dict[str, float] = {}
        self.renewed = {m.node: 0 for m in members}
        self.noted: set = set()
        self.inflight: set = set()
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.stopped = threading.Event()
        self.thread: Optional[threading.Thread] = None
        self.pool: Optional[futures.ThreadPoolExecutor] = None

    def learn(self, node: str, lease_s) -> None:
        """Record ``node``'s lease (seconds); a shorter one wakes the thread at once."""
        try:
            lease_s = float(lease_s or 0)
        except (TypeError, ValueError):
            return
        if lease_s > 0 and self.leases.get(node) != lease_s:
            self.leases[node] = lease_s
            self.wake.set()

    def period_s(self) -> float:
        """Seconds between renewals: ``RENEW_FRACTION`` of the shortest known lease."""
        return max(0.01, min(self.leases.values() or [self.default_lease_s]) * RENEW_FRACTION)

    def start(self) -> "Renewer":
        self.pool = futures.ThreadPoolExecutor(
            max_workers=max(1, len(self.members)), thread_name_prefix="cui-renew"
        )
        self.thread = threading.Thread(target=self._run, name="cui-group-renew", daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopped.set()
        self.wake.set()
        if self.thread is not None:
            self.thread.join()
        if self.pool is not None:
            self.pool.shutdown(wait=False)

    def _run(self) -> None:
        last = time.monotonic()
        while not self.stopped.is_set():
            due = last + self.period_s()
            now = time.monotonic()
            if now < due:
                self.wake.wait(due - now)
                self.wake.clear()
                continue
            last = now
            for m in self.members:
                with self.lock:
                    if m.node in self.inflight:
                        continue
                    self.inflight.add(m.node)
                try:
                    self.pool.submit(self._renew_one, m)
                except RuntimeError:  # the pool is shut down: the group has ended
                    return

    def _renew_one(self, m) -> None:
        apb, _, _ = pb.modules()
        try:
            req = apb.RenewRequest(request_id=self.rid, node=m.node, leader=self.leader)
            try:
                res = self.renew(m.address, req, max(1.0, self.period_s()))
            except Exception as e:
                self._note(
                    m.node,
                    f"cannot renew the lease of group request {self.rid} on node "
                    f"{m.node} ({m.address}): {e}",
                )
                return
            if res.ok:
                self.renewed[m.node] += 1
                self.learn(m.node, res.lease_s)
            else:  # expired (it undid its part), or it holds no job (it restarted)
                self._note(
                    m.node,
                    f"node {m.node}: {res.reason or 'it holds no job for '}"
                    + ("" if res.reason else f"group request {self.rid}"),
                )
        finally:
            with self.lock:
                self.inflight.discard(m.node)

    def confirm(self, phase: str) -> list[tuple]:
        """Renew every member's lease now and wait for the answers (before ``phase``, the
        first one that cannot be undone). Returns ``[(member, AgentError)]`` for the members
        whose lease is gone (expired: they undid their part) or that did not answer, in member
        order; [] when every member still holds the job."""
        apb, _, _ = pb.modules()

        def one(m):
            req = apb.RenewRequest(request_id=self.rid, node=m.node, leader=self.leader)
            res = self.renew(m.address, req, max(1.0, self.period_s()))
            if res.ok:
                self.learn(m.node, res.lease_s)
            return res

        out = []
        with futures.ThreadPoolExecutor(
            max_workers=max(1, len(self.members)), thread_name_prefix="cui-confirm"
        ) as ex:
            futs = [(m, ex.submit(one, m)) for m in self.members]
            for m, f in futs:
                try:
                    res = f.result()
                except Exception as e:
                    err = AgentError(
                        phase,
                        f"its lease could not be confirmed before {phase} "
                        f"({type(e).__name__}: {e})",
                        outcome="unreachable",
                    )
                else:
                    if res.ok:
                        continue
                    err = AgentError(
                        phase,
                        f"its lease is gone before {phase}: "
                        f"{res.reason or 'no live job for the request'}",
                        outcome=LEASE_EXPIRED if res.expired else "unreachable",
                    )
                err.node = m.node
                out.append((m, err))
        return out

    def _note(self, node: str, text: str) -> None:
        with self.lock:
            if node in self.noted:
                return
            self.noted.add(node)
        if not self.stopped.is_set():
            self.rep.note(text)


class MemberFailed(Exception):
    """A group phase failed on at least one member (marks the leader's row failed)."""


def _members(request) -> list:
    seen = set()
    out = list(request.members)
    for m in out:
        if not m.node or not m.address:
            raise AgentError(
                "group", "every member needs a node name and an address", outcome="usage"
            )
        if m.node in seen:
            raise AgentError("group", f"member {m.node!r} listed twice", outcome="usage")
        seen.add(m.node)
    return out


def _distinct_images_dirs(members) -> None:
    """Refuse (``AgentError``, phase "group", refused) a group checkpoint two of whose members
    name one images dir: the same path once symlinks and ``..`` are resolved as this leader
    sees them (``paths.canonical``; a relative path, which each member takes against its own
    snapshot root, only normalized), whatever their addresses: two daemons may share a
    directory (NFS). Each member also claims its directory (agent/snapshot/claim.py), which
    catches one directory reached through different paths on different nodes."""
    seen: dict = {}
    for m in members:
        d = m.images_dir
        key = (
            d.rstrip("/")  # an object-store location (s3://BUCKET/PREFIX)
            if "://" in d
            else paths.canonical(d)
            if os.path.isabs(d)
            else os.path.normpath(d)
        )
        if key in seen:
            o = seen[key]
            raise AgentError(
                "group",
                f"members {o.node} ({o.address}) and {m.node} ({m.address}) name the same images "
                f"dir {key}: one run at a time writes a snapshot directory; give each member its "
                "own images_dir; nothing was done",
                outcome="refused",
            )
        seen[key] = m


def lead(
    kind: str,
    request,
    rep: Reporter,
    emit: Callable[[dict], None],
    *,
    tls=None,
    call=None,
    renew=None,
    request_id: Optional[str] = None,
    leader: Optional[str] = None,
    lease_s: Optional[float] = None,
) -> tuple[dict, None]:
    """Lead a group ``kind`` ("checkpoint" | "restore") for ``request`` (a
    ``CheckpointRequest``/``RestoreRequest`` with ``members``). ``emit`` receives the members'
    progress rows; ``call(address, method, request, on_progress)`` defaults to
    :func:`cuinterpose.agent.rpc.client.call` and ``renew(address, RenewRequest, timeout_s)`` to
    :func:`cuinterpose.agent.rpc.client.renew` (both with ``tls``; with a ``call`` given and no
    ``renew``: ``call(address, "Renew", request, None)``). ``request_id``: the group's id
    (default a fresh uuid4 hex); ``leader``: this leader in words, sent to the members (default
    "pid N on HOST"); ``lease_s``: the lease (seconds) assumed for members until they report
    theirs (default ``member.DEFAULT_GROUP_LEASE_S``). Every member's lease is renewed by a
    :class:`Renewer` while the group runs. Returns ({"ok": true, "request_id", "members":
    [{"node", "address", "images_dir", "state"}], "phases"}, None); raises ``AgentError``
    with ``node`` set to the failing member."""
    from cuinterpose.agent.run.checkpoint import Checkpoint
    from cuinterpose.agent.run.restore import Restore

    apb, _, mpb = pb.modules()
    if call is None:

        def call(addr, method, req, on_progress):
            return client.call(addr, method, req, tls=tls, on_progress=on_progress)

        if renew is None:

            def renew(addr, req, timeout_s):
                return client.renew(addr, req, tls=tls, timeout_s=timeout_s)

    if renew is None:

        def renew(addr, req, timeout_s):
            return call(addr, "Renew", req, None)

    members = _members(request)
    if kind == "checkpoint":
        _distinct_images_dirs(members)
    if kind == "restore" and request.into_pid:
        raise AgentError(
            "group",
            "into_pid places a single-node restore; in a group restore "
            "each member names its own into_pid (a pid on its node)",
            outcome="usage",
        )
    if kind == "restore" and request.device_map:
        raise AgentError(
            "group",
            "device_map maps one node's GPUs; in a group restore each member names its own "
            "device_map (the GPUs of its node)",
            outcome="usage",
        )
    cls = Checkpoint if kind == "checkpoint" else Restore
    rid = request_id or uuid.uuid4().hex
    leader = leader or f"pid {os.getpid()} on {socket.gethostname()}"
    renewer = Renewer(rid, members, leader, renew, rep, lease_s or DEFAULT_GROUP_LEASE_S)
    ginfo = mpb.GroupInfo(
        request_id=rid,
        members=[
            mpb.GroupMember(node=m.node, address=m.address, images_dir=m.images_dir)
            for m in members
        ],
    )
    states: dict[str, dict] = {m.node: {} for m in members}

    def run_on(m, phase: str):
        req = apb.RunPhaseRequest(
            request_id=rid, kind=kind, phase=phase, node=m.node, leader=leader
        )
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
                sub = apb.RestoreRequest(
                    images_dir=m.images_dir, into_pid=m.into_pid, device_map=m.device_map
                )
                sub.options.CopyFrom(request.options)
                req.restore.CopyFrom(sub)

        def fwd(row):
            row = dict(row)
            row["node"] = m.node
            row["group_phase"] = phase
            emit(row)

        res = call(m.address, "RunPhase", req, fwd)
        if not res.ok:
            e = res.error
            err = AgentError(
                e.phase or phase,
                e.reason,
                pid=e.pid if e.has_pid else None,
                outcome=e.outcome or None,
            )
            err.node = e.node or m.node
            raise err
        try:
            out = json.loads(res.json)
        except ValueError:
            out = {}
        states[m.node] = out.get("state", {}) or {}
        renewer.learn(m.node, out.get("lease_s"))

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
        with futures.ThreadPoolExecutor(
            max_workers=max(1, len(targets)), thread_name_prefix="cui-group"
        ) as ex:
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
        ph.detail = (
            f"{len(targets)} members"
            if not failed
            else "failed on " + ", ".join(m.node for m, _ in failed)
        )
        if failed:
            raise MemberFailed()

    renewer.start()
    try:
        for i, phase in enumerate(cls.GROUP_PHASES):
            failed = []
            if phase == cls.point_of_no_return():
                # a member whose lease expired has undone its part on its own: every member
                # must still hold the job before any of them passes the point of no return
                try:
                    with rep.phase("group confirm leases") as ph:
                        failed = renewer.confirm(phase)
                        ph.detail = (
                            f"{len(members)} members"
                            if not failed
                            else "lost on " + ", ".join(m.node for m, _ in failed)
                        )
                        if failed:
                            raise MemberFailed()
                except MemberFailed:
                    pass
            if not failed:
                failed = group_phase(phase, members)
            if not failed:
                continue
            _, first = failed[0]
            if len(failed) > 1:  # the first member's error leads; the others are named too
                first.reason += "; also failed: " + "; ".join(
                    f"node {m.node}: {e}" for m, e in failed[1:]
                )
            # a member the leader could not reach at the first phase gets no undo phase: it
            # never got the request, or (the stream broke) it undoes it when its lease expires
            targets = [
                m
                for m in members
                if i > 0 or not any(f is m and e.outcome == "unreachable" for f, e in failed)
            ]
            if kind == "checkpoint":
                raise _undo_checkpoint(first, targets, group_phase, states, rep)
            raise _undo_restore(first, i, targets, group_phase, cls, rep)
    finally:
        renewer.stop()
    return (
        {
            "ok": True,
            "request_id": rid,
            "kind": kind,
            "members": [
                {
                    "node": m.node,
                    "address": m.address,
                    "images_dir": m.images_dir,
                    "state": states[m.node],
                }
                for m in members
            ],
            "phases": rep.to_list(),
        },
        None,
    )


def _lease_hint(e: AgentError) -> str:
    return (
        " (unreachable: if it holds the job, it undoes it itself when its lease expires)"
        if e.outcome == "unreachable"
        else ""
    )


def _named(e: AgentError, reason: str, outcome: str) -> AgentError:
    err = AgentError(e.phase, reason, pid=e.pid, outcome=outcome)
    err.node = getattr(e, "node", "")
    err.args = (f"node {err.node}: {err}",)
    return err


def _undo_checkpoint(first: AgentError, members, group_phase, states, rep) -> AgentError:
    """Run ``rollback`` on every member, then ``release`` on those whose rollback worked.
    Returns the group's error."""
    rb = group_phase("rollback", members) if members else []
    # a member whose lease expired rolled back and released the job itself
    self_undone = {m.node for m, e in rb if e.outcome == LEASE_EXPIRED}
    rb_failed = [(m, e) for m, e in rb if m.node not in self_undone]
    bad = {m.node for m, _ in rb}
    torn = any(
        states.get(m.node, {}).get("torn_down")
        for m in members
        if m.node not in bad or m.node in self_undone
    )
    ok_members = [m for m in members if m.node not in bad]
    rel = group_phase("release", ok_members) if ok_members else []
    rel_failed = [(m, e) for m, e in rel if e.outcome != LEASE_EXPIRED]
    if rb_failed or rel_failed:
        why = "; ".join(f"node {m.node}: {e}{_lease_hint(e)}" for m, e in rb_failed + rel_failed)
        rep.note(f"group rollback failed: {why}")
        return _named(first, f"{first.reason}; rollback failed too: {why}", "rollback_failed")
    if torn:
        return _named(
            first,
            first.reason + " (rolled back: every member's workload continues "
            "with its memory intact)",
            "rolled_back",
        )
    return _named(first, first.reason, first.outcome if first.outcome != "usage" else "refused")


def _undo_restore(first: AgentError, index: int, members, group_phase, cls, rep) -> AgentError:
    if index < cls.GROUP_PHASES.index("criu restore"):
        return _named(first, first.reason, "refused")
    ab_failed = [
        (m, e)
        for m, e in (group_phase("abort", members) if members else [])
        if e.outcome != LEASE_EXPIRED
    ]  # expired: it aborted by itself
    extra = (
        ""
        if not ab_failed
        else "; abort failed on "
        + ", ".join(f"node {m.node}: {e}{_lease_hint(e)}" for m, e in ab_failed)
    )
    return _named(
        first,
        first.reason + "; every member's restored trees were killed, the "
        "snapshots are untouched" + extra,
        "restore_failed",
    )
