"""The coordinator: capture, restore and rollback across every participant, one barrier per phase.

Capture:  INSPECT -> validate -> [PREPARE_MULTICAST] -> SAVE_ALLOCATIONS -> PREPARE_UNICAST
          -> INSPECT (carriers)
Restore:  INSPECT (all PREPARED, carriers intact) -> LOAD_ALLOCATIONS -> RESTORE_UNICAST
          -> [RESTORE_MULTICAST_CREATORS -> _IMPORTERS -> _DEVICES -> _BINDINGS]
          -> INSPECT (must equal the capture, see topology.COMPARE_IGNORED)
Rollback: see rollback.py.

The bracketed multicast phases run only when some participant reported a multicast record
(topology.has_multicast). The barrier runner is barrier.py, the results and PhaseError are
results.py; sequences, failure semantics and results are described in docs/coordinator.md.
"""

from __future__ import annotations

import logging
from typing import Iterable, Mapping

from . import topology
from .barrier import Barrier
from .carrierfiles import CarrierFiles, streams_of
from .protocol import (
    DEFAULT_CHUNK_CHECKSUM,
    MULTICAST_RESTORE_OPS,
    Op,
    Phase,
    Record,
    RecordFlag,
    RecordKind,
    Role,
    ShimFlag,
)
from .results import Capture, Participant, PhaseError, PhaseResult, RestoreResult, RollbackResult
from .rollback import rollback
from .topology import TopologyError

__all__ = ["Coordinator", "Participant", "Capture", "PhaseError", "TopologyError"]

log = logging.getLogger(__name__)

# plain ints: a record's fields compare with them without an enum operator per record
_ALLOCATION, _CREATOR = int(RecordKind.ALLOCATION), int(Role.CREATOR)
_CARRIED = int(RecordFlag.CARRIED)


def _records_text(records: dict[int, list[Record]]) -> str:
    """``"4002 records of 2 pids"``: the detail of a row that walked ``records``."""
    return f"{sum(map(len, records.values()))} records of {len(records)} pids"


class Coordinator(Barrier):
    """Runs phases across ``participants`` (list of :class:`Participant`, unique pids).

    ``timeout_s``: deadline of one request (seconds); ``carrier_timeout_s``: the deadline for
    the byte-copy ops SAVE_ALLOCATIONS and LOAD_ALLOCATIONS; ``carriers``: the
    :class:`~cuinterpose.coordinator.carrierfiles.CarrierFiles` those ops write and read (None:
    a private directory, removed after a restore or rollback); ``on_event``: called with a
    :class:`~cuinterpose.coordinator.results.PhaseEvent` per participant reply and per phase
    completion, from the calling thread (exceptions it raises are logged and ignored).
    """

    # --- read-only --------------------------------------------------------------------------
    def inspect(
        self, *, expected_phase: Phase = Phase.ACTIVE, check_phase: bool = False
    ) -> dict[int, list[Record]]:
        """INSPECT every participant concurrently; returns pid -> records. Read-only.

        ``expected_phase`` is sent as the request's expected phase (the shim accepts INSPECT
        in every phase except FAILED). With ``check_phase`` a participant whose reply phase
        differs raises :class:`PhaseError` (``changed`` False).
        Raises PhaseError on a refusal, failure or timeout.
        """
        return self._inspect(expected_phase, check_phase, changed_before=False)

    def validate(
        self, records_by_pid: Mapping[int, Iterable[Record]] | None = None
    ) -> dict[int, list[Record]]:
        """Check the topology (topology.validate rules) of ``records_by_pid``, or of a fresh
        :meth:`inspect` when None. Returns the records checked. Raises TopologyError naming
        pid and allocation, or PhaseError from the INSPECT; nothing is changed either way."""
        if records_by_pid is None:
            records_by_pid = self.inspect(check_phase=True)
        records = {int(p): list(rs) for p, rs in records_by_pid.items()}
        missing = [pid for pid in self.pids if pid not in records]
        if missing:
            raise TopologyError(
                f"pid {missing[0]} is a participant but reported no records", pid=missing[0]
            )
        topology.validate(records, participants=self.pids)
        return records

    # --- one function per phase ---------------------------------------------------------------
    def prepare_multicast(self) -> PhaseResult:
        """PREPARE_MULTICAST (ACTIVE -> MULTICAST_RELEASED): unmap multicast VAs, unbind,
        close cached export FDs, release the objects. Refused by every shim: nothing changed."""
        return self._run(Op.PREPARE_MULTICAST, Phase.ACTIVE, changed_before=False)[0]

    def save_allocations(
        self, expected_phase: Phase = Phase.ACTIVE, *, changed_before: bool = False
    ) -> PhaseResult:
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
        """INSPECT -> validate -> SAVE_ALLOCATIONS -> PREPARE_UNICAST -> INSPECT -> check carriers.

        Returns the :class:`Capture`. Raises PhaseError/TopologyError with ``changed`` False
        (nothing changed) up to validation; PhaseError (``capture`` attribute: the partial
        Capture) from the mutating phases on, or if a creator's bytes were not carried. Any
        other exception raised after validation (a KeyboardInterrupt, a bug) carries the same
        ``capture`` attribute: SAVE_ALLOCATIONS may have gone out, so roll back with it.
        The coordinator's own work between the barriers is timed in the rows ``validate`` and
        ``check carriers`` (:attr:`Capture.steps`, and "phase" events).
        """
        start, first_step = len(self.phases), len(self.steps)
        inspected = self.inspect(check_phase=True)
        with self._step("validate") as row:
            self._fit_checksum(self.phases[start])
            records = self.validate(inspected)
            self.carried = streams_of(records)
            multicast = topology.has_multicast(records)
            row.detail = _records_text(records)
        cap = Capture(participants=list(self.participants), records=records)
        save = None
        try:
            if multicast:
                # outer objects first: no unicast mapping goes while a binding on it exists
                self.prepare_multicast()
                save = self.save_allocations(Phase.MULTICAST_RELEASED, changed_before=True)
            else:
                save = self.save_allocations()
            self.prepare_unicast()
            after = self._inspect(Phase.PREPARED, True, changed_before=True)
            with self._step("check carriers") as row:
                cap.chunks = self._chunks_json(save)
                cap.records = self._merge_carriers(records, after)
                self._check_tables(cap.records)
                cap.carriers = topology.carriers(cap.records)
                row.detail = f"{len(cap.carriers)} carriers"
        except BaseException as e:
            # whatever stopped the capture here (a PhaseError, a bug, Ctrl-C), SAVE_ALLOCATIONS
            # may have gone out: hand the caller the partial capture so it can roll back
            if save is not None and not cap.chunks:
                cap.chunks = self._chunks_json(save)
            cap.phases, cap.steps = self.phases[start:], self.steps[first_step:]
            cap.last_txn_id = self.last_txn_id
            try:
                e.capture = cap
            except AttributeError:
                pass
            raise
        cap.phases, cap.steps = self.phases[start:], self.steps[first_step:]
        cap.last_txn_id = self.last_txn_id
        return cap

    def restore(self, capture: Capture, device_map: dict[str, str] | None = None) -> RestoreResult:
        """INSPECT (every shim PREPARED) -> check carriers (as captured) -> LOAD_ALLOCATIONS ->
        RESTORE_UNICAST -> INSPECT -> compare (equal to ``capture.records`` modulo
        topology.COMPARE_IGNORED).

        Raises ValueError if the participants differ from the capture's; PhaseError (nothing
        changed) if a shim is not PREPARED or a carrier checksum differs; PhaseError from a
        mutating phase (stop there, no retry); TopologyError naming pid and object when the
        final INSPECT differs from the capture (its DEVICE records under ``device_map``, {old
        GPU UUID: new}: topology.compare). The coordinator's own work is timed in the rows
        ``check carriers``, ``compare`` and, for a private chunk directory, ``remove chunks``
        (:attr:`RestoreResult.steps`, and "phase" events).
        """
        want = sorted(p.pid for p in capture.participants)
        if sorted(self.pids) != want:
            raise ValueError(
                f"restore: participants {sorted(self.pids)} differ from the captured {want}"
            )
        self.txn_floor = max(self.txn_floor, capture.last_txn_id)
        start, first_step = len(self.phases), len(self.steps)
        before = self.inspect(expected_phase=Phase.PREPARED, check_phase=True)
        with self._step("check carriers") as row:
            self.carried = streams_of(capture.records)
            self._adopt_files(capture)
            self._check_carriers(capture, before)
            multicast = topology.has_multicast(capture.records)
            row.detail = f"{len(capture.carriers)} carriers"
        self.load_allocations()
        self._drop_private()
        self.restore_unicast()
        if multicast:
            self.restore_multicast()
        after = self._inspect(Phase.ACTIVE, True, changed_before=True)
        with self._step("compare") as row:
            topology.compare(capture.records, after, device_map=device_map)
            row.detail = _records_text(after)
        return RestoreResult(
            phases=self.phases[start:], records=after, steps=self.steps[first_step:]
        )

    def rollback(
        self,
        capture_or_records: "Capture | Mapping[int, Iterable[Record]]",
        device_map: dict[str, str] | None = None,
    ) -> RollbackResult:
        """Bring every participant of a failed or abandoned capture back to ACTIVE.

        ``capture_or_records``: the :class:`Capture` (also the partial one on
        ``PhaseError.capture``) or pid -> the records of the capture's first INSPECT. Steps in
        docs/coordinator.md "Rollback"; a FAILED or silent participant raises PhaseError
        before anything is sent (fail-stop). Raises PhaseError from any failing phase
        (``changed`` True; stop there, no retry). ``device_map`` ({old GPU UUID: new}): the
        final compare's, for the rollback that finishes a restore onto other GPUs (an agent
        that died mid-restore, docs/agent.md).
        """
        if isinstance(capture_or_records, Capture):
            self._adopt_files(capture_or_records)
        result = rollback(self, capture_or_records, device_map=device_map)
        self._drop_private()
        return result

    def survivors(self, gone) -> "Coordinator":
        """A coordinator of the participants but ``gone`` (processes of the job that died
        during a checkpoint), with this one's timeouts, ``on_event``, chunk files and claim and
        its txn ids as the floor: what the agent rolls back of a job that lost a process."""
        gone = set(gone)
        out = Coordinator(
            [p for p in self.participants if p.pid not in gone],
            timeout_s=self.timeout_s,
            carrier_timeout_s=self.carrier_timeout_s,
            on_event=self.on_event,
            carriers=self.carriers,
            claim=self.claim,
        )
        out.txn_floor = max(self.txn_floor, self.last_txn_id)
        return out

    # --- helpers --------------------------------------------------------------------------------
    def _fit_checksum(self, inspect: PhaseResult) -> None:
        """A capture asked for SHA-256 chunks (decisions D36) whose INSPECT replies show a shim
        without ``ShimFlag.CARRY_SHA256`` (loaded before D36: it would refuse the flag) uses
        BLAKE2b-256 instead, and no chunk store digests (they are SHA-256 ones). A shim without
        ``ShimFlag.CARRY_STREAMED`` (before D70) gets its SAVE's files opened before the request
        (:attr:`unstreamed`)."""
        files = self.carrier_files()
        self.unstreamed = {  # their SAVE opens its files first (decisions D70)
            p.pid
            for p in inspect.participants.values()
            if not p.shim_flags & ShimFlag.CARRY_STREAMED
        }
        old = sorted(
            p.pid for p in inspect.participants.values() if not p.shim_flags & ShimFlag.CARRY_SHA256
        )
        if files.checksum != DEFAULT_CHUNK_CHECKSUM and old:
            log.info(
                "chunk checksum %s -> %s: the shim of pid %s predates it",
                files.checksum,
                DEFAULT_CHUNK_CHECKSUM,
                old[0],
            )
            files.checksum = DEFAULT_CHUNK_CHECKSUM
            if files.known is not None:
                files.known = {}

    def _chunks_json(self, save: PhaseResult) -> dict:
        """The capture's ``chunks`` object (issue 12 chunk format) from the SAVE replies
        (``save``); ``direct_bytes``: the chunk bytes the shims wrote with O_DIRECT."""
        files = self.carrier_files()
        out = {
            "chunk_bytes": files.chunk_bytes,
            "checksum": files.checksum,
            "direct_bytes": save.direct_bytes,
            "streams": files.streams_json(),
            "directory": files.directory,  # where this capture's files are (not in a manifest)
            "private": files.owned,
        }
        if files.store is not None:  # a chunk store: what this capture wrote of its chunks
            out["store"] = files.store
            out["written_bytes"] = files.written_bytes()
        return out

    def _adopt_files(self, capture: Capture) -> None:
        """Without ``carriers``, read the chunk files where ``capture`` wrote them."""
        if self.carriers is None and capture.chunks.get("directory"):
            self.carriers = CarrierFiles(
                capture.chunks["directory"],
                chunk_bytes=capture.chunks["chunk_bytes"],
                owned=bool(capture.chunks.get("private")),
                checksum=capture.chunks.get("checksum", DEFAULT_CHUNK_CHECKSUM),
            )

    def _drop_private(self) -> None:
        """Remove a private chunk directory once the shims loaded (or dropped) their bytes
        (row ``remove chunks``)."""
        if self.carriers is not None and self.carriers.owned:
            with self._step("remove chunks"):
                self.carriers.remove()

    def _check_tables(self, records: dict[int, list[Record]]) -> None:
        """Each SAVE reply's chunk table agrees with the carrier record the shim reports
        (carrier_bytes, carrier_checksum = cui_checksum64 of the digests); PhaseError else."""
        tables = self.carrier_files().tables
        for pid, rs in records.items():
            for r in rs:
                if not (r.kind == _ALLOCATION and r.flags & _CARRIED):
                    continue
                t = tables.get((pid, r.alloc_id_hex))
                if t is not None and (
                    t.bytes == r.carrier_bytes and t.carrier_checksum == r.carrier_checksum
                ):
                    continue
                raise PhaseError(
                    f"SAVE_ALLOCATIONS: pid {pid} allocation {r.alloc_id_hex}: the chunk table of "
                    f"the reply does not match the carrier record (carrier_checksum "
                    f"{r.carrier_checksum:016x}, {r.carrier_bytes} bytes)",
                    phase=Op.SAVE_ALLOCATIONS.name,
                    pid=pid,
                    status=None,
                    cuda_result=0,
                    message="chunk table mismatch",
                    failures=[],
                    changed=True,
                )

    @staticmethod
    def _merge_carriers(
        records: dict[int, list[Record]], after: dict[int, list[Record]]
    ) -> dict[int, list[Record]]:
        """Copy the carrier fields of the post-PREPARE INSPECT into the captured creator
        allocation records; raise PhaseError if a creator's bytes are not carried."""
        merged: dict[int, list[Record]] = {}
        for pid, rs in records.items():
            carried = {bytes(r.alloc_id): r for r in after.get(pid, []) if r.kind == _ALLOCATION}
            out = []
            for r in rs:
                if r.kind == _ALLOCATION and r.role == _CREATOR:
                    a = carried.get(bytes(r.alloc_id))
                    if a is None or not (a.flags & _CARRIED):
                        raise PhaseError(
                            f"SAVE_ALLOCATIONS: pid {pid} allocation {r.alloc_id_hex} is not "
                            "saved to its chunk file after PREPARE_UNICAST",
                            phase=Op.SAVE_ALLOCATIONS.name,
                            pid=pid,
                            status=None,
                            cuda_result=0,
                            message="not carried",
                            failures=[],
                            changed=True,
                        )
                    r = r.replace(
                        flags=int(r.flags) | _CARRIED,
                        carrier_checksum=a.carrier_checksum,
                        carrier_bytes=a.carrier_bytes,
                    )
                out.append(r)
            merged[pid] = out
        return merged

    @staticmethod
    def _check_carriers(capture: Capture, before: dict[int, list[Record]]) -> None:
        """Every carrier of the capture is still held, with the same checksum and size."""
        held = {
            (pid, r.alloc_id): r for pid, rs in before.items() for r in rs if r.kind == _ALLOCATION
        }
        for c in capture.carriers:
            pid, aid = c["pid"], c["alloc_id"]
            now = held.get((pid, bytes.fromhex(aid)))
            problem = None
            if now is None or not (now.flags & _CARRIED):
                problem = "no longer holds the chunk table of its chunk file"
            elif f"{now.carrier_checksum:016x}" != c["checksum"] or now.carrier_bytes != c["bytes"]:
                problem = (
                    f"carrier checksum {now.carrier_checksum:016x} ({now.carrier_bytes} "
                    f"bytes) differs from the captured {c['checksum']} ({c['bytes']} "
                    "bytes)"
                )
            if problem:
                raise PhaseError(
                    f"INSPECT: pid {pid} allocation {aid} {problem}; restore "
                    "refused, nothing was changed",
                    phase=Op.INSPECT.name,
                    pid=pid,
                    status=None,
                    cuda_result=0,
                    message=problem,
                    failures=[],
                    changed=False,
                )
