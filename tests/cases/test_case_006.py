"""Case 006 (shared/cases/006-lost-save-reply): a lost SAVE_ALLOCATIONS reply left the job
stuck in SAVED.

Kind: an undo that assumes which phase the shims reached. The agent's rollback hands the
capture to the coordinator's ``rollback()``, which INSPECTs every shim first and undoes what
the phase found needs (SAVED: CANCEL_CAPTURE; PREPARED: LOAD_ALLOCATIONS + RESTORE_UNICAST),
never retrying a mutating op; the agent now says what state each process was in. Reproduced in
the agent's recording world (tests/agent/agent_world.py): a failure after the capture, the
rollback's note asserted exactly. Left: ``release`` of a dead agent does not run this undo yet
(it refuses without ``--force`` and names the steps the agent had started, test_case_009).
"""

from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "agent"))

from agent_world import ROOT, answer_quiesce, world  # noqa: E402,F401 (the fixture)

from cuinterpose.agent.errors import CheckpointFailed  # noqa: E402
from cuinterpose.agent.mech import quiesce  # noqa: E402
from cuinterpose.agent.run import checkpoint as cp_mod  # noqa: E402
from cuinterpose.agent.run.report import Reporter  # noqa: E402


def test_the_rollback_names_each_shims_phase(world, tmp_path, monkeypatch):  # noqa: F811
    world.fail = {"lock": 202}
    monkeypatch.setattr(quiesce, "request", answer_quiesce(world))
    rep = Reporter()
    with pytest.raises(CheckpointFailed) as ei:
        cp_mod.Checkpoint([ROOT], tmp_path / "snap", control_dir=world.ctl, reporter=rep).run()
    assert ei.value.outcome == "rolled_back"
    assert ("coord", "rollback", None) in world.log
    assert (
        "rollback: shims found in pid 201 PREPARED, pid 202 PREPARED; each brought back to "
        "ACTIVE, topology equal to the capture"
    ) in rep.notes
