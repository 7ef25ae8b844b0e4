"""The coordinator's data: participants, per-phase results, progress events, PhaseError, and the
Capture / RestoreResult / RollbackResult that :class:`~cuinterpose.coordinator.phases.Coordinator`
returns (docs/coordinator.md "Results and events").
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from .errors import CoordinatorError
from .protocol import CUI_PROTO_VERSION, Op, Phase, Record, Status, cuda_result_name, socket_path

__all__ = [
    "Participant",
    "ParticipantResult",
    "PhaseResult",
    "PhaseEvent",
    "PhaseError",
    "failure_text",
    "enum_name",
    "Capture",
    "RestoreResult",
    "RollbackResult",
    "CAPTURE_FORMAT",
]

#: Version of the dict written by :meth:`Capture.to_dict`.
CAPTURE_FORMAT = 1


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


def enum_name(enum_cls, value) -> str | None:
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
    request's round trip seen by the coordinator; ``direct_bytes`` (SAVE_ALLOCATIONS,
    ``reply.reserved[3]``): the chunk bytes the shim wrote with O_DIRECT;
    ``staging_pinned_bytes`` / ``staging_pin_result`` (SAVE_ALLOCATIONS and LOAD_ALLOCATIONS,
    ``reply.reserved[4]`` / ``[5]``): the bytes of the shim's staging ring that
    ``cuMemHostRegister`` page-locked (0: none, or the process carried nothing), and that call's
    CUresult when it failed (0 otherwise; the ring then stays pageable and the copies run at
    pageable speed); ``shim_flags``: the reply's ``ShimFlag`` bits.
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
    direct_bytes: int = 0
    shim_flags: int = 0
    staging_pinned_bytes: int = 0
    staging_pin_result: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == Status.OK

    def to_dict(self) -> dict:
        return {
            "pid": self.pid,
            "status": enum_name(Status, self.status),
            "phase": enum_name(Phase, self.phase),
            "bytes": self.bytes,
            "elapsed_ns": self.elapsed_ns,
            "copy_ns": self.copy_ns,
            "records_changed": self.records_changed,
            "cuda_result": self.cuda_result,
            "message": self.message,
            "record_count": self.record_count,
            "wall_ns": self.wall_ns,
            "error": self.error,
            "direct_bytes": self.direct_bytes,
            "shim_flags": self.shim_flags,
            "staging_pinned_bytes": self.staging_pinned_bytes,
            "staging_pin_result": self.staging_pin_result,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "ParticipantResult":
        def code(enum_cls, v):
            if v is None:
                return None
            return enum_cls[v] if isinstance(v, str) and v in enum_cls.__members__ else int(v)

        return cls(
            pid=int(d["pid"]),
            status=code(Status, d.get("status")),
            phase=code(Phase, d.get("phase")),
            bytes=int(d.get("bytes", 0)),
            elapsed_ns=int(d.get("elapsed_ns", 0)),
            copy_ns=int(d.get("copy_ns", 0)),
            records_changed=int(d.get("records_changed", 0)),
            cuda_result=int(d.get("cuda_result", 0)),
            message=d.get("message", ""),
            record_count=int(d.get("record_count", 0)),
            wall_ns=int(d.get("wall_ns", 0)),
            error=d.get("error"),
            direct_bytes=int(d.get("direct_bytes", 0)),
            shim_flags=int(d.get("shim_flags", 0)),
            staging_pinned_bytes=int(d.get("staging_pinned_bytes", 0)),
            staging_pin_result=int(d.get("staging_pin_result", 0)),
        )


@dataclass
class PhaseResult:
    """One phase across all participants. ``wall_ns``: send to last reply (the barrier).

    Also a row of the coordinator's own work between barriers (``validate``, ``check
    carriers``, ``compare``, ``remove chunks``): no participants, txn id 0, ``wall_ns`` the
    work's time and ``detail`` what it walked (e.g. "4002 records of 2 pids")."""

    phase: str
    txn_id: int
    expected_phase: int
    wall_ns: int
    participants: dict[int, ParticipantResult] = field(default_factory=dict)
    detail: str = ""

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

    @property
    def direct_bytes(self) -> int:
        """Chunk bytes all participants wrote with O_DIRECT (SAVE_ALLOCATIONS)."""
        return sum(p.direct_bytes for p in self.participants.values())

    @property
    def pageable_staging(self) -> dict[int, str]:
        """pid -> the CUresult name of each participant whose staging ring could not be
        page-locked (SAVE_ALLOCATIONS, LOAD_ALLOCATIONS): its copies ran at pageable speed."""
        return {
            pid: cuda_result_name(p.staging_pin_result)
            for pid, p in sorted(self.participants.items())
            if p.staging_pin_result
        }

    def to_dict(self) -> dict:
        return {
            "phase": self.phase,
            "txn_id": self.txn_id,
            "expected_phase": enum_name(Phase, self.expected_phase),
            "wall_ns": self.wall_ns,
            "bytes": self.bytes,
            "copy_ns": self.copy_ns,
            "records_changed": self.records_changed,
            "direct_bytes": self.direct_bytes,
            "participants": [p.to_dict() for _, p in sorted(self.participants.items())],
        }

    @classmethod
    def from_dict(cls, d: dict) -> "PhaseResult":
        ep = d.get("expected_phase", 0)
        ep = Phase[ep] if isinstance(ep, str) and ep in Phase.__members__ else int(ep)
        parts = [ParticipantResult.from_dict(p) for p in d.get("participants", [])]
        return cls(
            phase=d["phase"],
            txn_id=int(d["txn_id"]),
            expected_phase=ep,
            wall_ns=int(d.get("wall_ns", 0)),
            participants={p.pid: p for p in parts},
        )


@dataclass(frozen=True)
class PhaseEvent:
    """Progress notification passed to ``on_event``.

    ``kind`` is ``"reply"`` (one participant answered; ``pid`` and ``result`` set),
    ``"phase"`` (the phase finished for everyone, ``ok`` False if it failed; ``result`` None,
    ``phase_result`` set) or ``"wait"`` (a rollback waits for ``pid``, whose INSPECT says a
    mutating op is still running there: coordinator/rollback.py). ``done``/``total``: replies
    so far / participants.
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

    def __init__(
        self,
        text: str,
        *,
        phase: str,
        pid: int | None,
        status: int | None,
        cuda_result: int,
        message: str,
        failures: list[ParticipantResult],
        changed: bool,
        result: PhaseResult | None = None,
    ):
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


def failure_text(phase: str, r: ParticipantResult) -> str:
    """One line naming phase, pid and cause. Shim messages that already start with
    "<PHASE>: pid <n>" (the shim's own style) are used as they are."""
    if r.error is not None:
        return r.error if r.error.startswith(phase) else f"{phase}: {r.error}"
    status = enum_name(Status, r.status)
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
    ``chunks``: the chunk files of the carriers (issue 12 chunk format): ``{"chunk_bytes",
    "checksum": "sha256" or "blake2b-256", "direct_bytes", "streams": [stream record]}``
    (CarrierFiles.streams_json; decisions D35, D36).
    """

    participants: list[Participant]
    records: dict[int, list[Record]]
    phases: list[PhaseResult] = field(default_factory=list)
    carriers: list[dict] = field(default_factory=list)
    last_txn_id: int = 0
    chunks: dict = field(default_factory=dict)
    #: the coordinator's own rows (validate, check carriers); not in :meth:`to_dict`
    steps: list[PhaseResult] = field(default_factory=list)

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
            "format": CAPTURE_FORMAT,
            "protocol_version": CUI_PROTO_VERSION,
            "participants": [
                {**p.to_dict(), "records": [r.to_dict() for r in self.records.get(p.pid, [])]}
                for p in self.participants
            ],
            "phases": [p.to_dict() for p in self.phases],
            "carriers": [dict(c) for c in self.carriers],
            "carrier_bytes": self.carrier_bytes,
            "last_txn_id": self.last_txn_id,
            "chunks": self.chunks,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Capture":
        """Inverse of :meth:`to_dict`. Raises ValueError on an unknown format or protocol."""
        fmt = d.get("format")
        if fmt != CAPTURE_FORMAT:
            raise ValueError(f"capture format {fmt!r} is not supported (expected {CAPTURE_FORMAT})")
        if d.get("protocol_version") != CUI_PROTO_VERSION:
            raise ValueError(
                f"capture was taken with protocol version "
                f"{d.get('protocol_version')!r}; this coordinator speaks "
                f"{CUI_PROTO_VERSION}"
            )
        parts = [Participant(int(p["pid"]), p["socket_path"]) for p in d["participants"]]
        records = {
            int(p["pid"]): [Record.from_dict(r) for r in p.get("records", [])]
            for p in d["participants"]
        }
        return cls(
            participants=parts,
            records=records,
            phases=[PhaseResult.from_dict(p) for p in d.get("phases", [])],
            carriers=[dict(c) for c in d.get("carriers", [])],
            last_txn_id=int(d.get("last_txn_id", 0)),
            chunks=dict(d.get("chunks", {})),
        )


@dataclass
class RestoreResult:
    """What restore() did: ``phases`` run and the final INSPECT ``records`` (equal to the
    capture modulo topology.COMPARE_IGNORED)."""

    phases: list[PhaseResult]
    records: dict[int, list[Record]]
    #: the coordinator's own rows (check carriers, compare, remove chunks)
    steps: list[PhaseResult] = field(default_factory=list)

    @property
    def carrier_bytes(self) -> int:
        return sum(p.bytes for p in self.phases if p.phase == Op.LOAD_ALLOCATIONS.name)

    def phase(self, name: str) -> PhaseResult | None:
        for p in reversed(self.phases):
            if p.phase == name:
                return p
        return None

    def to_dict(self) -> dict:
        return {
            "phases": [p.to_dict() for p in self.phases],
            "records": {
                str(pid): [r.to_dict() for r in rs] for pid, rs in sorted(self.records.items())
            },
        }


@dataclass
class RollbackResult:
    """What rollback() did: ``found`` (pid -> the shim phase name found by the first INSPECT),
    ``phases`` run (the INSPECTs included) and the final INSPECT ``records`` (every shim
    ACTIVE, equal to the capture modulo topology.COMPARE_IGNORED)."""

    found: dict[int, str]
    phases: list[PhaseResult]
    records: dict[int, list[Record]]

    def to_dict(self) -> dict:
        return {
            "found": {str(p): ph for p, ph in sorted(self.found.items())},
            "phases": [p.to_dict() for p in self.phases],
        }
