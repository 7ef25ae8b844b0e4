"""Coordinator.rollback(): every participant of a failed capture back to ACTIVE, against mock
shims in mixed phases (SAVED -> CANCEL_CAPTURE, PREPARED -> LOAD_ALLOCATIONS ->
RESTORE_UNICAST, each step one barrier phase); a FAILED shim is fail-stop."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from cuinterpose.coordinator.phases import Coordinator, PhaseError, TopologyError
from cuinterpose.coordinator.protocol import Op, Phase, RecordFlag, Role, Status

from .helpers import BASE, A, MiB, alloc, group, group_records, mapping, reservation


def sent(g, pid):
    """Ops received by ``pid`` (names, in order)."""
    return [name for _, name in g.ops_received(pid)]


def phases_of(res):
    return [(p.phase, sorted(p.participants)) for p in res.phases]


def carried(mock):
    """What SAVE_ALLOCATIONS does to a mock's records (CARRIED on creators)."""
    mock.records = [
        dataclasses.replace(
            r, flags=r.flags | RecordFlag.CARRIED, carrier_bytes=r.size, carrier_checksum=7
        )
        if r.kind == 1 and r.role == Role.CREATOR
        else r
        for r in mock.records
    ]


def test_capture_failing_in_save_rolls_back_with_cancel(ctl):
    """SAVE failed on 4121 (it stays ACTIVE, it only copied); 4119 and 4123 are SAVED:
    CANCEL_CAPTURE to those two only, then INSPECT equal to the capture."""
    with group(ctl, inspect_checks_phase=False) as g:
        g.mocks[4121].fail[Op.SAVE_ALLOCATIONS] = (
            2,
            "SAVE_ALLOCATIONS: pid 4121 allocation b7e2: cuMemcpyDtoH_v2 failed",
        )
        coord = Coordinator(g.participants)
        with pytest.raises(PhaseError) as ei:
            coord.capture()
        assert {pid: m.phase for pid, m in g.mocks.items()} == {
            4119: Phase.SAVED,
            4121: Phase.ACTIVE,
            4123: Phase.SAVED,
        }
        save_txn = coord.last_txn_id
        res = coord.rollback(ei.value.capture)
        assert res.found == {4119: "SAVED", 4121: "ACTIVE", 4123: "SAVED"}
        assert phases_of(res) == [
            ("INSPECT", [4119, 4121, 4123]),
            ("CANCEL_CAPTURE", [4119, 4123]),
            ("INSPECT", [4119, 4121, 4123]),
        ]
        assert all(m.phase == Phase.ACTIVE for m in g.mocks.values())
        assert sent(g, 4119) == [
            "INSPECT",
            "SAVE_ALLOCATIONS",
            "INSPECT",
            "CANCEL_CAPTURE",
            "INSPECT",
        ]
        assert sent(g, 4121) == ["INSPECT", "SAVE_ALLOCATIONS", "INSPECT", "INSPECT"]
        cancel = res.phases[1]
        assert cancel.txn_id > save_txn
        assert {pid: r.records_changed for pid, r in cancel.participants.items()} == {
            4119: 1,
            4123: 0,
        }
        # the creators' records lost CARRIED again: equal to the capture's first INSPECT
        assert res.records == group_records()


def test_mixed_saved_and_prepared_run_cancel_and_load_as_one_barrier_phase(ctl):
    """4119 (creator of A) is SAVED, 4121 (importer of A) and 4123 (importer of A, private P)
    are PREPARED: phase 1 = CANCEL_CAPTURE on 4119 + LOAD_ALLOCATIONS on 4121/4123, all in
    flight together (a barrier inside the mocks proves it); phase 2 = RESTORE_UNICAST on the
    formerly PREPARED only."""
    C, I = Role.CREATOR, Role.IMPORTER
    recs = {
        4119: [reservation(BASE, 2 * MiB), alloc(A, C, 4119), mapping(A, C, 4119, BASE)],
        4121: [alloc(A, I, 4119), mapping(A, I, 4119, BASE + 4 * MiB)],
        4123: group_records()[4123],
    }
    with group(ctl, records=recs, inspect_checks_phase=False) as g:
        g.mocks[4119].phase = Phase.SAVED
        carried(g.mocks[4119])
        g.mocks[4121].phase = g.mocks[4123].phase = Phase.PREPARED
        gate = threading.Barrier(3)
        g.mocks[4119].gate[Op.CANCEL_CAPTURE] = gate
        for pid in (4121, 4123):
            g.mocks[pid].gate[Op.LOAD_ALLOCATIONS] = gate
        res = Coordinator(g.participants).rollback(recs)
        assert res.found == {4119: "SAVED", 4121: "PREPARED", 4123: "PREPARED"}
        assert phases_of(res) == [
            ("INSPECT", [4119, 4121, 4123]),
            ("CANCEL_CAPTURE+LOAD_ALLOCATIONS", [4119, 4121, 4123]),
            ("RESTORE_UNICAST", [4121, 4123]),
            ("INSPECT", [4119, 4121, 4123]),
        ]
        assert all(m.phase == Phase.ACTIVE for m in g.mocks.values())
        assert sent(g, 4119) == ["INSPECT", "CANCEL_CAPTURE", "INSPECT"]
        assert sent(g, 4121) == ["INSPECT", "LOAD_ALLOCATIONS", "RESTORE_UNICAST", "INSPECT"]
        # one txn for the mixed phase, and the barrier: no RESTORE before the last reply
        mixed = res.phases[1]
        assert {
            e.txn_id for e in g.log.of("recv") if e.op in (Op.CANCEL_CAPTURE, Op.LOAD_ALLOCATIONS)
        } == {mixed.txn_id}
        last_reply = max(e.seq for e in g.log.of("reply") if e.txn_id == mixed.txn_id)
        assert min(e.seq for e in g.log.of("recv", op=Op.RESTORE_UNICAST)) > last_reply
        assert {pid: r.status for pid, r in mixed.participants.items()} == {
            4119: Status.OK,
            4121: Status.OK,
            4123: Status.OK,
        }
        assert res.records == recs


def test_saved_importer_of_a_torn_down_creator_is_prepared_first(ctl):
    """4119 (creator of A) is PREPARED, 4121 still maps A (SAVED): 4121 must not keep the old
    allocation while 4119 rebuilds a new one, so it runs PREPARE_UNICAST first, then both
    LOAD and RESTORE."""
    C, I = Role.CREATOR, Role.IMPORTER
    recs = {
        4119: [alloc(A, C, 4119), mapping(A, C, 4119, BASE)],
        4121: [alloc(A, I, 4119), mapping(A, I, 4119, BASE + 4 * MiB)],
    }
    with group(ctl, records=recs, inspect_checks_phase=False) as g:
        g.mocks[4119].phase = Phase.PREPARED
        carried(g.mocks[4119])
        g.mocks[4121].phase = Phase.SAVED
        res = Coordinator(g.participants, carriers=g.chunk_files()).rollback(recs)
        assert res.found == {4119: "PREPARED", 4121: "SAVED"}
        assert phases_of(res) == [
            ("INSPECT", [4119, 4121]),
            ("PREPARE_UNICAST", [4121]),
            ("LOAD_ALLOCATIONS", [4119, 4121]),
            ("RESTORE_UNICAST", [4119, 4121]),
            ("INSPECT", [4119, 4121]),
        ]
        assert all(m.phase == Phase.ACTIVE for m in g.mocks.values())


def test_active_importer_of_a_torn_down_creator_refuses(ctl):
    C, I = Role.CREATOR, Role.IMPORTER
    recs = {
        4119: [alloc(A, C, 4119), mapping(A, C, 4119, BASE)],
        4121: [alloc(A, I, 4119), mapping(A, I, 4119, BASE + 4 * MiB)],
    }
    with group(ctl, records=recs, inspect_checks_phase=False) as g:
        g.mocks[4119].phase = Phase.PREPARED
        with pytest.raises(PhaseError) as ei:
            Coordinator(g.participants).rollback(recs)
        e = ei.value
        assert (e.phase, e.pid) == ("rollback", 4121)
        assert str(e) == (
            f"rollback: pid 4121 is ACTIVE and still maps allocation {A.hex()} at va "
            f"{BASE + 4 * MiB:#x}, whose creator pid 4119 is PREPARED (already torn "
            "down): rebuilding the creator would split the sharing; nothing was sent"
        )
        assert [n for _, n in g.ops_received()] == ["INSPECT", "INSPECT"]


def test_failed_participant_is_fail_stop(ctl):
    with group(ctl, inspect_checks_phase=False) as g:
        g.mocks[4119].phase = Phase.SAVED
        g.mocks[4121].phase = Phase.FAILED
        g.mocks[4123].phase = Phase.PREPARED
        with pytest.raises(PhaseError) as ei:
            Coordinator(g.participants).rollback(group_records())
        e = ei.value
        assert (e.phase, e.pid, e.status, e.changed) == (
            "rollback",
            4121,
            Status.REFUSED_PHASE,
            True,
        )
        assert str(e) == (
            "rollback: pid 4121 is FAILED (a destructive op failed part-way): shim is "
            "FAILED; it cannot be brought back to ACTIVE; nothing was rolled back "
            "(fail-stop)"
        )
        # only the read-only INSPECT went out: no participant was touched
        assert sorted(n for _, n in g.ops_received()) == ["INSPECT"] * 3
        assert (g.mocks[4119].phase, g.mocks[4123].phase) == (Phase.SAVED, Phase.PREPARED)


def test_silent_participant_is_fail_stop(ctl):
    with group(ctl, inspect_checks_phase=False) as g:
        g.mocks[4119].phase = Phase.SAVED
        g.mocks[4123].hang.add(Op.INSPECT)
        with pytest.raises(PhaseError) as ei:
            Coordinator(g.participants, timeout_s=0.3).rollback(group_records())
        assert (ei.value.phase, ei.value.pid) == ("rollback", 4123)
        assert str(ei.value).startswith(
            "rollback: pid 4123 did not answer INSPECT (INSPECT: pid 4123"
        )
        assert "its phase is unknown; nothing was rolled back (fail-stop)" in str(ei.value)
        assert g.mocks[4119].phase == Phase.SAVED


def test_failure_during_rollback_stops_there(ctl):
    with group(ctl, inspect_checks_phase=False) as g:
        for m in g.mocks.values():
            m.phase = Phase.PREPARED
        g.mocks[4121].fail[Op.LOAD_ALLOCATIONS] = (
            2,
            "LOAD_ALLOCATIONS: pid 4121 allocation b7e2: "
            "cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY",
        )
        with pytest.raises(PhaseError) as ei:
            Coordinator(g.participants, carriers=g.chunk_files()).rollback(group_records())
        e = ei.value
        assert (e.phase, e.pid, e.changed) == ("LOAD_ALLOCATIONS", 4121, True)
        assert (
            str(e)
            == "LOAD_ALLOCATIONS: pid 4121 allocation b7e2: cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY"
        )
        assert "RESTORE_UNICAST" not in [n for _, n in g.ops_received()]


def test_all_active_only_inspects(ctl):
    with group(ctl, inspect_checks_phase=False) as g:
        res = Coordinator(g.participants).rollback(group_records())
        assert (
            phases_of(res)[0][0] == "INSPECT" and [p.phase for p in res.phases] == ["INSPECT"] * 2
        )
        assert res.found == {4119: "ACTIVE", 4121: "ACTIVE", 4123: "ACTIVE"}


def test_rollback_compares_with_the_capture(ctl):
    with group(ctl, inspect_checks_phase=False) as g:
        want = group_records()
        want[4121] = [r for r in want[4121] if r.kind != 3]  # a reservation "disappeared"
        with pytest.raises(TopologyError) as ei:
            Coordinator(g.participants).rollback(want)
        assert ei.value.pid == 4121 and "unexpected reservation" in str(ei.value)


def test_shim_that_checks_inspect_phase_is_asked_again(ctl):
    """A mock that refuses INSPECT with another expected phase (REFUSED_PHASE, reply phase
    set): rollback asks it again with the phase it reported."""
    with group(ctl) as g:
        g.mocks[4119].phase = Phase.SAVED
        res = Coordinator(g.participants).rollback(group_records())
        assert res.found == {4119: "SAVED", 4121: "ACTIVE", 4123: "ACTIVE"}
        assert [p.phase for p in res.phases] == ["INSPECT", "INSPECT", "CANCEL_CAPTURE", "INSPECT"]
        assert all(m.phase == Phase.ACTIVE for m in g.mocks.values())


def test_capture_txn_floor_is_honoured(ctl):
    with group(ctl, inspect_checks_phase=False) as g:
        g.mocks[4121].fail[Op.SAVE_ALLOCATIONS] = (2, "boom")
        with pytest.raises(PhaseError) as ei:
            Coordinator(g.participants).capture()
        cap = ei.value.capture
        cap.last_txn_id = 1 << 62  # as if the clock went backwards
        res = Coordinator(g.participants).rollback(cap)
        assert res.phases[1].phase == "CANCEL_CAPTURE" and res.phases[1].txn_id > 1 << 62


def test_interrupt_between_capture_phases_leaves_a_partial_capture_to_roll_back(ctl, monkeypatch):
    """Anything raised inside capture() after SAVE_ALLOCATIONS went out (here a
    KeyboardInterrupt between SAVE and PREPARE, as Ctrl-C would) carries the partial capture,
    so the caller can still bring every shim back to ACTIVE instead of leaving them SAVED."""
    with group(ctl, inspect_checks_phase=False) as g:
        coord = Coordinator(g.participants)

        def interrupted():
            raise KeyboardInterrupt

        monkeypatch.setattr(coord, "prepare_unicast", interrupted)
        with pytest.raises(KeyboardInterrupt) as ei:
            coord.capture()
        assert {pid: m.phase for pid, m in g.mocks.items()} == {
            4119: Phase.SAVED,
            4121: Phase.SAVED,
            4123: Phase.SAVED,
        }
        cap = ei.value.capture
        assert [p.phase for p in cap.phases] == ["INSPECT", "SAVE_ALLOCATIONS"]
        res = coord.rollback(cap)
        assert res.found == {4119: "SAVED", 4121: "SAVED", 4123: "SAVED"}
        assert all(m.phase == Phase.ACTIVE for m in g.mocks.values())
        assert res.records == group_records()
