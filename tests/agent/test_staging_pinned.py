"""A staging ring the shim could not page-lock is visible (protocol.h "Carriers",
reply.reserved[4..5]): the participant's result keeps both values through JSON, the phase
names the pid and the CUresult, and the agent's report prints it as a note.

The shim side (a first SAVE and LOAD in a fresh process report the whole ring locked) is in
tests/coordinator/test_shim_integration.py.
"""

from __future__ import annotations

import json
import types

from cuinterpose.agent.run.report import Reporter
from cuinterpose.coordinator.protocol import Phase, Status
from cuinterpose.coordinator.results import ParticipantResult, PhaseResult

RING = 64 << 20
INVALID_CONTEXT = 201  # cuda.h: CUDA_ERROR_INVALID_CONTEXT


def _save(pinned: dict[int, tuple[int, int]]) -> PhaseResult:
    pr = PhaseResult("SAVE_ALLOCATIONS", 7, Phase.SAVED, 1_000_000)
    for pid, (locked, result) in pinned.items():
        pr.participants[pid] = ParticipantResult(
            pid,
            Status.OK,
            Phase.SAVED,
            bytes=RING,
            staging_pinned_bytes=locked,
            staging_pin_result=result,
        )
    return pr


def test_the_pin_result_survives_json_and_names_the_pid():
    pr = _save({11: (RING, 0), 12: (0, INVALID_CONTEXT), 13: (0, 0)})
    back = PhaseResult.from_dict(json.loads(json.dumps(pr.to_dict())))
    got = {p: (r.staging_pinned_bytes, r.staging_pin_result) for p, r in back.participants.items()}
    assert got == {11: (RING, 0), 12: (0, INVALID_CONTEXT), 13: (0, 0)}
    # 13 carried nothing (no ring, no register): only 12's failure counts
    assert back.pageable_staging == {12: "CUDA_ERROR_INVALID_CONTEXT"}


def test_the_report_notes_a_pageable_ring():
    rep = Reporter()
    ev = types.SimpleNamespace(
        kind="phase", ok=True, phase_result=_save({12: (0, INVALID_CONTEXT)})
    )
    rep.coordinator_event(ev)
    assert [p.name for p in rep.phases] == ["SAVE_ALLOCATIONS"]
    assert rep.notes == [
        "SAVE_ALLOCATIONS: pid 12: its staging ring could not be page-locked "
        "(cuMemHostRegister: CUDA_ERROR_INVALID_CONTEXT); its copies ran at pageable speed"
    ]


def test_a_locked_ring_adds_no_note():
    rep = Reporter()
    ev = types.SimpleNamespace(kind="phase", ok=True, phase_result=_save({11: (RING, 0)}))
    rep.coordinator_event(ev)
    assert rep.notes == []
