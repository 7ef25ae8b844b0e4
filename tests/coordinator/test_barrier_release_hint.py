"""A shim found in a capture phase where ACTIVE was expected (issue 11, cases 009/001): the
INSPECT refusal names the pid and the phase and points to ``cuinterpose-agent release``
(where another phase was expected the text stays plain: tests/coordinator/test_phases.py)."""

from __future__ import annotations

import pytest

from cuinterpose.coordinator.phases import Coordinator, PhaseError
from cuinterpose.coordinator.protocol import Phase

from .helpers import group


@pytest.mark.parametrize("phase", ["SAVED", "PREPARED", "MULTICAST_RELEASED", "LOADED"])
def test_a_shim_held_by_an_unfinished_capture_points_to_release(ctl, phase):
    with group(ctl, inspect_checks_phase=False) as g:
        g.mocks[4123].phase = Phase[phase]
        with pytest.raises(PhaseError) as ei:
            Coordinator(g.participants).capture()
        assert str(ei.value) == (
            f"INSPECT: pid 4123 is in phase {phase}, expected ACTIVE: a capture that was not "
            "finished holds it (an agent that died mid-checkpoint); roll it back with "
            "`cuinterpose-agent release --pid ROOT` (ROOT: the root pid of pid 4123's job), "
            "then retry; nothing was changed"
        )
        assert (ei.value.pid, ei.value.changed) == (4123, False)
        assert {name for _, name in g.ops_received()} == {"INSPECT"}
