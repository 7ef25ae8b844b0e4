"""Coordinator phases against mock shims over real Unix sockets."""

from __future__ import annotations

import gc
import json

import pytest

from cuinterpose.coordinator.barrier import gc_paused, next_txn_id
from cuinterpose.coordinator.carrierfiles import streams_of
from cuinterpose.coordinator.errors import CoordinatorError
from cuinterpose.coordinator.phases import (
    Capture,
    Coordinator,
    Participant,
    PhaseError,
    TopologyError,
)
from cuinterpose.coordinator.protocol import (
    Op,
    Phase,
    RecordFlag,
    RecordKind,
    Role,
    Status,
    cui_checksum64,
)
from cuinterpose.coordinator.results import ParticipantResult, failure_text

from .helpers import BASE, A, MiB, group, group_records

CAPTURE_OPS = ["INSPECT", "SAVE_ALLOCATIONS", "PREPARE_UNICAST", "INSPECT"]
RESTORE_OPS = ["INSPECT", "LOAD_ALLOCATIONS", "RESTORE_UNICAST", "INSPECT"]

#: the mock saves every creator as one all-zero chunk (2 and 4 MiB < 8 MiB): the carrier
#: checksum is cui_checksum64 of one zero digest (protocol.h "Carriers")
ZERO_TABLE_SUM = cui_checksum64(bytes(32))


def _phase_order(g):
    """Ops in the order first received, with each phase's txn id."""
    out = []
    for e in g.log.of("recv"):
        if not out or out[-1][1] != e.txn_id:
            out.append((Op(e.op).name, e.txn_id))
    return out


def _assert_barrier(g):
    """No participant received phase N+1 before every participant replied to phase N."""
    recv, reply = g.log.of("recv"), g.log.of("reply")
    txns = []
    for e in recv:
        if e.txn_id not in txns:
            txns.append(e.txn_id)
    for a, b in zip(txns, txns[1:]):
        replies_a = [e.seq for e in reply if e.txn_id == a]
        recv_b = [e.seq for e in recv if e.txn_id == b]
        assert len(replies_a) == len(g.mocks)
        assert max(replies_a) < min(recv_b)


def test_capture_runs_phases_in_order_with_a_barrier(ctl):
    with group(ctl) as g:
        g.gate(Op.SAVE_ALLOCATIONS, Op.PREPARE_UNICAST)  # succeeds only if sent concurrently
        g.mocks[4119].delay_s[Op.SAVE_ALLOCATIONS] = 0.2  # a slow participant
        cap = Coordinator(g.participants, timeout_s=5).capture()
        assert [name for name, _ in _phase_order(g)] == CAPTURE_OPS
        _assert_barrier(g)
        assert all(m.phase == Phase.PREPARED for m in g.mocks.values())
        # every participant got every phase, one txn per phase
        for pid in g.mocks:
            assert [name for _, name in g.ops_received(pid)] == CAPTURE_OPS
        assert [p.phase for p in cap.phases] == CAPTURE_OPS
        save = cap.phase("SAVE_ALLOCATIONS")
        assert {pid: r.bytes for pid, r in save.participants.items()} == {
            4119: 2 * MiB,
            4121: 4 * MiB,
            4123: 6 * MiB,
        }
        assert save.bytes == 12 * MiB
        assert {r.elapsed_ns for r in save.participants.values()} == {1000}
        assert {r.copy_ns for r in save.participants.values()} == {400}
        assert {pid: r.records_changed for pid, r in save.participants.items()} == {
            4119: 1,
            4121: 1,
            4123: 0,
        }
        assert save.wall_ns > 0 and all(r.wall_ns > 0 for r in save.participants.values())


@pytest.mark.parametrize("old", [None, 4121], ids=["all-new", "one-old-shim"])
def test_capture_uses_sha256_only_where_every_shim_takes_it(ctl, old):
    """A capture asked for SHA-256 chunks (decisions D36) sends CarryFlag.SHA256 with every
    SAVE when every INSPECT reply has ShimFlag.CARRY_SHA256; one shim without it (loaded
    before D36: it would refuse the flag) makes the whole capture BLAKE2b-256, named in its
    chunks, and drops a chunk store's (SHA-256) known digests. A SAVE is streamed
    (CarryFlag.STREAMED, D70) to each shim with ShimFlag.CARRY_STREAMED, not to one without."""
    from cuinterpose.coordinator.carrierfiles import CarrierFiles
    from cuinterpose.coordinator.protocol import CarryFlag, ShimFlag
    from cuinterpose.coordinator.results import PhaseResult

    with group(ctl, shim_flags=ShimFlag.CARRY_SHA256 | ShimFlag.CARRY_STREAMED) as g:
        if old is not None:
            g.mocks[old].shim_flags = 0
        coord = Coordinator(g.participants)
        coord.carriers = CarrierFiles(ctl.parent / "chunks", checksum="sha256")
        cap = coord.capture()
    want = "sha256" if old is None else "blake2b-256"
    assert cap.chunks["checksum"] == coord.carriers.checksum == want
    # a SAVE streams its descriptors as the files are created (decisions D70) where the shim
    # takes it: not to the old one
    sha = CarryFlag.SHA256 if old is None else 0
    streamed = CarryFlag.STREAMED
    assert {pid: m.carrier_flags for pid, m in g.mocks.items()} == {
        4119: [sha | streamed],
        4121: [sha | (streamed if old is None else 0)],
        4123: [sha | streamed],
    }
    # the chunk store's digests of the other checksum name nothing this capture can refer to
    files = CarrierFiles(ctl.parent / "store", checksum="sha256", known={b"\x01" * 32: ("p", 0)})
    coord.carriers = files
    inspect = PhaseResult(
        "INSPECT", 1, 0, 0, {7: ParticipantResult(pid=7, shim_flags=ShimFlag.CARRY_SHA256)}
    )
    coord._fit_checksum(inspect)
    assert (files.checksum, files.known) == ("sha256", {b"\x01" * 32: ("p", 0)})
    inspect.participants[8] = ParticipantResult(pid=8)
    coord._fit_checksum(inspect)
    assert (files.checksum, files.known) == ("blake2b-256", {})


def test_capture_records_and_carriers(ctl):
    with group(ctl) as g:
        cap = Coordinator(g.participants).capture()
    want = group_records()
    assert sorted(cap.records) == [4119, 4121, 4123]
    creator_a = next(
        r for r in cap.records[4119] if r.kind == RecordKind.ALLOCATION and r.alloc_id == A
    )
    assert creator_a.flags == RecordFlag.SHARED | RecordFlag.EXPORTED | RecordFlag.CARRIED
    assert creator_a.carrier_bytes == 2 * MiB
    assert creator_a.carrier_checksum == ZERO_TABLE_SUM
    # everything except the carrier fields is what the first INSPECT returned
    assert [
        r.replace(flags=r.flags & ~RecordFlag.CARRIED, carrier_bytes=0, carrier_checksum=0)
        for r in cap.records[4119]
    ] == want[4119]
    assert cap.records[4123] == want[4123]
    assert cap.carriers == [
        {
            "pid": 4119,
            "alloc_id": A.hex(),
            "bytes": 2 * MiB,
            "checksum": f"{ZERO_TABLE_SUM:016x}",
        },
        {
            "pid": 4121,
            "alloc_id": want[4121][1].alloc_id_hex,
            "bytes": 4 * MiB,
            "checksum": f"{ZERO_TABLE_SUM:016x}",
        },
    ]
    assert cap.carrier_bytes == 6 * MiB


def test_capture_json_round_trip_and_restore_in_a_new_coordinator(ctl):
    with group(ctl) as g:
        cap = Coordinator(g.participants).capture()
        d = json.loads(json.dumps(cap.to_dict()))
        assert d["format"] == 1 and d["protocol_version"] == 2
        assert [p["pid"] for p in d["participants"]] == [4119, 4121, 4123]
        assert d["participants"][0]["records"][1]["alloc_id"] == A.hex()
        assert d["carrier_bytes"] == 6 * MiB
        back = Capture.from_dict(d)
        assert back.records == cap.records
        assert back.carriers == cap.carriers and back.last_txn_id == cap.last_txn_id
        assert [p.to_dict() for p in back.phases] == [p.to_dict() for p in cap.phases]

        res = Coordinator(g.participants).restore(back)
        assert [p.phase for p in res.phases] == RESTORE_OPS
        assert all(m.phase == Phase.ACTIVE for m in g.mocks.values())
        assert res.phase("LOAD_ALLOCATIONS").bytes == 12 * MiB
        assert res.carrier_bytes == 12 * MiB
        _assert_barrier(g)
        # txn ids strictly increasing over the whole run, one per phase, never reused
        order = _phase_order(g)
        assert [n for n, _ in order] == CAPTURE_OPS + RESTORE_OPS
        txns = [t for _, t in order]
        assert txns == sorted(set(txns))
        for m in g.mocks.values():
            assert m.txns_seen == sorted(set(m.txns_seen)) and len(m.txns_seen) == 4


def test_restore_txn_ids_stay_above_the_capture(ctl):
    with group(ctl) as g:
        cap = Coordinator(g.participants).capture()
        future = next_txn_id() + 10**15  # a capture taken "later" by another clock
        for m in g.mocks.values():
            m.last_txn = future
        cap.last_txn_id = future
        Coordinator(g.participants).restore(Capture.from_dict(cap.to_dict()))
        assert all(m.phase == Phase.ACTIVE for m in g.mocks.values())
        assert all(m.txns_seen[-1] > future for m in g.mocks.values())


def test_next_txn_id_strictly_increasing():
    ids = [next_txn_id() for _ in range(1000)]
    assert ids == sorted(set(ids))
    # the counter is process-wide (other tests may have raised it): a floor above it wins
    floor = max(ids[-1], 2**62) + 1000
    assert next_txn_id(floor=floor) == floor + 1
    assert next_txn_id() == floor + 2


def test_on_event_per_reply_and_per_phase(ctl):
    events = []
    with group(ctl) as g:
        Coordinator(g.participants, on_event=events.append).capture()
    # the coordinator's own work between barriers is a row of its own (no participants)
    assert [(e.phase, e.txn_id > 0) for e in events if e.kind == "phase"] == [
        ("INSPECT", True),
        ("validate", False),
        ("SAVE_ALLOCATIONS", True),
        ("PREPARE_UNICAST", True),
        ("INSPECT", True),
        ("check carriers", False),
    ]
    steps = [e.phase_result for e in events if e.txn_id == 0]
    assert [(s.participants, s.detail) for s in steps] == [
        ({}, "14 records of 3 pids"),
        ({}, "2 carriers"),
    ]
    events = [e for e in events if e.txn_id]
    assert len(events) == 4 * 4
    for i, name in enumerate(CAPTURE_OPS):
        chunk = events[4 * i : 4 * i + 4]
        assert [e.kind for e in chunk] == ["reply", "reply", "reply", "phase"]
        assert {e.phase for e in chunk} == {name}
        assert sorted(e.pid for e in chunk[:3]) == [4119, 4121, 4123]
        assert [e.done for e in chunk] == [1, 2, 3, 3] and {e.total for e in chunk} == {3}
        assert all(e.ok for e in chunk)
        assert chunk[3].phase_result.phase == name
    save_phase = events[7]
    assert save_phase.bytes == 12 * MiB


def test_gc_paused_nests_and_leaves_the_collector_as_it_found_it(ctl):
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    with group(ctl) as g:  # every pause of a capture and a restore ended
        co = Coordinator(g.participants)
        co.restore(co.capture())
    assert gc.isenabled()
    gc.disable()
    try:  # a caller that runs without the collector keeps it off
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_on_event_exception_does_not_break_the_barrier(ctl):
    def boom(event):
        raise RuntimeError("display broke")

    with group(ctl) as g:
        Coordinator(g.participants, on_event=boom).capture()
        assert all(m.phase == Phase.PREPARED for m in g.mocks.values())


def test_refusal_at_inspect_changes_nothing(ctl):
    with group(ctl) as g:
        g.mocks[4121].refuse[Op.INSPECT] = (
            Status.REFUSED_STATE,
            "allocation 77 was created with FABRIC handles",
        )
        with pytest.raises(PhaseError) as ei:
            Coordinator(g.participants).capture()
        e = ei.value
        assert str(e) == (
            "INSPECT: pid 4121 refused (REFUSED_STATE): allocation 77 was created "
            "with FABRIC handles; nothing was changed"
        )
        assert (e.phase, e.pid, e.status, e.changed) == (
            "INSPECT",
            4121,
            Status.REFUSED_STATE,
            False,
        )
        assert {name for _, name in g.ops_received()} == {"INSPECT"}
        assert all(m.phase == Phase.ACTIVE for m in g.mocks.values())


@pytest.mark.parametrize("strict", [True, False])
def test_participant_in_wrong_phase_refused_before_mutation(ctl, strict):
    """Whether the shim refuses INSPECT with a wrong expected_phase (strict) or answers it
    with its phase, the coordinator stops before any mutation."""
    with group(ctl, inspect_checks_phase=strict) as g:
        g.mocks[4123].phase = Phase.SAVED
        with pytest.raises(PhaseError) as ei:
            Coordinator(g.participants).capture()
        if strict:
            assert str(ei.value) == (
                "INSPECT: pid 4123 refused (REFUSED_PHASE): expected phase "
                "0, shim is in SAVED; nothing was changed"
            )
        else:
            assert str(ei.value) == (
                "INSPECT: pid 4123 is in phase SAVED, expected ACTIVE: a capture that was not "
                "finished holds it (an agent that died mid-checkpoint); roll it back with "
                "`cuinterpose-agent release --pid ROOT` (ROOT: the root pid of pid 4123's job), "
                "then retry; nothing was changed"
            )
        assert ei.value.pid == 4123 and not ei.value.changed
        assert {name for _, name in g.ops_received()} == {"INSPECT"}


def test_all_refuse_mutating_phase_changes_nothing(ctl):
    with group(ctl) as g:
        coord = Coordinator(g.participants)
        for m in g.mocks.values():
            m.last_txn = next_txn_id() + 10**15  # every shim has seen a newer txn
        with pytest.raises(PhaseError) as ei:
            coord.save_allocations()
        assert ei.value.status == Status.REFUSED_DUPLICATE
        assert ei.value.changed is False
        assert str(ei.value).startswith("SAVE_ALLOCATIONS: pid 4119 refused (REFUSED_DUPLICATE)")
        assert str(ei.value).endswith("; nothing was changed (and 2 more: pids 4121, 4123)")
        assert all(m.phase == Phase.ACTIVE for m in g.mocks.values())


def test_validation_error_stops_before_mutation(ctl):
    recs = group_records()
    recs[4123][0] = recs[4123][0].replace(flags=recs[4123][0].flags | RecordFlag.RAW_IMPORT)
    with group(ctl, records=recs) as g:
        with pytest.raises(TopologyError) as ei:
            Coordinator(g.participants).capture()
        assert ei.value.pid == 4123 and ei.value.alloc_id == A.hex()
        assert str(ei.value).startswith(f"pid 4123 holds a live raw import of allocation {A.hex()}")
        assert {name for _, name in g.ops_received()} == {"INSPECT"}
        assert all(m.phase == Phase.ACTIVE for m in g.mocks.values())


def test_validate_without_records_inspects(ctl):
    with group(ctl) as g:
        recs = Coordinator(g.participants).validate()
        assert recs == group_records()
        assert [name for _, name in g.ops_received()] == ["INSPECT"] * 3


def test_failure_in_save_stops_the_group(ctl):
    with group(ctl) as g:
        g.mocks[4121].fail[Op.SAVE_ALLOCATIONS] = (
            2,
            "could not copy allocation b7e2… to its host carrier",
        )
        with pytest.raises(PhaseError) as ei:
            Coordinator(g.participants).capture()
        e = ei.value
        assert str(e) == (
            "SAVE_ALLOCATIONS: pid 4121 could not copy allocation b7e2… to its "
            "host carrier: CUDA_ERROR_OUT_OF_MEMORY"
        )
        assert (e.phase, e.pid, e.status, e.cuda_result, e.changed) == (
            "SAVE_ALLOCATIONS",
            4121,
            Status.FAILED,
            2,
            True,
        )
        assert [f.pid for f in e.failures] == [4121]
        assert [name for _, name in g.ops_received()] == ["INSPECT"] * 3 + ["SAVE_ALLOCATIONS"] * 3
        # SAVE_ALLOCATIONS only copies: the failing shim stays ACTIVE, the others are SAVED
        assert g.mocks[4121].phase == Phase.ACTIVE and g.mocks[4119].phase == Phase.SAVED
        assert e.capture is not None and sorted(e.capture.records) == [4119, 4121, 4123]
        assert [p.phase for p in e.capture.phases] == ["INSPECT", "SAVE_ALLOCATIONS"]


def test_failure_in_restore_unicast_names_phase_pid_and_message(ctl):
    with group(ctl) as g:
        cap = Coordinator(g.participants).capture()
        g.mocks[4121].fail[Op.RESTORE_UNICAST] = (
            1,
            f"could not import allocation {A.hex()} from creator pid 4119",
        )
        with pytest.raises(PhaseError) as ei:
            Coordinator(g.participants).restore(cap)
        assert str(ei.value) == (
            f"RESTORE_UNICAST: pid 4121 could not import allocation "
            f"{A.hex()} from creator pid 4119: CUDA_ERROR_INVALID_VALUE"
        )
        assert ei.value.message == f"could not import allocation {A.hex()} from creator pid 4119"
        ops = [name for _, name in g.ops_received()]
        assert ops[-3:] == ["RESTORE_UNICAST"] * 3  # stopped: no final INSPECT
        assert ops.count("RESTORE_UNICAST") == 3  # never retried


def test_participant_that_never_answers_times_out(ctl):
    with group(ctl) as g:
        g.mocks[4123].hang.add(Op.PREPARE_UNICAST)
        with pytest.raises(PhaseError) as ei:
            Coordinator(g.participants, timeout_s=0.3).capture()
        e = ei.value
        path = g.mocks[4123].path
        assert str(e) == (f"PREPARE_UNICAST: pid 4123 (socket {path}) did not reply within 0.3 s")
        assert (e.phase, e.pid, e.status, e.changed) == ("PREPARE_UNICAST", 4123, None, True)
        assert [name for _, name in g.ops_received()][-3:] == ["PREPARE_UNICAST"] * 3


def test_carrier_ops_use_the_carrier_timeout(ctl):
    with group(ctl) as g:
        g.mocks[4119].delay_s[Op.SAVE_ALLOCATIONS] = 0.5
        # 0.2 s would be too short for the SAVE copy; the carrier timeout applies instead
        c = Coordinator(g.participants, timeout_s=0.2, carrier_timeout_s=5)
        c.carried = streams_of(c.inspect())  # the chunk files of the creators (capture does it)
        c.save_allocations()
    with group(ctl) as g:
        g.mocks[4119].hang.add(Op.SAVE_ALLOCATIONS)
        with pytest.raises(
            PhaseError,
            match=r"^SAVE_ALLOCATIONS: pid 4119 \(socket .*\) did "
            r"not reply within 0.3 s$",
        ):
            Coordinator(g.participants, timeout_s=5, carrier_timeout_s=0.3).capture()


def test_missing_socket_names_pid(ctl):
    with group(ctl) as g:
        parts = g.participants + [Participant.from_pid(4200, str(ctl))]
        with pytest.raises(PhaseError) as ei:
            Coordinator(parts).inspect()
        assert str(ei.value) == (
            f"INSPECT: cannot connect to pid 4200 (socket "
            f"{ctl}/cuinterpose-4200.sock): No such file or directory; "
            "nothing was changed"
        )


def test_restore_detects_changed_va(ctl):
    def move(mock):
        i = next(
            i
            for i, r in enumerate(mock.records)
            if r.kind == RecordKind.MAPPING and r.alloc_id == A
        )
        mock.records[i] = mock.records[i].replace(va=BASE + 0x40000000)

    with group(ctl) as g:
        cap = Coordinator(g.participants).capture()
        g.mocks[4121].after[Op.RESTORE_UNICAST] = move
        with pytest.raises(TopologyError) as ei:
            Coordinator(g.participants).restore(cap)
        assert str(ei.value) == (
            f"INSPECT after restore: pid 4121 mapping of allocation "
            f"{A.hex()} at va {BASE + 4 * MiB:#x}: va differs (captured "
            f"{BASE + 4 * MiB:#x}, restored {BASE + 0x40000000:#x})"
        )
        assert ei.value.pid == 4121 and ei.value.phase == "INSPECT"


def test_restore_refuses_bad_carrier_checksum_before_load(ctl):
    with group(ctl) as g:
        cap = Coordinator(g.participants).capture()
        m = g.mocks[4119]
        i = next(
            i
            for i, r in enumerate(m.records)
            if r.kind == RecordKind.ALLOCATION and r.role == Role.CREATOR
        )
        m.records[i] = m.records[i].replace(carrier_checksum=1)
        with pytest.raises(PhaseError) as ei:
            Coordinator(g.participants).restore(cap)
        want = f"{ZERO_TABLE_SUM:016x}"
        assert str(ei.value) == (
            f"INSPECT: pid 4119 allocation {A.hex()} carrier checksum "
            f"0000000000000001 ({2 * MiB} bytes) differs from the captured "
            f"{want} ({2 * MiB} bytes); restore refused, nothing was "
            "changed"
        )
        assert "LOAD_ALLOCATIONS" not in {name for _, name in g.ops_received()}


def test_restore_refuses_a_carrier_no_longer_held_before_load(ctl):
    """The restore's carrier check finds each captured carrier by (pid, allocation) in one index
    of the INSPECT records: a creator record without CUI_REC_CARRIED is named, nothing sent."""
    with group(ctl) as g:
        cap = Coordinator(g.participants).capture()
        m = g.mocks[4121]
        i = next(
            i
            for i, r in enumerate(m.records)
            if r.kind == RecordKind.ALLOCATION and r.role == Role.CREATOR
        )
        m.records[i] = m.records[i].replace(flags=int(m.records[i].flags) & ~RecordFlag.CARRIED)
        events = []
        with pytest.raises(PhaseError) as ei:
            Coordinator(g.participants, on_event=events.append).restore(cap)
        assert str(ei.value) == (
            f"INSPECT: pid 4121 allocation {m.records[i].alloc_id_hex} no longer holds the chunk "
            "table of its chunk file; restore refused, nothing was changed"
        )
        assert (ei.value.pid, ei.value.changed) == (4121, False)
        assert [(e.phase, e.ok) for e in events if e.kind == "phase"] == [
            ("INSPECT", True),
            ("check carriers", False),
        ]
        assert "LOAD_ALLOCATIONS" not in {name for _, name in g.ops_received()}


def test_restore_refuses_shim_not_prepared(ctl):
    with group(ctl) as g:
        cap = Coordinator(g.participants).capture()
        g.mocks[4121].phase = Phase.ACTIVE
        g.mocks[4121].inspect_checks_phase = False
        with pytest.raises(
            PhaseError,
            match="^INSPECT: pid 4121 is in phase ACTIVE, expected PREPARED; nothing was changed$",
        ):
            Coordinator(g.participants).restore(cap)


def test_restore_needs_the_captured_participants(ctl):
    with group(ctl) as g:
        cap = Coordinator(g.participants).capture()
        with pytest.raises(
            ValueError,
            match=r"participants \[4119, 4121\] differ from the "
            r"captured \[4119, 4121, 4123\]",
        ):
            Coordinator(g.participants[:2]).restore(cap)


def test_capture_refuses_uncarried_creator(ctl):
    with group(ctl) as g:
        for m in g.mocks.values():
            m._mutate = lambda op, chunk_bytes=0: 0  # a shim that "forgot" to carry the bytes
        with pytest.raises(PhaseError) as ei:
            Coordinator(g.participants).capture()
        assert str(ei.value) == (
            f"SAVE_ALLOCATIONS: pid 4119 allocation {A.hex()} is not saved "
            "to its chunk file after PREPARE_UNICAST"
        )
        assert ei.value.capture is not None


def test_constructor_rejects_duplicates():
    with pytest.raises(ValueError, match="duplicate participant pids"):
        Coordinator([Participant(1, "/a"), Participant(1, "/b")])
    with pytest.raises(ValueError, match="at least one participant"):
        Coordinator([])


def test_capture_from_dict_rejects_other_format():
    with pytest.raises(ValueError, match="capture format 2 is not supported"):
        Capture.from_dict({"format": 2})
    with pytest.raises(ValueError, match="protocol version 9"):
        Capture.from_dict({"format": 1, "protocol_version": 9})


def test_phase_error_is_a_coordinator_error():
    assert issubclass(PhaseError, CoordinatorError)


@pytest.mark.parametrize(
    "status,cuda,message,text",
    [
        # the shim's own style: used as is
        (
            Status.FAILED,
            1,
            "RESTORE_UNICAST: pid 4121 could not import allocation 9f3c from creator "
            "pid 4119: CUDA_ERROR_INVALID_VALUE",
            "RESTORE_UNICAST: pid 4121 could not import "
            "allocation 9f3c from creator pid 4119: CUDA_ERROR_INVALID_VALUE",
        ),
        (
            Status.FAILED,
            2,
            "RESTORE_UNICAST: pid 4121 allocation 9f3c: cuMemMap failed",
            "RESTORE_UNICAST: pid 4121 allocation 9f3c: cuMemMap failed: CUDA_ERROR_OUT_OF_MEMORY",
        ),
        (
            Status.REFUSED_PHASE,
            0,
            "RESTORE_UNICAST: pid 4121 is FAILED; no request is accepted",
            "RESTORE_UNICAST: pid 4121 is FAILED; no request is accepted (refused: REFUSED_PHASE)",
        ),
        (
            Status.BAD_REQUEST,
            0,
            "busy: pid 4121 is still running another control request",
            "RESTORE_UNICAST: pid 4121 refused (BAD_REQUEST): busy: pid 4121 is still running "
            "another control request",
        ),
        (
            Status.BAD_REQUEST,
            0,
            "pid 4121: bad request magic",
            "RESTORE_UNICAST: pid 4121: bad request magic (refused: BAD_REQUEST)",
        ),
        (Status.FAILED, 0, "", "RESTORE_UNICAST: pid 4121 failed (FAILED)"),
    ],
)
def test_failure_text(status, cuda, message, text):
    r = ParticipantResult(pid=4121, status=status, cuda_result=cuda, message=message)
    assert failure_text("RESTORE_UNICAST", r) == text
