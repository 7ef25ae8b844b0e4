"""The phase runner: capture and restore across every participant, with a barrier per phase.

Capture:  INSPECT -> validate -> [PREPARE_MULTICAST] -> SAVE_ALLOCATIONS -> PREPARE_UNICAST
          -> INSPECT (carriers)
Restore:  INSPECT (all PREPARED, carriers intact) -> LOAD_ALLOCATIONS -> RESTORE_UNICAST
          -> [RESTORE_MULTICAST_CREATORS -> _IMPORTERS -> _DEVICES -> _BINDINGS]
          -> INSPECT (must equal the capture, see topology.COMPARE_IGNORED)
Rollback: INSPECT (each shim's phase) -> CANCEL_CAPTURE on SAVED + LOAD_ALLOCATIONS on
          PREPARED (one barrier phase) -> RESTORE_UNICAST on the formerly PREPARED/LOADED
          -> [the four multicast rebuild ops, each to the shims in its source phase]
          -> INSPECT (all ACTIVE, must equal the capture)

The bracketed multicast phases run only when some participant reported a multicast record
(topology.has_multicast); then every participant gets every one of them (a process without
multicast state answers OK with nothing to do). Without multicast the sequences are exactly the
unicast ones.

Each phase goes to every participant concurrently (one thread per participant); the next
phase starts only after every participant replied (the barrier). One transaction id per phase,
shared by all participants, strictly increasing and never reused (also across processes: it
is wall-clock ns based and above the capture's last txn).

Failure semantics (see docs/coordinator.md):
- a refusal or a validation error before the first mutating phase: :class:`PhaseError` /
  :class:`~cuinterpose.coordinator.topology.TopologyError`, nothing changed anywhere;
- any failure in a mutating phase (status, timeout, lost reply): :class:`PhaseError` naming the
  phase, the pid and the shim's message; the run stops there and no op is retried;
- :meth:`Coordinator.rollback` brings every shim of a failed capture back to ACTIVE, or raises
  :class:`PhaseError` naming the pid it cannot bring back (a FAILED shim: fail-stop).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from . import topology
from .client import ShimClient, ShimClientError
from .errors import CoordinatorError
from .protocol import (CARRIER_OPS, CUI_PROTO_VERSION, MULTICAST_RESTORE_OPS, MUTATING_OPS, Op,
                       Phase, Record, RecordFlag, RecordKind, Role, Status, cuda_result_name,
                       socket_path)
from .topology import TopologyError

__all__ = ["Participant", "Coordinator", "Capture", "RestoreResult", "RollbackResult",
           "PhaseResult",
           "ParticipantResult", "PhaseEvent", "PhaseError", "TopologyError", "CoordinatorError",
           "next_txn_id", "CAPTURE_FORMAT"]

log = logging.getLogger(__name__)

#: Version of the dict written by :meth:`Capture.to_dict`.
CAPTURE_FORMAT = 1


#: The shim phases of a multicast teardown/rebuild (rollback resumes from any of them).
_MC_PHASES = (Phase.MULTICAST_RELEASED, Phase.MULTICAST_CREATED, Phase.MULTICAST_IMPORTED,
              Phase.MULTICAST_DEVICES)


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


# --- data -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Participant:
    """One CUDA process under the shim: ``pid`` and its control ``socket_path``."""
    pid: int
    socket_path: str

    @classmethod
    def from_pid(cls, pid: int, control_dir: str | os.PathLike | None = None) -> "Participant":
        """``<control_dir>/cuinterpose-<pid>.sock``; control_dir defaults to
        ``$CUINTERPOSE_CONTROL_DIR`` or /tmp/cuinterpose."""
        return cls(int(pid), socket_path(control_dir, pid))

    def to_dict(self) -> dict:
        return {"pid": self.pid, "socket_path": self.socket_path}


def _name(enum_cls, value) -> str | None:
    if value is None:
        return None
    try:
        return enum_cls(value).name
    except ValueError:
        return str(int(value))


@dataclass
class ParticipantResult:
    """One participant's answer to one phase.

    ``status``/``phase`` are None when no reply arrived (``error`` says why). ``bytes``:
    carrier bytes moved; ``elapsed_ns``/``copy_ns``: reported by the shim; ``wall_ns``: the
    request's round trip seen by the coordinator.
    """
    pid: int
    status: int | None = None
    phase: int | None = None
    bytes: int = 0
    elapsed_ns: int = 0
    copy_ns: int = 0
    records_changed: int = 0
    cuda_result: int = 0
    message: str = ""
    record_count: int = 0
    wall_ns: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == Status.OK

    def to_dict(self) -> dict:
        return {"pid": self.pid, "status": _name(Status, self.status),
                "phase": _name(Phase, self.phase), "bytes": self.bytes,
                "elapsed_ns": self.elapsed_ns, "copy_ns": self.copy_ns,
                "records_changed": self.records_changed, "cuda_result": self.cuda_result,
                "message": self.message, "record_count": self.record_count,
                "wall_ns": self.wall_ns, "error": self.error}

    @classmethod
    def from_dict(cls, d: dict) -> "ParticipantResult":
        def code(enum_cls, v):
            if v is None:
                return None
            return enum_cls[v] if isinstance(v, str) and v in enum_cls.__members__ else int(v)
        return cls(pid=int(d["pid"]), status=code(Status, d.get("status")),
                   phase=code(Phase, d.get("phase")), bytes=int(d.get("bytes", 0)),
                   elapsed_ns=int(d.get("elapsed_ns", 0)), copy_ns=int(d.get("copy_ns", 0)),
                   records_changed=int(d.get("records_changed", 0)),
                   cuda_result=int(d.get("cuda_result", 0)), message=d.get("message", ""),
                   record_count=int(d.get("record_count", 0)), wall_ns=int(d.get("wall_ns", 0)),
                   error=d.get("error"))


@dataclass
class PhaseResult:
    """One phase across all participants. ``wall_ns``: send to last reply (the barrier)."""
    phase: str
    txn_id: int
    expected_phase: int
    wall_ns: int
    participants: dict[int, ParticipantResult] = field(default_factory=dict)

    @property
    def bytes(self) -> int:
        """Carrier bytes moved by all participants."""
        return sum(p.bytes for p in self.participants.values())

    @property
    def copy_ns(self) -> int:
        """Sum of the participants' copy_ns (they copy concurrently; see max_copy_ns)."""
        return sum(p.copy_ns for p in self.participants.values())

    @property
    def max_elapsed_ns(self) -> int:
        return max((p.elapsed_ns for p in self.participants.values()), default=0)

    @property
    def max_copy_ns(self) -> int:
        return max((p.copy_ns for p in self.participants.values()), default=0)

    @property
    def records_changed(self) -> int:
        return sum(p.records_changed for p in self.participants.values())

    def to_dict(self) -> dict:
        return {"phase": self.phase, "txn_id": self.txn_id,
                "expected_phase": _name(Phase, self.expected_phase), "wall_ns": self.wall_ns,
                "bytes": self.bytes, "copy_ns": self.copy_ns,
                "records_changed": self.records_changed,
                "participants": [p.to_dict() for _, p in sorted(self.participants.items())]}

    @classmethod
    def from_dict(cls, d: dict) -> "PhaseResult":
        ep = d.get("expected_phase", 0)
        ep = Phase[ep] if isinstance(ep, str) and ep in Phase.__members__ else int(ep)
        parts = [ParticipantResult.from_dict(p) for p in d.get("participants", [])]
        return cls(phase=d["phase"], txn_id=int(d["txn_id"]), expected_phase=ep,
                   wall_ns=int(d.get("wall_ns", 0)), participants={p.pid: p for p in parts})


@dataclass(frozen=True)
class PhaseEvent:
    """Progress notification passed to ``on_event``.

    ``kind`` is ``"reply"`` (one participant answered; ``pid`` and ``result`` set) or
    ``"phase"`` (the phase finished for everyone, ``ok`` False if it failed; ``result`` None,
    ``phase_result`` set). ``done``/``total``: replies so far / participants.
    """
    kind: str
    phase: str
    txn_id: int
    done: int
    total: int
    pid: int | None = None
    result: ParticipantResult | None = None
    phase_result: PhaseResult | None = None
    ok: bool = True

    @property
    def bytes(self) -> int:
        if self.result is not None:
            return self.result.bytes
        return self.phase_result.bytes if self.phase_result else 0

    @property
    def wall_ns(self) -> int:
        if self.result is not None:
            return self.result.wall_ns
        return self.phase_result.wall_ns if self.phase_result else 0


class PhaseError(CoordinatorError):
    """A phase did not complete on every participant.

    ``phase``: op name ("RESTORE_UNICAST"); ``pid``: the first participant at fault (in
    participant order); ``status``: its reply status (None if it never replied);
    ``cuda_result``: CUresult of the failing driver call (0 if none); ``message``: the shim's
    message or the client error; ``failures``: every participant at fault;
    ``changed``: False when nothing was changed anywhere (refusal before any mutation);
    ``result``: the PhaseResult; ``capture``: the partial Capture when capture() failed after
    its first INSPECT (so a caller can attempt a rollback), else None.
    """

    def __init__(self, text: str, *, phase: str, pid: int | None, status: int | None,
                 cuda_result: int, message: str, failures: list[ParticipantResult],
                 changed: bool, result: PhaseResult | None = None):
        super().__init__(text)
        self.phase = phase
        self.pid = pid
        self.status = status
        self.cuda_result = cuda_result
        self.message = message
        self.failures = failures
        self.changed = changed
        self.result = result
        self.capture: Capture | None = None
        #: pid -> records of the participants that answered (INSPECT), when raised by a phase
        self.records: dict[int, list[Record]] | None = None


def _failure_text(phase: str, r: ParticipantResult) -> str:
    """One line naming phase, pid and cause. Shim messages that already start with
    "<PHASE>: pid <n>" (the shim's own style) are used as they are."""
    if r.error is not None:
        return r.error if r.error.startswith(phase) else f"{phase}: {r.error}"
    status = _name(Status, r.status)
    msg = r.message.strip()
    refusal = r.status in Status._value2member_map_ and Status(r.status).is_refusal
    prefixed = msg.startswith(f"{phase}:")
    if not prefixed and msg.startswith(f"pid {r.pid}"):
        msg, prefixed = f"{phase}: {msg}", True
    if prefixed:
        text = f"{msg} (refused: {status})" if refusal else msg
    elif refusal:
        text = f"{phase}: pid {r.pid} refused ({status})" + (f": {msg}" if msg else "")
    elif msg:
        text = f"{phase}: pid {r.pid} {msg}"
    else:
        text = f"{phase}: pid {r.pid} failed ({status})"
    cuda = cuda_result_name(r.cuda_result) if r.cuda_result else ""
    if cuda and cuda not in text:
        text += f": {cuda}"
    return text


# --- capture / restore results -----------------------------------------------------------------
@dataclass
class Capture:
    """What capture() saw and did; JSON-able via :meth:`to_dict` for the snapshot manifest.

    ``records``: pid -> the INSPECT records before teardown, with the carrier fields
    (``CUI_REC_CARRIED``, ``carrier_checksum``, ``carrier_bytes``) filled in from the INSPECT
    after PREPARE_UNICAST. ``phases``: every phase run. ``carriers``: per carried allocation
    ``{"pid", "alloc_id", "bytes", "checksum"}``. ``last_txn_id``: the highest txn id used.
    """
    participants: list[Participant]
    records: dict[int, list[Record]]
    phases: list[PhaseResult] = field(default_factory=list)
    carriers: list[dict] = field(default_factory=list)
    last_txn_id: int = 0

    @property
    def carrier_bytes(self) -> int:
        """Total bytes held in host carriers."""
        return sum(c["bytes"] for c in self.carriers)

    def phase(self, name: str) -> PhaseResult | None:
        """The last PhaseResult of ``name`` (e.g. "SAVE_ALLOCATIONS"), or None."""
        for p in reversed(self.phases):
            if p.phase == name:
                return p
        return None

    def to_dict(self) -> dict:
        """``{"format", "protocol_version", "participants": [{"pid", "socket_path", "records":
        [record dict]}], "phases": [...], "carriers": [...], "carrier_bytes", "last_txn_id"}``."""
        return {
            "format": CAPTURE_FORMAT, "protocol_version": CUI_PROTO_VERSION,
            "participants": [{**p.to_dict(),
                              "records": [r.to_dict() for r in self.records.get(p.pid, [])]}
                             for p in self.participants],
            "phases": [p.to_dict() for p in self.phases],
            "carriers": [dict(c) for c in self.carriers],
            "carrier_bytes": self.carrier_bytes,
            "last_txn_id": self.last_txn_id,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Capture":
        """Inverse of :meth:`to_dict`. Raises ValueError on an unknown format or protocol."""
        fmt = d.get("format")
        if fmt != CAPTURE_FORMAT:
            raise ValueError(f"capture format {fmt!r} is not supported (expected "
                             f"{CAPTURE_FORMAT})")
        if d.get("protocol_version") != CUI_PROTO_VERSION:
            raise ValueError(f"capture was taken with protocol version "
                             f"{d.get('protocol_version')!r}; this coordinator speaks "
                             f"{CUI_PROTO_VERSION}")
        parts = [Participant(int(p["pid"]), p["socket_path"]) for p in d["participants"]]
        records = {int(p["pid"]): [Record.from_dict(r) for r in p.get("records", [])]
                   for p in d["participants"]}
        return cls(participants=parts, records=records,
                   phases=[PhaseResult.from_dict(p) for p in d.get("phases", [])],
                   carriers=[dict(c) for c in d.get("carriers", [])],
                   last_txn_id=int(d.get("last_txn_id", 0)))


@dataclass
class RestoreResult:
    """What restore() did: ``phases`` run and the final INSPECT ``records`` (equal to the
    capture modulo topology.COMPARE_IGNORED)."""
    phases: list[PhaseResult]
    records: dict[int, list[Record]]

    @property
    def carrier_bytes(self) -> int:
        return sum(p.bytes for p in self.phases if p.phase == Op.LOAD_ALLOCATIONS.name)

    def phase(self, name: str) -> PhaseResult | None:
        for p in reversed(self.phases):
            if p.phase == name:
                return p
        return None

    def to_dict(self) -> dict:
        return {"phases": [p.to_dict() for p in self.phases],
                "records": {str(pid): [r.to_dict() for r in rs]
                            for pid, rs in sorted(self.records.items())}}


@dataclass
class RollbackResult:
    """What rollback() did: ``found`` (pid -> the shim phase name found by the first INSPECT),
    ``phases`` run (the INSPECTs included) and the final INSPECT ``records`` (every shim
    ACTIVE, equal to the capture modulo topology.COMPARE_IGNORED)."""
    found: dict[int, str]
    phases: list[PhaseResult]
    records: dict[int, list[Record]]

    def to_dict(self) -> dict:
        return {"found": {str(p): ph for p, ph in sorted(self.found.items())},
                "phases": [p.to_dict() for p in self.phases]}


# --- the coordinator -------------------------------------------------------------------------
class Coordinator:
    """Runs phases across ``participants`` (list of :class:`Participant`, unique pids).

    ``timeout_s``: deadline of one request (seconds); ``carrier_timeout_s``: the deadline for
    the byte-copy ops SAVE_ALLOCATIONS and LOAD_ALLOCATIONS; ``on_event``: called with a
    :class:`PhaseEvent` per participant reply and per phase completion, from the calling
    thread (exceptions it raises are logged and ignored).
    """

    def __init__(self, participants: Iterable[Participant], *, timeout_s: float = 10.0,
                 carrier_timeout_s: float = 3600.0,
                 on_event: Callable[[PhaseEvent], None] | None = None):
        self.participants = [p if isinstance(p, Participant) else Participant(*p)
                             for p in participants]
        pids = [p.pid for p in self.participants]
        if not pids:
            raise ValueError("a coordinator needs at least one participant")
        if len(set(pids)) != len(pids):
            raise ValueError(f"duplicate participant pids: {sorted(pids)}")
        self.timeout_s = float(timeout_s)
        self.carrier_timeout_s = float(carrier_timeout_s)
        self.on_event = on_event
        self.txn_floor = 0
        self.last_txn_id = 0
        self.phases: list[PhaseResult] = []
        self._clients = {p.pid: ShimClient(p.socket_path, self.timeout_s, pid=p.pid)
                         for p in self.participants}

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.participants]

    # --- read-only --------------------------------------------------------------------------
    def inspect(self, *, expected_phase: Phase = Phase.ACTIVE,
                check_phase: bool = False) -> dict[int, list[Record]]:
        """INSPECT every participant concurrently; returns pid -> records. Read-only.

        ``expected_phase`` is sent as the request's expected phase (the shim accepts INSPECT
        in every phase except FAILED). With ``check_phase`` a participant whose reply phase
        differs raises :class:`PhaseError` (``changed`` False).
        Raises PhaseError on a refusal, failure or timeout.
        """
        return self._inspect(expected_phase, check_phase, changed_before=False)

    def _inspect(self, expected_phase: Phase, check_phase: bool, *, changed_before: bool
                 ) -> dict[int, list[Record]]:
        res, records = self._run(Op.INSPECT, expected_phase, changed_before=changed_before)
        if check_phase:
            wrong = [r for r in res.participants.values() if r.phase != expected_phase]
            if wrong:
                r = wrong[0]
                raise PhaseError(
                    f"INSPECT: pid {r.pid} is in phase {_name(Phase, r.phase)}, expected "
                    f"{_name(Phase, expected_phase)}"
                    + ("" if changed_before else "; nothing was changed"), phase="INSPECT",
                    pid=r.pid, status=r.status, cuda_result=0, message="", failures=wrong,
                    changed=changed_before, result=res)
        return records

    def validate(self, records_by_pid: Mapping[int, Iterable[Record]] | None = None
                 ) -> dict[int, list[Record]]:
        """Check the topology (topology.validate rules) of ``records_by_pid``, or of a fresh
        :meth:`inspect` when None. Returns the records checked. Raises TopologyError naming
        pid and allocation, or PhaseError from the INSPECT; nothing is changed either way."""
        if records_by_pid is None:
            records_by_pid = self.inspect(check_phase=True)
        records = {int(p): list(rs) for p, rs in records_by_pid.items()}
        missing = [pid for pid in self.pids if pid not in records]
        if missing:
            raise TopologyError(f"pid {missing[0]} is a participant but reported no records",
                                pid=missing[0])
        topology.validate(records, participants=self.pids)
        return records

    # --- one function per phase ---------------------------------------------------------------
    def prepare_multicast(self) -> PhaseResult:
        """PREPARE_MULTICAST (ACTIVE -> MULTICAST_RELEASED): unmap multicast VAs, unbind,
        close cached export FDs, release the objects. Refused by every shim: nothing changed."""
        return self._run(Op.PREPARE_MULTICAST, Phase.ACTIVE, changed_before=False)[0]

    def save_allocations(self, expected_phase: Phase = Phase.ACTIVE, *,
                         changed_before: bool = False) -> PhaseResult:
        """SAVE_ALLOCATIONS (ACTIVE, or MULTICAST_RELEASED after PREPARE_MULTICAST -> SAVED):
        creators copy shared bytes to host carriers."""
        return self._run(Op.SAVE_ALLOCATIONS, expected_phase, changed_before=changed_before)[0]

    def restore_multicast(self) -> list[PhaseResult]:
        """The four multicast rebuild phases, each a barrier (MULTICAST_RELEASED -> ACTIVE):
        creators create (requested size) and re-export -> importers import -> every participant
        adds its devices -> every participant binds, maps and sets access."""
        return [self._run(op, src, changed_before=True)[0] for op, src in MULTICAST_RESTORE_OPS]

    def prepare_unicast(self) -> PhaseResult:
        """PREPARE_UNICAST (SAVED -> PREPARED): unmap shared mappings, release handles."""
        return self._run(Op.PREPARE_UNICAST, Phase.SAVED, changed_before=True)[0]

    def load_allocations(self) -> PhaseResult:
        """LOAD_ALLOCATIONS (PREPARED -> LOADED): creators re-create at the original VA,
        copy the carried bytes back, re-export."""
        return self._run(Op.LOAD_ALLOCATIONS, Phase.PREPARED, changed_before=False)[0]

    def restore_unicast(self) -> PhaseResult:
        """RESTORE_UNICAST (LOADED -> ACTIVE): importers fetch, import, map, set access."""
        return self._run(Op.RESTORE_UNICAST, Phase.LOADED, changed_before=True)[0]

    # --- sequences ----------------------------------------------------------------------------
    def capture(self) -> Capture:
        """INSPECT -> validate -> SAVE_ALLOCATIONS -> PREPARE_UNICAST -> INSPECT.

        Returns the :class:`Capture`. Raises PhaseError/TopologyError with ``changed`` False
        (nothing changed) up to validation; PhaseError (``capture`` attribute: the partial
        Capture) from the mutating phases on, or if a creator's bytes were not carried. Any
        other exception raised after validation (a KeyboardInterrupt, a bug) carries the same
        ``capture`` attribute: SAVE_ALLOCATIONS may have gone out, so roll back with it.
        """
        start = len(self.phases)
        records = self.validate(self.inspect(check_phase=True))
        cap = Capture(participants=list(self.participants), records=records)
        try:
            if topology.has_multicast(records):
                # outer objects first: no unicast mapping goes while a binding on it exists
                self.prepare_multicast()
                self.save_allocations(Phase.MULTICAST_RELEASED, changed_before=True)
            else:
                self.save_allocations()
            self.prepare_unicast()
            after = self._inspect(Phase.PREPARED, True, changed_before=True)
            cap.records = self._merge_carriers(records, after)
        except BaseException as e:
            # whatever stopped the capture here (a PhaseError, a bug, Ctrl-C), SAVE_ALLOCATIONS
            # may have gone out: hand the caller the partial capture so it can roll back
            cap.phases = self.phases[start:]
            cap.last_txn_id = self.last_txn_id
            try:
                e.capture = cap
            except AttributeError:
                pass
            raise
        cap.phases = self.phases[start:]
        cap.carriers = topology.carriers(cap.records)
        cap.last_txn_id = self.last_txn_id
        return cap

    def restore(self, capture: Capture) -> RestoreResult:
        """INSPECT (every shim PREPARED, carriers as captured) -> LOAD_ALLOCATIONS ->
        RESTORE_UNICAST -> INSPECT equal to ``capture.records`` (modulo
        topology.COMPARE_IGNORED).

        Raises ValueError if the participants differ from the capture's; PhaseError (nothing
        changed) if a shim is not PREPARED or a carrier checksum differs; PhaseError from a
        mutating phase (stop there, no retry); TopologyError naming pid and object when the
        final INSPECT differs from the capture.
        """
        want = sorted(p.pid for p in capture.participants)
        if sorted(self.pids) != want:
            raise ValueError(f"restore: participants {sorted(self.pids)} differ from the "
                             f"captured {want}")
        self.txn_floor = max(self.txn_floor, capture.last_txn_id)
        start = len(self.phases)
        before = self.inspect(expected_phase=Phase.PREPARED, check_phase=True)
        self._check_carriers(capture, before)
        self.load_allocations()
        self.restore_unicast()
        if topology.has_multicast(capture.records):
            self.restore_multicast()
        after = self._inspect(Phase.ACTIVE, True, changed_before=True)
        topology.compare(capture.records, after)
        return RestoreResult(phases=self.phases[start:], records=after)

    def rollback(self, capture_or_records: "Capture | Mapping[int, Iterable[Record]]"
                 ) -> RollbackResult:
        """Bring every participant of a failed or abandoned capture back to ACTIVE.

        ``capture_or_records``: the :class:`Capture` (also the partial one on
        ``PhaseError.capture``) or pid -> the records of the capture's first INSPECT.

        1. INSPECT every participant (read-only) to learn its phase. A FAILED participant, one
           that does not answer, or one in a phase rollback does not handle raises
           :class:`PhaseError` naming the pid before anything is sent (fail-stop, no retries).
        2. Only if some shim already tore its shared memory down (PREPARED/LOADED) while a SAVED
           peer still maps an allocation that such a shim created: that SAVED peer first runs
           PREPARE_UNICAST too (else it would keep mapping the old allocation while its
           creator rebuilds a new one: the sharing would silently split). An ACTIVE peer in
           that position cannot be fixed: PhaseError, nothing sent.
        3. One barrier phase: CANCEL_CAPTURE on the SAVED, LOAD_ALLOCATIONS on the PREPARED
           (concurrently).
        4. One barrier phase: RESTORE_UNICAST on the formerly PREPARED (and LOADED).
        4b. Multicast (a capture that ran PREPARE_MULTICAST): an ACTIVE shim that still holds
           multicast state while a peer released its objects runs PREPARE_MULTICAST first (one
           team is rebuilt, never a split one); then RESTORE_MULTICAST_CREATORS, _IMPORTERS,
           _DEVICES, _BINDINGS, each a barrier phase sent to the shims in its source phase
           (MULTICAST_RELEASED, _CREATED, _IMPORTED, _DEVICES).
        5. INSPECT: every shim ACTIVE, records equal to ``capture_or_records`` (modulo
           topology.COMPARE_IGNORED), else TopologyError.

        A phase with nobody to ask is skipped (all ACTIVE: only the two INSPECTs run).
        Raises PhaseError from any failing phase (``changed`` True; stop there, no retry).
        """
        if isinstance(capture_or_records, Capture):
            records = capture_or_records.records
            self.txn_floor = max(self.txn_floor, capture_or_records.last_txn_id)
        else:
            records = {int(p): list(rs) for p, rs in capture_or_records.items()}
        missing = [pid for pid in self.pids if pid not in records]
        if missing:
            raise ValueError(f"rollback: no captured records for participant pid {missing[0]}")
        start = len(self.phases)
        found, now = self._rollback_inspect()
        found_first = {pid: _name(Phase, ph) for pid, ph in found.items()}

        # step 2: SAVED importers of an allocation whose creator already tore it down
        torn = {Phase.PREPARED, Phase.LOADED}
        forward: list[int] = []
        changed = True
        while changed:
            changed = False
            for pid in self.pids:
                if found[pid] in torn:
                    continue
                # a mapping or a held handle of the creator's old allocation
                stale = sorted((r for r in now[pid] if int(r.role) == Role.IMPORTER
                                and int(r.kind) in (RecordKind.MAPPING, RecordKind.ALLOCATION)
                                and found.get(int(r.creator_pid)) in torn),
                               key=lambda r: int(r.kind) != RecordKind.MAPPING)
                if not stale:
                    continue
                stale = stale[0]
                if found[pid] != Phase.SAVED:
                    where = (f"maps allocation {stale.alloc_id_hex} at va {stale.va:#x}"
                             if int(stale.kind) == RecordKind.MAPPING else
                             f"holds allocation {stale.alloc_id_hex}")
                    raise PhaseError(
                        f"rollback: pid {pid} is {found[pid].name} and still {where}, whose "
                        f"creator pid "
                        f"{stale.creator_pid} is {found[int(stale.creator_pid)].name} (already "
                        "torn down): rebuilding the creator would split the sharing; nothing "
                        "was sent", phase="rollback", pid=pid, status=None, cuda_result=0,
                        message="stale importer", failures=[], changed=True)
                forward.append(pid)
                found[pid] = Phase.PREPARED
                changed = True
        if forward:
            self._run_plan({pid: (Op.PREPARE_UNICAST, Phase.SAVED) for pid in forward},
                           changed_before=True)
        original = dict(found)
        # the multicast teardown is all-or-nothing: once any shim released its objects, an
        # ACTIVE one still holding multicast state releases too, so the rebuild recreates one team
        mc_torn = [pid for pid in self.pids if found[pid] != Phase.ACTIVE
                   and (found[pid] in _MC_PHASES or any(int(r.kind) == RecordKind.MULTICAST
                                                        for r in records.get(pid, [])))]
        if mc_torn and topology.has_multicast(records):
            stay = [pid for pid in self.pids if found[pid] == Phase.ACTIVE
                    and topology.has_multicast({pid: now.get(pid, [])})]
            if stay:
                res, _ = self._run_plan({pid: (Op.PREPARE_MULTICAST, Phase.ACTIVE)
                                         for pid in stay}, changed_before=True)
                for pid in stay:
                    found[pid] = original[pid] = Phase(res.participants[pid].phase)
        cur = dict(found)

        plan = {}
        for pid in self.pids:
            if original[pid] == Phase.SAVED:
                plan[pid] = (Op.CANCEL_CAPTURE, Phase.SAVED)
            elif original[pid] == Phase.PREPARED:
                plan[pid] = (Op.LOAD_ALLOCATIONS, Phase.PREPARED)
        if plan:
            res, _ = self._run_plan(plan, changed_before=True)
            cur.update({pid: Phase(r.phase) for pid, r in res.participants.items()})
        plan = {pid: (Op.RESTORE_UNICAST, Phase.LOADED) for pid in self.pids
                if original[pid] in torn}
        if plan:
            res, _ = self._run_plan(plan, changed_before=True)
            cur.update({pid: Phase(r.phase) for pid, r in res.participants.items()})
        # multicast rebuild: each op to the shims in its source phase, in order
        for op, src in MULTICAST_RESTORE_OPS:
            plan = {pid: (op, src) for pid in self.pids if cur[pid] == src}
            if plan:
                res, _ = self._run_plan(plan, changed_before=True)
                cur.update({pid: Phase(r.phase) for pid, r in res.participants.items()})
        after = self._inspect(Phase.ACTIVE, True, changed_before=True)
        topology.compare(records, after)
        return RollbackResult(found=found_first, phases=self.phases[start:], records=after)

    def _rollback_inspect(self) -> tuple[dict[int, Phase], dict[int, list[Record]]]:
        """INSPECT every participant; returns (pid -> Phase, pid -> records). Raises PhaseError
        naming the first participant that is FAILED, silent, or in an unknown phase."""
        try:
            res, records = self._run(Op.INSPECT, Phase.ACTIVE, changed_before=True)
            results = dict(res.participants)
        except PhaseError as e:
            results, records = dict(e.result.participants), dict(e.records or {})
            # a shim that checks INSPECT's expected phase: ask again with the phase it reported
            again = {r.pid: (Op.INSPECT, Phase(r.phase)) for r in e.failures
                     if r.error is None and r.status == Status.REFUSED_PHASE
                     and r.phase in Phase._value2member_map_ and r.phase != Phase.FAILED}
            if again:
                try:
                    res2, rec2 = self._run_plan(again, changed_before=True)
                    results.update(res2.participants)
                    records.update(rec2)
                except PhaseError as e2:
                    results.update(e2.result.participants)
        found: dict[int, Phase] = {}
        for pid in self.pids:
            r = results[pid]
            if r.error is not None:
                raise self._rollback_refusal(pid, r, f"did not answer INSPECT ({r.error}); its "
                                             "phase is unknown")
            if r.phase == Phase.FAILED:
                why = f": {r.message.strip()}" if r.message.strip() else ""
                raise self._rollback_refusal(pid, r, f"is FAILED (a destructive op failed "
                                             f"part-way){why}; it cannot be brought back to "
                                             "ACTIVE")
            if not r.ok or r.phase not in (Phase.ACTIVE, Phase.SAVED, Phase.PREPARED,
                                           Phase.LOADED, *_MC_PHASES):
                raise self._rollback_refusal(pid, r, f"answered INSPECT with status "
                                             f"{_name(Status, r.status)} in phase "
                                             f"{_name(Phase, r.phase)}")
            found[pid] = Phase(r.phase)
        return found, records

    @staticmethod
    def _rollback_refusal(pid: int, r: ParticipantResult, why: str) -> PhaseError:
        return PhaseError(f"rollback: pid {pid} {why}; nothing was rolled back (fail-stop)",
                          phase="rollback", pid=pid, status=r.status,
                          cuda_result=r.cuda_result, message=r.message or (r.error or ""),
                          failures=[r], changed=True)

    # --- helpers --------------------------------------------------------------------------------
    @staticmethod
    def _merge_carriers(records: dict[int, list[Record]],
                        after: dict[int, list[Record]]) -> dict[int, list[Record]]:
        """Copy the carrier fields of the post-PREPARE INSPECT into the captured creator
        allocation records; raise PhaseError if a creator's bytes are not carried."""
        merged: dict[int, list[Record]] = {}
        for pid, rs in records.items():
            carried = {bytes(r.alloc_id): r for r in after.get(pid, [])
                       if int(r.kind) == RecordKind.ALLOCATION}
            out = []
            for r in rs:
                if int(r.kind) == RecordKind.ALLOCATION and int(r.role) == Role.CREATOR:
                    a = carried.get(bytes(r.alloc_id))
                    if a is None or not (a.flags & RecordFlag.CARRIED):
                        raise PhaseError(
                            f"SAVE_ALLOCATIONS: pid {pid} allocation {r.alloc_id_hex} is not "
                            "held in a host carrier after PREPARE_UNICAST",
                            phase="SAVE_ALLOCATIONS",
                            pid=pid, status=None, cuda_result=0, message="not carried",
                            failures=[], changed=True)
                    r = r.replace(flags=int(r.flags) | RecordFlag.CARRIED,
                                  carrier_checksum=a.carrier_checksum,
                                  carrier_bytes=a.carrier_bytes)
                out.append(r)
            merged[pid] = out
        return merged

    @staticmethod
    def _check_carriers(capture: Capture, before: dict[int, list[Record]]) -> None:
        """Every carrier of the capture is still held, with the same checksum and size."""
        for c in capture.carriers:
            pid, aid = c["pid"], c["alloc_id"]
            now = next((r for r in before.get(pid, [])
                        if int(r.kind) == RecordKind.ALLOCATION and r.alloc_id_hex == aid), None)
            problem = None
            if now is None or not (now.flags & RecordFlag.CARRIED):
                problem = "is no longer held in its host carrier"
            elif f"{now.carrier_checksum:016x}" != c["checksum"] or now.carrier_bytes != c["bytes"]:
                problem = (f"carrier checksum {now.carrier_checksum:016x} ({now.carrier_bytes} "
                           f"bytes) differs from the captured {c['checksum']} ({c['bytes']} "
                           "bytes)")
            if problem:
                raise PhaseError(f"INSPECT: pid {pid} allocation {aid} {problem}; restore "
                                 "refused, nothing was changed", phase="INSPECT", pid=pid,
                                 status=None, cuda_result=0, message=problem, failures=[],
                                 changed=False)

    def _emit(self, event: PhaseEvent) -> None:
        if self.on_event is None:
            return
        try:
            self.on_event(event)
        except Exception:  # a progress display must not break a barrier
            log.exception("on_event callback failed")

    def _one(self, pid: int, op: Op, txn_id: int, expected_phase: Phase, timeout_s: float
             ) -> tuple[ParticipantResult, list[Record]]:
        t0 = time.monotonic_ns()
        try:
            resp = self._clients[pid].request(op, txn_id=txn_id, expected_phase=expected_phase,
                                              timeout_s=timeout_s)
        except ShimClientError as e:
            return ParticipantResult(pid=pid, wall_ns=time.monotonic_ns() - t0,
                                     error=str(e)), []
        resp.close()
        y = resp.reply
        r = ParticipantResult(pid=pid, status=y.status, phase=y.phase, bytes=y.bytes,
                              elapsed_ns=y.elapsed_ns, copy_ns=y.copy_ns,
                              records_changed=y.records_changed, cuda_result=y.cuda_result,
                              message=resp.message, record_count=y.record_count,
                              wall_ns=time.monotonic_ns() - t0)
        if y.pid and y.pid != pid and r.status == Status.OK:
            r.error = (f"{op.name}: pid {pid}: reply comes from pid {y.pid} (socket "
                       f"{self._clients[pid].socket_path})")
        return r, resp.records

    def _run(self, op: Op, expected_phase: Phase, *, changed_before: bool
             ) -> tuple[PhaseResult, dict[int, list[Record]]]:
        """Send ``op`` to every participant at once; wait for all (the barrier)."""
        return self._run_plan({p.pid: (op, expected_phase) for p in self.participants},
                              changed_before=changed_before)

    def _run_plan(self, plan: Mapping[int, tuple[Op, Phase]], *, changed_before: bool
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
        res = PhaseResult(phase=name, txn_id=txn, expected_phase=expected, wall_ns=0)
        records: dict[int, list[Record]] = {}
        t0 = time.monotonic_ns()
        with ThreadPoolExecutor(max_workers=total,
                                thread_name_prefix=f"cui-{name.lower()[:40]}") as pool:
            futs = []
            for pid in pids:
                op, exp = plan[pid]
                timeout = self.carrier_timeout_s if op in CARRIER_OPS else self.timeout_s
                futs.append(pool.submit(self._one, pid, op, txn, exp, timeout))
            for fut in as_completed(futs):
                r, recs = fut.result()
                res.participants[r.pid] = r
                records[r.pid] = recs
                self._emit(PhaseEvent("reply", name, txn, len(res.participants), total,
                                      pid=r.pid, result=r, ok=r.ok))
        res.wall_ns = time.monotonic_ns() - t0
        res.participants = {pid: res.participants[pid] for pid in pids}
        records = {pid: records[pid] for pid in pids}
        self.phases.append(res)
        failures = [r for r in res.participants.values() if not r.ok]
        self._emit(PhaseEvent("phase", name, txn, total, total, phase_result=res,
                              ok=not failures))
        if failures:
            first = failures[0]
            refusal_only = all(f.error is None and f.status in Status._value2member_map_
                               and Status(f.status).is_refusal for f in failures)
            mutating = any(plan[pid][0] in MUTATING_OPS for pid in pids)
            changed = changed_before or (mutating and
                                         not (refusal_only and len(failures) == total))
            first_op = plan[first.pid][0].name
            text = _failure_text(first_op, first)
            if not changed:
                text += "; nothing was changed"
            if len(failures) > 1:
                text += f" (and {len(failures) - 1} more: pids " + \
                        ", ".join(str(f.pid) for f in failures[1:]) + ")"
            err = PhaseError(text, phase=first_op, pid=first.pid, status=first.status,
                             cuda_result=first.cuda_result,
                             message=first.message or (first.error or ""), failures=failures,
                             changed=changed, result=res)
            err.records = records
            raise err
        return res, records
