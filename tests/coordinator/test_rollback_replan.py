"""Rollback after a lost reply (shared/cases/006, issue 11): the op sent on the lost
connection runs at the shim after the rollback's first INSPECT; the rollback re-INSPECTs and
re-plans that shim (bounded by MAX_REPLANS), never resending an op to a shim that moved."""

from __future__ import annotations

import pytest

from cuinterpose.coordinator import rollback as rollback_mod
from cuinterpose.coordinator.phases import Coordinator, PhaseError
from cuinterpose.coordinator.protocol import Op, Phase, Status

from .helpers import group, group_records
from .test_phases_multicast import mc_group_records


def lose_save_then_run_it_late(mock):
    """SAVE_ALLOCATIONS to ``mock``: the connection closes before the reply (a lost reply);
    the shim runs the SAVE right after answering the next INSPECT (the rollback's first)."""
    state = {"txn": None}
    answer = mock._answer

    def lost(conn, req):
        state["txn"] = req.txn_id
        conn.close()

    def late(req):
        out = answer(req)
        if req.op == Op.INSPECT and state["txn"] is not None:
            with mock._lock:
                mock._mutate(Op.SAVE_ALLOCATIONS)
                mock.phase, mock.last_txn = Phase.SAVED, state["txn"]
            state["txn"] = None
        return out

    mock.raw[Op.SAVE_ALLOCATIONS] = lost
    mock._answer = late


def names(rb):
    return [(p.phase, sorted(p.participants)) for p in rb.phases]


def test_lost_save_with_multicast_replans_the_shim_that_saved_late(ctl):
    with group(ctl, records=mc_group_records(), inspect_checks_phase=False) as g:
        lose_save_then_run_it_late(g.mocks[4121])
        co = Coordinator(g.participants, timeout_s=5)
        with pytest.raises(PhaseError) as e:
            co.capture()
        assert (e.value.phase, e.value.pid) == ("SAVE_ALLOCATIONS", 4121)
        rb = co.rollback(e.value.capture)
        assert rb.found == {4119: "SAVED", 4121: "MULTICAST_RELEASED", 4123: "SAVED"}
        everyone = [4119, 4121, 4123]
        assert names(rb) == [
            ("INSPECT", everyone),
            ("CANCEL_CAPTURE", [4119, 4123]),
            ("RESTORE_MULTICAST_CREATORS", everyone),  # 4121 is SAVED by now: REFUSED_PHASE
            ("INSPECT", everyone),
            ("CANCEL_CAPTURE", [4121]),
            ("RESTORE_MULTICAST_CREATORS", [4121]),
            ("RESTORE_MULTICAST_IMPORTERS", everyone),
            ("RESTORE_MULTICAST_DEVICES", everyone),
            ("RESTORE_MULTICAST_BINDINGS", everyone),
            ("INSPECT", everyone),
        ]
        refused = rb.phases[2].participants
        assert {p: Status(r.status).name for p, r in refused.items()} == {
            4119: "OK",
            4121: "REFUSED_PHASE",
            4123: "OK",
        }
        assert refused[4121].phase == Phase.SAVED
        assert {pid: m.phase for pid, m in g.mocks.items()} == dict.fromkeys(g.mocks, Phase.ACTIVE)
        assert rb.records == mc_group_records()
        # RESTORE_MULTICAST_CREATORS reached 4121 twice: once refused, once from its phase
        assert [n for _, n in g.ops_received(4121)].count("RESTORE_MULTICAST_CREATORS") == 2


def test_lost_save_without_multicast_is_found_by_the_final_inspect(ctl):
    """4121 is ACTIVE at the first INSPECT (nothing to send it); its late SAVE shows in the
    final INSPECT (SAVED, not ACTIVE): a new plan cancels it."""
    with group(ctl, inspect_checks_phase=False) as g:
        lose_save_then_run_it_late(g.mocks[4121])
        co = Coordinator(g.participants, timeout_s=5)
        with pytest.raises(PhaseError) as e:
            co.capture()
        rb = co.rollback(e.value.capture)
        assert rb.found == {4119: "SAVED", 4121: "ACTIVE", 4123: "SAVED"}
        everyone = [4119, 4121, 4123]
        assert names(rb) == [
            ("INSPECT", everyone),
            ("CANCEL_CAPTURE", [4119, 4123]),
            ("INSPECT", everyone),  # 4121 SAVED
            ("INSPECT", everyone),
            ("CANCEL_CAPTURE", [4121]),
            ("INSPECT", everyone),
        ]
        assert {pid: m.phase for pid, m in g.mocks.items()} == dict.fromkeys(g.mocks, Phase.ACTIVE)
        assert rb.records == group_records()


def test_lost_reply_of_an_undo_op_is_settled_by_inspect(ctl):
    """The reply of CANCEL_CAPTURE to 4119 is lost after the shim ran it: the next INSPECT
    finds it MULTICAST_RELEASED/ACTIVE and the op is not sent again."""
    with group(ctl, inspect_checks_phase=False) as g:
        for m in g.mocks.values():
            m.phase = Phase.SAVED
        m = g.mocks[4119]
        answer = m._answer

        def ran_then_lost(conn, req):
            answer(req)
            conn.close()

        m.raw[Op.CANCEL_CAPTURE] = ran_then_lost
        co = Coordinator(g.participants, timeout_s=5)
        rb = co.rollback(group_records())
        everyone = [4119, 4121, 4123]
        assert names(rb) == [
            ("INSPECT", everyone),
            ("CANCEL_CAPTURE", everyone),
            ("INSPECT", everyone),
            ("INSPECT", everyone),
        ]
        assert [n for _, n in g.ops_received(4119)].count("CANCEL_CAPTURE") == 1
        assert {pid: m.phase for pid, m in g.mocks.items()} == dict.fromkeys(g.mocks, Phase.ACTIVE)


def test_replans_are_bounded(ctl):
    """A shim that answers REFUSED_PHASE from SAVED every time: MAX_REPLANS new plans, then
    the PhaseError of the last one."""
    with group(ctl, inspect_checks_phase=False) as g:
        for m in g.mocks.values():
            m.phase = Phase.SAVED
        g.mocks[4121].refuse[Op.CANCEL_CAPTURE] = (Status.REFUSED_PHASE, "moved")
        co = Coordinator(g.participants, timeout_s=5)
        with pytest.raises(PhaseError) as e:
            co.rollback(group_records())
        assert (e.value.phase, e.value.pid, e.value.status) == (
            "CANCEL_CAPTURE",
            4121,
            Status.REFUSED_PHASE,
        )
        rounds = rollback_mod.MAX_REPLANS + 1
        assert [n for _, n in g.ops_received(4121)] == ["INSPECT", "CANCEL_CAPTURE"] * rounds
        assert g.mocks[4121].phase == Phase.SAVED
