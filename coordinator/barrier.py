"""The barrier runner: one phase sent to every participant at once, then wait for all.

One thread per participant; the next phase starts only after every participant replied or
failed. One transaction id per phase, shared by all participants, strictly increasing and never
reused (also across processes: it is wall-clock ns based and above the capture's last txn).
docs/coordinator.md "Barrier" and "Failure semantics".
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Callable, Iterable, Mapping

from .carrierfiles import CarrierFiles
from .client import ShimClient, ShimClientError
from .protocol import (
    CARRIER_OPS,
    DEFAULT_CARRIER_TIMEOUT_S,
    MUTATING_OPS,
    Op,
    Phase,
    ProtocolError,
    Record,
    Status,
    parse_chunk_table,
)
from .results import (
    Participant,
    ParticipantResult,
    PhaseError,
    PhaseEvent,
    PhaseResult,
    enum_name,
    failure_text,
)

__all__ = ["Barrier", "next_txn_id", "gc_paused"]

log = logging.getLogger(__name__)


# --- transaction ids --------------------------------------------------------------------------
_txn_lock = threading.Lock()
_txn_last = 0


def next_txn_id(floor: int = 0) -> int:
    """A new transaction id: ``max(time.time_ns(), last + 1, floor + 1)`` (uint64).

    Strictly increasing within the process; wall-clock based so that a new coordinator
    process (after restore) continues above the old one, and ``floor`` (a capture's
    ``last_txn_id``) guards against a clock that went backwards.
    """
    global _txn_last
    with _txn_lock:
        _txn_last = max(time.time_ns(), _txn_last + 1, int(floor) + 1)
        return _txn_last


# --- the garbage collector ---------------------------------------------------------------------
_gc_lock = threading.Lock()
_gc_state = {"depth": 0, "was_enabled": False}


@contextlib.contextmanager
def gc_paused():
    """Pause Python's cyclic garbage collector while a block builds or walks many records.

    Records and their tuples hold no cycles (their reference counts free them), but each
    collection that their allocation triggers walks every live object: at 40000 records the
    collections cost as much as the work itself, and more as the records of a capture and of
    its restore pile up (K = 10000 cost up to 77x K = 1000 in ``check carriers`` and
    ``compare``; decisions D60). Nested and concurrent blocks (the barrier's threads) share one
    pause; the collector is enabled again after the last only if it was enabled before the
    first."""
    with _gc_lock:
        if _gc_state["depth"] == 0:
            _gc_state["was_enabled"] = gc.isenabled()
            gc.disable()
        _gc_state["depth"] += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_state["depth"] -= 1
            if _gc_state["depth"] == 0 and _gc_state["was_enabled"]:
                gc.enable()


#: the phases a capture or restore leaves a shim in (every phase but ACTIVE and FAILED)
CAPTURE_PHASES = frozenset(p for p in Phase if p not in (Phase.ACTIVE, Phase.FAILED))


def _wrong_phase_text(pid: int, phase: int, expected: Phase) -> str:
    """What INSPECT found: ``pid`` in ``phase`` where ``expected`` was due. A shim found in a
    capture phase where ACTIVE was expected is held by a capture nobody finished (an agent
    that died mid-checkpoint): the text points to ``cuinterpose-agent release``, which rolls
    it back (docs/agent.md)."""
    text = (
        f"INSPECT: pid {pid} is in phase {enum_name(Phase, phase)}, expected "
        f"{enum_name(Phase, expected)}"
    )
    if expected == Phase.ACTIVE and phase in CAPTURE_PHASES:
        text += (
            f": a capture that was not finished holds it (an agent that died mid-checkpoint); "
            f"roll it back with `cuinterpose-agent release --pid ROOT` (ROOT: the root pid of "
            f"pid {pid}'s job), then retry"
        )
    return text


# --- the runner ------------------------------------------------------------------------------
class Barrier:
    """Sends phases to ``participants`` (list of :class:`Participant`, unique pids), each phase
    as one barrier; :class:`~cuinterpose.coordinator.phases.Coordinator` builds the sequences
    on it. ``timeout_s``, ``carrier_timeout_s``, ``on_event``, ``carriers``: see Coordinator.
    ``carried``: pid -> (alloc_id, size) of the allocations its shim carries (set by the
    sequences from the capture's records; the chunk files of SAVE/LOAD name them). ``phases``:
    every PhaseResult so far; ``steps``: the coordinator's own rows so far (:meth:`_step`);
    ``last_txn_id``: the highest txn id sent; ``txn_floor``: txn ids stay above it (a capture's
    ``last_txn_id``). ``claim``: the :class:`~cuinterpose.coordinator.claim.Claim` whose token
    every mutating request carries (protocol.h "Claims"; settable later, e.g. once the capture
    takes it; None: a shim refuses every mutating request).
    """

    def __init__(
        self,
        participants: Iterable[Participant],
        *,
        timeout_s: float = 10.0,
        carrier_timeout_s: float = DEFAULT_CARRIER_TIMEOUT_S,
        on_event: Callable[[PhaseEvent], None] | None = None,
        carriers: CarrierFiles | None = None,
        claim=None,
    ):
        self.participants = [
            p if isinstance(p, Participant) else Participant(*p) for p in participants
        ]
        pids = [p.pid for p in self.participants]
        if not pids:
            raise ValueError("a coordinator needs at least one participant")
        if len(set(pids)) != len(pids):
            raise ValueError(f"duplicate participant pids: {sorted(pids)}")
        self.timeout_s = float(timeout_s)
        self.carrier_timeout_s = float(carrier_timeout_s)
        self.on_event = on_event
        self.carriers = carriers
        self.carried: dict[int, list[tuple[bytes, int]]] = {}
        #: pids whose shim does not take a streamed SAVE (no ShimFlag.CARRY_STREAMED in the
        #: capture's INSPECT: loaded before D70); their chunk files are opened before the request
        self.unstreamed: set[int] = set()
        self.txn_floor = 0
        self.last_txn_id = 0
        self.phases: list[PhaseResult] = []
        #: the coordinator's own work between barriers, one row each (:meth:`_step`)
        self.steps: list[PhaseResult] = []
        self._clients = {
            p.pid: ShimClient(p.socket_path, self.timeout_s, pid=p.pid, inspect_devices=True)
            for p in self.participants
        }
        self.claim = claim

    @property
    def claim(self):
        """The :class:`~cuinterpose.coordinator.claim.Claim` of the mutating requests (or None)."""
        return self._claim

    @claim.setter
    def claim(self, claim) -> None:
        self._claim = claim
        for c in self._clients.values():
            c.claim = claim.token if claim is not None else None

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.participants]

    def _inspect(
        self, expected_phase: Phase, check_phase: bool, *, changed_before: bool
    ) -> dict[int, list[Record]]:
        res, records = self._run(Op.INSPECT, expected_phase, changed_before=changed_before)
        if check_phase:
            wrong = [r for r in res.participants.values() if r.phase != expected_phase]
            if wrong:
                r = wrong[0]
                raise PhaseError(
                    _wrong_phase_text(r.pid, r.phase, expected_phase)
                    + ("" if changed_before else "; nothing was changed"),
                    phase=Op.INSPECT.name,
                    pid=r.pid,
                    status=r.status,
                    cuda_result=0,
                    message="",
                    failures=wrong,
                    changed=changed_before,
                    result=res,
                )
        return records

    @contextlib.contextmanager
    def _step(self, name: str):
        """Time the coordinator's own work between two barriers as the row ``name``: a
        PhaseResult without participants (txn id 0; the block may set its ``detail``) appended
        to :attr:`steps` and sent as a "phase" event (``ok`` False when the block raised)."""
        row = PhaseResult(phase=name, txn_id=0, expected_phase=0, wall_ns=0)
        t0, ok = time.monotonic_ns(), False
        try:
            with gc_paused():
                yield row
            ok = True
        finally:
            row.wall_ns = time.monotonic_ns() - t0
            self.steps.append(row)
            self._emit(PhaseEvent("phase", name, 0, 0, 0, phase_result=row, ok=ok))

    def _emit(self, event: PhaseEvent) -> None:
        if self.on_event is None:
            return
        try:
            self.on_event(event)
        except Exception:  # a progress display must not break a barrier
            log.exception("on_event callback failed")

    def _one(
        self, pid: int, op: Op, txn_id: int, expected_phase: Phase, timeout_s: float
    ) -> tuple[ParticipantResult, list[Record]]:
        t0 = time.monotonic_ns()
        files = None
        try:
            if op in CARRIER_OPS:
                files = self.carrier_files().request(
                    op, pid, self.carried.get(pid, []), streamed=pid not in self.unstreamed
                )
            # an INSPECT reply is parsed into a record per object (see gc_paused)
            with gc_paused() if op == Op.INSPECT else contextlib.nullcontext():
                resp = self._clients[pid].request(
                    op,
                    txn_id=txn_id,
                    expected_phase=expected_phase,
                    timeout_s=timeout_s,
                    carriers=files,
                )
        except (ShimClientError, OSError) as e:
            return ParticipantResult(pid=pid, wall_ns=time.monotonic_ns() - t0, error=str(e)), []
        finally:
            CarrierFiles.close(files)
        resp.close()
        y = resp.reply
        r = ParticipantResult(
            pid=pid,
            status=y.status,
            phase=y.phase,
            bytes=y.bytes,
            elapsed_ns=y.elapsed_ns,
            copy_ns=y.copy_ns,
            records_changed=y.records_changed,
            cuda_result=y.cuda_result,
            message=resp.message,
            record_count=y.record_count,
            wall_ns=time.monotonic_ns() - t0,
            direct_bytes=y.reserved[3] if op == Op.SAVE_ALLOCATIONS else 0,
            shim_flags=y.shim_flags,
            staging_pinned_bytes=y.reserved[4] if op in CARRIER_OPS else 0,
            staging_pin_result=y.reserved[5] & 0xFFFFFFFF if op in CARRIER_OPS else 0,
        )
        if y.pid and y.pid != pid and r.status == Status.OK:
            r.error = (
                f"{op.name}: pid {pid}: reply comes from pid {y.pid} (socket "
                f"{self._clients[pid].socket_path})"
            )
        if op == Op.SAVE_ALLOCATIONS and r.status == Status.OK and r.error is None:
            with gc_paused():  # a table per carried allocation
                r.error = self._keep_tables(pid, y.reserved[1], resp.chunk_table)
        return r, resp.records

    def carrier_files(self) -> CarrierFiles:
        """The chunk files of this capture (a private directory when none was given)."""
        if self.carriers is None:
            self.carriers = CarrierFiles.private()
        return self.carriers

    def _keep_tables(self, pid: int, chunk_bytes: int, raw: bytes) -> str | None:
        """Parse and keep ``pid``'s SAVE_ALLOCATIONS chunk table; the error text when it does
        not name exactly the streams sent, with the request's chunk_bytes."""
        files = self.carrier_files()
        sent = sorted(a.hex() for a, _ in self.carried.get(pid, []))
        try:
            if sent and chunk_bytes != files.chunk_bytes:
                raise ProtocolError(f"chunk_bytes {chunk_bytes} != requested {files.chunk_bytes}")
            tables = parse_chunk_table(raw, files.chunk_bytes)
            if sorted(t.alloc_id for t in tables) != sent:
                raise ProtocolError(
                    f"the chunk table names {sorted(t.alloc_id for t in tables)}, sent {sent}"
                )
        except ProtocolError as e:
            return f"SAVE_ALLOCATIONS: pid {pid}: bad chunk table in the reply: {e}"
        files.saved(pid, tables)
        return None

    def _run(
        self, op: Op, expected_phase: Phase, *, changed_before: bool
    ) -> tuple[PhaseResult, dict[int, list[Record]]]:
        """Send ``op`` to every participant at once; wait for all (the barrier)."""
        return self._run_plan(
            {p.pid: (op, expected_phase) for p in self.participants}, changed_before=changed_before
        )

    def _run_plan(
        self, plan: Mapping[int, tuple[Op, Phase]], *, changed_before: bool
    ) -> tuple[PhaseResult, dict[int, list[Record]]]:
        """One barrier phase: ``plan`` maps pid -> (op, expected phase) for the participants
        to ask (all concurrently, one txn id); wait for all. The PhaseResult is named after
        the op, or "OP1+OP2" when the plan mixes ops (in participant order)."""
        pids = [p.pid for p in self.participants if p.pid in plan]
        ops = list(dict.fromkeys(plan[pid][0] for pid in pids))
        name = "+".join(o.name for o in ops)
        expected = plan[pids[0]][1]
        txn = next_txn_id(max(self.txn_floor, self.last_txn_id))
        self.last_txn_id = txn
        total = len(pids)
        if any(plan[pid][0] in CARRIER_OPS for pid in pids):
            self.carrier_files()  # one directory for all threads
        res = PhaseResult(phase=name, txn_id=txn, expected_phase=expected, wall_ns=0)
        records: dict[int, list[Record]] = {}
        t0 = time.monotonic_ns()
        with ThreadPoolExecutor(
            max_workers=total, thread_name_prefix=f"cui-{name.lower()[:40]}"
        ) as pool:
            futs = []
            for pid in pids:
                op, exp = plan[pid]
                timeout = self.carrier_timeout_s if op in CARRIER_OPS else self.timeout_s
                futs.append(pool.submit(self._one, pid, op, txn, exp, timeout))
            for fut in as_completed(futs):
                r, recs = fut.result()
                res.participants[r.pid] = r
                records[r.pid] = recs
                self._emit(
                    PhaseEvent(
                        "reply",
                        name,
                        txn,
                        len(res.participants),
                        total,
                        pid=r.pid,
                        result=r,
                        ok=r.ok,
                    )
                )
        res.wall_ns = time.monotonic_ns() - t0
        res.participants = {pid: res.participants[pid] for pid in pids}
        records = {pid: records[pid] for pid in pids}
        self.phases.append(res)
        failures = [r for r in res.participants.values() if not r.ok]
        self._emit(PhaseEvent("phase", name, txn, total, total, phase_result=res, ok=not failures))
        if failures:
            first = failures[0]
            refusal_only = all(
                f.error is None
                and f.status in Status._value2member_map_
                and Status(f.status).is_refusal
                for f in failures
            )
            mutating = any(plan[pid][0] in MUTATING_OPS for pid in pids)
            changed = changed_before or (mutating and not (refusal_only and len(failures) == total))
            first_op = plan[first.pid][0].name
            text = failure_text(first_op, first)
            if not changed:
                text += "; nothing was changed"
            if len(failures) > 1:
                text += (
                    f" (and {len(failures) - 1} more: pids "
                    + ", ".join(str(f.pid) for f in failures[1:])
                    + ")"
                )
            err = PhaseError(
                text,
                phase=first_op,
                pid=first.pid,
                status=first.status,
                cuda_result=first.cuda_result,
                message=first.message or (first.error or ""),
                failures=failures,
                changed=changed,
                result=res,
            )
            err.records = records
            raise err
        return res, records
