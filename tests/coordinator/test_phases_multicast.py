"""Coordinator multicast phases against mock shims: when any participant reports a multicast
record, every participant gets PREPARE_MULTICAST before SAVE_ALLOCATIONS and the four rebuild
ops after RESTORE_UNICAST, each a barrier (the add-device -> bind barrier included); rollback
rebuilds multicast; without multicast the sequences are the unicast ones."""

from __future__ import annotations

import struct

import pytest

from cuinterpose.coordinator.phases import Coordinator, PhaseError
from cuinterpose.coordinator.protocol import Op, Phase, Record, RecordFlag, RecordKind, Role, Status

from .helpers import MiB, group, group_records

M = bytes(range(0x60, 0x70))

CAPTURE = ["INSPECT", "PREPARE_MULTICAST", "SAVE_ALLOCATIONS", "PREPARE_UNICAST", "INSPECT"]
RESTORE = [
    "INSPECT",
    "LOAD_ALLOCATIONS",
    "RESTORE_UNICAST",
    "RESTORE_MULTICAST_CREATORS",
    "RESTORE_MULTICAST_IMPORTERS",
    "RESTORE_MULTICAST_DEVICES",
    "RESTORE_MULTICAST_BINDINGS",
    "INSPECT",
]


def mc_group_records():
    """group_records() plus multicast object M created by 4119, imported by 4121, each binding
    its creator allocation (A for 4119, B for 4121) on device 0; 4123 has no multicast state."""
    recs = group_records()
    member = {4119: bytes.fromhex("9f3c" + "11" * 14), 4121: bytes.fromhex("b7e2" + "22" * 14)}
    for pid, role in ((4119, Role.CREATOR), (4121, Role.IMPORTER)):
        lo, hi = struct.unpack("<QQ", member[pid])
        recs[pid] = recs[pid] + [
            Record(
                kind=RecordKind.MULTICAST,
                role=role,
                flags=RecordFlag.SHARED,
                alloc_id=M,
                creator_pid=4119,
                handle_refs=1,
                size=2 * MiB,
                offset=2 * MiB,
                prop_location_id=2,
                prop_handle_types=1,
            ),
            Record(
                kind=RecordKind.MULTICAST_DEVICE,
                role=role,
                alloc_id=M,
                creator_pid=4119,
                prop_location_type=1,
                prop_location_id=0,
            ),
            Record(
                kind=RecordKind.MULTICAST_BINDING,
                role=role,
                alloc_id=M,
                creator_pid=4119,
                prop_location_type=1,
                prop_location_id=0,
                size=2 * MiB,
                reserved0=pid,
                reserved=(lo, hi, 0, 0),
            ),
        ]
    return recs


def _assert_barrier(g):
    recv, reply = g.log.of("recv"), g.log.of("reply")
    txns = list(dict.fromkeys(e.txn_id for e in recv))
    for a, b in zip(txns, txns[1:]):
        assert max(e.seq for e in reply if e.txn_id == a) < min(
            e.seq for e in recv if e.txn_id == b
        )


def test_capture_and_restore_send_every_multicast_op_to_everyone(ctl):
    with group(ctl, records=mc_group_records()) as g:
        g.gate(Op.PREPARE_MULTICAST, Op.RESTORE_MULTICAST_DEVICES, Op.RESTORE_MULTICAST_BINDINGS)
        g.mocks[4121].delay_s[Op.RESTORE_MULTICAST_DEVICES] = 0.2  # a slow add-device
        co = Coordinator(g.participants, timeout_s=5)
        cap = co.capture()
        assert [p.phase for p in cap.phases] == CAPTURE
        res = Coordinator(g.participants, timeout_s=5).restore(cap)
        assert [p.phase for p in res.phases] == RESTORE
        for pid in (4119, 4121, 4123):  # 4123 has no multicast state: asked anyway
            assert [n for _, n in g.ops_received(pid)] == CAPTURE + RESTORE
        _assert_barrier(g)  # no bind before every add-device replied
        assert {pid: m.phase for pid, m in g.mocks.items()} == {p: Phase.ACTIVE for p in g.mocks}
        # expected phases on the wire: SAVE after PREPARE_MULTICAST expects MULTICAST_RELEASED
        save = [e for e in g.log.of("recv", op=Op.SAVE_ALLOCATIONS)]
        assert {e.expected_phase for e in save} == {Phase.MULTICAST_RELEASED}
        binds = g.log.of("recv", op=Op.RESTORE_MULTICAST_BINDINGS)
        assert {e.expected_phase for e in binds} == {Phase.MULTICAST_DEVICES}


def test_no_multicast_keeps_the_unicast_sequence(ctl):
    with group(ctl) as g:
        cap = Coordinator(g.participants, timeout_s=5).capture()
        assert [p.phase for p in cap.phases] == [
            "INSPECT",
            "SAVE_ALLOCATIONS",
            "PREPARE_UNICAST",
            "INSPECT",
        ]


def test_prepare_multicast_refused_by_everyone_changes_nothing(ctl):
    with group(ctl, records=mc_group_records()) as g:
        for m in g.mocks.values():
            m.refuse[Op.PREPARE_MULTICAST] = (Status.REFUSED_STATE, "in flight")
        with pytest.raises(PhaseError) as e:
            Coordinator(g.participants, timeout_s=5).capture()
        assert (e.value.phase, e.value.changed) == ("PREPARE_MULTICAST", False)


def test_failure_after_prepare_multicast_rolls_back_through_the_rebuild(ctl):
    # the real shim answers INSPECT in any phase (the mock may check: not here)
    with group(ctl, records=mc_group_records(), inspect_checks_phase=False) as g:
        g.mocks[4123].refuse[Op.SAVE_ALLOCATIONS] = (Status.REFUSED_STATE, "no carrier")
        co = Coordinator(g.participants, timeout_s=5)
        with pytest.raises(PhaseError) as e:
            co.capture()
        assert (e.value.phase, e.value.pid, e.value.changed) == ("SAVE_ALLOCATIONS", 4123, True)
        rb = co.rollback(e.value.capture)
        assert rb.found == {4119: "SAVED", 4121: "SAVED", 4123: "MULTICAST_RELEASED"}
        assert [p.phase for p in rb.phases] == [
            "INSPECT",
            "CANCEL_CAPTURE",
            "RESTORE_MULTICAST_CREATORS",
            "RESTORE_MULTICAST_IMPORTERS",
            "RESTORE_MULTICAST_DEVICES",
            "RESTORE_MULTICAST_BINDINGS",
            "INSPECT",
        ]
        assert sorted(rb.phases[1].participants) == [4119, 4121]
        assert all(sorted(p.participants) == [4119, 4121, 4123] for p in rb.phases[2:6])
        assert {pid: m.phase for pid, m in g.mocks.items()} == {p: Phase.ACTIVE for p in g.mocks}


def test_rollback_releases_an_active_holder_first(ctl):
    """One participant never got PREPARE_MULTICAST (still ACTIVE, holding the object) while its
    peer released: rollback sends it PREPARE_MULTICAST before the rebuild, so one team is
    rebuilt."""
    with group(ctl, records=mc_group_records(), inspect_checks_phase=False) as g:
        co = Coordinator(g.participants, timeout_s=5)
        records = co.validate()
        co._run_plan({4119: (Op.PREPARE_MULTICAST, Phase.ACTIVE)}, changed_before=False)
        rb = co.rollback(records)
        assert rb.found == {4119: "MULTICAST_RELEASED", 4121: "ACTIVE", 4123: "ACTIVE"}
        assert [p.phase for p in rb.phases] == [
            "INSPECT",
            "PREPARE_MULTICAST",
            "RESTORE_MULTICAST_CREATORS",
            "RESTORE_MULTICAST_IMPORTERS",
            "RESTORE_MULTICAST_DEVICES",
            "RESTORE_MULTICAST_BINDINGS",
            "INSPECT",
        ]
        assert sorted(rb.phases[1].participants) == [4121]
        assert sorted(rb.phases[2].participants) == [4119, 4121]
