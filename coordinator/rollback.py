"""Rollback: bring every participant of a failed or abandoned capture back to ACTIVE.

:func:`rollback` implements :meth:`Coordinator.rollback
<cuinterpose.coordinator.phases.Coordinator.rollback>`; its steps (INSPECT, forward the stale
SAVED importers, CANCEL_CAPTURE + LOAD_ALLOCATIONS, RESTORE_UNICAST, the multicast rebuild,
INSPECT) are described in docs/coordinator.md "Rollback".
"""

from __future__ import annotations

import time
from typing import Iterable, Mapping

from . import topology
from .barrier import Barrier
from .carrierfiles import streams_of
from .client import ShimClientError
from .protocol import MULTICAST_RESTORE_OPS, Op, Phase, Record, RecordKind, Role, ShimFlag, Status
from .results import (
    Capture,
    ParticipantResult,
    PhaseError,
    PhaseEvent,
    RollbackResult,
    enum_name,
)

__all__ = ["rollback"]

#: The shim phases of a multicast teardown/rebuild (rollback resumes from any of them).
MULTICAST_PHASES = tuple(src for _, src in MULTICAST_RESTORE_OPS)
#: every phase rollback brings back to ACTIVE
ROLLBACK_PHASES = (Phase.ACTIVE, Phase.SAVED, Phase.PREPARED, Phase.LOADED, *MULTICAST_PHASES)
#: how often a rollback re-INSPECTs and re-plans after a shim moved under it (docs/coordinator.md
#: "Rollback": one op in flight per lost connection; a bound, never an endless retry)
MAX_REPLANS = 3


def rollback(
    coord: Barrier,
    capture_or_records: "Capture | Mapping[int, Iterable[Record]]",
    device_map: dict[str, str] | None = None,
) -> RollbackResult:
    """Bring every participant of ``coord`` back to ACTIVE (docs/coordinator.md "Rollback").

    ``capture_or_records``: the :class:`Capture` (also the partial one on
    ``PhaseError.capture``) or pid -> the records of the capture's first INSPECT. A FAILED or
    silent participant raises :class:`PhaseError` before anything is sent (fail-stop); a
    phase with nobody to ask is skipped. A phase failing only with lost replies or with
    shims found in another phase than planned (an op in flight on a lost connection ran
    meanwhile) is settled by a new INSPECT and plan, at most ``MAX_REPLANS`` times; any other
    failing phase raises PhaseError (``changed`` True; stop there); a final INSPECT unequal to
    the capture raises TopologyError.
    """
    if isinstance(capture_or_records, Capture):
        records = capture_or_records.records
        coord.txn_floor = max(coord.txn_floor, capture_or_records.last_txn_id)
    else:
        records = {int(p): list(rs) for p, rs in capture_or_records.items()}
    missing = [pid for pid in coord.pids if pid not in records]
    if missing:
        raise ValueError(f"rollback: no captured records for participant pid {missing[0]}")
    coord.carried = streams_of(records)  # a PREPARED shim loads its chunk files back
    start = len(coord.phases)
    found_first: dict[int, str] | None = None
    for attempt in range(MAX_REPLANS + 1):
        found, now = _inspect_phases(coord)
        if found_first is None:
            found_first = {pid: enum_name(Phase, ph) for pid, ph in found.items()}
        try:
            _undo(coord, records, found, now)
            after = coord._inspect(Phase.ACTIVE, True, changed_before=True)
        except PhaseError as e:
            if attempt < MAX_REPLANS and _moved(e):
                continue  # an op in flight on a lost connection ran after that INSPECT
            raise
        break
    topology.compare(records, after, device_map=device_map)
    return RollbackResult(found=found_first, phases=coord.phases[start:], records=after)


def _moved(e: PhaseError) -> bool:
    """True when ``e`` is settled by a new INSPECT and plan: every failure is either a reply
    that never came (``error``: the op may or may not have run; the next INSPECT tells, and a
    resent op carries a higher txn, so the late one is refused as a duplicate or for its
    phase), or a shim that answered from another phase than the plan assumed, one rollback
    handles (``REFUSED_PHASE``, which changes nothing, or the final INSPECT's wrong phase):
    an op sent on a lost connection ran after the rollback's INSPECT. FAILED, BUSY or
    otherwise refusing shims are not (and a shim that is gone fails the next INSPECT)."""
    inspect = e.phase == Op.INSPECT.name
    return bool(e.failures) and all(
        f.error is not None
        or (
            f.phase in ROLLBACK_PHASES
            and (f.status == Status.REFUSED_PHASE or (inspect and f.status == Status.OK))
        )
        for f in e.failures
    )


def _undo(
    coord: Barrier,
    records: Mapping[int, list[Record]],
    found: dict[int, Phase],
    now: Mapping[int, list[Record]],
) -> None:
    """Steps 2-4b of docs/coordinator.md "Rollback" from the phases ``found`` (pid -> Phase of
    this round's INSPECT, updated in place) and its records ``now``; raises PhaseError from
    the first failing phase."""

    # step 2: SAVED importers of an allocation whose creator already tore it down
    torn = {Phase.PREPARED, Phase.LOADED}
    forward: list[int] = []
    changed = True
    while changed:
        changed = False
        for pid in coord.pids:
            if found[pid] in torn:
                continue
            # a mapping or a held handle of the creator's old allocation
            stale = sorted(
                (
                    r
                    for r in now[pid]
                    if int(r.role) == Role.IMPORTER
                    and int(r.kind) in (RecordKind.MAPPING, RecordKind.ALLOCATION)
                    and found.get(int(r.creator_pid)) in torn
                ),
                key=lambda r: int(r.kind) != RecordKind.MAPPING,
            )
            if not stale:
                continue
            stale = stale[0]
            if found[pid] != Phase.SAVED:
                where = (
                    f"maps allocation {stale.alloc_id_hex} at va {stale.va:#x}"
                    if int(stale.kind) == RecordKind.MAPPING
                    else f"holds allocation {stale.alloc_id_hex}"
                )
                raise PhaseError(
                    f"rollback: pid {pid} is {found[pid].name} and still {where}, whose "
                    f"creator pid "
                    f"{stale.creator_pid} is {found[int(stale.creator_pid)].name} (already "
                    "torn down): rebuilding the creator would split the sharing; nothing "
                    "was sent",
                    phase="rollback",
                    pid=pid,
                    status=None,
                    cuda_result=0,
                    message="stale importer",
                    failures=[],
                    changed=True,
                )
            forward.append(pid)
            found[pid] = Phase.PREPARED
            changed = True
    if forward:
        coord._run_plan(
            {pid: (Op.PREPARE_UNICAST, Phase.SAVED) for pid in forward}, changed_before=True
        )
    original = dict(found)
    # the multicast teardown is all-or-nothing: once any shim released its objects, an
    # ACTIVE one still holding multicast state releases too, so the rebuild recreates one team
    mc_torn = [
        pid
        for pid in coord.pids
        if found[pid] != Phase.ACTIVE
        and (
            found[pid] in MULTICAST_PHASES
            or any(int(r.kind) == RecordKind.MULTICAST for r in records.get(pid, []))
        )
    ]
    if mc_torn and topology.has_multicast(records):
        stay = [
            pid
            for pid in coord.pids
            if found[pid] == Phase.ACTIVE and topology.has_multicast({pid: now.get(pid, [])})
        ]
        if stay:
            res, _ = coord._run_plan(
                {pid: (Op.PREPARE_MULTICAST, Phase.ACTIVE) for pid in stay}, changed_before=True
            )
            for pid in stay:
                found[pid] = original[pid] = Phase(res.participants[pid].phase)
    cur = dict(found)

    plan = {}
    for pid in coord.pids:
        if original[pid] == Phase.SAVED:
            plan[pid] = (Op.CANCEL_CAPTURE, Phase.SAVED)
        elif original[pid] == Phase.PREPARED:
            plan[pid] = (Op.LOAD_ALLOCATIONS, Phase.PREPARED)
    if plan:
        res, _ = coord._run_plan(plan, changed_before=True)
        cur.update({pid: Phase(r.phase) for pid, r in res.participants.items()})
    plan = {pid: (Op.RESTORE_UNICAST, Phase.LOADED) for pid in coord.pids if original[pid] in torn}
    if plan:
        res, _ = coord._run_plan(plan, changed_before=True)
        cur.update({pid: Phase(r.phase) for pid, r in res.participants.items()})
    # multicast rebuild: each op to the shims in its source phase, in order
    for op, src in MULTICAST_RESTORE_OPS:
        plan = {pid: (op, src) for pid in coord.pids if cur[pid] == src}
        if plan:
            res, _ = coord._run_plan(plan, changed_before=True)
            cur.update({pid: Phase(r.phase) for pid, r in res.participants.items()})


def _inspect_phases(coord: Barrier) -> tuple[dict[int, Phase], dict[int, list[Record]]]:
    """INSPECT every participant; returns (pid -> Phase, pid -> records). A shim whose reply
    says a mutating op is still queued or running (``ShimFlag.OP_RUNNING``: one sent on a lost
    connection, the op of a dead agent) is waited for (:func:`_wait_idle`), then every
    participant is INSPECTed again: its phase is only known once that op answered. Raises
    PhaseError naming the first participant that is FAILED, silent, or in an unknown phase."""
    while True:
        found, records, busy = _inspect_once(coord)
        if not busy:
            return found, records
        _wait_idle(coord, busy)


def _wait_idle(coord: Barrier, pids: list[int]) -> None:
    """Wait until none of ``pids`` runs a mutating op (an INSPECT reply without
    ``ShimFlag.OP_RUNNING``; INSPECT is answered while the op runs), polling every 5 ms doubling
    to 100 ms, each wait announced as a ``PhaseEvent`` of kind "wait". The bound is the carrier
    timeout, the longest any op may run: a shim still working is never given up on earlier
    (issue 23: a rollback that lost its own LOAD_ALLOCATIONS reply re-planned while the shim was
    still loading and gave up). Raises PhaseError (phase "rollback") for a shim that stops
    answering or is still busy at that bound; nothing was sent then."""
    deadline = time.monotonic() + coord.carrier_timeout_s
    for pid in pids:
        coord._emit(PhaseEvent("wait", Op.INSPECT.name, 0, 0, len(pids), pid=pid))
        pause = 0.005
        while True:
            try:
                r = coord._clients[pid].request(Op.INSPECT, txn_id=0, expected_phase=Phase.ACTIVE)
            except ShimClientError as e:
                raise _refusal(
                    pid,
                    ParticipantResult(pid=pid, wall_ns=0, error=str(e)),
                    f"did not answer INSPECT while its op ran ({e}); its phase is unknown",
                ) from e
            if not r.reply.shim_flags & ShimFlag.OP_RUNNING:
                break
            if time.monotonic() >= deadline:
                raise _refusal(
                    pid,
                    ParticipantResult(pid=pid, status=r.reply.status, phase=r.reply.phase),
                    f"still runs a mutating op after the carrier timeout "
                    f"({coord.carrier_timeout_s:g} s)",
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.1)


def _inspect_once(
    coord: Barrier,
) -> tuple[dict[int, Phase], dict[int, list[Record]], list[int]]:
    """One INSPECT of every participant: (pid -> Phase, pid -> records, pids whose reply says a
    mutating op is still queued or running)."""
    try:
        res, records = coord._run(Op.INSPECT, Phase.ACTIVE, changed_before=True)
        results = dict(res.participants)
    except PhaseError as e:
        results, records = dict(e.result.participants), dict(e.records or {})
        # a shim that checks INSPECT's expected phase: ask again with the phase it reported
        again = {
            r.pid: (Op.INSPECT, Phase(r.phase))
            for r in e.failures
            if r.error is None
            and r.status == Status.REFUSED_PHASE
            and r.phase in Phase._value2member_map_
            and r.phase != Phase.FAILED
        }
        if again:
            try:
                res2, rec2 = coord._run_plan(again, changed_before=True)
                results.update(res2.participants)
                records.update(rec2)
            except PhaseError as e2:
                results.update(e2.result.participants)
    found: dict[int, Phase] = {}
    for pid in coord.pids:
        r = results[pid]
        if r.error is not None:
            raise _refusal(pid, r, f"did not answer INSPECT ({r.error}); its phase is unknown")
        if r.phase == Phase.FAILED:
            why = f": {r.message.strip()}" if r.message.strip() else ""
            raise _refusal(
                pid,
                r,
                f"is FAILED (a destructive op failed part-way){why}; it "
                "cannot be brought back to ACTIVE",
            )
        if not r.ok or r.phase not in ROLLBACK_PHASES:
            raise _refusal(
                pid,
                r,
                f"answered INSPECT with status "
                f"{enum_name(Status, r.status)} in phase "
                f"{enum_name(Phase, r.phase)}",
            )
        found[pid] = Phase(r.phase)
    busy = [pid for pid in coord.pids if results[pid].shim_flags & ShimFlag.OP_RUNNING]
    return found, records, busy


def _refusal(pid: int, r: ParticipantResult, why: str) -> PhaseError:
    return PhaseError(
        f"rollback: pid {pid} {why}; nothing was rolled back (fail-stop)",
        phase="rollback",
        pid=pid,
        status=r.status,
        cuda_result=r.cuda_result,
        message=r.message or (r.error or ""),
        failures=[r],
        changed=True,
    )
